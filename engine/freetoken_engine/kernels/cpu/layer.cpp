// One decode layer of a plain decoder (pre-norm attention, then a MoE block) on the CPU in two
// calls instead of about forty torch ops and Python calls (kernels/cpu/layer.py says which layers
// qualify). Each half chains the compiled kernels the unfused path calls one by one, on the
// same buffers' values, and adds the two element-wise steps in between the way torch does, so
// the result is bit for bit the unfused path's:
//
//   ft_layer_attn: x = rmsnorm(h); qkv = x Wqkv^T (+ b); o = attention(qkv) (K/V written);
//                  a = o Wo^T (+ b); h2 = h + a (rounded); x2 = rmsnorm'(h2)
//   (the router runs in Python on x2: its softmax and top-k stay torch's)
//   ft_layer_moe:  rows = experts(x2, pairs); out = h2 + round(round(sum_j round(w[t, j] rows[t k + j]))
//                  + shared) (the shared expert's output, computed in Python, when the layer has one)
//
// Compiled for baseline x86-64; the kernels it calls dispatch by instruction set themselves.
#include <stdint.h>
#include <string.h>

#include "entry.h"

extern "C" {

// A projection's weight as ft_linear takes it.
struct FtProj {
  const void* w;            // [N, K] rows of K (row stride rs elements)
  int w_bf16;
  int64_t N, K, rs;
  const void* bias;         // [N] in the weight's dtype, or null
};

// One layer's constants and scratch. The buffers hold max_rows rows; each call uses the first B.
struct FtLayer {
  int64_t H;
  int bf16;                 // the activations' dtype: 1 bf16, 0 fp32
  const void* in_norm;      // [H] input RMSNorm weight (activations' dtype)
  float in_eps;
  const void* post_norm;    // [H] post-attention RMSNorm weight
  float post_eps;
  FtProj qkv, o;
  FtAttn attn;              // h, kvh, d, qn_w, kn_w, eps, scale, window, chunk, sinks, bf16; the rest per call
  // the MoE block's experts: ft_experts_range's weight arguments
  int64_t I, E, k;
  const void* w13;
  const void* w2;
  int w_kind;               // 0 fp32, 1 bf16, 2 MXFP4 rows
  int64_t w13_es, w13_rs, w2_es, w2_rs;
  // experts of another kind (gpt-oss; ft_experts_gated): gate_act 1 the clamped gate (alpha,
  // limit), b13 [E, 2I] fp32 gate/up bias rows (null: none); gate_act 0 and no b13: plain
  int gate_act;
  float alpha, limit;
  const float* b13;
  const int64_t* pair_tok;  // [max_rows k]: t of pair t k + j
  // scratch [max_rows, ...] in the activations' dtype
  void* x;                  // [, H]
  void* qkv_out;            // [, qkv.N]
  void* o_in;               // [, o.K]
  void* a;                  // [, H]
  void* h2;                 // [, H]  the residual after attention (the MoE block's residual)
  void* x2;                 // [, H]  its norm: the router's and the experts' input
  void* rows;               // [, k H]
  void* out;                // [, H]  the layer's output
};

// One decode pass's rows, shared by its layers (a sliding-window layer of a model with a window
// store reads its own: kv_index through the store's map).
struct FtStep {
  int64_t B;
  const void* cos;          // [B, rot]
  const void* sin;          // [B, rot] signed
  int64_t rot;
  const int64_t* slot;      // [B]
  const int64_t* kv_index;  // [B, lmax]
  int64_t lmax;
  const int64_t* kv_len;    // [B]
  int write_first;
};

}  // extern "C"

namespace {

inline float bf2f(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, NaN kept (torch's narrowing; simd.h's f2bf for the baseline unit).
inline uint16_t f2bf(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// out = a + b element-wise, rounded to the data type (torch's add).
void add_rows(const void* a, const void* b, void* out, int64_t n, int bf16) {
  if (bf16) {
    const uint16_t *x = (const uint16_t*)a, *y = (const uint16_t*)b;
    uint16_t* o = (uint16_t*)out;
    for (int64_t i = 0; i < n; ++i) o[i] = f2bf(bf2f(x[i]) + bf2f(y[i]));
  } else {
    const float *x = (const float*)a, *y = (const float*)b;
    float* o = (float*)out;
    for (int64_t i = 0; i < n; ++i) o[i] = x[i] + y[i];
  }
}

int project(const FtProj& p, const void* x, int bf16, int64_t B, void* out) {
  return ft_linear(x, bf16, B, p.K, p.w, p.w_bf16, p.N, p.rs, p.bias, out);
}

}  // namespace

extern "C" {

// The attention half of layer L for s->B rows of h (see the file's head). k_cache / v_cache:
// the layer's KV pool. Returns 0, or -1 with ft_last_error() set.
int ft_layer_attn(const FtLayer* L, const FtStep* s, const void* h, void* k_cache, void* v_cache) {
  const int64_t B = s->B, H = L->H;
  const int b = L->bf16;
  if (ft_rmsnorm(h, B, H, L->in_norm, L->in_eps, b, L->x)) return -1;
  if (project(L->qkv, L->x, b, B, L->qkv_out)) return -1;
  for (int phase = s->write_first ? 1 : 0; phase <= (s->write_first ? 2 : 0); ++phase) {
    FtAttn p = L->attn;
    p.B = B;
    p.qkv = L->qkv_out;
    p.cos = s->cos;
    p.sin = s->sin;
    p.rot = s->rot;
    p.k_cache = k_cache;
    p.v_cache = v_cache;
    p.slot = s->slot;
    p.kv_index = s->kv_index;
    p.lmax = s->lmax;
    p.kv_len = s->kv_len;
    p.phase = phase;
    p.out = L->o_in;
    if (ft_attn(&p)) return -1;
  }
  if (project(L->o, L->o_in, b, B, L->a)) return -1;
  add_rows(h, L->a, L->h2, B * H, b);
  return ft_rmsnorm(L->h2, B, H, L->post_norm, L->post_eps, b, L->x2);
}

// The MoE half: experts of the pairs (t, ids[t k + j]) on x2 [B, H], combined with their routing
// weights w [B, k] (the activations' dtype) and the shared expert's rows shared [B, H] (or
// null) onto h2 [B, H], into L->out. x2 / h2: the attention half's (L->x2, L->h2) or, where the
// layer's modules ran it, theirs. Returns 0, or -1 with ft_last_error() set (an expert id out of range).
int ft_layer_moe(const FtLayer* L, int64_t B, const int64_t* ids, const void* w, const void* shared,
                 const void* x2, const void* h2) {
  const int64_t H = L->H, k = L->k;
  // (plain experts: gate_act 0 and no biases, ft_experts_range's whole experts)
  if (ft_experts_gated(x2, L->bf16, B, H, L->I, L->w13, L->w2, L->w_kind, L->E, L->w13_es, L->w13_rs, L->w2_es,
                       L->w2_rs, L->pair_tok, ids, B * k, L->rows, L->gate_act, L->alpha, L->limit, L->b13, L->E,
                       ids))
    return -1;
  return ft_combine(L->rows, w, shared, h2, L->out, B, k, H, L->bf16);
}

}  // extern "C"
