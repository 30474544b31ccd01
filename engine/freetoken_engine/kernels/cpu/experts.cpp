// Dispatcher: the C entry points that cpu_experts.py (and branch.cpp, layer.cpp) call, over the
// thread pool (pool.h) with the instruction set chosen at run time (isa.h); the state they share
// is state.h's, an expert call's body (pairs grouped by expert, the work queue) call.h's.
// Compiled for baseline x86-64.
//
// Threading contract: one call at a time runs on the pool (a mutex serialises callers); the
// calling thread does a share of the work itself, unpinned; the other n-1 workers are pinned to
// the CPUs given to ft_configure. Workers spin for spin_us after a call, then sleep, so an idle
// engine costs no CPU.
#include <cstdio>
#include <stdlib.h>
#include <string.h>

#include <new>

#include <algorithm>

#include <atomic>
#include <mutex>
#include <vector>

#include "experts.h"
#include "entry.h"   // (checks the entry points' declarations against their definitions)
#include "isa.h"
#include "pool.h"
#include "tune.h"
#include "jobs.h"
#include "exp_job.h"
#include "state.h"
#include "call.h"

extern "C" {

int ft_best_isa() { return detect_isa(); }
int ft_has_amx() { return has_amx() ? 1 : 0; }
const char* ft_isa_name(int isa) { return isa >= 0 && isa <= ISA_AMX ? kIsaNames[isa] : "?"; }
const char* ft_last_error() { return g_err; }

// threads: participants including the caller; cpus: where workers 1..threads-1 are pinned
// (none: unpinned); isa: -1 = best available; prefetch / prefetch_f32: bytes ahead along bf16 /
// fp32 weight rows (0 = off).
int ft_configure(int threads, const int* cpus, int ncpus, int isa, int64_t prefetch, int64_t prefetch_f32,
                 int spin_us) {
  std::lock_guard<std::mutex> lk(g_call);
  const int best = detect_isa();
  if (isa > best) {
    snprintf(g_err, sizeof g_err, "ISA %s not supported by this CPU (best: %s)",
             ft_isa_name(isa), kIsaNames[best]);
    return -2;
  }
  if (g_pool && g_pool->pid == getpid()) {
    pool_stop(g_pool);
    delete g_pool;
  }
  g_pool = nullptr;
  g_isa = isa < 0 ? best : isa;
  g_threads = threads < 1 ? 1 : threads;
  g_cpus.assign(cpus, cpus + (ncpus > 0 ? ncpus : 0));
  g_prefetch = prefetch;
  g_prefetch_f32 = prefetch_f32;
  g_spin_us = spin_us;
  return g_isa;
}

}  // extern "C"

extern "C" {

// y[p] = W2[e] (silu(W1[e] x[t]) * W3[e] x[t]) for every pair p = (t, e); see reference.py.
// Only the intermediate rows [i0, I) (0 <= i0 < I): the part of each expert's sum that the rows
// [0, i0) streamed to a GPU leave to the CPU (cpu_branch.py); i0 = 0 is the whole expert.
// Returns 0, or -1 with ft_last_error() set when an index is out of range.
int ft_experts_range(const void* x, int x_bf16, int64_t T, int64_t H, int64_t I,
                     const void* w13, const void* w2, int w_bf16, int64_t E,
                     int64_t w13_es, int64_t w13_rs, int64_t w2_es, int64_t w2_rs,
                     const int64_t* pair_tok, const int64_t* pair_exp, int64_t P, void* out, int64_t i0) {
  std::lock_guard<std::mutex> lk(g_call);
  return experts_call(x, x_bf16, T, H, I, w13, w2, w_bf16, E, w13_es, w13_rs, w2_es, w2_rs, pair_tok, pair_exp,
                      P, out, i0, nullptr);
}

// The first stage only: act[p] = silu(W1[e] x[t]) * W3[e] x[t] ([P, I] in x's dtype, rounded as
// the reference rounds it), for a split by stage whose down projection runs on a GPU
// (kernels/triton/stage.py). Returns 0, or -1 as ft_experts_range.
int ft_experts_act(const void* x, int x_bf16, int64_t T, int64_t H, int64_t I,
                   const void* w13, const void* w2, int w_bf16, int64_t E,
                   int64_t w13_es, int64_t w13_rs, int64_t w2_es, int64_t w2_rs,
                   const int64_t* pair_tok, const int64_t* pair_exp, int64_t P, void* act) {
  std::lock_guard<std::mutex> lk(g_call);
  return experts_call(x, x_bf16, T, H, I, w13, w2, w_bf16, E, w13_es, w13_rs, w2_es, w2_rs, pair_tok, pair_exp,
                      P, nullptr, 0, act);
}

// ft_experts_range (whole experts) for experts of another kind: act 0 silu(gate) * up, 1 gpt-oss's
// clamped gate (alpha, limit: simd.h oai_gate); b13 (or null): fp32 gate/up bias rows [n_bias, 2I],
// pair p's row pair_bias[p] (the pair's expert where pair_exp holds cache slots). Returns 0, or -1
// as ft_experts_range (also for a bias row out of range).
int ft_experts_gated(const void* x, int x_bf16, int64_t T, int64_t H, int64_t I,
                     const void* w13, const void* w2, int w_bf16, int64_t E,
                     int64_t w13_es, int64_t w13_rs, int64_t w2_es, int64_t w2_rs,
                     const int64_t* pair_tok, const int64_t* pair_exp, int64_t P, void* out,
                     int act, float alpha, float limit, const float* b13, int64_t n_bias, const int64_t* pair_bias) {
  std::lock_guard<std::mutex> lk(g_call);
  g_gate.act = act; g_gate.alpha = alpha; g_gate.limit = limit;
  g_gate.b13 = b13; g_gate.n_bias = n_bias; g_gate.pair_bias = pair_bias;
  const int rc = experts_call(x, x_bf16, T, H, I, w13, w2, w_bf16, E, w13_es, w13_rs, w2_es, w2_rs, pair_tok,
                              pair_exp, P, out, 0, nullptr);
  g_gate = Gate();
  return rc;
}

// Seconds for n_calls calls of ft_experts_range (intermediate rows [i0, I); 0: whole experts) back
// to back, call c on the P experts pair_exps[c * P .. c * P + P) (same tokens): the kernel's rate as a C caller such as
// branch.cpp sees it, without the Python call around each (calibrate.py's B_cpu). Negative:
// a call failed (ft_last_error says why).
double ft_experts_loop(const void* x, int x_bf16, int64_t T, int64_t H, int64_t I,
                       const void* w13, const void* w2, int w_bf16, int64_t E,
                       int64_t w13_es, int64_t w13_rs, int64_t w2_es, int64_t w2_rs,
                       const int64_t* pair_tok, const int64_t* pair_exps, int64_t P, int64_t n_calls, void* out,
                       int64_t i0) {
  const double t0 = now_s();
  for (int64_t c = 0; c < n_calls; ++c)
    if (ft_experts_range(x, x_bf16, T, H, I, w13, w2, w_bf16, E, w13_es, w13_rs, w2_es, w2_rs,
                         pair_tok, pair_exps + c * P, P, out, i0) != 0)
      return -1.0;
  return now_s() - t0;
}

// The knob `name` of tune.h set to value (value < 0: left as it is); returns its value before,
// or -1 (unknown name, value out of range).
int64_t ft_tune(const char* name, int64_t value) {
  std::lock_guard<std::mutex> lk(g_call);
  const Knob* k = tune_find(name);
  if (!k || value > k->hi || (value >= 0 && value < k->lo)) {
    snprintf(g_err, sizeof g_err, "unknown tuning knob %s or value %lld out of its range", name, (long long)value);
    return -1;
  }
  const int64_t was = *k->at;
  if (value >= 0) *k->at = value;
  return was;
}

// The pool's contention record (pool.h): out2[0] workers left out now, out2[1] calls so far that
// waited for a stalled worker (0, 0 before the pool's first job).
void ft_pool_stats(int64_t* out2) {
  std::lock_guard<std::mutex> lk(g_call);
  out2[0] = out2[1] = 0;
  if (g_pool && g_pool->pid == getpid()) pool_contention(g_pool, out2);
}

// Jobs run and each worker's share of them (pool.h pool_entries); 0 before the pool's first job.
int ft_pool_entries(int64_t* out, int cap) {
  std::lock_guard<std::mutex> lk(g_call);
  return g_pool && g_pool->pid == getpid() ? pool_entries(g_pool, out, cap) : 0;
}

// The last expert call's phases in microseconds from its start: grouping done (job posted),
// the last participant's first chunk, the last stage-1 chunk's end, the call's end.
void ft_last_timing(double* out4) {
  std::lock_guard<std::mutex> lk(g_call);
  const int64_t e = g_timing.enter;
  out4[0] = 1e-3 * (g_timing.posted - e);
  out4[1] = 1e-3 * (g_timing.last_start.load() - e);
  out4[2] = 1e-3 * (g_timing.stage1_end.load() - e);
  out4[3] = 1e-3 * (g_timing.end - e);
}

// out[t, n] = sum_k w[n, k] x[t, k] (+ bias[n]) for T tokens (see kernels/cpu/linear.py).
// x: [T, K] contiguous, bf16 or fp32; w: [N, K] with row stride w_rs, bf16 or fp32; bias: [N] in
// the weight's dtype or null; out: [T, N] contiguous in x's dtype.
int ft_linear(const void* x, int x_bf16, int64_t T, int64_t K, const void* w, int w_bf16,
              int64_t N, int64_t w_rs, const void* bias, void* out) {
  std::lock_guard<std::mutex> lk(g_call);
  if (g_isa < 0) g_isa = detect_isa();
  if (T <= 0 || N <= 0) return 0;
  FtLinear p;
  memset(&p, 0, sizeof p);
  p.T = T; p.K = K; p.N = N; p.w = w; p.w_bf16 = w_bf16; p.w_rs = w_rs; p.bias = bias;
  p.out = out; p.out_bf16 = x_bf16; p.prefetch = w_bf16 ? g_prefetch : g_prefetch_f32;
  // decode of 1-4 tokens: a second prefetch into L2 as the expert rows' (tune.h linear_far_pf,
  // linear_far_tokens; at 8 tokens it gained nothing, docs/cpu_kernel.md)
  p.far = T <= g_tune.linear_far_tokens ? g_tune.linear_far_pf * p.prefetch : 0;
  if (x_bf16 && w_bf16 && base_isa(g_isa) == ISA_AVX512BF16) {
    p.xb = (const uint16_t*)x;
  } else {
    p.xf = as_f32(x, x_bf16, T * K);
  }
  // float32 token vectors on bf16 rows: the rows four (or two) at a time
  p.row_group = p.xf && w_bf16 && T >= g_tune.linear_pair_tokens ? (int)g_tune.linear_row_group : 0;
  LinJob J;
  J.p = &p;
  J.fn = linear_of(g_isa);
  const int64_t es = w_bf16 ? 2 : 4;
  J.chunk = (chunk_bytes(N * K * es, g_threads) / (K * es)) & ~int64_t(3);
  if (J.chunk < 4) J.chunk = 4;
  J.total = (N + J.chunk - 1) / J.chunk;
  if (g_threads == 1 || J.total == 1) J.fn(&p, 0, N);   // no pool round trip for one participant
  else pool_run(pool_get(), lin_job, &J);
  return 0;
}

// RMSNorm rows (see FtNorm in experts.h); one participant (a few rows of a decode step).
int ft_rmsnorm(const void* x, int64_t T, int64_t H, const void* w, float eps, int bf16, void* out) {
  std::lock_guard<std::mutex> lk(g_call);
  if (g_isa < 0) g_isa = detect_isa();
  FtNorm p = {T, H, x, w, eps, bf16, out};
  norm_of(g_isa)(&p);
  return 0;
}

// An MoE layer's combine of T tokens (see FtCombine in experts.h): on this thread up to 1 MiB of
// rows (a decode step's: handing them to the pool costs more than it saves, and its workers then
// spin on the CPUs torch's next ops want), else in chunks of about 64 KB of rows on the pool.
int ft_combine(const void* rows, const void* w, const void* shared, const void* res, void* out,
               int64_t T, int64_t k, int64_t H, int bf16) {
  std::lock_guard<std::mutex> lk(g_call);
  if (g_isa < 0) g_isa = detect_isa();
  if (T <= 0 || k <= 0 || H <= 0) return 0;
  FtCombine p = {k, H, rows, w, shared, res, bf16, out};
  CombJob J;
  J.p = &p;
  J.fn = combine_of(g_isa);
  J.T = T;
  const int64_t row_bytes = (bf16 ? 2 : 4) * k * H;
  J.chunk = 65536 / row_bytes + 1;
  if (g_threads == 1 || T * row_bytes <= (1 << 20)) J.fn(&p, 0, T);
  else pool_run(pool_get(), comb_job, &J);
  return 0;
}

// Decode attention (see FtAttn in experts.h). The caller fills every field but scratch.
int ft_attn(FtAttn* p) {
  std::lock_guard<std::mutex> lk(g_call);
  if (g_isa < 0) g_isa = detect_isa();
  if (p->h % p->kvh != 0 || p->d % 2 != 0 || p->rot % 2 != 0 || p->rot <= 0 || p->rot > p->d) {
    snprintf(g_err, sizeof g_err,
             "heads %lld not a multiple of kv heads %lld, or odd head_dim %lld, or rotary dims %lld not even "
             "and in 2..head_dim", (long long)p->h, (long long)p->kvh, (long long)p->d, (long long)p->rot);
    return -1;
  }
  AttnJob J;
  J.p = p;
  J.fn = attn_of(g_isa);
  const int64_t grp = p->h / p->kvh;
  J.per = grp * p->lmax + (p->h + 2) * p->d + grp * p->d + 16;
  // fewer rows than threads (one sequence decoding, a latent attention's 16 or 128 heads on one
  // KV head): each row's query heads split among the threads, every row's K/V written first
  p->hsplit = p->B < g_threads && p->phase != 1 && p->h > 1 ? (g_threads + p->B - 1) / p->B : 1;
  if (p->hsplit > p->h) p->hsplit = p->h;
  J.items = p->B * p->hsplit;
  const int n = J.items > 1 ? g_threads : 1;
  s_attn.resize((size_t)(J.per * n));
  p->scratch = s_attn.data();
  if (p->hsplit > 1 && p->phase == 0) {      // the writes, on this thread, before any row attends
    FtAttn w = *p;
    w.phase = 1;
    w.hsplit = 1;
    J.fn(&w, 0, p->B, p->scratch);
    p->phase = 2;
  }
  if (n == 1) J.fn(p, 0, J.items, p->scratch);
  else pool_run(pool_get(), attn_job, &J);
  return 0;
}

// Seconds to read [buf, buf + bytes) once with the kernel's threads and instruction set.
double ft_read_seconds(const void* buf, int64_t bytes) {
  std::lock_guard<std::mutex> lk(g_call);
  if (g_isa < 0) g_isa = detect_isa();
  ReadJob J;
  J.p = (const char*)buf;
  J.bytes = bytes;
  J.fn = read_of(g_isa);
  const double t0 = now_s();
  pool_run(pool_get(), read_job, &J);
  const double dt = now_s() - t0;
  return J.sink.load() == 0x5eed5eed5eedull ? dt + 1e-12 : dt;  // keep the reads alive
}

}  // extern "C"
