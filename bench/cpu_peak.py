"""The core's arithmetic ceiling for the CPU expert kernel: instructions per cycle of the ops its
inner loops issue, and what that allows a call with many tokens on one expert.

With T tokens on one expert, each 64-byte line of a bf16 weight row costs T ``vdpbf16ps`` (one
per token, 32 multiply-adds each), so past a few tokens a core's rate of that instruction, not
memory, bounds the kernel: ``64 * f * r / T`` bytes a second at r instructions a cycle and clock f.
This compiles a few register-only loops with g++ (-O2 -march=native): a chain of dependent integer
adds (one a cycle: the clock), and 16 independent accumulators of ``vdpbf16ps`` (zmm) and of FMA
(zmm and ymm), then prints the rates and the per-core bound for 4-8 tokens.

    python bench/cpu_peak.py [--out bench/results]

Writes OUT/cpu_peak_<N>cpu.json and a PNG, hardware named. Needs g++ and AVX-512-BF16.
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
#include <time.h>
static double now() { timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
template <class V, class F> __attribute__((noinline)) double rate(long iters, V init, F op) {
  V acc[16];
  for (int i = 0; i < 16; i++) acc[i] = init;
  double t0 = now();
  for (long k = 0; k < iters; k++) {
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) acc[i] = op(acc[i]);
    asm volatile("" ::: "memory");
  }
  double dt = now() - t0;
  volatile V sink = acc[0];
  for (int i = 1; i < 16; i++) sink = acc[i];
  (void)sink;
  return 16.0 * iters / dt;
}
int main() {
  const long it = 60000000;
  unsigned long x = 1;
  double t0 = now();
  for (long k = 0; k < 4 * it; k++) asm volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x));
  const double hz = 16.0 * it / (now() - t0);
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3f00);
  const __m512 fa = _mm512_set1_ps(1.0001f), fb = _mm512_set1_ps(0.9999f);
  const __m256 ya = _mm256_set1_ps(1.0001f), yb = _mm256_set1_ps(0.9999f);
  double dp = rate(it, _mm512_setzero_ps(), [&](__m512 c) { return _mm512_dpbf16_ps(c, a, b); });
  double fz = rate(it, _mm512_setzero_ps(), [&](__m512 c) { return _mm512_fmadd_ps(fa, fb, c); });
  double fy = rate(it, _mm256_setzero_ps(), [&](__m256 c) { return _mm256_fmadd_ps(ya, yb, c); });
  printf("{\"clock_hz\": %.6e, \"vdpbf16ps_zmm_per_s\": %.6e, \"fma_zmm_per_s\": %.6e, \"fma_ymm_per_s\": %.6e}\n",
         hz, dp, fz, fy);
  return x == 0;
}
"""


def measure() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "peak.cpp", Path(tmp) / "peak"
        src.write_text(SOURCE)
        subprocess.run(["g++", "-O2", "-march=native", "-std=c++17", "-o", str(exe), str(src)], check=True)
        return json.loads(subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    hw = hardware()
    if "avx512_bf16" not in hw["flags"]:
        sys.exit("needs AVX-512-BF16")
    rounds = [measure() for _ in range(args.rounds)]
    best = {k: max(r[k] for r in rounds) for k in rounds[0]}
    f = best["clock_hz"]
    per_cycle = {k.replace("_per_s", "_per_cycle"): v / f for k, v in best.items() if k != "clock_hz"}
    bound = {str(t): 64 * best["vdpbf16ps_zmm_per_s"] / t / 1e9 for t in (1, 2, 4, 6, 8)}
    print(f"{hw['cpu_model']}: clock {f / 1e9:.2f} GHz; per cycle: " +
          ", ".join(f"{k} {v:.2f}" for k, v in per_cycle.items()))
    print("per-core bound of T tokens on one expert (GB/s): " + ", ".join(f"T={t} {v:.1f}" for t, v in bound.items()))
    data = {"benchmark": "cpu_peak", "method": __doc__.strip().split("\n\n")[0], "hardware": hw,
            "rounds": rounds, "best": best, "per_cycle": per_cycle, "per_core_gbps_bound_by_tokens": bound}
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
    b.set_ylabel("per-core GB/s bound (vdpbf16ps rate)")
    fig.suptitle(f"{data['hardware']['cpu_model']}: clock {data['best']['clock_hz'] / 1e9:.2f} GHz", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
