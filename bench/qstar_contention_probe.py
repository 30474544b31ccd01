"""Calibration beside busy processes, and GPU decode with the q* of each calibration (exploratory).

Runs ``freetoken calibrate --device cuda --json --refresh`` idle, beside N busy processes placed
by the scheduler (busy-free) and pinned to the last CPUs (busy-last); then, in three rounds, the
decode of bench/cpu_generate.py's qwen3moe-bf16 checkpoint (256 cached experts of 1024) with each
condition's q* (``--cpu-expert-fraction 1 - fill_fraction``) under that condition, against the
idle calibration's q*. Writes $OUT/qprobe.json (or the path in QPROBE_OUT).

    python bench/qstar_contention_probe.py [N=8]     # on the GPU machine, from the repo root
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

sys.path.insert(0, "bench")
from cpu_contention import CONDITIONS, ROOT, decode_rate, start_hogs, stop_hogs, write_checkpoint  # noqa: E402

OUT = os.environ.get("OUT", ".")


def calib() -> dict:
    p = subprocess.run([sys.executable, "-m", "freetoken_engine.cli", "calibrate", "--device", "cuda", "--json",
                        "--refresh"], capture_output=True, text=True, timeout=120)
    return json.loads(p.stdout.strip().splitlines()[-1])


def gen(model: str, frac: float) -> float:
    """Decode tok/s of the README's main job on ``model``, a share ``frac`` of misses on the CPU."""
    return decode_rate(ROOT, model, 48, False, ["--device", "cuda", "--expert-cache-experts", "256",
                                                "--cpu-expert-fraction", f"{frac:.3f}"])


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    res = {"hogs": n, "calib": {}, "runs": []}

    def save():
        with open(os.environ.get("QPROBE_OUT", f"{OUT}/qprobe.json"), "w") as f:
            json.dump(res, f, indent=1)

    for cond in CONDITIONS:
        hogs, t0 = start_hogs(cond, n), time.time()
        try:
            res["calib"][cond] = c = calib()
        finally:
            stop_hogs(hogs)
        print(cond, "calib s", round(time.time() - t0, 1), "f", round(c["fill_fraction"], 3), "cpu",
              round(c["cpu_expert_gbps"], 1), "conc", c["concurrent"], "stalls", c.get("cpu_stalled_calls"), flush=True)
        save()
    model = str(write_checkpoint("qwen3moe-bf16"))
    fr = {k: 1 - res["calib"][k]["fill_fraction"] for k in CONDITIONS}
    for r in range(3):
        for cond in ("busy-free", "busy-last", "idle"):
            hogs = start_hogs(cond, n)
            try:
                for side in ("idle", cond) if cond != "idle" else ("idle",):
                    rate = gen(model, fr[side])
                    res["runs"].append({"round": r, "condition": cond, "calibrated": side, "cpu_fraction": fr[side],
                                        "tok_s": rate})
                    print(r, cond, "q from", side, round(fr[side], 3), rate, flush=True)
            finally:
                stop_hogs(hogs)
        save()


if __name__ == "__main__":
    main()
