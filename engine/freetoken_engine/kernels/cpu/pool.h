// The persistent worker pool of the dispatcher (experts.cpp; baseline ISA, included once).
//
// Contract: one job at a time (the dispatcher's call mutex serialises callers); the calling
// thread runs a share itself (tid 0), workers 1..n-1 are pinned to the CPUs they were given.
// After a job, workers spin for spin_us, then sleep on a futex on the job counter: a new job
// wakes every sleeper with one FUTEX_WAKE, each returning on its own (a condition variable made
// them re-take its mutex one after another: a chain of wake-ups before the last one started).
#pragma once
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <thread>
#include <vector>

namespace {

inline void cpu_pause() { __builtin_ia32_pause(); }

// One step of a wait loop: pause a while, then yield, so a waiter that shares its CPU with the
// thread it waits for (more runnable threads than CPUs) hands the CPU over instead of burning
// its whole time slice.
inline void wait_step(int& it) {
  if (++it < 256) cpu_pause();
  else sched_yield();
}

double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

typedef void (*job_fn)(void* ctx, int tid, int n);

struct Pool {
  int n = 1;                       // participants, the caller included
  int spin_us = 200;
  pid_t pid = 0;
  std::vector<std::thread> threads;
  std::atomic<uint32_t> gen{0};    // job counter; sleepers wait on this word
  std::atomic<int> sleepers{0};
  std::atomic<int> done{0};
  std::atomic<bool> stop{false};
  job_fn fn = nullptr;
  void* ctx = nullptr;
};

void futex_wait(std::atomic<uint32_t>* word, uint32_t seen) {
  syscall(SYS_futex, (uint32_t*)word, FUTEX_WAIT_PRIVATE, seen, nullptr, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, (uint32_t*)word, FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

void worker_main(Pool* P, int tid, int cpu) {
  if (cpu >= 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
  }
  uint32_t seen = 0;
  for (;;) {
    uint32_t g;
    const double t0 = now_s();
    int it = 0;
    while ((g = P->gen.load()) == seen) {
      if (P->stop.load()) return;
      wait_step(it);
      if ((it & 255) == 0 && now_s() - t0 > 1e-6 * P->spin_us) {
        // Announce, then re-check inside the kernel: a job posted after the announcement either
        // changed gen before futex_wait compares it, or sees sleepers > 0 and wakes us.
        P->sleepers.fetch_add(1);
        while (P->gen.load() == seen && !P->stop.load()) futex_wait(&P->gen, seen);
        P->sleepers.fetch_sub(1);
        it = 0;
      }
    }
    seen = g;
    if (P->stop.load()) return;
    P->fn(P->ctx, tid, P->n);
    P->done.fetch_add(1, std::memory_order_release);
  }
}

void pool_stop(Pool* P) {
  P->stop.store(true);
  P->gen.fetch_add(1);
  futex_wake_all(&P->gen);
  for (auto& t : P->threads) t.join();
}

Pool* pool_start(int n, const int* cpus, int ncpus, int spin_us) {
  Pool* P = new Pool();
  P->n = n < 1 ? 1 : n;
  P->spin_us = spin_us;
  P->pid = getpid();
  for (int t = 1; t < P->n; ++t)
    P->threads.emplace_back(worker_main, P, t, ncpus > 0 ? cpus[(t - 1) % ncpus] : -1);
  return P;
}

void pool_run(Pool* P, job_fn fn, void* ctx) {
  P->fn = fn;
  P->ctx = ctx;
  P->done.store(0);
  P->gen.fetch_add(1);
  if (P->sleepers.load() > 0) futex_wake_all(&P->gen);
  fn(ctx, 0, P->n);
  int it = 0;
  while (P->done.load(std::memory_order_acquire) < P->n - 1) wait_step(it);
}

}  // namespace
