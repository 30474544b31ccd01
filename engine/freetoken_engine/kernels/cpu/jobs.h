// The pool jobs of the dense decode kernels (experts.cpp; baseline ISA, included once): a
// projection's output rows, attention's sequences, and the STREAM-style read, each handed out
// in chunks from an atomic counter so a thread slowed by other work holds no one back.
#pragma once
#include <atomic>

#include "experts.h"
#include "isa.h"
#include "pool.h"
#include "tune.h"

namespace {

// Output rows in chunks handed out dynamically (sized in ft_linear).
struct LinJob {
  const FtLinear* p;
  ft_linear_fn fn;
  int64_t chunk, total;
  std::atomic<int64_t> next{0};
};

void lin_job(void* c, int tid, int n) {
  (void)n;
  LinJob* J = (LinJob*)c;
  for (bool test_stalled = false;;) {
    const int64_t k = J->next.fetch_add(1, std::memory_order_relaxed);
    if (k >= J->total) return;
    pool_busy();
    pool_test_stall(tid, test_stalled);
    const int64_t n0 = k * J->chunk, n1 = n0 + J->chunk < J->p->N ? n0 + J->chunk : J->p->N;
    J->fn(J->p, n0, n1);
  }
}

// Sequences handed out one at a time; each participant has its own scratch.
struct AttnJob {
  const FtAttn* p;
  ft_attn_fn fn;
  int64_t per;                     // scratch floats per participant
  int64_t items;                   // rows x FtAttn::hsplit
  std::atomic<int64_t> next{0};
};

void attn_job(void* c, int tid, int n) {
  (void)n;
  AttnJob* J = (AttnJob*)c;
  for (;;) {
    const int64_t b = J->next.fetch_add(1, std::memory_order_relaxed);
    if (b >= J->items) return;
    J->fn(J->p, b, b + 1, J->p->scratch + tid * J->per);
  }
}

// An MoE combine's tokens in chunks handed out dynamically.
struct CombJob {
  const FtCombine* p;
  ft_combine_fn fn;
  int64_t chunk, T;
  std::atomic<int64_t> next{0};
};

void comb_job(void* c, int tid, int n) {
  (void)tid; (void)n;
  CombJob* J = (CombJob*)c;
  for (;;) {
    const int64_t t0 = J->next.fetch_add(J->chunk, std::memory_order_relaxed);
    if (t0 >= J->T) return;
    J->fn(J->p, t0, t0 + J->chunk < J->T ? t0 + J->chunk : J->T);
  }
}

struct ReadJob {
  const char* p;
  int64_t bytes;
  ft_read_fn fn;
  std::atomic<int64_t> next{0};
  std::atomic<uint64_t> sink{0};
};

// Chunks (tune.h read_chunk: 1 MiB, smaller to read an expert-sized buffer the way an expert
// call splits it) handed out dynamically, so a thread that shares its core with another process
// does not hold the others back (the same scheduling as the expert job).
void read_job(void* c, int tid, int n) {
  (void)tid; (void)n;
  ReadJob* J = (ReadJob*)c;
  const int64_t chunk = g_tune.read_chunk;
  uint64_t acc = 0;
  for (;;) {
    const int64_t b0 = J->next.fetch_add(chunk, std::memory_order_relaxed);
    if (b0 >= J->bytes) break;
    acc ^= J->fn(J->p + b0, b0 + chunk < J->bytes ? chunk : J->bytes - b0);
  }
  J->sink.fetch_xor(acc, std::memory_order_relaxed);
}

}  // namespace
