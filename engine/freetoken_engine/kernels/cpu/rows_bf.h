// The AVX512-BF16 rows of the expert kernels (experts_isa.cpp, FT_ISA 3): bf16 tokens against
// bf16 weight rows with vdpbf16ps, the sums of up to 16 of them in one tree, and the prefetch
// into L1 and L2 along the rows.
#pragma once
#include "simd.h"

namespace {

#if FT_ISA == 3
// Sums of n <= 16 vectors, out[v] = _mm512_reduce_add_ps(acc[v]) bitwise (the same tree of
// adds: halves of 256, of 128, then pairs), done as one transposing tree: 15 adds instead of
// 16 separate reductions. Lanes of different vectors never mix, so zero padding is exact.
inline void reduce16(const __m512* acc, int n, float* out) {
  __m512 v[16], s[8], t[4], u[2];
  for (int i = 0; i < 16; ++i) v[i] = i < n ? acc[i] : _mm512_setzero_ps();
  for (int i = 0; i < 8; ++i)
    s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)));
  for (int i = 0; i < 4; ++i)
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  float lanes[16];
  _mm512_storeu_ps(lanes, r);
  for (int i = 0; i < n; ++i) out[i] = lanes[4 * (i & 3) + (i >> 2)];  // lane 4L+e holds vector L+4e
}

// With many tokens the loop spends long enough on each weight line that the L1 prefetch one
// distance ahead no longer keeps enough misses in flight: a second prefetch into L2, FAR_PF
// distances ahead, for NT >= FAR_PF_TOKENS. On the 2-CPU EPYC, one thread, 8 tokens on the same
// 8 experts: 16 -> 22-24 GB/s (paired, same run). With the larger work chunks, at 2 threads
// (same-expert tokens, the two libraries alternating in one process): 3 tokens 50.8 -> 54.3,
// 4 tokens 42.3 -> 49.2 (1 thread 22.6 -> 25.5) from 3 tokens on instead of 5; 2 tokens
// 65.3 -> 63.8 (not used there); 8 distances instead of 4 changed nothing. The distance
// (FtProblem::far_pf, in units of the L1 distance) and the token threshold are tune.h's.
// Groups of 1-2 tokens take an L2 prefetch too, small_far_pf = 2 distances ahead (stop 66): on the
// H100 host's Xeon (15 threads, paired with the read, bench/cpu_kernel_tune.py) one token on 8
// experts 87 -> 98% of the read from C, 2 experts 82 -> 90%, 4 tokens over a random top-8 86 ->
// 97%, 1 expert 73 -> 72%; 3 and 4 distances ahead gained less. With the L1 prefetch alone (one
// 4 KiB row ahead) a 1-token call's gate/up rows read at 90 GB/s where a plain read of the same
// bytes ran at 117 (bench/expert_call_size.py). Float32 tokens (rows_f) take it too.

// out[t] = dot(row[0:K], xs[t][0:K]) for NT bf16 token vectors: vdpbf16ps into U_BF fp32
// accumulators per token (32-element block j of the row goes to accumulator j % U_BF, added
// before the horizontal sum), one sequential weight stream, the NT sums in one tree. U_BF does
// not depend on NT, so a pair's result never depends on the other tokens of its group.
// Against one accumulator per token (EPYC, 2 threads, same-expert tokens, the two libraries
// alternating in one process): 8 tokens 32.9-34.6 vs 27.8-27.9 GB/s, 3-4 tokens 2-5% slower,
// 1 token the same (49 GB/s; 38.5 at 1 thread).
// Two rows at once, each token load serving both (half the loads per weight line), cost 4 tokens
// 18% on the EPYC: two streams. Again at 6 and 8 tokens (2026-11-30, a `rows2` knob, the paired
// sweep of bench/cpu_kernel_tune.py, 3 rounds, the read at 45-47 GB/s): 6 tokens 87 -> 78% of the
// read, 8 tokens (two passes of 4 over the pair) 85 -> 66%; the same bits, dropped.
enum { U_BF = 2 };

// The NT per-token vectors whose horizontal sums are dot(row[0:K0], xs[t][0:K0]), K0 = K rounded
// down to 32: vdpbf16ps into U_BF fp32 accumulators per token (32-element block j of the row goes
// to accumulator j % U_BF, added before the horizontal sum), one sequential weight stream.
template <int NT>
inline void dot_row_sums(const uint16_t* row, const uint16_t* const* xs, int64_t K, int64_t pf, int64_t far,
                         __m512* sum) {
  __m512 acc[U_BF][NT];
  for (int u = 0; u < U_BF; ++u)
    for (int t = 0; t < NT; ++t) acc[u][t] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + U_BF * 32 <= K; k += U_BF * 32) {
    if (pf) {
      prefetch((const char*)(row + k) + pf);
      prefetch((const char*)(row + k) + pf + 64);
      if (far) {
        prefetch_far((const char*)(row + k) + far);
        prefetch_far((const char*)(row + k) + far + 64);
      }
    }
    for (int u = 0; u < U_BF; ++u) {
      const __m512bh w = (__m512bh)_mm512_loadu_si512((const void*)(row + k + 32 * u));
      for (int t = 0; t < NT; ++t)
        acc[u][t] = _mm512_dpbf16_ps(acc[u][t], w, (__m512bh)_mm512_loadu_si512((const void*)(xs[t] + k + 32 * u)));
    }
  }
  if (k + 32 <= K) {
    const __m512bh w = (__m512bh)_mm512_loadu_si512((const void*)(row + k));
    for (int t = 0; t < NT; ++t)
      acc[0][t] = _mm512_dpbf16_ps(acc[0][t], w, (__m512bh)_mm512_loadu_si512((const void*)(xs[t] + k)));
  }
  for (int t = 0; t < NT; ++t) sum[t] = _mm512_add_ps(acc[0][t], acc[1][t]);
}

// out[t] = dot(row[0:K], xs[t][0:K]) for NT bf16 token vectors (dot_row_sums, the NT sums in one
// tree, then the K % 32 tail). U_BF does not depend on NT, so a pair's result never depends on
// the other tokens of its group (see U_BF).
template <int NT>
inline void dot_row_bf(const uint16_t* row, const uint16_t* const* xs, int64_t K, int64_t pf, int64_t far,
                       float* out) {
  __m512 sum[NT];
  dot_row_sums<NT>(row, xs, K, pf, far, sum);
  if (NT >= 4) {
    reduce16(sum, NT, out);
  } else {
    for (int t = 0; t < NT; ++t) out[t] = _mm512_reduce_add_ps(sum[t]);
  }
  for (int64_t k = K / 32 * 32; k < K; ++k) {
    const float wv = bf2f(row[k]);
    for (int t = 0; t < NT; ++t) out[t] += wv * bf2f(xs[t][k]);
  }
}

// Rows [r0, r1) at base + r * rs against NT tokens: out[(r - r0) * NTMAX + t]. The software
// prefetch runs pf bytes ahead along the rows, so it stops at the chunk's last row rend: rows
// past it are another thread's (they cost 4 KiB per stream per chunk, 6-12% of the reads with
// 64 KiB chunks).
// With 4 to 8 tokens (those that reduce in a tree) and K a multiple of 32, rows go in groups of
// 16 / NT (4 rows of 4 tokens, 3 of 5, 2 of 6-8) whose sums share one tree (reduce16 is bitwise
// the per-vector sums, so the results do not change): with 8 tokens a row's own tree was half zero padding, and a down-projection row
// (I = 768: 12 steps of the loop) spent about a quarter of its time in it. Hot in L3, 2 threads,
// the EPYC, one expert (alternating processes, 3 each, against one tree per row): 4 / 5 / 6 / 8
// tokens 96-102 / 88-92 / 78-81 / 64-65 -> 100-107 / 93-98 / 83-87 / 69-71 GB/s. 1-3 tokens
// keep one row at a time.
template <int NT>
inline void rows_bf(const char* base, int64_t rs, int64_t r0, int64_t r1, const uint16_t* const* xs,
                    int64_t K, int64_t pf, int64_t far, float* out, int64_t rend) {
  const int64_t last = rend - (pf + rs - 1) / rs;   // rows before it prefetch inside the chunk
  int64_t r = r0;
  constexpr int R = NT >= 4 ? 16 / NT : 1;          // rows per tree: as many as fill its 16 sums
  if (R > 1 && K % 32 == 0) {
    for (; r + R <= r1; r += R) {
      __m512 sum[R * NT];
      float o[16];
      for (int j = 0; j < R; ++j)
        dot_row_sums<NT>((const uint16_t*)(base + (r + j) * rs), xs, K, r + j < last ? pf : 0,
                         r + j < last ? far : 0, sum + j * NT);
      reduce16(sum, R * NT, o);
      for (int j = 0; j < R; ++j)
        for (int t = 0; t < NT; ++t) out[(r + j - r0) * NTMAX + t] = o[j * NT + t];
    }
  }
  for (; r < r1; ++r)
    dot_row_bf<NT>((const uint16_t*)(base + r * rs), xs, K, r < last ? pf : 0, r < last ? far : 0,
                   out + (r - r0) * NTMAX);
}

inline void rows_bf_n(const FtProblem* p, int nt, const char* base, int64_t rs, int64_t r0, int64_t r1,
                      const uint16_t* const* xs, int64_t K, float* out, int64_t rend) {
  const int64_t pf = p->prefetch, far = (nt >= p->far_pf_tokens ? p->far_pf : p->small_far_pf) * pf;
  switch (nt) {
    case 1: rows_bf<1>(base, rs, r0, r1, xs, K, pf, far, out, rend); break;
    case 2: rows_bf<2>(base, rs, r0, r1, xs, K, pf, far, out, rend); break;
    case 3: rows_bf<3>(base, rs, r0, r1, xs, K, pf, far, out, rend); break;
    case 4: rows_bf<4>(base, rs, r0, r1, xs, K, pf, far, out, rend); break;
    case 5: rows_bf<5>(base, rs, r0, r1, xs, K, pf, far, out, rend); break;
    case 6: rows_bf<6>(base, rs, r0, r1, xs, K, pf, far, out, rend); break;
    case 7: rows_bf<7>(base, rs, r0, r1, xs, K, pf, far, out, rend); break;
    default: rows_bf<8>(base, rs, r0, r1, xs, K, pf, far, out, rend); break;
  }
}
#endif

}  // namespace
