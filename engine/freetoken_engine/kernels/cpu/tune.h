// Run-time tuning of the expert kernel and the timing of its last call (experts.cpp; baseline
// ISA, included once). The defaults are the measured best (docs/cpu_kernel.md); ft_tune changes
// one knob by name so a sweep (bench/cpu_kernel_tune.py) can compare settings in one process.
#pragma once
#include <string.h>
#include <time.h>

#include <atomic>

#include "isa.h"
#include "pool.h"

namespace {

struct Tune {
  int64_t chunks_per_thread = 4;           // work chunks per participant and stage (chunk_bytes)
  int64_t amx_min_tokens = AMX_MIN_TOKENS; // a group with this many tokens goes to the tiles
  int64_t amx_pf = 0;                      // FtProblem::amx_pf (stop 59: off, with amx_next)
  int64_t amx_next = 1;                    // FtProblem::amx_next (stop 59: on)
  int64_t far_pf = 4;                      // FtProblem::far_pf
  int64_t far_pf_tokens = 3;               // FtProblem::far_pf_tokens
  int64_t small_far_pf = 2;                // FtProblem::small_far_pf (stop 66: 2, was off)
  int64_t linear_far_pf = 2;               // FtLinear::far, in prefetch distances (stop 67)
  int64_t linear_far_tokens = 4;           // ... for projections of at most this many tokens
  int64_t linear_pair_tokens = 1;          // FtLinear::row_group from this many tokens on (stop 67)
  int64_t linear_row_group = 4;            // ... rows a group: 4 up to ROWS4_TOKENS, else 2; or 2
  int64_t read_chunk = 1 << 20;            // bytes a participant takes at a time in ft_read_seconds
};
Tune g_tune;

struct Knob { const char* name; int64_t* at; int64_t lo, hi; };

// The knob called name, or null.
const Knob* tune_find(const char* name) {
  static const Knob knobs[] = {
      {"chunks_per_thread", &g_tune.chunks_per_thread, 1, 64},
      {"amx_min_tokens", &g_tune.amx_min_tokens, 1, 1 << 20},
      {"amx_pf", &g_tune.amx_pf, 0, 1 << 16},
      {"amx_next", &g_tune.amx_next, 0, 1},
      {"far_pf", &g_tune.far_pf, 0, 64},
      {"far_pf_tokens", &g_tune.far_pf_tokens, 1, 1 << 20},
      {"read_chunk", &g_tune.read_chunk, 4096, int64_t(1) << 30},
      {"small_far_pf", &g_tune.small_far_pf, 0, 64},
      {"linear_far_pf", &g_tune.linear_far_pf, 0, 64},
      {"linear_far_tokens", &g_tune.linear_far_tokens, 0, 1 << 20},
      {"linear_pair_tokens", &g_tune.linear_pair_tokens, 1, 1 << 20},
      {"linear_row_group", &g_tune.linear_row_group, 2, 4},      // (3: as 2)
      {"stall_us", &g_pool_knobs.stall_us, 1, 1 << 30},          // pool.h: contended workers
      {"backoff_ms", &g_pool_knobs.backoff_ms, 1, 1 << 20},
      {"backoff_max_ms", &g_pool_knobs.backoff_max_ms, 1, 1 << 20},
      {"test_stall_us", &g_pool_knobs.test_stall_us, 0, 1 << 24},
  };
  for (const Knob& k : knobs)
    if (!strcmp(k.name, name)) return &k;
  return nullptr;
}

// Bytes of weights per work chunk for `total` bytes read by `threads` participants: about
// chunks_per_thread chunks each (between 16 KiB and 4 MiB): long sequential streams, yet a
// thread slowed by other work still hands chunks to the others. Each chunk restarts the hardware
// prefetchers' streams: on the 2-CPU EPYC at 2 threads, chunks of at most 64 KiB read one token
// on 8 experts at 51 GB/s and 4 per thread at 70 (91% of the read), a 1-token bf16 projection at
// 50-51 and 65-68 (alternating in one process, docs/cpu_kernel.md).
int64_t chunk_bytes(int64_t total, int threads) {
  const int64_t c = total / (g_tune.chunks_per_thread * (int64_t)threads);
  return c > (4 << 20) ? (4 << 20) : c < 16384 ? 16384 : c;
}

// Where the last expert call spent its time (ns, CLOCK_MONOTONIC), for ft_last_timing.
struct CallTiming {
  int64_t enter = 0;                        // the call took the lock
  int64_t posted = 0;                       // the job went to the pool (grouping done)
  std::atomic<int64_t> last_start{0};       // the last participant took its first chunk
  std::atomic<int64_t> stage1_end{0};       // the last stage-1 chunk finished
  int64_t end = 0;                          // every participant finished
};
CallTiming g_timing;

void atomic_max(std::atomic<int64_t>& a, int64_t v) {
  int64_t cur = a.load(std::memory_order_relaxed);
  while (v > cur && !a.compare_exchange_weak(cur, v, std::memory_order_relaxed)) {}
}

}  // namespace
