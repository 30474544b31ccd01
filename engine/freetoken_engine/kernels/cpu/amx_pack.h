// The AMX groups' token vectors in VNNI pairs, the tiles' B operand (experts.cpp; baseline ISA,
// included once). Measured on the H200 host's Xeon (bench/cpu_kernel_tune.py phases): packed by
// the calling thread before the pool started, 8 experts with the same 8 tokens spent 81 us of a
// 740 us call there alone (4 tokens: 40 us). Now:
//   * groups whose token lists are equal (a batch whose tokens share experts, as in a prefill
//     chunk or the same-expert calls) share one packed copy: each group has a word offset into
//     the packed buffer (FtProblem::g_xv);
//   * the packs are the first items of the call's work queue, so the pool packs in parallel and a
//     group's stage-1 chunks wait only for their own pack.
// Layout of one pack of n tokens, per block of up to 16 (nt = min(16, n - tb)):
//   word [off + tb * H/2 + k/2 * nt + t] = (x[tok t][k], x[tok t][k + 1]).
#pragma once
#include <stdint.h>

#include <vector>

namespace {

struct PackPlan {
  std::vector<int64_t> group;   // [packs] the group whose token list a pack holds
  std::vector<int64_t> off;     // [packs] its word offset in the packed buffer
  std::vector<int64_t> g_pack;  // [n_groups] the pack an AMX group reads, -1 for other groups
  std::vector<int64_t> g_xv;    // [n_groups] word offset of that pack (0 for other groups)
  int64_t words = 0;
};

// How far back a group's token list is compared with the packs before it: equal lists are
// usually neighbours (a prefill chunk's groups, the same-expert calls), and the compare stays
// O(groups) for a call with many distinct lists.
constexpr int kPackLookback = 8;

bool same_tokens(const int64_t* sorted_pair, const int64_t* pair_tok, int64_t s1, int64_t s2, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (pair_tok[sorted_pair[s1 + i]] != pair_tok[sorted_pair[s2 + i]]) return false;
  return true;
}

void plan_packs(int64_t n_groups, const uint8_t* g_amx, const int64_t* g_start, const int64_t* g_count,
                const int64_t* sorted_pair, const int64_t* pair_tok, int64_t H, PackPlan& P) {
  P.group.clear();
  P.off.clear();
  P.g_pack.assign(n_groups, -1);
  P.g_xv.assign(n_groups, 0);
  P.words = 0;
  for (int64_t g = 0; g < n_groups; ++g) {
    if (!g_amx[g]) continue;
    const int64_t n = g_count[g];
    int64_t found = -1;
    const int64_t first = (int64_t)P.group.size() > kPackLookback ? (int64_t)P.group.size() - kPackLookback : 0;
    for (int64_t j = (int64_t)P.group.size() - 1; j >= first && found < 0; --j) {
      const int64_t h = P.group[j];
      if (g_count[h] == n && same_tokens(sorted_pair, pair_tok, g_start[h], g_start[g], n)) found = j;
    }
    if (found < 0) {
      found = (int64_t)P.group.size();
      P.group.push_back(g);
      P.off.push_back(P.words);
      P.words += n * (H / 2);
    }
    P.g_pack[g] = found;
    P.g_xv[g] = P.off[found];
  }
}

// Pack j of the plan: its group's tokens, block by block.
void pack_one(const PackPlan& P, int64_t j, const uint16_t* x, int64_t H, const int64_t* g_start,
              const int64_t* g_count, const int64_t* sorted_pair, const int64_t* pair_tok, uint32_t* xv) {
  const int64_t g = P.group[j], st = g_start[g], n = g_count[g], kp_n = H / 2;
  for (int64_t tb = 0; tb < n; tb += 16) {
    const int64_t nt = n - tb < 16 ? n - tb : 16;
    uint32_t* dst = xv + P.off[j] + tb * kp_n;
    for (int64_t t = 0; t < nt; ++t) {
      const uint32_t* src = (const uint32_t*)(x + pair_tok[sorted_pair[st + tb + t]] * H);
      for (int64_t kp = 0; kp < kp_n; ++kp) dst[kp * nt + t] = src[kp];
    }
  }
}

}  // namespace
