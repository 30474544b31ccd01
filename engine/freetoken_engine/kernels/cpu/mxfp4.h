// MXFP4 weight rows (kernels/mxfp4.py): a row of K values (K a multiple of 32) is K/2 bytes of
// 4-bit e2m1 codes, then K/32 scale bytes (2^(s - 127), one per block of 32 values). Each run of
// 16 values is 8 bytes, little-endian words A and B: value 2m in A's nibble m, value 2m + 1 in B's.
// Broadcast to every 64-bit lane, the words alternate A, B across the 32-bit lanes, so lane l
// shifted right by 4 (l / 2) holds value l's code in its low nibble: a load, a variable shift and a
// table lookup (vpermps, which reads the low 4 bits of each index) per 16 values, and the only
// shuffle-port instruction is the lookup. The block's scale is folded into the table.
// Included by experts_isa.cpp after simd.h (same ISA macros, same anonymous namespace rules).
#pragma once
#include "simd.h"

namespace {

// 2^(s - 127) as ldexp gives it (s = 0: the subnormal 2^-127; s = 255: +inf).
inline float mx_scale(uint8_t s) {
  union { uint32_t u; float f; } v;
  v.u = s ? (uint32_t)s << 23 : 0x00400000u;
  return v.f;
}

static const float kE2M1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

// Value k's code in a row's code bytes (scalar; the layout's definition).
inline int mx_code(const uint8_t* row, int64_t k) {
  const uint8_t* run = row + (k >> 4) * 8;
  const int v = (int)(k & 15), m = v >> 1;
  const uint8_t byte = run[(v & 1) * 4 + (m >> 1)];
  return (m & 1) ? byte >> 4 : byte & 15;
}

#if FT_ISA >= 2
// The 8 code bytes of a run of 16 values in every 64-bit lane, and a block's scale in every lane:
// broadcasts from memory (load ports), where a broadcast from a register takes the shuffle port
// that the lookups need.
inline __m512i mx_bcast(const uint8_t* run) { return _mm512_castpd_si512(_mm512_set1_pd(*(const double*)run)); }
#elif FT_ISA == 1
inline __m256i mx_bcast(const uint8_t* run) { return _mm256_castpd_si256(_mm256_broadcast_sd((const double*)run)); }
#endif

// The scales of blocks [b0, b0 + n) of a row (its scale bytes at sc) as floats, n <= MX_CHUNK.
enum { MX_CHUNK = 256 };
inline void mx_scales(const uint8_t* sc, int64_t b0, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = mx_scale(sc[b0 + i]);
}

inline float mx_value(const uint8_t* row, int64_t K, int64_t k) {
  return kE2M1[mx_code(row, k)] * mx_scale(row[K / 2 + (k >> 5)]);
}

// out[t] = dot(row[0:K], xs[t][0:K]) for NT fp32 token vectors over an MXFP4 row. Two
// accumulators per token (the first and second 16 values of each block; AVX2: the first and
// second 8 of each run of 16), added before the horizontal sum: with four times fewer bytes a
// value than bf16, one chain of dependent multiply-adds would bound a lone token's row (about 12 G
// values/s a core at 3 GHz). Their number does not depend on NT, so a pair's result never depends
// on the other tokens of its group.
template <int NT>
inline void dotq(const uint8_t* row, const float* const* xs, int64_t K, int64_t pf, float* out) {
  vf acc[2][NT];
  for (int t = 0; t < NT; ++t) acc[0][t] = acc[1][t] = vzero();
  const uint8_t* sc = row + K / 2;
  float scl[MX_CHUNK];
#if FT_ISA >= 2
  const __m512 lut = _mm512_loadu_ps(kE2M1);
  const __m512i sh = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
#elif FT_ISA == 1
  const __m256 mag = _mm256_loadu_ps(kE2M1);
  const __m256i sh0 = _mm256_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12), sh1 = _mm256_setr_epi32(16, 16, 20, 20, 24, 24, 28, 28);
  const __m256i sign = _mm256_set1_epi32((int)0x80000000u);
#endif
  for (int64_t b = 0; b < K / 32; ++b) {
    if (b % MX_CHUNK == 0) mx_scales(sc, b, K / 32 - b < MX_CHUNK ? K / 32 - b : MX_CHUNK, scl);
    const uint8_t* blk = row + b * 16;
    if (pf && (b & 3) == 0) prefetch(blk + pf);
    const int64_t k = b * 32;
#if FT_ISA >= 2
    const __m512 ls = _mm512_mul_ps(lut, _mm512_set1_ps(scl[b % MX_CHUNK]));     // the block's values
    for (int r = 0; r < 2; ++r) {
      const vf w = _mm512_permutexvar_ps(_mm512_srlv_epi32(mx_bcast(blk + 8 * r), sh), ls);
      for (int t = 0; t < NT; ++t) acc[r][t] = vfma(w, vld(xs[t] + k + 16 * r), acc[r][t]);
    }
#elif FT_ISA == 1
    const __m256 ms = _mm256_mul_ps(mag, _mm256_broadcast_ss(scl + b % MX_CHUNK));  // magnitudes (codes 0-7)
    for (int r = 0; r < 4; ++r) {
      const __m256i idx = _mm256_srlv_epi32(mx_bcast(blk + 8 * (r >> 1)), (r & 1) ? sh1 : sh0);
      const __m256i sgn = _mm256_and_si256(_mm256_slli_epi32(idx, 28), sign);
      const vf w = _mm256_or_ps(_mm256_permutevar8x32_ps(ms, idx), _mm256_castsi256_ps(sgn));
      for (int t = 0; t < NT; ++t) acc[r & 1][t] = vfma(w, vld(xs[t] + k + 8 * r), acc[r & 1][t]);
    }
#else
    for (int j = 0; j < 32; ++j) {
      const float wv = mx_value(row, K, k + j);
      for (int t = 0; t < NT; ++t) acc[(j >> 4) & 1][t] = vfma(wv, xs[t][k + j], acc[(j >> 4) & 1][t]);
    }
#endif
  }
  for (int t = 0; t < NT; ++t) out[t] = vsum(vadd(acc[0][t], acc[1][t]));
}

inline void dotqn(int nt, const uint8_t* row, const float* const* xs, int64_t K, int64_t pf, float* out) {
  switch (nt) {
    case 1: dotq<1>(row, xs, K, pf, out); break;
    case 2: dotq<2>(row, xs, K, pf, out); break;
    case 3: dotq<3>(row, xs, K, pf, out); break;
#if FT_ISA >= 1
    case 4: dotq<4>(row, xs, K, pf, out); break;
    case 5: dotq<5>(row, xs, K, pf, out); break;
    case 6: dotq<6>(row, xs, K, pf, out); break;
    case 7: dotq<7>(row, xs, K, pf, out); break;
    default: dotq<8>(row, xs, K, pf, out); break;
#else
    default: dotq<4>(row, xs, K, pf, out); break;
#endif
  }
}

// Rows [r0, r1) at base + r * rs: out[(r - r0) * NTMAX + t], as rows_f (prefetch stops at rend).
inline void rows_q(int nt, const char* base, int64_t rs, int64_t r0, int64_t r1, const float* const* xs,
                   int64_t K, int64_t pf, float* out, int64_t rend) {
  const int64_t last = rend - (pf + rs - 1) / rs;
  for (int64_t r = r0; r < r1; ++r)
    dotqn(nt, (const uint8_t*)(base + r * rs), xs, K, r < last ? pf : 0, out + (r - r0) * NTMAX);
}

}  // namespace
