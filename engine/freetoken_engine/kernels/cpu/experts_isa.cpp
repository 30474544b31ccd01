// Per-ISA expert kernels. Compiled once per instruction set by build.py:
//   -DFT_ISA=0 generic C (any x86-64), 1 AVX2+FMA, 2 AVX-512F/BW/VL, 3 AVX-512 + AVX512-BF16.
// Everything here is file-local except the two stage functions (see experts.h), and no C++
// library header is included, so no ISA-specific inline code can leak into other units.
//
// Memory-bound design (decode: a few tokens per expert): each weight row is streamed once, in
// address order (a block of gate rows, then the matching up rows, then SwiGLU), converted
// bf16 -> fp32 in registers (a 16-bit shift) and multiplied into up to NTMAX token vectors
// kept hot in L1. With x in
// bf16 and AVX512-BF16 present, vdpbf16ps multiplies bf16 pairs directly (products are exact
// in fp32, so the result matches the fp32 path up to summation order).
#include "simd.h"

namespace {

// SwiGLU of one (gate, up) pair, rounding where the reference rounds when x is bf16.
inline float swiglu(float g, float u, int xb16) {
  if (xb16) {
    g = rbf(g);
    u = rbf(u);
    return rbf(rbf(g / (1.f + expf(-g))) * u);
  }
  return g / (1.f + expf(-g)) * u;
}

// Gate rows then up rows of a block of at most RB intermediate rows: two sequential streams
// one after the other (dotr), then SwiGLU.
enum { RB = 64 };

template <bool WB>
void stage1(const FtProblem* p, int64_t g, int64_t i0, int64_t i1) {
  const int64_t H = p->H, I = p->I, s = p->g_start[g], n = p->g_count[g];
  const int64_t es = WB ? 2 : 4;
  const char* base = (const char*)p->w13 + p->g_expert[g] * p->w13_es * es;
  const int64_t rs = p->w13_rs * es;
  float og[RB][NTMAX], ou[RB][NTMAX];
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
    for (int64_t ib = i0; ib < i1; ib += RB) {
      const int64_t ie = ib + RB < i1 ? ib + RB : i1;
      for (int half = 0; half < 2; ++half)
        for (int64_t i = ib; i < ie; ++i) {
          const char* row = base + (half * I + i) * rs;
          float* o = half ? ou[i - ib] : og[i - ib];
#if FT_ISA == 3
          if (p->xb) dotrn_bf(nt, (const uint16_t*)row, xbs, H, p->prefetch, o);
          else
#endif
            dotrn<WB>(nt, row, xs, H, p->prefetch, o);
        }
      for (int64_t i = ib; i < ie; ++i)
        for (int t = 0; t < nt; ++t) {
          const float a = swiglu(og[i - ib][t], ou[i - ib][t], p->x_bf16);
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
    for (int64_t h = h0; h < h1; ++h) {
      const char* row = base + h * rs;
      float o[NTMAX];
#if FT_ISA == 3
      if (p->xb) dotrn_bf(nt, (const uint16_t*)row, xbs, I, p->prefetch, o);
      else
#endif
        dotrn<WB>(nt, row, xs, I, p->prefetch, o);
      for (int t = 0; t < nt; ++t) {
        if (p->out_bf16) ((uint16_t*)p->out)[dst[t] + h] = f2bf(o[t]);
        else ((float*)p->out)[dst[t] + h] = o[t];
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
