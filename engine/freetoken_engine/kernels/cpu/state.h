// The dispatcher's state (experts.cpp; baseline ISA, included once): the configuration and the
// pool behind the call mutex, the last error, and the scratch every call reuses while it holds
// the mutex (aligned token buffers, the pairs grouped by expert, the gate of the call).
#pragma once
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <algorithm>
#include <mutex>
#include <new>
#include <vector>

#include "amx_pack.h"
#include "experts.h"
#include "pool.h"

namespace {

// Global state, guarded by g_call (a call holds it for its whole duration).
std::mutex g_call;
Pool* g_pool = nullptr;
int g_isa = -1;
int g_threads = 1;
std::vector<int> g_cpus;
int g_spin_us = 200;
int64_t g_prefetch = 0;       // bf16 weight rows
int64_t g_prefetch_f32 = 0;   // fp32 weight rows
char g_err[256];

Pool* pool_get() {
  if (g_pool && g_pool->pid != getpid()) g_pool = nullptr;  // forked child: threads are gone
  if (!g_pool) g_pool = pool_start(g_threads, g_cpus.data(), (int)g_cpus.size(), g_spin_us);
  return g_pool;
}

// Cache-line-aligned storage for the buffers the kernels read as token vectors (x in fp32, x in
// VNNI pairs for the tiles, the activations between the stages). std::vector's default allocator
// gives 16-byte alignment, so in some processes every 64-byte load of a token row straddled two
// cache lines: on the EPYC, stage 2 of an expert with 8 tokens (one thread, hot in cache) ran at
// 21-22 GB/s in those processes and 31 in the others, the same code and addresses otherwise.
template <class T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <class U> Aligned64(const Aligned64<U>&) {}
  T* allocate(size_t n) {
    void* ptr = nullptr;
    if (posix_memalign(&ptr, 64, n * sizeof(T) + 64)) throw std::bad_alloc();
    return (T*)ptr;
  }
  void deallocate(T* ptr, size_t) { free(ptr); }
  template <class U> bool operator==(const Aligned64<U>&) const { return true; }
  template <class U> bool operator!=(const Aligned64<U>&) const { return false; }
};
template <class T> using avec = std::vector<T, Aligned64<T>>;

PackPlan s_pack;
std::vector<int64_t> s_done0, s_done1, s_cnt, s_gexp, s_gstart, s_gcount, s_sorted;
std::vector<uint8_t> s_gamx;
std::vector<int64_t> s_gbias;

// The gate of the call in progress (set by ft_experts_gated under g_call; plain otherwise).
struct Gate {
  int act = 0;
  float alpha = 0.f, limit = 0.f;
  const float* b13 = nullptr;       // [n_bias, 2 I] fp32 gate/up bias rows
  int64_t n_bias = 0;
  const int64_t* pair_bias = nullptr;   // [P] each pair's bias row
};
Gate g_gate;
avec<uint32_t> s_xv;
avec<float> s_xf, s_act, s_attn;

// Groups the pairs by expert, stably (each expert's weights are then read once): s_sorted holds
// the pair at each sorted position, group g covers [s_gstart[g], + s_gcount[g]) of expert
// s_gexp[g]. A counting sort over the experts, or, for a few pairs on a large bank (a decode
// step's CPU experts of a whole bank: 1 pair on 768 experts took 1-2 us of counting), a sort of
// the pairs themselves.
void group_pairs(const int64_t* pair_exp, int64_t P, int64_t E) {
  s_gexp.clear(); s_gstart.clear(); s_gcount.clear();
  s_sorted.resize(P);
  if (P * 8 < E) {
    for (int64_t i = 0; i < P; ++i) s_sorted[i] = i;
    std::stable_sort(s_sorted.begin(), s_sorted.end(),
                     [&](int64_t a, int64_t b) { return pair_exp[a] < pair_exp[b]; });
    for (int64_t i = 0; i < P; ++i) {
      if (i == 0 || pair_exp[s_sorted[i]] != s_gexp.back()) {
        s_gexp.push_back(pair_exp[s_sorted[i]]);
        s_gstart.push_back(i);
        s_gcount.push_back(0);
      }
      ++s_gcount.back();
    }
    return;
  }
  s_cnt.assign(E + 1, 0);
  for (int64_t i = 0; i < P; ++i) ++s_cnt[pair_exp[i] + 1];
  for (int64_t e = 0; e < E; ++e) {
    if (s_cnt[e + 1]) {
      s_gexp.push_back(e);
      s_gstart.push_back(s_cnt[e]);
      s_gcount.push_back(s_cnt[e + 1]);
    }
    s_cnt[e + 1] += s_cnt[e];
  }
  for (int64_t i = 0; i < P; ++i) s_sorted[s_cnt[pair_exp[i]]++] = i;
}

// x as fp32: itself, or its n bf16 values widened into s_xf (callers hold g_call).
const float* as_f32(const void* x, int x_bf16, int64_t n) {
  if (!x_bf16) return (const float*)x;
  s_xf.resize(n);
  const uint16_t* xb = (const uint16_t*)x;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u = (uint32_t)xb[i] << 16;
    memcpy(&s_xf[i], &u, 4);
  }
  return s_xf.data();
}
avec<uint16_t> s_actb;

}  // namespace
