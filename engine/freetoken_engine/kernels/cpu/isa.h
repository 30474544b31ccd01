// Instruction-set choice for the dispatcher (experts.cpp; baseline ISA, included once): cpuid
// plus the OS's saved state at run time, and the per-ISA function tables.
#pragma once
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "experts.h"

namespace {

// ISA_AMX: the AVX-512-BF16 kernels, plus AMX tiles for the groups of at least AMX_MIN_TOKENS
// tokens (bf16 x and weights, H and I multiples of 32); everything else as ISA_AVX512BF16.
enum { ISA_GENERIC = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX512BF16 = 3, ISA_AMX = 4 };
const char* kIsaNames[] = {"generic", "avx2", "avx512", "avx512bf16", "amx"};
enum { AMX_MIN_TOKENS = 4 };

bool has_amx() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 22)) && (d & (1u << 24));
}

// AMX-TILE and AMX-BF16 in cpuid, the tile state enabled by the OS (XCR0 bits 17-18), and this
// process granted the tile data (Linux asks for it: arch_prctl(ARCH_REQ_XCOMP_PERM)). Once.
bool amx_usable() {
  static int ok = -1;
  if (ok >= 0) return ok;
  ok = 0;
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!has_amx() || !__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return false;  // OSXSAVE
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo & (3u << 17)) != (3u << 17)) return false;
  const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  ok = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return ok;
}

// The per-ISA tables below have no AMX column: ISA_AMX uses the AVX-512-BF16 functions.
int base_isa(int isa) { return isa == ISA_AMX ? ISA_AVX512BF16 : isa; }

int detect_isa() {
  __builtin_cpu_init();  // __builtin_cpu_supports also checks that the OS saves the state
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl");
  if (avx512) {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5)))
      return amx_usable() ? ISA_AMX : ISA_AVX512BF16;
    return ISA_AVX512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return ISA_AVX2;
  return ISA_GENERIC;
}

ft_stage_fn stage1_of(int isa) {
  ft_stage_fn f[] = {ft_stage1_generic, ft_stage1_avx2, ft_stage1_avx512, ft_stage1_avx512bf16};
  return f[base_isa(isa)];
}
ft_stage_fn stage2_of(int isa) {
  ft_stage_fn f[] = {ft_stage2_generic, ft_stage2_avx2, ft_stage2_avx512, ft_stage2_avx512bf16};
  return f[base_isa(isa)];
}
ft_linear_fn linear_of(int isa) {
  ft_linear_fn f[] = {ft_linear_generic, ft_linear_avx2, ft_linear_avx512, ft_linear_avx512bf16};
  return f[base_isa(isa)];
}
ft_norm_fn norm_of(int isa) {
  ft_norm_fn f[] = {ft_rmsnorm_generic, ft_rmsnorm_avx2, ft_rmsnorm_avx512, ft_rmsnorm_avx512bf16};
  return f[base_isa(isa)];
}
ft_combine_fn combine_of(int isa) {
  ft_combine_fn f[] = {ft_combine_generic, ft_combine_avx2, ft_combine_avx512, ft_combine_avx512bf16};
  return f[base_isa(isa)];
}
ft_attn_fn attn_of(int isa) {
  ft_attn_fn f[] = {ft_attn_generic, ft_attn_avx2, ft_attn_avx512, ft_attn_avx512bf16};
  return f[base_isa(isa)];
}
typedef uint64_t (*ft_read_fn)(const void*, int64_t);
ft_read_fn read_of(int isa) {
  ft_read_fn f[] = {ft_read_generic, ft_read_avx2, ft_read_avx512, ft_read_avx512bf16};
  return f[base_isa(isa)];
}

}  // namespace
