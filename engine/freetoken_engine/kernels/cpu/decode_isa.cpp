// Per-ISA decode kernels (compiled once per instruction set by build.py, like experts_isa.cpp):
// the dense projection of a few tokens (ft_linear), RMSNorm (ft_rmsnorm) and the attention of
// one new token per sequence over the paged KV pool (ft_attn). Decode is bounded by reading
// weights (linear) or by per-op overhead (norm, attention): each replaces a chain of torch ops
// with one call that touches its data once.
#include "simd.h"

namespace {

// Groups of 4 rows up to this many tokens (then pairs): 4 rows x 4 tokens of accumulators fill
// AVX-512's 32 vector registers by half, AVX2's 16 entirely, whose spills made 3-4 tokens slower
// than pairs (0.83 / 0.71 of the read against 0.86 / 0.77; at 1-2 tokens 0.98 / 0.94 against
// 0.94 / 0.90: the 2-core Xeon VM run with the AVX2 kernels, Qwen3-30B's output projection).
enum { ROWS4_TOKENS = FT_ISA >= 2 ? 4 : 2 };

// simd.h dotr_rows for nt tokens, every row prefetched pf ahead (out: [R][NTMAX]).
template <int R, bool WB>
inline void dotr_rows_n(int nt, const char* row0, int64_t rs, const float* const* xs, int64_t K, int64_t pf,
                        float* out, int64_t far) {
  int64_t pfs[R];
  for (int j = 0; j < R; ++j) pfs[j] = pf;
  switch (nt) {
    case 1: dotr_rows<R, 1, WB>(row0, rs, xs, K, pfs, out, NTMAX, far); break;
    case 2: dotr_rows<R, 2, WB>(row0, rs, xs, K, pfs, out, NTMAX, far); break;
    case 3: dotr_rows<R, 3, WB>(row0, rs, xs, K, pfs, out, NTMAX, far); break;
#if FT_ISA >= 1
    case 4: dotr_rows<R, 4, WB>(row0, rs, xs, K, pfs, out, NTMAX, far); break;
    case 5: dotr_rows<R, 5, WB>(row0, rs, xs, K, pfs, out, NTMAX, far); break;
    case 6: dotr_rows<R, 6, WB>(row0, rs, xs, K, pfs, out, NTMAX, far); break;
    case 7: dotr_rows<R, 7, WB>(row0, rs, xs, K, pfs, out, NTMAX, far); break;
    default: dotr_rows<R, 8, WB>(row0, rs, xs, K, pfs, out, NTMAX, far); break;
#else
    default: dotr_rows<R, 4, WB>(row0, rs, xs, K, pfs, out, NTMAX, far); break;
#endif
  }
}

// Dense projection rows [n0, n1) for every token, in address order: one row at a time, or 4 or 2
// (dotr_rows, p->row_group: float32 token vectors on bf16 rows), each token vector's load then
// serving every row of the group.
template <bool WB>
void linear_rows(const FtLinear* p, int64_t n0, int64_t n1) {
  const int64_t K = p->K, N = p->N, es = WB ? 2 : 4;
  const char* base = (const char*)p->w;
  const int64_t rs = p->w_rs * es;
  for (int64_t tb = 0; tb < p->T; tb += NTMAX) {
    const int nt = (int)(p->T - tb < NTMAX ? p->T - tb : NTMAX);
    const float* xs[NTMAX];
#if FT_ISA == 3
    const uint16_t* xbs[NTMAX];
#endif
    for (int t = 0; t < nt; ++t) {
      xs[t] = p->xf ? p->xf + (tb + t) * K : 0;
#if FT_ISA == 3
      xbs[t] = p->xb ? p->xb + (tb + t) * K : 0;
#endif
    }
    auto store = [&](int64_t n, const float* o) {
      const float b = p->bias ? sw<WB>(p->bias, n) : 0.f;
      for (int t = 0; t < nt; ++t) {
        const int64_t at = (tb + t) * N + n;
        if (p->out_bf16) ((uint16_t*)p->out)[at] = f2bf(o[t] + b);
        else ((float*)p->out)[at] = o[t] + b;
      }
    };
    int64_t n = n0;
    if (p->row_group) {
      float o[4 * NTMAX];
      if (p->row_group == 4 && nt <= ROWS4_TOKENS)
        for (; n + 3 < n1; n += 4) {
          dotr_rows_n<4, WB>(nt, base + n * rs, rs, xs, K, p->prefetch, o, p->far);
          for (int r = 0; r < 4; ++r) store(n + r, o + r * NTMAX);
        }
      for (; n + 1 < n1; n += 2) {
        dotr_rows_n<2, WB>(nt, base + n * rs, rs, xs, K, p->prefetch, o, p->far);
        store(n, o);
        store(n + 1, o + NTMAX);
      }
    }
    for (; n < n1; ++n) {
      const char* row = base + n * rs;
      float o[NTMAX];
#if FT_ISA == 3
      if (p->xb) dotrn_bf(nt, (const uint16_t*)row, xbs, K, p->prefetch, o, p->far);
      else
#endif
        dotrn<WB>(nt, row, xs, K, p->prefetch, o, p->far);
      store(n, o);
    }
  }
}

template <bool B16>
inline float ld(const void* p, int64_t i) {
  return B16 ? bf2f(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}

template <bool B16>
inline void st(void* p, int64_t i, float v) {
  if (B16) ((uint16_t*)p)[i] = f2bf(v);
  else ((float*)p)[i] = v;
}

// Rounds to the data type (identity for fp32): where the reference rounds an intermediate.
template <bool B16>
inline float rd(float v) { return B16 ? rbf(v) : v; }

template <bool B16>
float sum_squares(const void* x, int64_t n) {
  vf acc = vzero();
  int64_t k = 0;
  for (; k + VW <= n; k += VW) {
    const vf v = vw<B16>(x, k);
    acc = vfma(v, v, acc);
  }
  float s = vsum(acc);
  for (; k < n; ++k) s += ld<B16>(x, k) * ld<B16>(x, k);
  return s;
}

template <bool B16>
void rmsnorm(const FtNorm* p) {
  for (int64_t t = 0; t < p->T; ++t) {
    const void* x = (const char*)p->x + t * p->H * (B16 ? 2 : 4);
    const float r = 1.f / sqrtf(sum_squares<B16>(x, p->H) / (float)p->H + p->eps);
    for (int64_t i = 0; i < p->H; ++i)
      st<B16>(p->out, t * p->H + i, ld<B16>(p->w, i) * rd<B16>(ld<B16>(x, i) * r));
  }
}

// One head of d values -> fp32 dst: optional RMSNorm (weight w), then the rotary embedding over
// its first rot values (the rest pass), rounding to the data type wherever the reference
// (layers/norm.py, layers/rope.py) does.
template <bool B16>
void norm_rope(const void* src, const void* w, float eps, const void* cos, const void* sin,
               int64_t d, int64_t rot, float* tmp, float* dst) {
  float r = 1.f;
  if (w) r = 1.f / sqrtf(sum_squares<B16>(src, d) / (float)d + eps);
  for (int64_t i = 0; i < d; ++i) {
    const float x = ld<B16>(src, i);
    tmp[i] = w ? rd<B16>(ld<B16>(w, i) * rd<B16>(x * r)) : x;
  }
  const int64_t half = rot / 2;
  for (int64_t i = 0; i < rot; ++i) {
    const float a = rd<B16>(tmp[i] * ld<B16>(cos, i));
    const float b = rd<B16>(tmp[(i + half) % rot] * ld<B16>(sin, i));
    dst[i] = rd<B16>(a + b);
  }
  for (int64_t i = rot; i < d; ++i) dst[i] = tmp[i];
}

template <bool B16>
float dot(const float* q, const void* k, int64_t d) {
  vf acc = vzero();
  int64_t i = 0;
  for (; i + VW <= d; i += VW) acc = vfma(vld(q + i), vw<B16>(k, i), acc);
  float s = vsum(acc);
  for (; i < d; ++i) s += q[i] * ld<B16>(k, i);
  return s;
}

// Work items [i0, i1) of the call: item i is row b = i / split's query heads [c h / split,
// (c + 1) h / split), c = i % split (split = p->hsplit, at least 1). With split 1 an item also
// writes its row's new K/V (unless phase 2); with more, the caller wrote every row first.
template <bool B16>
void attn(const FtAttn* p, int64_t i0, int64_t i1, float* scratch) {
  const int64_t h = p->h, kvh = p->kvh, d = p->d, grp = h / kvh, es = B16 ? 2 : 4;
  const int64_t split = p->hsplit > 1 ? p->hsplit : 1;
  const int64_t row = (h + 2 * kvh) * d;
  float* qf = scratch;                 // [h, d] normed + rotated queries
  float* kf = qf + h * d;              // [d]
  float* tmp = kf + d;                 // [d]
  float* sc = tmp + d;                 // [grp, lmax] scores, then weights
  float* acc = sc + grp * p->lmax;     // [grp, d] a KV head's query heads' sums
  for (int64_t it = i0; it < i1; ++it) {
    const int64_t b = it / split, c = it % split;
    const int64_t h0 = c * h / split, h1 = (c + 1) * h / split;
    const char* x = (const char*)p->qkv + b * row * es;
    const void* cs = (const char*)p->cos + b * p->rot * es;
    const void* sn = (const char*)p->sin + b * p->rot * es;
    const int64_t slot = p->slot[b];
    for (int64_t g = 0; g < kvh && p->phase != 2 && split == 1; ++g) {   // the new token's K (normed, rotated) and V
      norm_rope<B16>(x + (h + g) * d * es, p->kn_w, p->eps, cs, sn, d, p->rot, tmp, kf);
      const void* v = x + (h + kvh + g) * d * es;
      for (int64_t i = 0; i < d; ++i) {      // V first: the pool's V may be its K (cache/kv.py)
        st<B16>(p->v_cache, (slot * kvh + g) * d + i, ld<B16>(v, i));
        st<B16>(p->k_cache, (slot * kvh + g) * d + i, kf[i]);
      }
    }
    if (p->phase == 1 || h0 == h1) continue;
    for (int64_t hq = h0; hq < h1; ++hq)
      norm_rope<B16>(x + hq * d * es, p->qn_w, p->eps, cs, sn, d, p->rot, tmp, qf + hq * d);
    const int64_t len = p->kv_len[b];
    int64_t lo = p->window > 0 && len > p->window ? len - p->window : 0;
    if (p->chunk > 0 && (len - 1) / p->chunk * p->chunk > lo) lo = (len - 1) / p->chunk * p->chunk;
    const int64_t* idx = p->kv_index + b * p->lmax;
    for (int64_t g = h0 / grp; g * grp < h1; ++g) {
      const int64_t q0 = (h0 > g * grp ? h0 : g * grp) - g * grp;
      const int64_t q1 = (h1 < (g + 1) * grp ? h1 : (g + 1) * grp) - g * grp;
      for (int64_t j = lo; j < len; ++j) {
        const void* key = (const char*)p->k_cache + (idx[j] * kvh + g) * d * es;
        for (int64_t q = q0; q < q1; ++q) sc[q * p->lmax + j] = dot<B16>(qf + (g * grp + q) * d, key, d) * p->scale;
      }
      for (int64_t q = q0; q < q1; ++q) {
        float* s = sc + q * p->lmax;
        float m = s[lo];
        for (int64_t j = lo + 1; j < len; ++j) m = s[j] > m ? s[j] : m;
        const float sink = p->sinks ? p->sinks[g * grp + q] : 0.f;
        if (p->sinks && sink > m) m = sink;
        float z = p->sinks ? expf(sink - m) : 0.f;
        for (int64_t j = lo; j < len; ++j) {
          s[j] = expf(s[j] - m);
          z += s[j];
        }
        for (int64_t j = lo; j < len; ++j) s[j] = s[j] / z;
        for (int64_t i = 0; i < d; ++i) acc[q * d + i] = 0.f;
      }
      for (int64_t j = lo; j < len; ++j) {   // each value row read once for the group's heads
        const void* v = (const char*)p->v_cache + (idx[j] * kvh + g) * d * es;
        for (int64_t q = q0; q < q1; ++q) {
          const float w = sc[q * p->lmax + j];
          float* a = acc + q * d;
          for (int64_t i = 0; i < d; ++i) a[i] += w * ld<B16>(v, i);
        }
      }
      for (int64_t q = q0; q < q1; ++q)
        for (int64_t i = 0; i < d; ++i) st<B16>(p->out, b * h * d + (g * grp + q) * d + i, acc[q * d + i]);
    }
  }
}

// Tokens [t0, t1) of an MoE layer's combine (FtCombine); every output element sums its k
// products in the order of j, so vectorising across H keeps the reference's result bit for bit.
// No multiply-add contraction: torch rounds each product before it adds it.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
template <bool B16>
void combine(const FtCombine* p, int64_t t0, int64_t t1) {
#ifdef __clang__
#pragma clang fp contract(off)
#endif
  const int64_t k = p->k, H = p->H;
  float acc[256];
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t c0 = 0; c0 < H; c0 += 256) {
      const int64_t n = H - c0 < 256 ? H - c0 : 256;
      for (int64_t c = 0; c < n; ++c) acc[c] = 0.f;
      for (int64_t j = 0; j < k; ++j) {
        const float wj = ld<B16>(p->w, t * k + j);
        const int64_t r = (t * k + j) * H + c0;
        int64_t c = 0;
#if FT_ISA >= 1
        const vf wv = vsplat(wj);
        for (; c + VW <= n; c += VW) {
          const vf x = B16 ? vldb((const uint16_t*)p->rows + r + c) : vld((const float*)p->rows + r + c);
          const vf prod = B16 ? vrbf(vmul(wv, x)) : vmul(wv, x);
          vst(acc + c, vadd(vld(acc + c), prod));
        }
#endif
        for (; c < n; ++c) acc[c] += rd<B16>(wj * ld<B16>(p->rows, r + c));
      }
      const int64_t o = t * H + c0;
      if (p->shared)
        for (int64_t c = 0; c < n; ++c) acc[c] = rd<B16>(rd<B16>(acc[c]) + ld<B16>(p->shared, o + c));
      if (p->res)
        for (int64_t c = 0; c < n; ++c) st<B16>(p->out, o + c, ld<B16>(p->res, o + c) + rd<B16>(acc[c]));
      else
        for (int64_t c = 0; c < n; ++c) st<B16>(p->out, o + c, acc[c]);
    }
}
#pragma GCC pop_options

}  // namespace

extern "C" void FT_SUFFIX(ft_combine)(const FtCombine* p, int64_t t0, int64_t t1) {
  if (p->bf16) combine<true>(p, t0, t1);
  else combine<false>(p, t0, t1);
}

extern "C" void FT_SUFFIX(ft_linear)(const FtLinear* p, int64_t n0, int64_t n1) {
  if (p->w_bf16) linear_rows<true>(p, n0, n1);
  else linear_rows<false>(p, n0, n1);
}

extern "C" void FT_SUFFIX(ft_rmsnorm)(const FtNorm* p) {
  if (p->bf16) rmsnorm<true>(p);
  else rmsnorm<false>(p);
}

extern "C" void FT_SUFFIX(ft_attn)(const FtAttn* p, int64_t b0, int64_t b1, float* scratch) {
  if (p->bf16) attn<true>(p, b0, b1, scratch);
  else attn<false>(p, b0, b1, scratch);
}
