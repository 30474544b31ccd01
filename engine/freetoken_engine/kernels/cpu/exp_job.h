// The expert job of the dispatcher (experts.cpp; baseline ISA, included once): the call's work
// queue over the pool, from the AMX groups' token packs (amx_pack.h) through stage 1 to stage 2.
#pragma once
#include <atomic>

#include "amx_pack.h"
#include "experts.h"
#include "pool.h"
#include "tune.h"

namespace {

struct ExpJob {
  const FtProblem* p;
  ft_stage_fn s1, s2;              // the vector kernels; groups with p->g_amx[g] use the tile ones
  int64_t tot0 = 0;                // packs of the AMX groups' tokens (amx_pack.h), queued first
  const PackPlan* pk = nullptr;
  const uint16_t* x = nullptr;     // bf16 x, the packs' source
  uint32_t* xv = nullptr;          // the packs' destination (p->xv)
  int64_t* done0 = nullptr;        // [packs] 1 once packed
  int64_t ch1, per1, tot1, ch2, per2, tot2;
  int64_t es;                      // bytes per weight element (1: MXFP4 rows, strides in bytes)
  int64_t rb1, rb2;                // bytes of a gate/up row and of a down row
  int64_t* done1;                  // [n_groups] finished stage-1 chunks per group
  std::atomic<int64_t> next{0};
};

// Prefetch the first `bytes` of `rows` rows (row stride rs) at p: a chunk's streams start with
// their first lines in flight instead of waiting for the software prefetch to get ahead.
// l2: into L2 only (lines needed after the block that is read first).
void prefetch_start(const char* p, int64_t rs, int64_t rows, int64_t row_bytes, int64_t bytes, bool l2) {
  for (int64_t off = 0; off < bytes; off += 64) {
    const int64_t r = off / row_bytes;
    if (r >= rows) return;
    if (l2) __builtin_prefetch(p + r * rs + off % row_bytes, 0, 2);
    else __builtin_prefetch(p + r * rs + off % row_bytes, 0, 3);
  }
}

// Waits until *flag reaches want: the pool hears that this participant waits for another's chunk
// (so it is not the one holding the call up), and, once the wait has lasted the pool's stall_us,
// leaves the holder out of later calls (pool.h). prefetch: called while waiting, returns false
// once it has nothing more to fetch.
template <class F>
void wait_for(const int64_t* flag, int64_t want, F prefetch) {
  if (__atomic_load_n(flag, __ATOMIC_ACQUIRE) >= want) return;
  pool_waiting();
  const int64_t since = now_ns();
  int it = 0;
  for (int64_t n = 0; __atomic_load_n(flag, __ATOMIC_ACQUIRE) < want; ++n) {
    if (!prefetch()) wait_step(it);
    if ((n & 255) == 255) pool_waited(since);
  }
  pool_busy();
}

// One queue: the AMX groups' token packs, every group's stage 1, then every group's stage 2. An
// AMX group's stage-1 chunk waits for its pack (started by then: the packs are first in line). A
// stage-2 chunk waits only for its own group's stage 1 (long finished, except for the last
// groups), so threads flow from one stage into the next without a global barrier; a thread that
// must wait (a call with one or two experts) spends the wait prefetching its chunk's w2 rows into
// L2, so the wait still moves the bytes the call needs.
void exp_job(void* c, int tid, int n) {
  (void)n;
  ExpJob* J = (ExpJob*)c;
  const FtProblem* p = J->p;
  atomic_max(g_timing.last_start, now_ns());
  int64_t s1_end = 0;                  // this thread's last stage-1 chunk: published once, on leaving
  bool test_stalled = false;           // the pool's test knob: worker 1 stalls in one stage-1 chunk
  for (;;) {
    int64_t k = J->next.fetch_add(1, std::memory_order_relaxed);
    pool_busy();
    if (k < J->tot0) {
      pack_one(*J->pk, k, J->x, p->H, p->g_start, p->g_count, p->sorted_pair, p->pair_tok, J->xv);
      __atomic_store_n(&J->done0[k], 1, __ATOMIC_RELEASE);
      continue;
    }
    k -= J->tot0;
    if (k < J->tot1) {
      const int64_t g = k / J->per1, r0 = (k % J->per1) * J->ch1;
      const int64_t r1 = r0 + J->ch1 < p->I ? r0 + J->ch1 : p->I;
      const char* w = (const char*)p->w13 + p->g_expert[g] * p->w13_es * J->es;
      const int64_t rs = p->w13_rs * J->es;
      prefetch_start(w + r0 * rs, rs, r1 - r0, J->rb1, p->prefetch, false);         // gate rows
      prefetch_start(w + (p->up + r0) * rs, rs, r1 - r0, J->rb1, p->prefetch, true);  // up rows
      const bool amx = p->g_amx && p->g_amx[g];
      if (amx) wait_for(&J->done0[J->pk->g_pack[g]], 1, [] { return false; });
      pool_test_stall(tid, test_stalled);
      (amx ? ft_stage1_amx : J->s1)(p, g, r0, r1);
      s1_end = now_ns();
      __atomic_fetch_add(&J->done1[g], 1, __ATOMIC_RELEASE);
    } else if (k < J->tot1 + J->tot2) {
      const int64_t g = (k - J->tot1) / J->per2, r0 = ((k - J->tot1) % J->per2) * J->ch2;
      const int64_t r1 = r0 + J->ch2 < p->H ? r0 + J->ch2 : p->H;
      const char* w = (const char*)p->w2 + p->g_expert[g] * p->w2_es * J->es;
      const int64_t rs = p->w2_rs * J->es, row_bytes = J->rb2;
      const int64_t per_row = (row_bytes + 63) / 64, lines = (r1 - r0) * per_row;
      int64_t line = 0;
      wait_for(&J->done1[g], J->per1, [&] {
        if (line >= lines) return false;
        for (int q = 0; q < 8 && line < lines; ++q, ++line)
          __builtin_prefetch(w + (r0 + line / per_row) * rs + (line % per_row) * 64, 0, 2);
        return true;
      });
      if (line == 0) prefetch_start(w + r0 * rs, rs, r1 - r0, row_bytes, p->prefetch, false);
      (p->g_amx && p->g_amx[g] ? ft_stage2_amx : J->s2)(p, g, r0, r1);
    } else {
      if (s1_end) atomic_max(g_timing.stage1_end, s1_end);
      return;
    }
  }
}

}  // namespace
