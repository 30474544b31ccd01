// Shared between the dispatcher (experts.cpp, baseline ISA) and the per-ISA kernels
// (experts_isa.cpp, compiled once per instruction set with -DFT_ISA_NAME=...).
// Plain C types only: the per-ISA translation units must not emit inline library code that
// the linker could merge into the baseline unit (an AVX-512 copy of std::min would crash an
// AVX2-only machine).
#pragma once
#include <stdint.h>

extern "C" {

// One call's work, already grouped by expert by the dispatcher.
//   pairs are sorted by expert (stable); group g covers sorted positions
//   [g_start[g], g_start[g] + g_count[g]) and uses expert g_expert[g].
struct FtProblem {
  int64_t H, I;                 // hidden size, intermediate size
  const void* w13;              // [E, 2I, H] rows of H, bf16 or fp32
  const void* w2;               // [E, H, I]  rows of I
  int w_bf16;                   // 1: weights are bf16, 0: fp32
  int64_t w13_es, w13_rs;       // expert stride, row stride (elements)
  int64_t w2_es, w2_rs;
  int64_t n_groups;
  const int64_t* g_expert;
  const int64_t* g_start;
  const int64_t* g_count;
  const int64_t* sorted_pair;   // [P] pair index at each sorted position
  const int64_t* pair_tok;      // [P] token of each pair
  const float* xf;              // [T, H] x as fp32 (fp32 paths)
  const uint16_t* xb;           // [T, H] x as bf16 (bf16-dot path), else null
  int x_bf16;                   // 1: x is bf16: round intermediates to bf16 like the reference
  float* act;                   // [P, I] scratch, sorted order (fp32 paths)
  uint16_t* act_b;              // [P, I] scratch, sorted order (bf16-dot path)
  void* out;                    // [P, H] output in caller pair order
  int out_bf16;
  int64_t prefetch;             // software prefetch distance in bytes (0: off)
};

// Stage 1: for group g and intermediate rows [i0, i1): act = silu(x W1^T) * (x W3^T).
// Stage 2: for group g and output rows [h0, h1): out = act W2^T.
typedef void (*ft_stage_fn)(const FtProblem*, int64_t g, int64_t r0, int64_t r1);

void ft_stage1_generic(const FtProblem*, int64_t, int64_t, int64_t);
void ft_stage2_generic(const FtProblem*, int64_t, int64_t, int64_t);
void ft_stage1_avx2(const FtProblem*, int64_t, int64_t, int64_t);
void ft_stage2_avx2(const FtProblem*, int64_t, int64_t, int64_t);
void ft_stage1_avx512(const FtProblem*, int64_t, int64_t, int64_t);
void ft_stage2_avx512(const FtProblem*, int64_t, int64_t, int64_t);
void ft_stage1_avx512bf16(const FtProblem*, int64_t, int64_t, int64_t);
void ft_stage2_avx512bf16(const FtProblem*, int64_t, int64_t, int64_t);
}

extern "C" {
uint64_t ft_read_generic(const void*, int64_t);
uint64_t ft_read_avx2(const void*, int64_t);
uint64_t ft_read_avx512(const void*, int64_t);
uint64_t ft_read_avx512bf16(const void*, int64_t);
}
