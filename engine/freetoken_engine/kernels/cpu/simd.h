// Vector primitives shared by the per-ISA kernel units (experts_isa.cpp, decode_isa.cpp).
// Included once per instruction set (FT_ISA set by build.py: 0 generic C, 1 AVX2+FMA,
// 2 AVX-512F/BW/VL, 3 AVX-512 + AVX512-BF16); everything is file-local (an anonymous namespace)
// and no C++ library header is included, so no ISA-specific inline code can leak into other units.
#pragma once
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
inline void vst(float* p, vf a) { _mm512_storeu_ps(p, a); }
inline vf vldb(const uint16_t* p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
#elif FT_ISA == 1
typedef __m256 vf;
// 8 tokens a call, as AVX-512 (experts_isa.cpp's row pairs take them in groups of 4, so that a
// row's weights cross memory once for all 8).
enum { VW = 8, NTMAX = 8 };
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vld(const float* p) { return _mm256_loadu_ps(p); }
inline void vst(float* p, vf a) { _mm256_storeu_ps(p, a); }
// 8 bf16 values as fp32: their 16 bytes loaded into both 128-bit halves, and each value's two
// bytes shuffled to the top of its fp32 lane (the low two zeroed): a load and one shuffle, where
// a zero-extension and a shift put the shift on the ports of the multiply-adds (Intel's p0/p1).
// The AVX2 path on the Xeon VM: one token x 8 experts 1.09x, 5-8 same-expert tokens unchanged
// (docs/cpu_kernel.md, stop 64).
inline vf vldb(const uint16_t* p) {
  const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)p));
  const __m256i top = _mm256_setr_epi8(-128, -128, 0, 1, -128, -128, 2, 3, -128, -128, 4, 5, -128, -128, 6, 7,
                                       -128, -128, 8, 9, -128, -128, 10, 11, -128, -128, 12, 13, -128, -128, 14, 15);
  return _mm256_castsi256_ps(_mm256_shuffle_epi8(b, top));
}
// The same values by zero-extension and shift, for a loop whose 16 registers are all taken (the
// shuffle's mask would need one: experts_isa.cpp's dotr_rows, 5-8 same-expert tokens 5% slower
// with the shuffle).
inline vf vldb_ext(const uint16_t* p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
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
inline vf vadd(vf a, vf b) { return a + b; }
inline float vsum(vf a) { return a; }
#endif

inline void prefetch(const void* p) {
#if FT_ISA >= 1
  _mm_prefetch((const char*)p, _MM_HINT_T0);
#else
  (void)p;
#endif
}

// A second prefetch further ahead, into L2 only (the far prefetch: rows_bf.h, dotr, dotr_bf,
// dotr_rows).
inline void prefetch_far(const void* p) {
#if FT_ISA >= 1
  _mm_prefetch((const char*)p, _MM_HINT_T2);
#else
  (void)p;
#endif
}

#if FT_ISA != 1
inline vf vldb_ext(const uint16_t* p) { return vldb(p); }
#endif

template <bool WB>
inline vf vw(const void* row, int64_t k) {
  if (WB) return vldb((const uint16_t*)row + k);
  return vld((const float*)row + k);
}

template <bool WB>
inline vf vw_ext(const void* row, int64_t k) {
  if (WB) return vldb_ext((const uint16_t*)row + k);
  return vld((const float*)row + k);
}

template <bool WB>
inline float sw(const void* row, int64_t k) {
  if (WB) return bf2f(((const uint16_t*)row)[k]);
  return ((const float*)row)[k];
}

// out[t] = dot(row[0:K], xs[t][0:K]) for NT fp32 token vectors, reading the weight row as one
// sequential stream: on the 2-CPU EPYC one stream per call reads at the STREAM rate (~40 GB/s)
// where four interleaved rows reach 31. U_DOT accumulators per token: U_DOT does not depend on
// NT, so a token's result (its summation order) does not depend on how many other tokens share
// the call (pair outputs stay independent of the batch). One is enough to stay memory-bound
// (2 measured within noise: SmolLM2 decode 52.2 vs 50.9 tok/s, the bf16 MoE 93.1 vs 92.1) and
// keeps the prefill of the converted default model within its 1e-4 test of transformers
// (max |diff| 1.10e-4 of logits up to 37.6 in rtol+atol, where 2 gave 1.33e-4: fp32 noise).
enum { U_DOT = 1 };

// far (bytes, 0: none): a second prefetch, into L2, that far ahead (rows_f's groups of 1-2 tokens,
// ft_linear's calls of 1-4).
template <int NT, bool WB>
inline void dotr(const void* row, const float* const* xs, int64_t K, int64_t pf, float* out, int64_t far = 0) {
  enum { U = U_DOT };
  vf acc[U][NT];
  for (int u = 0; u < U; ++u)
    for (int t = 0; t < NT; ++t) acc[u][t] = vzero();
  int64_t k = 0;
  for (; k + U * VW <= K; k += U * VW)
    for (int u = 0; u < U; ++u) {
      const vf w = vw<WB>(row, k + u * VW);
      if (pf) {
        prefetch((const char*)row + (k + u * VW) * (WB ? 2 : 4) + pf);
        if (far) prefetch_far((const char*)row + (k + u * VW) * (WB ? 2 : 4) + far);
      }
      for (int t = 0; t < NT; ++t) acc[u][t] = vfma(w, vld(xs[t] + k + u * VW), acc[u][t]);
    }
  for (; k + VW <= K; k += VW) {
    const vf w = vw<WB>(row, k);
    for (int t = 0; t < NT; ++t) acc[0][t] = vfma(w, vld(xs[t] + k), acc[0][t]);
  }
  for (int t = 0; t < NT; ++t) {
    vf a = acc[0][t];
    for (int u = 1; u < U; ++u) a = vadd(a, acc[u][t]);
    out[t] = vsum(a);
  }
  for (; k < K; ++k) {
    const float wv = sw<WB>(row, k);
    for (int t = 0; t < NT; ++t) out[t] += wv * xs[t][k];
  }
}

template <bool WB>
inline void dotrn(int nt, const void* row, const float* const* xs, int64_t K, int64_t pf, float* out,
                  int64_t far = 0) {
  switch (nt) {
    case 1: dotr<1, WB>(row, xs, K, pf, out, far); break;
    case 2: dotr<2, WB>(row, xs, K, pf, out, far); break;
    case 3: dotr<3, WB>(row, xs, K, pf, out, far); break;
#if FT_ISA >= 1
    case 4: dotr<4, WB>(row, xs, K, pf, out, far); break;
    case 5: dotr<5, WB>(row, xs, K, pf, out, far); break;
    case 6: dotr<6, WB>(row, xs, K, pf, out, far); break;
    case 7: dotr<7, WB>(row, xs, K, pf, out, far); break;
    default: dotr<8, WB>(row, xs, K, pf, out, far); break;
#else
    default: dotr<4, WB>(row, xs, K, pf, out, far); break;
#endif
  }
}

// dotr for R rows at once (row0 + j * rs, out o[j * os + t]): each token vector's load serves all
// R rows, where with several tokens the loads of them, not memory, can bound one row at a time
// (experts_isa.cpp rows_walk on AVX2, decode_isa.cpp's projections). Each (row, token) accumulator
// sums in dotr's order (U_DOT = 1, k ascending, the same tail), so the results are dotr's bit for
// bit and a token's output does not depend on the rows or tokens beside it. pf[j]: row j's
// prefetch distance (0: none); far: a second one into L2 beside each (0: none).
template <int R, int NT, bool WB>
inline void dotr_rows(const char* row0, int64_t rs, const float* const* xs, int64_t K, const int64_t* pf,
                      float* o, int64_t os, int64_t far = 0) {
  static_assert(U_DOT == 1, "dotr_rows repeats dotr's order of one accumulator per token");
  const int64_t es = WB ? 2 : 4;
  vf a[R][NT];
  for (int j = 0; j < R; ++j)
    for (int t = 0; t < NT; ++t) a[j][t] = vzero();
  int64_t k = 0;
  for (; k + VW <= K; k += VW) {
    vf w[R];
    for (int j = 0; j < R; ++j) {
      w[j] = vw_ext<WB>(row0 + j * rs, k);
      if (pf[j]) {
        prefetch(row0 + j * rs + k * es + pf[j]);
        if (far) prefetch_far(row0 + j * rs + k * es + far);
      }
    }
    for (int t = 0; t < NT; ++t) {
      const vf x = vld(xs[t] + k);
      for (int j = 0; j < R; ++j) a[j][t] = vfma(w[j], x, a[j][t]);
    }
  }
  for (int j = 0; j < R; ++j)
    for (int t = 0; t < NT; ++t) o[j * os + t] = vsum(a[j][t]);
  for (; k < K; ++k)
    for (int j = 0; j < R; ++j) {
      const float v = sw<WB>(row0 + j * rs, k);
      for (int t = 0; t < NT; ++t) o[j * os + t] += v * xs[t][k];
    }
}

// ---- Element-wise vector arithmetic (gate.h's SwiGLU, decode_isa.cpp's combine) ------------

#if FT_ISA >= 1
#if FT_ISA >= 2
typedef __m512i vi;
inline vf vsplat(float a) { return _mm512_set1_ps(a); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vclamp(vf a, float lo, float hi) { return _mm512_min_ps(_mm512_max_ps(a, vsplat(lo)), vsplat(hi)); }
inline vf vround(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vpow2i(vf n) {  // 2^n for integral n in [-126, 127]
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
// Round to bf16 (nearest even) and back, as f2bf; NaN stays NaN.
inline vf vrbf(vf a) {
  const vi u = _mm512_castps_si512(a);
  const vi r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
  const __mmask16 nan = _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
  return _mm512_castsi512_ps(_mm512_mask_or_epi32(_mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u)),
                                                  nan, u, _mm512_set1_epi32(0x400000)));
}
#else
typedef __m256i vi;
inline vf vsplat(float a) { return _mm256_set1_ps(a); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vclamp(vf a, float lo, float hi) { return _mm256_min_ps(_mm256_max_ps(a, vsplat(lo)), vsplat(hi)); }
inline vf vround(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vpow2i(vf n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline vf vrbf(vf a) {
  const vi u = _mm256_castps_si256(a);
  const vi r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)),
                                _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)));
  const vf kept = _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u)));
  const vf qnan = _mm256_castsi256_ps(_mm256_or_si256(u, _mm256_set1_epi32(0x400000)));
  return _mm256_blendv_ps(kept, qnan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
}
#endif

#endif

// ---- Results out of a block ---------------------------------------------------------------

// dst[j] = src[j * stride] for j < n, as bf16 (f2bf's rounding) when bf, else fp32: one token's
// outputs of a block of rows, gathered from the block's [row][token] buffer and written with
// vector stores, instead of one scalar store per row and token that reloaded the destination
// through the problem struct after every store. Measured small: stage 2 of one expert with 8
// tokens, hot in cache on the EPYC, 5-10% faster in three alternating pairs; cold (bench/
// cpu_kernel_ab.py) the same-expert rates over the one-token rate 0.80-0.83 -> 0.83-0.85 there,
// unchanged on the H200 host's Xeon (bench/results/cpu_kernel_ab_strided_stores_*.json).
inline void store_strided(const float* src, int64_t stride, int64_t n, bool bf, void* dst) {
  int64_t j = 0;
#if FT_ISA >= 1
#if FT_ISA >= 2
  const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32((int)stride));
  for (; j + VW <= n; j += VW) {
    const vf v = _mm512_i32gather_ps(idx, src + j * stride, 4);
    if (bf) {
      const __m512i hi = _mm512_srli_epi32(_mm512_castps_si512(vrbf(v)), 16);
      _mm256_storeu_si256((__m256i*)((uint16_t*)dst + j), _mm512_cvtepi32_epi16(hi));
    } else {
      _mm512_storeu_ps((float*)dst + j, v);
    }
  }
#else
  const __m256i idx = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)stride));
  for (; j + VW <= n; j += VW) {
    const vf v = _mm256_i32gather_ps(src + j * stride, idx, 4);
    if (bf) {
      const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(vrbf(v)), 16);
      _mm_storeu_si128((__m128i*)((uint16_t*)dst + j),
                       _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)));
    } else {
      _mm256_storeu_ps((float*)dst + j, v);
    }
  }
#endif
#endif
  for (; j < n; ++j) {
    if (bf) ((uint16_t*)dst)[j] = f2bf(src[j * stride]);
    else ((float*)dst)[j] = src[j * stride];
  }
}

#if FT_ISA == 3
// The same with bf16 token vectors and vdpbf16ps (32 elements per instruction).
template <int NT>
inline void dotr_bf(const uint16_t* row, const uint16_t* const* xs, int64_t K, int64_t pf, float* out,
                    int64_t far = 0) {
  enum { U = U_DOT };
  __m512 acc[U][NT];
  for (int u = 0; u < U; ++u)
    for (int t = 0; t < NT; ++t) acc[u][t] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + U * 32 <= K; k += U * 32)
    for (int u = 0; u < U; ++u) {
      const __m512bh w = (__m512bh)_mm512_loadu_si512((const void*)(row + k + u * 32));
      if (pf) {
        prefetch((const char*)(row + k + u * 32) + pf);
        if (far) prefetch_far((const char*)(row + k + u * 32) + far);
      }
      for (int t = 0; t < NT; ++t)
        acc[u][t] = _mm512_dpbf16_ps(acc[u][t], w, (__m512bh)_mm512_loadu_si512((const void*)(xs[t] + k + u * 32)));
    }
  for (; k + 32 <= K; k += 32) {
    const __m512bh w = (__m512bh)_mm512_loadu_si512((const void*)(row + k));
    for (int t = 0; t < NT; ++t)
      acc[0][t] = _mm512_dpbf16_ps(acc[0][t], w, (__m512bh)_mm512_loadu_si512((const void*)(xs[t] + k)));
  }
  for (int t = 0; t < NT; ++t) {
    __m512 a = acc[0][t];
    for (int u = 1; u < U; ++u) a = _mm512_add_ps(a, acc[u][t]);
    out[t] = _mm512_reduce_add_ps(a);
  }
  for (; k < K; ++k) {
    const float wv = bf2f(row[k]);
    for (int t = 0; t < NT; ++t) out[t] += wv * bf2f(xs[t][k]);
  }
}

inline void dotrn_bf(int nt, const uint16_t* row, const uint16_t* const* xs, int64_t K, int64_t pf, float* out,
                     int64_t far = 0) {
  switch (nt) {
    case 1: dotr_bf<1>(row, xs, K, pf, out, far); break;
    case 2: dotr_bf<2>(row, xs, K, pf, out, far); break;
    case 3: dotr_bf<3>(row, xs, K, pf, out, far); break;
    case 4: dotr_bf<4>(row, xs, K, pf, out, far); break;
    case 5: dotr_bf<5>(row, xs, K, pf, out, far); break;
    case 6: dotr_bf<6>(row, xs, K, pf, out, far); break;
    case 7: dotr_bf<7>(row, xs, K, pf, out, far); break;
    default: dotr_bf<8>(row, xs, K, pf, out, far); break;
  }
}
#endif

}  // namespace
