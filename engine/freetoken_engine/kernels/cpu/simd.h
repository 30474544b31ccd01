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
inline vf vldb(const uint16_t* p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
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

// out[t] = dot(row[0:K], xs[t][0:K]) for NT fp32 token vectors, reading the weight row as one
// sequential stream: on the 2-CPU EPYC one stream per call reads at the STREAM rate (~40 GB/s)
// where four interleaved rows reach 31. U_DOT accumulators per token: U_DOT does not depend on
// NT, so a token's result (its summation order) does not depend on how many other tokens share
// the call (pair outputs stay independent of the batch). One is enough to stay memory-bound
// (2 measured within noise: SmolLM2 decode 52.2 vs 50.9 tok/s, the bf16 MoE 93.1 vs 92.1) and
// keeps the prefill of the converted default model within its 1e-4 test of transformers
// (max |diff| 1.10e-4 of logits up to 37.6 in rtol+atol, where 2 gave 1.33e-4: fp32 noise).
enum { U_DOT = 1 };

template <int NT, bool WB>
inline void dotr(const void* row, const float* const* xs, int64_t K, int64_t pf, float* out) {
  enum { U = U_DOT };
  vf acc[U][NT];
  for (int u = 0; u < U; ++u)
    for (int t = 0; t < NT; ++t) acc[u][t] = vzero();
  int64_t k = 0;
  for (; k + U * VW <= K; k += U * VW)
    for (int u = 0; u < U; ++u) {
      const vf w = vw<WB>(row, k + u * VW);
      if (pf) prefetch((const char*)row + (k + u * VW) * (WB ? 2 : 4) + pf);
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
inline void dotrn(int nt, const void* row, const float* const* xs, int64_t K, int64_t pf, float* out) {
  switch (nt) {
    case 1: dotr<1, WB>(row, xs, K, pf, out); break;
    case 2: dotr<2, WB>(row, xs, K, pf, out); break;
    case 3: dotr<3, WB>(row, xs, K, pf, out); break;
#if FT_ISA >= 2
    case 4: dotr<4, WB>(row, xs, K, pf, out); break;
    case 5: dotr<5, WB>(row, xs, K, pf, out); break;
    case 6: dotr<6, WB>(row, xs, K, pf, out); break;
    case 7: dotr<7, WB>(row, xs, K, pf, out); break;
    default: dotr<8, WB>(row, xs, K, pf, out); break;
#else
    default: dotr<4, WB>(row, xs, K, pf, out); break;
#endif
  }
}

#if FT_ISA == 3
// The same with bf16 token vectors and vdpbf16ps (32 elements per instruction).
template <int NT>
inline void dotr_bf(const uint16_t* row, const uint16_t* const* xs, int64_t K, int64_t pf, float* out) {
  enum { U = U_DOT };
  __m512 acc[U][NT];
  for (int u = 0; u < U; ++u)
    for (int t = 0; t < NT; ++t) acc[u][t] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + U * 32 <= K; k += U * 32)
    for (int u = 0; u < U; ++u) {
      const __m512bh w = (__m512bh)_mm512_loadu_si512((const void*)(row + k + u * 32));
      if (pf) prefetch((const char*)(row + k + u * 32) + pf);
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

inline void dotrn_bf(int nt, const uint16_t* row, const uint16_t* const* xs, int64_t K, int64_t pf, float* out) {
  switch (nt) {
    case 1: dotr_bf<1>(row, xs, K, pf, out); break;
    case 2: dotr_bf<2>(row, xs, K, pf, out); break;
    case 3: dotr_bf<3>(row, xs, K, pf, out); break;
    case 4: dotr_bf<4>(row, xs, K, pf, out); break;
    case 5: dotr_bf<5>(row, xs, K, pf, out); break;
    case 6: dotr_bf<6>(row, xs, K, pf, out); break;
    case 7: dotr_bf<7>(row, xs, K, pf, out); break;
    default: dotr_bf<8>(row, xs, K, pf, out); break;
  }
}
#endif

}  // namespace
