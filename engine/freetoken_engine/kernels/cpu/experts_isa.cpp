// Per-ISA expert kernels. Compiled once per instruction set by build.py:
//   -DFT_ISA=0 generic C (any x86-64), 1 AVX2+FMA, 2 AVX-512F/BW/VL, 3 AVX-512 + AVX512-BF16.
// Everything here is file-local except the two stage functions (see experts.h), and no C++
// library header is included, so no ISA-specific inline code can leak into other units.
//
// Memory-bound design (decode: a few tokens per expert): each weight row is streamed once,
// converted bf16 -> fp32 in registers (a 16-bit shift) and multiplied into up to NTMAX token
// vectors kept hot in L1; gate and up rows are walked together so SwiGLU is fused. With x in
// bf16 and AVX512-BF16 present, vdpbf16ps multiplies bf16 pairs directly (products are exact
// in fp32, so the result matches the fp32 path up to summation order).
#include <math.h>
#include <stdint.h>
#if FT_ISA >= 1
#include <immintrin.h>
#endif
#include "experts.h"

#if FT_ISA == 0
#define FT_SUFFIX(name) name##_generic
#elif FT_ISA == 1
#define FT_SUFFIX(name) name##_avx2
#elif FT_ISA == 2
#define FT_SUFFIX(name) name##_avx512
#else
#define FT_SUFFIX(name) name##_avx512bf16
#endif

namespace {

inline float bf2f(uint16_t b) {
  union { uint32_t u; float f; } v;
  v.u = (uint32_t)b << 16;
  return v.f;
}

// Round to nearest even, as torch does when it narrows fp32 to bf16.
inline uint16_t f2bf(float f) {
  union { uint32_t u; float f; } v;
  v.f = f;
  if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u);
  return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

inline float rbf(float f) { return bf2f(f2bf(f)); }

#if FT_ISA >= 2
typedef __m512 vf;
enum { VW = 16, NTMAX = 8 };
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vld(const float* p) { return _mm512_loadu_ps(p); }
inline vf vldb(const uint16_t* p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
#elif FT_ISA == 1
typedef __m256 vf;
enum { VW = 8, NTMAX = 4 };
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vld(const float* p) { return _mm256_loadu_ps(p); }
inline vf vldb(const uint16_t* p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#else
typedef float vf;
enum { VW = 1, NTMAX = 4 };
inline vf vzero() { return 0.f; }
inline vf vld(const float* p) { return *p; }
inline vf vldb(const uint16_t* p) { return bf2f(*p); }
inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
inline float vsum(vf a) { return a; }
#endif

inline void prefetch(const void* p) {
#if FT_ISA >= 1
  _mm_prefetch((const char*)p, _MM_HINT_T0);
#else
  (void)p;
#endif
}

template <bool WB>
inline vf vw(const void* row, int64_t k) {
  if (WB) return vldb((const uint16_t*)row + k);
  return vld((const float*)row + k);
}

template <bool WB>
inline float sw(const void* row, int64_t k) {
  if (WB) return bf2f(((const uint16_t*)row)[k]);
  return ((const float*)row)[k];
}

// out[r][t] = dot(rows[r][0:K], xs[t][0:K]) for NR weight rows and NT fp32 vectors.
template <int NR, int NT, bool WB>
inline void dotk(const void* const* rows, const float* const* xs, int64_t K, int64_t pf,
                 float (*out)[NTMAX]) {
  vf acc[NR][NT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = vzero();
  const int64_t es = WB ? 2 : 4;
  const int64_t kv = K - K % VW;
  int64_t k = 0;
  for (; k < kv; k += VW) {
    vf w[NR];
    for (int r = 0; r < NR; ++r) {
      w[r] = vw<WB>(rows[r], k);
      if (pf) prefetch((const char*)rows[r] + k * es + pf);
    }
    for (int t = 0; t < NT; ++t) {
      const vf xv = vld(xs[t] + k);
      for (int r = 0; r < NR; ++r) acc[r][t] = vfma(w[r], xv, acc[r][t]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) out[r][t] = vsum(acc[r][t]);
  for (; k < K; ++k)
    for (int r = 0; r < NR; ++r) {
      const float wv = sw<WB>(rows[r], k);
      for (int t = 0; t < NT; ++t) out[r][t] += wv * xs[t][k];
    }
}

template <int NR, bool WB>
inline void dotn(int nt, const void* const* rows, const float* const* xs, int64_t K, int64_t pf,
                 float (*out)[NTMAX]) {
  switch (nt) {
    case 1: dotk<NR, 1, WB>(rows, xs, K, pf, out); break;
    case 2: dotk<NR, 2, WB>(rows, xs, K, pf, out); break;
    case 3: dotk<NR, 3, WB>(rows, xs, K, pf, out); break;
#if FT_ISA >= 2
    case 4: dotk<NR, 4, WB>(rows, xs, K, pf, out); break;
    case 5: dotk<NR, 5, WB>(rows, xs, K, pf, out); break;
    case 6: dotk<NR, 6, WB>(rows, xs, K, pf, out); break;
    case 7: dotk<NR, 7, WB>(rows, xs, K, pf, out); break;
    default: dotk<NR, 8, WB>(rows, xs, K, pf, out); break;
#else
    default: dotk<NR, 4, WB>(rows, xs, K, pf, out); break;
#endif
  }
}

#if FT_ISA == 3
// bf16 x bf16 -> fp32 with vdpbf16ps: 32 elements (16 pairs) per instruction.
template <int NR, int NT>
inline void dotk_bf(const uint16_t* const* rows, const uint16_t* const* xs, int64_t K, int64_t pf,
                    float (*out)[NTMAX]) {
  __m512 acc[NR][NT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  const int64_t kv = K - K % 32;
  int64_t k = 0;
  for (; k < kv; k += 32) {
    __m512bh w[NR];
    for (int r = 0; r < NR; ++r) {
      w[r] = (__m512bh)_mm512_loadu_si512((const void*)(rows[r] + k));
      if (pf) prefetch((const char*)(rows[r] + k) + pf);
    }
    for (int t = 0; t < NT; ++t) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void*)(xs[t] + k));
      for (int r = 0; r < NR; ++r) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], w[r], xv);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) out[r][t] = _mm512_reduce_add_ps(acc[r][t]);
  for (; k < K; ++k)
    for (int r = 0; r < NR; ++r) {
      const float wv = bf2f(rows[r][k]);
      for (int t = 0; t < NT; ++t) out[r][t] += wv * bf2f(xs[t][k]);
    }
}

template <int NR>
inline void dotn_bf(int nt, const uint16_t* const* rows, const uint16_t* const* xs, int64_t K,
                    int64_t pf, float (*out)[NTMAX]) {
  switch (nt) {
    case 1: dotk_bf<NR, 1>(rows, xs, K, pf, out); break;
    case 2: dotk_bf<NR, 2>(rows, xs, K, pf, out); break;
    case 3: dotk_bf<NR, 3>(rows, xs, K, pf, out); break;
    case 4: dotk_bf<NR, 4>(rows, xs, K, pf, out); break;
    case 5: dotk_bf<NR, 5>(rows, xs, K, pf, out); break;
    case 6: dotk_bf<NR, 6>(rows, xs, K, pf, out); break;
    case 7: dotk_bf<NR, 7>(rows, xs, K, pf, out); break;
    default: dotk_bf<NR, 8>(rows, xs, K, pf, out); break;
  }
}
#endif

// SwiGLU of one (gate, up) pair, rounding where the reference rounds when x is bf16.
inline float swiglu(float g, float u, int xb16) {
  if (xb16) {
    g = rbf(g);
    u = rbf(u);
    return rbf(rbf(g / (1.f + expf(-g))) * u);
  }
  return g / (1.f + expf(-g)) * u;
}

template <bool WB>
void stage1(const FtProblem* p, int64_t g, int64_t i0, int64_t i1) {
  const int64_t H = p->H, I = p->I, s = p->g_start[g], n = p->g_count[g];
  const int64_t es = WB ? 2 : 4;
  const char* base = (const char*)p->w13 + p->g_expert[g] * p->w13_es * es;
  const int64_t rs = p->w13_rs * es;
  for (int64_t tb = 0; tb < n; tb += NTMAX) {
    const int nt = (int)(n - tb < NTMAX ? n - tb : NTMAX);
    const float* xs[NTMAX];
#if FT_ISA == 3
    const uint16_t* xbs[NTMAX];
#endif
    for (int t = 0; t < nt; ++t) {
      const int64_t tok = p->pair_tok[p->sorted_pair[s + tb + t]];
      xs[t] = p->xf ? p->xf + tok * H : 0;
#if FT_ISA == 3
      xbs[t] = p->xb ? p->xb + tok * H : 0;
#endif
    }
    for (int64_t i = i0; i < i1; ++i) {
      const void* rows[2] = {base + i * rs, base + (I + i) * rs};
      float o[2][NTMAX];
#if FT_ISA == 3
      if (p->xb)
        dotn_bf<2>(nt, (const uint16_t* const*)rows, xbs, H, p->prefetch, o);
      else
#endif
        dotn<2, WB>(nt, rows, xs, H, p->prefetch, o);
      for (int t = 0; t < nt; ++t) {
        const float a = swiglu(o[0][t], o[1][t], p->x_bf16);
        const int64_t at = (s + tb + t) * I + i;
        if (p->act) p->act[at] = a;
        if (p->act_b) p->act_b[at] = f2bf(a);
      }
    }
  }
}

template <bool WB>
void stage2(const FtProblem* p, int64_t g, int64_t h0, int64_t h1) {
  const int64_t H = p->H, I = p->I, s = p->g_start[g], n = p->g_count[g];
  const int64_t es = WB ? 2 : 4;
  const char* base = (const char*)p->w2 + p->g_expert[g] * p->w2_es * es;
  const int64_t rs = p->w2_rs * es;
  for (int64_t tb = 0; tb < n; tb += NTMAX) {
    const int nt = (int)(n - tb < NTMAX ? n - tb : NTMAX);
    const float* xs[NTMAX];
    int64_t dst[NTMAX];
#if FT_ISA == 3
    const uint16_t* xbs[NTMAX];
#endif
    for (int t = 0; t < nt; ++t) {
      xs[t] = p->act ? p->act + (s + tb + t) * I : 0;
#if FT_ISA == 3
      xbs[t] = p->act_b ? p->act_b + (s + tb + t) * I : 0;
#endif
      dst[t] = p->sorted_pair[s + tb + t] * H;
    }
    for (int64_t h = h0; h < h1; h += 2) {
      const int nr = h + 1 < h1 ? 2 : 1;
      const void* rows[2] = {base + h * rs, base + (h + 1) * rs};
      float o[2][NTMAX];
#if FT_ISA == 3
      if (p->xb) {
        if (nr == 2) dotn_bf<2>(nt, (const uint16_t* const*)rows, xbs, I, p->prefetch, o);
        else dotn_bf<1>(nt, (const uint16_t* const*)rows, xbs, I, p->prefetch, o);
      } else
#endif
      if (nr == 2) dotn<2, WB>(nt, rows, xs, I, p->prefetch, o);
      else dotn<1, WB>(nt, rows, xs, I, p->prefetch, o);
      for (int r = 0; r < nr; ++r)
        for (int t = 0; t < nt; ++t) {
          if (p->out_bf16) ((uint16_t*)p->out)[dst[t] + h + r] = f2bf(o[r][t]);
          else ((float*)p->out)[dst[t] + h + r] = o[r][t];
        }
    }
  }
}

}  // namespace

extern "C" void FT_SUFFIX(ft_stage1)(const FtProblem* p, int64_t g, int64_t r0, int64_t r1) {
  if (p->w_bf16) stage1<true>(p, g, r0, r1);
  else stage1<false>(p, g, r0, r1);
}

extern "C" void FT_SUFFIX(ft_stage2)(const FtProblem* p, int64_t g, int64_t r0, int64_t r1) {
  if (p->w_bf16) stage2<true>(p, g, r0, r1);
  else stage2<false>(p, g, r0, r1);
}

// STREAM-style read of [p, p + bytes): the bandwidth yardstick, same threads as the kernel.
extern "C" uint64_t FT_SUFFIX(ft_read)(const void* p, int64_t bytes) {
  const char* c = (const char*)p;
  int64_t k = 0;
#if FT_ISA >= 2
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (; k + 256 <= bytes; k += 256) {
    a0 = _mm512_xor_si512(a0, _mm512_loadu_si512((const void*)(c + k)));
    a1 = _mm512_xor_si512(a1, _mm512_loadu_si512((const void*)(c + k + 64)));
    a2 = _mm512_xor_si512(a2, _mm512_loadu_si512((const void*)(c + k + 128)));
    a3 = _mm512_xor_si512(a3, _mm512_loadu_si512((const void*)(c + k + 192)));
  }
  a0 = _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
  uint64_t acc = (uint64_t)_mm512_reduce_add_epi64(a0);
#elif FT_ISA == 1
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (; k + 128 <= bytes; k += 128) {
    a0 = _mm256_xor_si256(a0, _mm256_loadu_si256((const __m256i*)(c + k)));
    a1 = _mm256_xor_si256(a1, _mm256_loadu_si256((const __m256i*)(c + k + 32)));
    a2 = _mm256_xor_si256(a2, _mm256_loadu_si256((const __m256i*)(c + k + 64)));
    a3 = _mm256_xor_si256(a3, _mm256_loadu_si256((const __m256i*)(c + k + 96)));
  }
  a0 = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
  uint64_t acc = (uint64_t)_mm256_extract_epi64(a0, 0) ^ (uint64_t)_mm256_extract_epi64(a0, 1) ^
                 (uint64_t)_mm256_extract_epi64(a0, 2) ^ (uint64_t)_mm256_extract_epi64(a0, 3);
#else
  uint64_t acc = 0;
  for (; k + 8 <= bytes; k += 8) acc ^= *(const uint64_t*)(c + k);
#endif
  for (; k < bytes; ++k) acc += (unsigned char)c[k];
  return acc;
}
