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

}  // namespace
