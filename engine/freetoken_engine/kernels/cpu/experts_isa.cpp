// Per-ISA expert kernels. Compiled once per instruction set by build.py:
//   -DFT_ISA=0 generic C (any x86-64), 1 AVX2+FMA, 2 AVX-512F/BW/VL, 3 AVX-512 + AVX512-BF16.
// Everything here is file-local except the two stage functions (see experts.h), and no C++
// library header is included, so no ISA-specific inline code can leak into other units.
//
// Memory-bound design (decode: a few tokens per expert): each weight row is streamed once, in
// address order (a block of gate rows, then the matching up rows, then SwiGLU, vectorised),
// converted bf16 -> fp32 in registers (a 16-bit shift) and multiplied into up to NTMAX token
// vectors kept hot in L1. With x in bf16 and AVX512-BF16 present, vdpbf16ps multiplies bf16
// pairs directly (products are exact in fp32, so the result matches the fp32 path up to
// summation order). Groups of 4+ tokens on an AMX CPU go to experts_amx.cpp instead.
#include <unistd.h>

#include "simd.h"
#include "gate.h"
#include "rows_bf.h"
#include "mxfp4.h"

namespace {

#if FT_ISA == 1
// AVX2 from 3 tokens: rows_walk takes ROWS rows at a time (simd.h dotr_rows), each token vector
// load serving all of them. A token's fp32 vector is 8 KiB at H = 2048, so 3-8 of them do not stay
// in Zen 3's 32 KiB L1 beside the weight stream, and each multiply-add's token operand came from
// L2 (one 32-byte line a cycle): 8 same-expert tokens ran at 34-38% of the read; two rows at a
// time 46-49%, three 48% (A/Bs in docs/cpu_kernel.md; with up to 4 tokens a group, 3 rows x 4
// accumulators and 3 weight vectors fill 15 of the 16 ymm registers).
enum { ROWS = 3 };   // rows a step of rows_walk (two: 0.54 -> 0.61 of the one-token rate at 8 tokens)

// Rows [r0, r1) ROWS at a time against nt tokens in groups of up to 4: the later groups read
// the rows from cache, so a row crosses memory once. The prefetch runs ROWS * pf ahead (the walk
// moves ROWS rows at a time) and stops at rend, as rows_bf's.
template <bool WB>
inline void rows_walk(int nt, const char* base, int64_t rs, int64_t r0, int64_t r1, const float* const* xs,
                      int64_t K, int64_t pf, float* out, int64_t rend) {
  const int64_t pfr = ROWS * pf, last = rend - (pfr + rs - 1) / rs;
  int64_t r = r0;
  for (; r + ROWS <= r1; r += ROWS) {
    const char* row0 = base + r * rs;
    int64_t p[ROWS];
    for (int j = 0; j < ROWS; ++j) p[j] = r + j < last ? pfr : 0;
    for (int tb = 0; tb < nt; tb += 4) {
      const float* const* x = xs + tb;
      float* o = out + (r - r0) * NTMAX + tb;
      switch (nt - tb < 4 ? nt - tb : 4) {
        case 1: dotr_rows<ROWS, 1, WB>(row0, rs, x, K, p, o, NTMAX); break;
        case 2: dotr_rows<ROWS, 2, WB>(row0, rs, x, K, p, o, NTMAX); break;
        case 3: dotr_rows<ROWS, 3, WB>(row0, rs, x, K, p, o, NTMAX); break;
        default: dotr_rows<ROWS, 4, WB>(row0, rs, x, K, p, o, NTMAX); break;
      }
    }
  }
  for (; r < r1; ++r) dotrn<WB>(nt, base + r * rs, xs, K, r < last ? pfr : 0, out + (r - r0) * NTMAX);
}
#endif

// Rows [r0, r1) at base + r * rs (fp32 token vectors): out[(r - r0) * NTMAX + t]; the prefetch
// stops at the chunk's last row rend, as rows_bf's. Groups of 1-2 tokens also prefetch into L2
// small_far_pf distances ahead, as rows_bf_n's.
template <bool WB>
inline void rows_f(const FtProblem* p, int nt, const char* base, int64_t rs, int64_t r0, int64_t r1,
                   const float* const* xs, int64_t K, int64_t pf, float* out, int64_t rend) {
#if FT_ISA == 1
  if (nt >= 3) return rows_walk<WB>(nt, base, rs, r0, r1, xs, K, pf, out, rend);
#endif
  const int64_t last = rend - (pf + rs - 1) / rs, far = nt < p->far_pf_tokens ? p->small_far_pf * pf : 0;
  for (int64_t r = r0; r < r1; ++r)
    dotrn<WB>(nt, base + r * rs, xs, K, r < last ? pf : 0, out + (r - r0) * NTMAX, r < last ? far : 0);
}

// A block of at most RB intermediate rows: the gate rows, then the matching up rows (each a
// sequential stream), then SwiGLU over the block.
enum { RB = 64 };

// Weight kinds (FtProblem::w_bf16): 0 fp32, 1 bf16, 2 MXFP4 rows (mxfp4.h; strides in bytes).
constexpr int64_t elem_bytes(int wk) { return wk == 1 ? 2 : wk == 0 ? 4 : 1; }

// How many of a call's rows [r0, r1) (row_bytes each) every token group passes before the next:
// all of them where they fit this core's L2 (the order of the decode calls and of a small
// expert's), else spans of half the L2 (a multiple of block rows), so that a large expert's rows
// stream from memory once in a prompt's call, not once per group of NTMAX tokens.
inline int64_t l2_span(int64_t rows, int64_t row_bytes, int64_t block) {
  static const int64_t l2 = [] {
    const long b = sysconf(_SC_LEVEL2_CACHE_SIZE);   // 0 or -1 where the C library cannot tell
    return b > 0 ? (int64_t)b : (int64_t)1 << 20;
  }();
  if (rows * row_bytes <= l2) return rows;
  const int64_t span = l2 / 2 / row_bytes / block * block;
  return span > block ? span : block;
}

template <int WK>
void stage1(const FtProblem* p, int64_t g, int64_t i0, int64_t i1) {
  constexpr bool WB = WK == 1;
  const int64_t H = p->H, I = p->I, s = p->g_start[g], n = p->g_count[g];
  const int64_t es = elem_bytes(WK);
  const char* base = (const char*)p->w13 + p->g_expert[g] * p->w13_es * es;
  const int64_t rs = p->w13_rs * es;
  float og[RB * NTMAX], ou[RB * NTMAX], oa[RB * NTMAX];
  float* const act = p->act;
  uint16_t* const act_b = p->act_b;
  // Each span of rows (l2_span) passed by every group of tokens before the next; each output is
  // the same dot product in either order.
  const int64_t span = l2_span(i1 - i0, 2 * H * es, RB);
  for (int64_t b0 = i0; b0 < i1; b0 += span) {
    const int64_t b1 = b0 + span < i1 ? b0 + span : i1;
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
      for (int64_t ib = b0; ib < b1; ib += RB) {
        const int64_t ie = ib + RB < b1 ? ib + RB : b1;
#if FT_ISA == 3
        if (p->xb && WK != 2) {        // (MXFP4 rows' vector groups multiply in fp32: experts.cpp)
          rows_bf_n(p, nt, base, rs, ib, ie, xbs, H, og, i1);
          rows_bf_n(p, nt, base + p->up * rs, rs, ib, ie, xbs, H, ou, i1);
        } else
#endif
        if (WK == 2) {
          rows_q(nt, base, rs, ib, ie, xs, H, p->prefetch, og, i1);
          rows_q(nt, base + p->up * rs, rs, ib, ie, xs, H, p->prefetch, ou, i1);
        } else {
          rows_f<WB>(p, nt, base, rs, ib, ie, xs, H, p->prefetch, og, i1);
          rows_f<WB>(p, nt, base + p->up * rs, rs, ib, ie, xs, H, p->prefetch, ou, i1);
        }
        gated_block(p, g, ib, ie - ib, NTMAX, nt, og, ou, oa);
        for (int t = 0; t < nt; ++t) {
          const int64_t at = (s + tb + t) * I + ib;
          if (act) store_strided(oa + t, NTMAX, ie - ib, false, act + at);
          if (act_b) store_strided(oa + t, NTMAX, ie - ib, true, act_b + at);
        }
      }
    }
  }
}

template <int WK>
void stage2(const FtProblem* p, int64_t g, int64_t h0, int64_t h1) {
  constexpr bool WB = WK == 1;
  const int64_t H = p->H, I = p->I, s = p->g_start[g], n = p->g_count[g];
  const int64_t es = elem_bytes(WK);
  const char* base = (const char*)p->w2 + p->g_expert[g] * p->w2_es * es;
  const int64_t rs = p->w2_rs * es;
  enum { HB = 32 };
  float o[HB * NTMAX];
  void* const out = p->out;           // locals: a store through out cannot change them
  const bool obf = p->out_bf16;
  const int64_t span = l2_span(h1 - h0, I * es, HB);   // as stage1
  for (int64_t b0 = h0; b0 < h1; b0 += span) {
    const int64_t b1 = b0 + span < h1 ? b0 + span : h1;
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
      for (int64_t hb = b0; hb < b1; hb += HB) {
        const int64_t he = hb + HB < b1 ? hb + HB : b1;
#if FT_ISA == 3
        if (p->xb && WK != 2) rows_bf_n(p, nt, base, rs, hb, he, xbs, I, o, h1);
        else
#endif
        if (WK == 2) rows_q(nt, base, rs, hb, he, xs, I, p->prefetch, o, h1);
        else rows_f<WB>(p, nt, base, rs, hb, he, xs, I, p->prefetch, o, h1);
        for (int t = 0; t < nt; ++t)
          store_strided(o + t, NTMAX, he - hb, obf,
                        obf ? (void*)((uint16_t*)out + dst[t] + hb) : (void*)((float*)out + dst[t] + hb));
      }
    }
  }
}

}  // namespace

extern "C" void FT_SUFFIX(ft_stage1)(const FtProblem* p, int64_t g, int64_t r0, int64_t r1) {
  if (p->w_bf16 == 2) stage1<2>(p, g, r0, r1);
  else if (p->w_bf16) stage1<1>(p, g, r0, r1);
  else stage1<0>(p, g, r0, r1);
}

extern "C" void FT_SUFFIX(ft_stage2)(const FtProblem* p, int64_t g, int64_t r0, int64_t r1) {
  if (p->w_bf16 == 2) stage2<2>(p, g, r0, r1);
  else if (p->w_bf16) stage2<1>(p, g, r0, r1);
  else stage2<0>(p, g, r0, r1);
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
