// The body of an expert call (experts.cpp; baseline ISA, included once): the pairs checked and
// grouped by expert (state.h), the call's problem, the AMX groups' token packs, and its job on
// the pool (exp_job.h) from stage 1 through stage 2.
#pragma once
#include <stdio.h>
#include <string.h>

#include "exp_job.h"
#include "isa.h"
#include "state.h"
#include "tune.h"

namespace {

// The body of ft_experts_range and ft_experts_act (the caller holds g_call). act_out: stage 1
// only (the vector kernels, no tiles), each pair's activations [I] written at act_out + pair * I
// in x's dtype, out unused.
int experts_call(const void* x, int x_bf16, int64_t T, int64_t H, int64_t I,
                 const void* w13, const void* w2, int w_bf16, int64_t E,
                 int64_t w13_es, int64_t w13_rs, int64_t w2_es, int64_t w2_rs,
                 const int64_t* pair_tok, const int64_t* pair_exp, int64_t P, void* out, int64_t i0,
                 void* act_out) {
  g_timing.enter = g_timing.posted = g_timing.end = now_ns();   // a call that returns early: all 0
  g_timing.last_start.store(g_timing.enter);
  g_timing.stage1_end.store(g_timing.enter);
  if (g_isa < 0) g_isa = detect_isa();
  if (i0 < 0 || i0 >= I) {
    snprintf(g_err, sizeof g_err, "first intermediate row %lld outside [0, %lld)", (long long)i0, (long long)I);
    return -1;
  }
  if (w_bf16 == 2 && (i0 != 0 || H % 32 || I % 32)) {
    snprintf(g_err, sizeof g_err, "MXFP4 weights need whole experts and H, I multiples of 32 (first row %lld, "
             "H=%lld, I=%lld)", (long long)i0, (long long)H, (long long)I);
    return -1;
  }
  const int64_t up = I;       // gate row i's up row stays at i + I; the call sees rows [i0, I) only
  const int64_t es = w_bf16 == 2 ? 1 : w_bf16 ? 2 : 4;   // strides' unit: MXFP4 rows' are bytes
  w13 = (const char*)w13 + i0 * w13_rs * es;
  w2 = (const char*)w2 + i0 * es;
  I -= i0;
  for (int64_t i = 0; i < P; ++i) {
    if (pair_tok[i] < 0 || pair_tok[i] >= T || pair_exp[i] < 0 || pair_exp[i] >= E) {
      snprintf(g_err, sizeof g_err, "pair %lld: token %lld / expert %lld out of range (T=%lld, E=%lld)",
               (long long)i, (long long)pair_tok[i], (long long)pair_exp[i], (long long)T, (long long)E);
      return -1;
    }
  }
  if (g_gate.b13) {
    if (i0 != 0) {
      snprintf(g_err, sizeof g_err, "expert biases need whole experts (first row 0, got %lld)", (long long)i0);
      return -1;
    }
    for (int64_t i = 0; i < P; ++i)
      if (g_gate.pair_bias[i] < 0 || g_gate.pair_bias[i] >= g_gate.n_bias) {
        snprintf(g_err, sizeof g_err, "pair %lld: bias row %lld out of range (%lld rows)", (long long)i,
                 (long long)g_gate.pair_bias[i], (long long)g_gate.n_bias);
        return -1;
      }
  }
  group_pairs(pair_exp, P, E);

  // bf16 x on AVX512-BF16: vdpbf16ps on bf16 weights; the AMX tiles on bf16 and on MXFP4 rows
  const bool bfdot = base_isa(g_isa) == ISA_AVX512BF16 && x_bf16 && w_bf16 >= 1;
  FtProblem p;
  memset(&p, 0, sizeof p);
  p.H = H; p.I = I; p.up = up; p.w13 = w13; p.w2 = w2; p.w_bf16 = w_bf16;
  p.w13_es = w13_es; p.w13_rs = w13_rs; p.w2_es = w2_es; p.w2_rs = w2_rs;
  p.n_groups = (int64_t)s_gexp.size();
  p.g_expert = s_gexp.data(); p.g_start = s_gstart.data(); p.g_count = s_gcount.data();
  p.sorted_pair = s_sorted.data(); p.pair_tok = pair_tok;
  p.x_bf16 = x_bf16; p.out = out; p.out_bf16 = x_bf16; p.prefetch = w_bf16 ? g_prefetch : g_prefetch_f32;
  // bytes of a gate/up row and of a down row read (an MXFP4 row: K/2 code bytes, K/32 scales; its
  // padding to 16 bytes is not read)
  const int64_t rb1 = w_bf16 == 2 ? H / 2 + H / 32 : H * es, rb2 = w_bf16 == 2 ? I / 2 + I / 32 : I * es;
  p.far_pf = g_tune.far_pf; p.far_pf_tokens = g_tune.far_pf_tokens; p.small_far_pf = g_tune.small_far_pf;
  p.amx_pf = g_tune.amx_pf; p.amx_next = g_tune.amx_next;
  p.gate_act = g_gate.act; p.alpha = g_gate.alpha; p.limit = g_gate.limit;
  if (g_gate.b13) {         // a group is one expert: its first pair's bias row is the group's
    s_gbias.resize(s_gexp.size());
    for (size_t g = 0; g < s_gexp.size(); ++g) s_gbias[g] = g_gate.pair_bias[s_sorted[s_gstart[g]]];
    p.b13 = g_gate.b13; p.b13_rs = 2 * up; p.g_bias = s_gbias.data();
  }
  if (bfdot) {
    p.xb = (const uint16_t*)x;
    s_actb.resize(P * I);
    p.act_b = s_actb.data();
  }
  // MXFP4 rows' vector groups multiply in fp32 (vdpbf16ps on rows decoded to bf16 measured slower:
  // 1.4x a one-token expert on the 2-CPU Xeon); only their groups on the AMX tiles take bf16
  if (!bfdot || w_bf16 == 2) {
    p.xf = as_f32(x, x_bf16, T * H);
    s_act.resize(P * I);
    p.act = s_act.data();
  }
  if (P == 0) return 0;
  // Groups with enough tokens go to the AMX tiles (a group's path depends only on its own token
  // count): their x rows are packed here in VNNI pairs, the tiles' B operand, per block of up to
  // 16 tokens: word [(start + tb) * H/2 + k/2 * nt + t] = (x[t][k], x[t][k + 1]).
  bool any_amx = false;
  p.g_amx = nullptr;
  ExpJob J;
  // (MXFP4 rows: up to 8192 values, the tiles' scale table, experts_amx.cpp tile_rows_q)
  if (g_isa == ISA_AMX && bfdot && H % 32 == 0 && I % 32 == 0 && !act_out
      && (w_bf16 != 2 || (H <= 8192 && I <= 8192))) {
    s_gamx.assign(p.n_groups, 0);
    for (int64_t g = 0; g < p.n_groups; ++g)
      if (s_gcount[g] >= g_tune.amx_min_tokens) s_gamx[g] = 1, any_amx = true;
    if (any_amx) {
      plan_packs(p.n_groups, s_gamx.data(), s_gstart.data(), s_gcount.data(), s_sorted.data(), pair_tok, H, s_pack);
      s_xv.resize(s_pack.words);
      s_done0.assign(s_pack.group.size(), 0);
      p.g_amx = s_gamx.data();
      p.xv = s_xv.data();
      p.g_xv = s_pack.g_xv.data();
      J.tot0 = (int64_t)s_pack.group.size();
      J.pk = &s_pack;
      J.x = (const uint16_t*)x;
      J.xv = s_xv.data();
      J.done0 = s_done0.data();
    }
  }

  J.p = &p;
  J.s1 = stage1_of(g_isa);
  J.s2 = stage2_of(g_isa);
  J.es = es;
  J.rb1 = rb1;
  J.rb2 = rb2;
  auto chunk = [&](int64_t stage_bytes) { return chunk_bytes(stage_bytes, g_threads); };
  J.ch1 = chunk(p.n_groups * 2 * I * rb1) / (2 * rb1); if (J.ch1 < 1) J.ch1 = 1;
  J.ch2 = (chunk(p.n_groups * H * rb2) / rb2) & ~int64_t(any_amx ? 15 : 1);  // AMX: 16-row tiles
  if (J.ch2 < 2) J.ch2 = 2;
  J.per1 = (I + J.ch1 - 1) / J.ch1;
  J.per2 = (H + J.ch2 - 1) / J.ch2;
  J.tot1 = J.per1 * p.n_groups;
  J.tot2 = act_out ? 0 : J.per2 * p.n_groups;
  s_done1.assign(p.n_groups, 0);
  J.done1 = s_done1.data();
  g_timing.posted = now_ns();
  pool_run(pool_get(), exp_job, &J);
  g_timing.end = now_ns();
  if (act_out) {            // sorted order -> pair order; bf16 activations are already rounded
    for (int64_t i = 0; i < P; ++i) {
      const int64_t pair = s_sorted[i];
      if (bfdot) {
        memcpy((uint16_t*)act_out + pair * I, p.act_b + i * I, I * 2);
      } else if (x_bf16) {
        for (int64_t j = 0; j < I; ++j) {
          uint32_t u;
          memcpy(&u, p.act + i * I + j, 4);
          ((uint16_t*)act_out)[pair * I + j] = (uint16_t)(u >> 16);
        }
      } else {
        memcpy((float*)act_out + pair * I, p.act + i * I, I * 4);
      }
    }
  }
  return 0;
}

}  // namespace
