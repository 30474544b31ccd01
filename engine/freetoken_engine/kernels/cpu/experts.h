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
  int64_t H, I;                 // hidden size, intermediate rows this call computes
  int64_t up;                   // rows from a gate row to its up row (the full I; see ft_experts_range)
  const void* w13;              // [E, 2I, H] rows of H, bf16 or fp32
  const void* w2;               // [E, H, I]  rows of I
  int w_bf16;                   // 1: weights are bf16, 0: fp32, 2: MXFP4 rows (mxfp4.h; strides in bytes)
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
  const uint8_t* g_amx;         // [n_groups] 1: the group runs on the AMX tiles, else null
  const uint32_t* xv;           // AMX groups' x in VNNI pairs (amx_pack.h): group g's block tb at
                                // xv + g_xv[g] + tb * H/2, words [k/2 * nt + t]; their act_b is kept
                                // in the same layout: [(start + tb) * I + i/2 * 2nt + 2t + i%2]
  const int64_t* g_xv;          // [n_groups] word offset of an AMX group's packed x (shared by
                                // groups with equal token lists)
  // Tuning (tune.h, set by ft_tune): a second prefetch into L2, far_pf times `prefetch` ahead in
  // the bf16-dot kernels' groups of at least far_pf_tokens tokens, small_far_pf times in smaller
  // groups (bf16 and fp32 tokens; 0: off); the tiles' prefetch distance along each of their 16
  // rows (bytes, 0: off) and, with amx_next, the next 16-row block prefetched into L2 in address
  // order while the tiles read the current one.
  int64_t far_pf, far_pf_tokens, amx_pf, amx_next, small_far_pf;
  // Experts of another kind (gated_block in gate.h): gate_act 0 silu(gate) * up, 1 gpt-oss's
  // (gate clamped above at limit, up to [-limit, limit], gate sigmoid(alpha gate) (up + 1)); b13:
  // fp32 gate/up bias rows of b13_rs floats (gate biases, then up ones at +up), group g's row
  // g_bias[g]; null: none.
  int gate_act;
  float alpha, limit;
  const float* b13;
  int64_t b13_rs;
  const int64_t* g_bias;
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
void ft_stage1_amx(const FtProblem*, int64_t, int64_t, int64_t);   // experts_amx.cpp
void ft_stage2_amx(const FtProblem*, int64_t, int64_t, int64_t);

// A dense projection of a few tokens (decode): out[t, n] = sum_k w[n, k] x[t, k] (+ bias[n]),
// fp32 accumulation, rounded once to bf16 when out_bf16.
struct FtLinear {
  int64_t T, K, N;              // tokens, input features, output features
  const void* w;                // [N, K] rows of K, bf16 or fp32
  int w_bf16;
  int64_t w_rs;                 // row stride (elements)
  const void* bias;             // [N] in the weight's dtype, or null
  const float* xf;              // [T, K] fp32 (fp32 paths)
  const uint16_t* xb;           // [T, K] bf16 (bf16-dot path), else null
  void* out;                    // [T, N], contiguous
  int out_bf16;
  int64_t prefetch;
  int64_t far;                  // a second prefetch, into L2, this many bytes ahead (0: none)
  int row_group;                // 0, or rows a group (2, 4): fp32 token vectors on bf16 rows (dotr_rows)
};

// RMSNorm of T rows of H: out = x * rsqrt(mean(x^2) + eps) * w, computed in fp32; with bf16
// data the normalised row is rounded to bf16 before the weight multiplies it (as the reference).
struct FtNorm {
  int64_t T, H;
  const void* x;                // [T, H] contiguous
  const void* w;                // [H]
  float eps;
  int bf16;                     // 1: x, w, out are bf16; 0: fp32
  void* out;                    // [T, H]
};

// Attention of one new token per sequence (decode) over a paged KV pool, for sequences
// [b0, b1): optional per-head RMSNorm of q and k, rotary embedding, K/V written to their slots,
// then softmax(q k^T * scale) v over the sequence's keys, all in fp32 (see kernels/cpu/attention.py).
struct FtAttn {
  int64_t B, h, kvh, d;
  const void* qkv;              // [B, (h + 2 kvh) d] rows: q heads, then k heads, then v heads
  const void* qn_w;             // [d] per-head q RMSNorm weight, or null
  const void* kn_w;             // [d] per-head k RMSNorm weight, or null
  float eps;
  const void* cos;              // [B, rot]
  const void* sin;              // [B, rot] signed sin (first half negated): rotate-half as a roll
  void* k_cache;                // [S, kvh, d]
  void* v_cache;                // [S, kvh, d]
  const int64_t* slot;          // [B] slot of the new token
  const int64_t* kv_index;      // [B, lmax] slot of each position
  int64_t lmax;
  const int64_t* kv_len;        // [B] keys of each sequence (the new token included)
  int64_t window;               // sliding window (0: none)
  float scale;
  int bf16;                     // 1: every tensor above is bf16 (indices aside); 0: fp32
  int phase;                    // 0: each row writes its K/V then attends; 1: write only; 2: attend only
                                // (1 then 2: rows of one sequence at consecutive positions, a draft's
                                // verification, see every row's K/V whichever thread runs them)
  void* out;                    // [B, h d]
  float* scratch;               // set by ft_attn: its own per-participant scratch
  int64_t rot;                  // the first rot <= d dimensions of each head rotate (cos, sin: [B, rot])
  int64_t hsplit;               // set by ft_attn: each row's query heads in this many work items
  const float* sinks;           // [h] fp32 attention sinks (one more logit in each softmax's
                                // denominator, no value), or null
  int64_t chunk;                // a query sees only its own chunk of this many positions (0: none)
};

// An MoE layer's output from its pair rows (reference.moe_combine_forward), for tokens [t0, t1):
// out[t] = res[t] + (round(round(sum_j round(w[t, j] rows[t k + j])) + shared[t])), the sum in
// fp32 in the order of j, each step rounded to the data type; shared / res may be null.
struct FtCombine {
  int64_t k, H;
  const void* rows;             // [T k, H] contiguous
  const void* w;                // [T, k]
  const void* shared;           // [T, H] or null
  const void* res;              // [T, H] or null
  int bf16;                     // 1: every tensor is bf16; 0: fp32
  void* out;                    // [T, H]
};

typedef void (*ft_norm_fn)(const FtNorm*);
typedef void (*ft_combine_fn)(const FtCombine*, int64_t t0, int64_t t1);
void ft_combine_generic(const FtCombine*, int64_t, int64_t);
void ft_combine_avx2(const FtCombine*, int64_t, int64_t);
void ft_combine_avx512(const FtCombine*, int64_t, int64_t);
void ft_combine_avx512bf16(const FtCombine*, int64_t, int64_t);
typedef void (*ft_attn_fn)(const FtAttn*, int64_t b0, int64_t b1, float* scratch);
void ft_rmsnorm_generic(const FtNorm*);
void ft_rmsnorm_avx2(const FtNorm*);
void ft_rmsnorm_avx512(const FtNorm*);
void ft_rmsnorm_avx512bf16(const FtNorm*);
void ft_attn_generic(const FtAttn*, int64_t, int64_t, float*);
void ft_attn_avx2(const FtAttn*, int64_t, int64_t, float*);
void ft_attn_avx512(const FtAttn*, int64_t, int64_t, float*);
void ft_attn_avx512bf16(const FtAttn*, int64_t, int64_t, float*);

// Output features [n0, n1) for every token.
typedef void (*ft_linear_fn)(const FtLinear*, int64_t n0, int64_t n1);
void ft_linear_generic(const FtLinear*, int64_t, int64_t);
void ft_linear_avx2(const FtLinear*, int64_t, int64_t);
void ft_linear_avx512(const FtLinear*, int64_t, int64_t);
void ft_linear_avx512bf16(const FtLinear*, int64_t, int64_t);
}

extern "C" {
uint64_t ft_read_generic(const void*, int64_t);
uint64_t ft_read_avx2(const void*, int64_t);
uint64_t ft_read_avx512(const void*, int64_t);
uint64_t ft_read_avx512bf16(const void*, int64_t);
}
