// The persistent worker pool of the dispatcher (experts.cpp; baseline ISA, included once).
//
// Contract: one job at a time (the dispatcher's call mutex serialises callers); the calling
// thread runs a share itself (tid 0), workers 1..n-1 are pinned to the CPUs they were given.
// After a job, workers spin for spin_us, then sleep on a futex on the job counter: a new job
// wakes every sleeper with one FUTEX_WAKE, each returning on its own (a condition variable made
// them re-take its mutex one after another: a chain of wake-ups before the last one started).
//
// A CPU shared with another process (a game, a browser, a build) must not hold the engine back:
//  - Jobs are queues of chunks, so a call is done when its chunks are: a worker that has not
//    started by the time the caller has taken the last chunk stays out (the job is closed to it)
//    instead of being waited for. Before, every call waited for every worker to run the job, and
//    the 2-CPU VM with one CPU busy decoded the default model at 2.1 tok/s instead of 57.
//  - A worker that holds a call up (on one chunk for stall_us while another participant waits
//    for it, or after the caller finished its own share: e.g. preempted in the middle of a
//    chunk) is left out of the jobs for a while:
//    backoff_ms at first, doubling while it keeps stalling calls (to backoff_max_ms), and sleeps
//    meanwhile instead of spinning on a CPU someone else wants.
// No result depends on which participants ran which chunks (the kernels' contract), so none
// of this changes an output bit.
#pragma once
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <memory>
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


typedef void (*job_fn)(void* ctx, int tid, int n);

int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000000000ll + ts.tv_nsec;
}

double now_s() { return 1e-9 * (double)now_ns(); }

// How the pool treats a worker that holds calls up (tune.h knobs of the same names).
struct PoolKnobs {
  int64_t stall_us = 1000;         // a worker on one chunk this long while another waits for it
  int64_t backoff_ms = 20;         // is left out this long, doubling while it keeps stalling calls
  int64_t backoff_max_ms = 2000;
  int64_t test_stall_us = 0;       // tests: worker 1 sleeps this long in its first stage-1 chunk of an
                                   // expert call (exp_job.h) or first chunk of a projection
                                   // (jobs.h), as if preempted mid-chunk
};
PoolKnobs g_pool_knobs;

// A worker's own flags, one cache line each: the workers write them at every job, and on a
// shared line 15 workers entering at once bounce it between their cores.
struct alignas(64) WorkerState {
  std::atomic<int64_t> out_until{0};  // left out until (CLOCK_MONOTONIC ns), 0: taking part
  std::atomic<int> inside{0};         // 0 outside a job, 1 working on a chunk, 2 waiting for another's
  std::atomic<int64_t> since{0};      // when it began that chunk (or entered the job)
  std::atomic<int64_t> entered{0};    // jobs it took part in (written by this worker only)
};

struct Pool {
  int n = 1;                       // participants, the caller included
  int spin_us = 200;
  pid_t pid = 0;
  std::vector<std::thread> threads;
  job_fn fn = nullptr;
  void* ctx = nullptr;
  // Read by every spinning worker, written once per job by the caller: a line of their own.
  alignas(64) std::atomic<uint32_t> gen{0};  // job counter; sleepers wait on this word
  std::atomic<uint32_t> open{0};   // the job workers may still enter (its gen), 0: closed
  std::atomic<bool> stop{false};
  std::atomic<int64_t> jobs{0};    // jobs run (written by the caller, beside gen)
  // Changed by the workers at every job.
  alignas(64) std::atomic<int> active{0};    // workers inside the open job (or deciding to enter)
  std::atomic<int> sleepers{0};
  std::atomic<uint32_t> flagged{0};          // the job whose stall was handled (once per job)
  alignas(64) std::unique_ptr<WorkerState[]> ws;
  // Each worker's backoff and last stall, kept by whichever participant wins a job's flag.
  std::vector<int64_t> backoff_ns, last_stall_ns;
  std::atomic<int64_t> stalls{0};  // calls that waited for a stalled worker
};

void futex_wait(std::atomic<uint32_t>* word, uint32_t seen) {
  syscall(SYS_futex, (uint32_t*)word, FUTEX_WAIT_PRIVATE, seen, nullptr, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, (uint32_t*)word, FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

void sleep_ns(int64_t ns) {
  timespec ts = {(time_t)(ns / 1000000000ll), (long)(ns % 1000000000ll)};
  nanosleep(&ts, nullptr);
}

// The calling thread's pool, and its own state when it is a worker (the caller has none: it is
// never left out). Jobs report their chunks and waits through these (pool_busy, pool_waiting).
thread_local Pool* t_pool = nullptr;
thread_local WorkerState* t_ws = nullptr;

void worker_main(Pool* P, int tid, int cpu) {
  t_pool = P;
  t_ws = &P->ws[tid];
  if (cpu >= 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
  }
  uint32_t seen = 0;
  for (;;) {
    const int64_t until = P->ws[tid].out_until.load();
    if (until) {                   // left out: sleep it off, then take jobs again
      const int64_t left = until - now_ns();
      if (left > 0) {
        if (P->stop.load()) return;
        sleep_ns(left < 10000000 ? left : 10000000);
        continue;
      }
      P->ws[tid].out_until.store(0);
      seen = P->gen.load();        // the jobs posted meanwhile are not this worker's
    }
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
    // Enter only while the job is open: announced first (active), then checked, so the caller,
    // which closes the job and then waits for active to drain, never returns under a worker
    // that is still reading its job.
    P->active.fetch_add(1);
    if (P->open.load() == g) {
      P->ws[tid].entered.store(P->ws[tid].entered.load(std::memory_order_relaxed) + 1,
                               std::memory_order_relaxed);
      P->ws[tid].since.store(now_ns());
      P->ws[tid].inside.store(1);
      P->fn(P->ctx, tid, P->n);
      P->ws[tid].inside.store(0);
    }
    P->active.fetch_sub(1);
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
  P->ws.reset(new WorkerState[P->n]);
  P->backoff_ns.assign(P->n, 0);
  P->last_stall_ns.assign(P->n, 0);
  for (int t = 1; t < P->n; ++t)
    P->threads.emplace_back(worker_main, P, t, ncpus > 0 ? cpus[(t - 1) % ncpus] : -1);
  return P;
}

// Leaves out the workers that have been on one chunk (or, for jobs that do not report chunks, in
// the job) for `held` ns or more: not those waiting for another participant, nor those that
// began their chunk since. backoff_ms, doubled for a worker that stalled a call within four of
// its backoffs before (up to backoff_max_ms), the first one again otherwise. At most once per
// job (whichever participant finds a holder first wins the job's flag); counts the call.
void pool_flag_stalled(Pool* P, int64_t held) {
  const uint32_t g = P->gen.load();
  uint32_t f = P->flagged.load();
  if (f == g) return;
  const int64_t now = now_ns();
  auto holding = [&](int t) { return P->ws[t].inside.load() == 1 && now - P->ws[t].since.load() >= held; };
  bool any = false;
  for (int t = 1; t < P->n && !any; ++t) any = holding(t);
  if (!any || !P->flagged.compare_exchange_strong(f, g)) return;
  const PoolKnobs& k = g_pool_knobs;
  for (int t = 1; t < P->n; ++t) {
    if (!holding(t)) continue;
    int64_t b = P->backoff_ns[t];
    b = b && now - P->last_stall_ns[t] < 4 * b ? 2 * b : k.backoff_ms * 1000000;
    if (b > k.backoff_max_ms * 1000000) b = k.backoff_max_ms * 1000000;
    P->backoff_ns[t] = b;
    P->last_stall_ns[t] = now;
    P->ws[t].out_until.store(now + b);
  }
  P->stalls.fetch_add(1);
}

void pool_run(Pool* P, job_fn fn, void* ctx) {
  P->fn = fn;
  P->ctx = ctx;
  uint32_t g = P->gen.load() + 1;
  if (g == 0) g = 1;               // 0 means closed
  P->open.store(g);
  P->jobs.fetch_add(1, std::memory_order_relaxed);
  P->gen.store(g);
  if (P->sleepers.load() > 0) futex_wake_all(&P->gen);
  const int64_t t0 = now_ns();
  t_pool = P;
  fn(ctx, 0, P->n);                // returns once every chunk is taken
  const int64_t t1 = now_ns();
  P->open.store(0);
  const int64_t stall = std::max<int64_t>(g_pool_knobs.stall_us * 1000, t1 - t0);
  int it = 0;
  while (P->active.load() > 0) {   // the workers that entered finish their chunks
    wait_step(it);
    if ((it & 255) == 0 && now_ns() - t1 > stall) pool_flag_stalled(P, stall);
  }
}

// For jobs: this worker starts a chunk (its held time counts from now).
inline void pool_busy() {
  if (t_ws) {
    t_ws->since.store(now_ns(), std::memory_order_relaxed);
    t_ws->inside.store(1, std::memory_order_release);
  }
}

// For jobs: this participant waits for another's chunk (a worker waiting is not the one holding
// the call up); pool_waited(since) from the wait loop leaves out the holder once the wait has
// lasted stall_us.
inline void pool_waiting() {
  if (t_ws) t_ws->inside.store(2, std::memory_order_release);
}

inline void pool_waited(int64_t since) {
  const int64_t stall = g_pool_knobs.stall_us * 1000;
  if (t_pool && now_ns() - since > stall) pool_flag_stalled(t_pool, stall);
}

// Tests (PoolKnobs::test_stall_us): worker 1 sleeps at this point of its first chunk of a call.
inline void pool_test_stall(int tid, bool& done) {
  if (tid == 1 && !done && g_pool_knobs.test_stall_us > 0) {
    done = true;
    sleep_ns(g_pool_knobs.test_stall_us * 1000);
  }
}

// Workers left out now, and the calls so far that waited for a stalled worker.
void pool_contention(Pool* P, int64_t* out2) {
  const int64_t now = now_ns();
  int64_t n = 0;
  for (int t = 1; t < P->n; ++t) n += P->ws[t].out_until.load() > now;
  out2[0] = n;
  out2[1] = P->stalls.load();
}

// Jobs run so far (out[0]) and the jobs each worker took part in (out[1..n-1]), at most cap
// values; returns the participants (the caller included). A worker that another process shares
// its CPU with takes part in fewer jobs without ever stalling one: the caller takes its chunks.
int pool_entries(Pool* P, int64_t* out, int cap) {
  if (cap > 0) out[0] = P->jobs.load(std::memory_order_relaxed);
  for (int t = 1; t < P->n && t < cap; ++t) out[t] = P->ws[t].entered.load(std::memory_order_relaxed);
  return P->n;
}

}  // namespace
