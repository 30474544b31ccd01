// MXFP4 weight rows (kernels/mxfp4.py): a row of K values (K a multiple of 32) is K/2 bytes of
// 4-bit e2m1 codes, then K/32 scale bytes (2^(s - 127)). Block b's 32 values are the 16 bytes at
// 16b: byte j holds value 32b + j in its low nibble and value 32b + 16 + j in its high one, so a
// nibble half of the block is a run of 16 consecutive values (one AVX-512 vector, two AVX2 ones).
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

#if FT_ISA >= 2
// The 16 low (hi = false) or high nibbles of a block's 16 bytes as fp32 values times scale.
inline vf mx_half(__m128i bytes, bool hi, vf scale) {
  static const float lut[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
  const __m128i nib = _mm_and_si128(hi ? _mm_srli_epi16(bytes, 4) : bytes, _mm_set1_epi8(0x0F));
  return _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(nib), _mm512_loadu_ps(lut)), scale);
}
#elif FT_ISA == 1
// Eight nibbles (the low or high ones of 8 bytes in the low half of `bytes`) as fp32 values times
// scale: the magnitude from an 8-entry table, the sign from the code's bit 3.
inline vf mx_eighth(__m128i bytes, bool hi, vf scale) {
  const __m128i nib = _mm_and_si128(hi ? _mm_srli_epi16(bytes, 4) : bytes, _mm_set1_epi8(0x0F));
  const __m256i idx = _mm256_cvtepu8_epi32(nib);
  const vf mag = _mm256_permutevar8x32_ps(_mm256_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f), idx);
  const __m256i sign = _mm256_and_si256(_mm256_slli_epi32(idx, 28), _mm256_set1_epi32((int)0x80000000u));
  return _mm256_mul_ps(_mm256_or_ps(mag, _mm256_castsi256_ps(sign)), scale);
}
#endif

inline float mx_value(const uint8_t* row, int64_t K, int64_t k) {
  static const float lut[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
  const int64_t b = k >> 5, j = k & 31;
  const uint8_t byte = row[b * 16 + (j & 15)];
  return lut[j < 16 ? byte & 15 : byte >> 4] * mx_scale(row[K / 2 + b]);
}

// Rows of up to 32768 values (1024 blocks): every model's hidden and expert sizes.
enum { MX_MAX_BLOCKS = 1024 };

// out[t] = dot(row[0:K], xs[t][0:K]) for NT fp32 token vectors over an MXFP4 row, one
// accumulator per token and VW values a step in order: dotr's summation exactly, so the result is
// dotr's on the row's dequantized (bf16 or fp32) values bit for bit.
template <int NT>
inline void dotq(const uint8_t* row, const float* const* xs, int64_t K, int64_t pf, float* out) {
  vf acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = vzero();
  const uint8_t* sc = row + K / 2;
  // the row's block scales as floats first: each block then broadcasts its scale from memory (a
  // load, where a broadcast from a register takes the shuffle port the decoding needs)
  float scale[MX_MAX_BLOCKS];
  const int64_t nb = K / 32;
  for (int64_t b = 0; b < nb; ++b) scale[b] = mx_scale(sc[b]);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * 16;
    if (pf && (b & 3) == 0) prefetch(blk + pf);
    const int64_t k = b * 32;
#if FT_ISA >= 2
    const vf s = _mm512_set1_ps(scale[b]);
    const __m128i bytes = _mm_loadu_si128((const __m128i*)blk);
    const vf w0 = mx_half(bytes, false, s), w1 = mx_half(bytes, true, s);
    for (int t = 0; t < NT; ++t) acc[t] = vfma(w0, vld(xs[t] + k), acc[t]);
    for (int t = 0; t < NT; ++t) acc[t] = vfma(w1, vld(xs[t] + k + 16), acc[t]);
#elif FT_ISA == 1
    const vf s = _mm256_set1_ps(scale[b]);
    const __m128i lo8 = _mm_loadl_epi64((const __m128i*)blk), hi8 = _mm_loadl_epi64((const __m128i*)(blk + 8));
    const vf w[4] = {mx_eighth(lo8, false, s), mx_eighth(hi8, false, s), mx_eighth(lo8, true, s),
                     mx_eighth(hi8, true, s)};
    for (int q = 0; q < 4; ++q)
      for (int t = 0; t < NT; ++t) acc[t] = vfma(w[q], vld(xs[t] + k + 8 * q), acc[t]);
#else
    for (int j = 0; j < 32; ++j) {
      const float wv = mx_value(row, K, k + j);
      for (int t = 0; t < NT; ++t) acc[t] = vfma(wv, xs[t][k + j], acc[t]);
    }
#endif
  }
  for (int t = 0; t < NT; ++t) out[t] = vsum(acc[t]);
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
