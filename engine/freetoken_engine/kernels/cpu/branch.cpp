// Decode's CPU branch driven from C++: the host half of a decode step whose device half is one
// CUDA graph (see kernels/cpu_branch.py for the protocol). For each MoE layer in order: wait
// until the device has published the layer's control step (flag[l] == epoch), compute the
// pairs it left to the CPU (pair_slot < 0) with the expert kernel straight from the bank, write
// their rows compactly, then publish them (done[l] = epoch) for the device's combine, which
// waits on that word. No Python runs between a layer's control step and its CPU experts.
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "entry.h"

extern "C" {

struct FtBranch {
  int64_t L, P, T, H, I, E;   // P = T k pairs of this step (token-major), T tokens
  const int64_t* flag;        // [L] the device stores the epoch after layer l's control step
  int64_t* done;              // [L] stored here (release) once layer l's CPU rows are written
  const int64_t* cancel;      // [1] the caller stores an epoch here to abandon that step
  const int64_t* pair_slot;   // [L, >= P] the control step's pair slots (-1: computed here, -2: its
                              // rows [from_rows[l], I) computed here, the rest streamed to the GPU)
  const int64_t* pair_exp;    // [L, >= P] the routed expert of every pair
  int64_t ps_ls;              // layer stride of pair_slot / pair_exp (elements)
  const int64_t* pair_tok;    // [P] the token of every pair
  const void* x;              // [L, >= T, H]: layer l's input, stored by the device
  int64_t x_ls;               // its layer stride (elements)
  int x_bf16, w_bf16;         // 1: bf16 (x and rows; the bank), 0: fp32; the bank 2: MXFP4 rows
  const void* w13;            // bank [L, E, 2I, H] with the strides below (elements)
  const void* w2;             // bank [L, E, H, I]
  int64_t w13_ls, w13_es, w13_rs, w2_ls, w2_es, w2_rs;
  void* rows;                 // [P, H] in x's dtype: the layer's CPU pairs' rows, in pair order
  double timeout_s;           // per layer wait
  // outputs of the last run
  double wait_s, compute_s;   // waiting for the device / in the expert kernel
  int64_t cpu_layers, cpu_pairs, failed_layer;
  const int64_t* from_rows;   // [L] stored by the device with the flag: the streamed pairs' first CPU row
  void* rows_tmp;             // [P, H] scratch in x's dtype (a layer with both kinds of CPU pairs)
  int64_t streamed_rows;      // output: sum over layers of from_rows x the streamed pairs' experts
  void* act;                  // [P, I] in x's dtype: split-by-stage pairs' (-3) activations, at their pair index
  int64_t* act_flag;          // [L] stored here (release) once layer l's activations are written
  void* act_tmp;              // [P, I] scratch in x's dtype
  int64_t stage_pairs;        // output: split-by-stage pairs answered
  // experts of another kind (gpt-oss; whole experts only: no streamed or staged pairs): the gate
  // (ft_experts_gated's act, alpha, limit) and fp32 gate/up bias rows [L, E, 2I] (null: none)
  int gate_act;
  float alpha, limit;
  const float* b13;
};

}  // extern "C"

namespace {

double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Spin until *word >= epoch (acquire): 0; -3 once *cancel >= epoch; -2 after timeout_s seconds.
int wait_for(const int64_t* word, const int64_t* cancel, int64_t epoch, double timeout_s) {
  if (__atomic_load_n(word, __ATOMIC_ACQUIRE) >= epoch) return 0;
  const double deadline = now_s() + timeout_s;
  for (uint32_t spin = 1;; ++spin) {
    if (__atomic_load_n(word, __ATOMIC_ACQUIRE) >= epoch) return 0;
    cpu_relax();
    if ((spin & 255) == 0) {
      if (__atomic_load_n(cancel, __ATOMIC_ACQUIRE) >= epoch) return -3;
      if (now_s() > deadline) return -2;
    }
  }
}

}  // namespace

extern "C" {

// Runs layers 0..L-1 of decode step `epoch`. Returns 0; -1 when the expert kernel rejected a
// pair (ft_last_error says why); -2 when the device did not publish layer failed_layer in time;
// -3 when the step was cancelled while waiting for layer failed_layer.
int ft_branch_run(FtBranch* b, int64_t epoch) {
  b->wait_s = b->compute_s = 0;
  b->cpu_layers = b->cpu_pairs = b->streamed_rows = b->stage_pairs = 0;
  b->failed_layer = -1;
  int64_t tok[1024], exp[1024], pos[1024], tok2[1024], exp2[1024], pos2[1024], tok3[1024], exp3[1024],
      pos3[1024], pair3[1024];
  if (b->P > 1024) return -1;
  const char* x = (const char*)b->x;
  const char* w13 = (const char*)b->w13;
  const char* w2 = (const char*)b->w2;
  const int64_t xs = b->x_bf16 ? 2 : 4, ws = b->w_bf16 == 2 ? 1 : b->w_bf16 ? 2 : 4;   // MXFP4 rows: bytes
  for (int64_t l = 0; l < b->L; ++l) {
    double t0 = now_s();
    int w = wait_for(b->flag + l, b->cancel, epoch, b->timeout_s);
    if (w != 0) {
      b->failed_layer = l;
      return w;
    }
    double t1 = now_s();
    b->wait_s += t1 - t0;
    const int64_t* ps = b->pair_slot + l * b->ps_ls;
    const int64_t* pe = b->pair_exp + l * b->ps_ls;
    const int64_t i0 = b->from_rows ? b->from_rows[l] : 0;
    // CPU pairs in pair order: whole ones (-1) into tok/exp, streamed ones (-2: rows from i0)
    // into tok2/exp2, split by stage (-3: the activations only; the device adds the down
    // projection to a zero row) into tok3/exp3; pos*: each one's compact place among the layer's
    // CPU rows.
    int64_t n = 0, n2 = 0, n3 = 0, nall = 0;
    for (int64_t p = 0; p < b->P; ++p) {
      if (ps[p] == -3 && b->act) {
        tok3[n3] = b->pair_tok[p];
        exp3[n3] = pe[p];
        pair3[n3] = p;
        pos3[n3++] = nall++;
      } else if (ps[p] == -2 && i0 > 0) {
        tok2[n2] = b->pair_tok[p];
        exp2[n2] = pe[p];
        pos2[n2++] = nall++;
      } else if (ps[p] < 0) {
        tok[n] = b->pair_tok[p];
        exp[n] = pe[p];
        pos[n++] = nall++;
      }
    }
    const char* xl = x + l * b->x_ls * xs;
    const char* w13l = w13 + l * b->w13_ls * ws;
    const char* w2l = w2 + l * b->w2_ls * ws;
    const int64_t row = b->H * xs;
    int rc = 0;
    if (n3) {               // the activations first: the device's down projection waits for them
      rc = ft_experts_act(xl, b->x_bf16, b->T, b->H, b->I, w13l, w2l, b->w_bf16, b->E, b->w13_es, b->w13_rs,
                          b->w2_es, b->w2_rs, tok3, exp3, n3, b->act_tmp);
      if (rc != 0) {
        b->failed_layer = l;
        return -1;
      }
      const int64_t arow = b->I * xs;
      for (int64_t j = 0; j < n3; ++j)
        memcpy((char*)b->act + pair3[j] * arow, (const char*)b->act_tmp + j * arow, arow);
      for (int64_t j = 0; j < n3; ++j) memset((char*)b->rows + pos3[j] * row, 0, row);
      b->stage_pairs += n3;
    }
    // every layer, split pairs or not: the device's wait for the activations is in its graph
    if (b->act_flag) __atomic_store_n(b->act_flag + l, epoch, __ATOMIC_RELEASE);
    // one kind only: straight into rows (compact order is then the call's order)
    const bool scatter = (n && n2) || n3;
    char* out1 = scatter || n2 ? (char*)b->rows_tmp : (char*)b->rows;
    char* out2 = n ? (char*)b->rows_tmp + n * row : scatter ? (char*)b->rows_tmp : (char*)b->rows;
    if (n && (b->gate_act || b->b13))   // each pair's bias row is its expert's: the bank is indexed by expert
      rc = ft_experts_gated(xl, b->x_bf16, b->T, b->H, b->I, w13l, w2l, b->w_bf16, b->E, b->w13_es, b->w13_rs,
                            b->w2_es, b->w2_rs, tok, exp, n, out1, b->gate_act, b->alpha, b->limit,
                            b->b13 ? b->b13 + l * b->E * 2 * b->I : nullptr, b->E, exp);
    else if (n)
      rc = ft_experts_range(xl, b->x_bf16, b->T, b->H, b->I, w13l, w2l, b->w_bf16, b->E, b->w13_es, b->w13_rs,
                            b->w2_es, b->w2_rs, tok, exp, n, out1, 0);
    if (n2 && rc == 0)
      rc = ft_experts_range(xl, b->x_bf16, b->T, b->H, b->I, w13l, w2l, b->w_bf16, b->E, b->w13_es, b->w13_rs,
                            b->w2_es, b->w2_rs, tok2, exp2, n2, out2, i0);
    if (rc != 0) {
      b->failed_layer = l;
      return -1;
    }
    if (scatter) {          // several kinds: the scratch holds them by kind, rows wants pair order
      for (int64_t j = 0; j < n; ++j) memcpy((char*)b->rows + pos[j] * row, out1 + j * row, row);
      for (int64_t j = 0; j < n2; ++j) memcpy((char*)b->rows + pos2[j] * row, out2 + j * row, row);
    }
    if (n2) {               // distinct streamed experts (a handful) for the statistics
      int64_t d = 0;
      for (int64_t j = 0; j < n2; ++j) {
        bool seen = false;
        for (int64_t i = 0; i < j && !seen; ++i) seen = exp2[i] == exp2[j];
        d += !seen;
      }
      b->streamed_rows += d * i0;
    }
    if (n + n2 + n3) {
      ++b->cpu_layers;
      b->cpu_pairs += n + n2 + n3;
    }
    __atomic_store_n(b->done + l, epoch, __ATOMIC_RELEASE);
    b->compute_s += now_s() - t1;
  }
  return 0;
}

}  // extern "C"
