"""The core's arithmetic ceiling for the CPU expert kernel: instructions per cycle of the ops its
inner loops issue, and what that allows a call with many tokens on one expert.

With T tokens on one expert, each 64-byte line of a bf16 weight row costs T ``vdpbf16ps`` (one
per token, 32 multiply-adds each), so past a few tokens a core's rate of that instruction, not
memory, bounds the kernel: ``64 * f * r / T`` bytes a second at r instructions a cycle and clock f.
This compiles a few register-only loops with g++ (-O3 -march=native; the kernel is built at -O3):
a chain of dependent integer adds (one a cycle: the clock), and 12 independent accumulators (in
registers) of ``vdpbf16ps`` (zmm) and of FMA (zmm and ymm), then prints the rates and the per-core
bound for 4-8 tokens. On a CPU without AVX-512-BF16 the kernel's bf16 path widens 8 weights (16
bytes) to fp32 and issues one ymm FMA per token: the bound is then ``16 * f * r / T`` with r that
FMA's rate. It also times a copy of the AVX2 kernel's step for 8 tokens on one expert (3 rows x 4
tokens, two groups; its weights in L2 and in L3): what that step reaches of the FMA bound, with
its loads, before memory is involved.

    python bench/cpu_peak.py [--out bench/results]

Writes OUT/cpu_peak_<N>cpu.json and a PNG, hardware named. Needs g++ and AVX2+FMA.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_expert_kernel import RESULTS, hardware, write_results  # noqa: E402

SOURCE = r"""
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now() { timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
// 12 independent accumulators, named so that they stay in registers (an array under a memory
// clobber lived on the stack, and the loop then measured store forwarding, not the pipe; runs
// before 2026-12-03 had that flaw): 12 covers a 4-6 cycle latency on two pipes and, with the two
// constant operands, fits AVX2's 16 registers.
template <class V, class F> __attribute__((noinline)) double rate(long iters, V init, F op) {
  V a0 = init, a1 = init, a2 = init, a3 = init, a4 = init, a5 = init, a6 = init, a7 = init, a8 = init,
    a9 = init, a10 = init, a11 = init;
  double t0 = now();
  for (long k = 0; k < iters; k++) {
    a0 = op(a0); a1 = op(a1); a2 = op(a2); a3 = op(a3); a4 = op(a4); a5 = op(a5);
    a6 = op(a6); a7 = op(a7); a8 = op(a8); a9 = op(a9); a10 = op(a10); a11 = op(a11);
    asm volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7),
                 "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11));
  }
  double dt = now() - t0;
  volatile V sink = a0;
  sink = a1; sink = a2; sink = a3; sink = a4; sink = a5; sink = a6; sink = a7; sink = a8; sink = a9;
  sink = a10; sink = a11;
  (void)sink;
  return 12.0 * iters / dt;
}
// The AVX2 kernel's own step for many tokens on one expert (experts_isa.cpp dotr_rows<3, 4>):
// 3 bf16 rows widened to fp32 (a widening load and a shift), each token vector load serving the
// 3 rows, 8 tokens in two groups of 4 (the second reads the rows from cache), over `rows` rows of
// K: in L2 (48 rows of 2048) it is the arithmetic of the step with its loads, in L3 the same
// with the weights further away.
static __m256 widen(const unsigned short* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
__attribute__((noinline)) void rows3(const unsigned short* w, long K, const float* const* xs, float* o) {
  __m256 a[3][4];
  for (int j = 0; j < 3; j++) for (int t = 0; t < 4; t++) a[j][t] = _mm256_setzero_ps();
  for (long k = 0; k < K; k += 8) {
    __m256 v[3];
    for (int j = 0; j < 3; j++) v[j] = widen(w + j * K + k);
    for (int t = 0; t < 4; t++) {
      const __m256 x = _mm256_loadu_ps(xs[t] + k);
      for (int j = 0; j < 3; j++) a[j][t] = _mm256_fmadd_ps(v[j], x, a[j][t]);
    }
  }
  for (int j = 0; j < 3; j++) for (int t = 0; t < 4; t++) o[4 * j + t] = a[j][t][0] + a[j][t][7];
}
static double step_rate(long K, long rows) {
  unsigned short* w = (unsigned short*)aligned_alloc(64, rows * K * 2);
  float* x = (float*)aligned_alloc(64, 8 * K * 4);
  for (long i = 0; i < rows * K; i++) w[i] = 0x3f80;
  for (long i = 0; i < 8 * K; i++) x[i] = 1.f;
  const float* xs[8];
  for (int t = 0; t < 8; t++) xs[t] = x + t * K;
  float o[12];
  double best = 0;
  for (int rep = 0; rep < 5; rep++) {
    long n = 0;
    double t0 = now(), dt;
    do {
      for (long r = 0; r + 3 <= rows; r += 3) { rows3(w + r * K, K, xs, o); rows3(w + r * K, K, xs + 4, o); }
      n++;
    } while ((dt = now() - t0) < 0.2);
    const double r = (double)n * (rows / 3 * 3) * (K / 8) * 8 / dt;    // ymm FMAs a second
    if (r > best) best = r;
  }
  free(w);
  free(x);
  return best;
}
int main() {
  const long it = 60000000;
  unsigned long x = 1;
  double t0 = now();
  for (long k = 0; k < 4 * it; k++) asm volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x));
  const double hz = 16.0 * it / (now() - t0);
  const __m256 ya = _mm256_set1_ps(1.0001f), yb = _mm256_set1_ps(0.9999f);
  double fy = rate(it, _mm256_setzero_ps(), [&](__m256 c) { return _mm256_fmadd_ps(ya, yb, c); });
  printf("{\"clock_hz\": %.6e, \"fma_ymm_per_s\": %.6e", hz, fy);
  printf(", \"row_step_l2_fma_ymm_per_s\": %.6e, \"row_step_l3_fma_ymm_per_s\": %.6e", step_rate(2048, 48),
         step_rate(2048, 3000));
#ifdef __AVX512BF16__
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3f00);
  const __m512 fa = _mm512_set1_ps(1.0001f), fb = _mm512_set1_ps(0.9999f);
  double dp = rate(it, _mm512_setzero_ps(), [&](__m512 c) { return _mm512_dpbf16_ps(c, a, b); });
  double fz = rate(it, _mm512_setzero_ps(), [&](__m512 c) { return _mm512_fmadd_ps(fa, fb, c); });
  printf(", \"vdpbf16ps_zmm_per_s\": %.6e, \"fma_zmm_per_s\": %.6e", dp, fz);
#endif
  printf("}\n");
  return x == 0;
}
"""


def measure() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "peak.cpp", Path(tmp) / "peak"
        src.write_text(SOURCE)
        subprocess.run(["g++", "-O3", "-march=native", "-std=c++17", "-o", str(exe), str(src)], check=True)
        return json.loads(subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    hw = hardware()
    if "avx2" not in hw["flags"]:
        sys.exit("needs AVX2 and FMA")
    rounds = [measure() for _ in range(args.rounds)]
    best = {k: max(r[k] for r in rounds) for k in rounds[0]}
    f = best["clock_hz"]
    per_cycle = {k.replace("_per_s", "_per_cycle"): v / f for k, v in best.items() if k != "clock_hz"}
    # the instruction the kernel's bf16 path issues per token and weight vector: vdpbf16ps on
    # 64 bytes of weights where AVX-512-BF16 is present, else an AVX2 FMA on 16 bytes (8 bf16
    # weights widened to fp32)
    op, width = ("vdpbf16ps_zmm_per_s", 64) if "vdpbf16ps_zmm_per_s" in best else ("fma_ymm_per_s", 16)
    bound = {str(t): width * best[op] / t / 1e9 for t in (1, 2, 4, 6, 8)}
    # what the AVX2 step itself (widening loads, token loads, 8 tokens in two groups) reaches: with
    # 8 tokens a weight vector costs 8 of its FMAs
    step = {lvl: 16 * best[f"row_step_{lvl}_fma_ymm_per_s"] / 8 / 1e9 for lvl in ("l2", "l3")}
    fma8 = 16 * best["fma_ymm_per_s"] / 8 / 1e9     # its own bound: the ymm FMA pipes (AVX-512 hosts too)
    print(f"{hw['cpu_model']}: clock {f / 1e9:.2f} GHz; per cycle: " +
          ", ".join(f"{k} {v:.2f}" for k, v in per_cycle.items()))
    print("per-core bound of T tokens on one expert (GB/s): " + ", ".join(f"T={t} {v:.1f}" for t, v in bound.items()))
    print("the AVX2 step with 8 tokens on one expert, per core (GB/s of weights): " +
          ", ".join(f"rows in {lvl.upper()} {v:.1f} ({v / fma8:.0%} of the ymm FMA bound, {fma8:.1f})"
                    for lvl, v in step.items()))
    data = {"benchmark": "cpu_peak", "method": __doc__.strip().split("\n\n")[0], "hardware": hw,
            "rounds": rounds, "best": best, "per_cycle": per_cycle, "bound_instruction": op,
            "per_core_gbps_bound_by_tokens": bound, "per_core_gbps_avx2_step_8_tokens": step}
    write_results(args.out / f"cpu_peak_{hw['cpus']}cpu.json", data, plot)


def plot(data: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    pc = data["per_cycle"]
    a.bar(list(pc), list(pc.values()))
    a.set_ylabel("instructions per cycle")
    a.tick_params(axis="x", labelsize=7)
    bd = data["per_core_gbps_bound_by_tokens"]
    b.plot([int(t) for t in bd], list(bd.values()), "o-")
    b.set_xlabel("tokens on one expert")
    b.set_ylabel(f"per-core GB/s bound ({data.get('bound_instruction', 'vdpbf16ps_zmm_per_s')[:-6]} rate)")
    fig.suptitle(f"{data['hardware']['cpu_model']}: clock {data['best']['clock_hz'] / 1e9:.2f} GHz", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
