"""VRAM pressure on a real GPU: calibration, reaction time, decode speed before/during/after.

What it runs (all on one machine, in one run):
1. `freetoken-agent calibrate --json --refresh` (the engine's `freetoken calibrate` on cuda);
2. a synthetic MoE checkpoint (Qwen3-MoE layout, random weights) and `freetoken-agent run`
   in standalone mode with one cuda engine on it, the real NVML path;
3. a client streaming greedy completions without pause, and a second process that allocates
   VRAM while the engine decodes (a game starting), holds it, then frees it (the game quits).

It records the hardware, the calibration, the time from the foreign allocation to NVML showing
the headroom free again (target < 1 s), the agent's own reaction histogram, the expert-cache
size over time and tokens/s before, during and after, into bench/results/pressure_gpu.json
and a PNG timeline.

    python bench/pressure_gpu.py                 # on a machine with an NVIDIA GPU
    python bench/pressure_gpu.py --simulate      # anywhere: CPU engine, simulated GPU (a dry run)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
TOKEN = "bench-admin"
GiB = 1 << 30


def hardware() -> dict:
    info = {"cpu": platform.processor() or platform.machine(), "cpu_cores": os.cpu_count(),
            "python": platform.python_version()}
    try:
        info["cpu"] = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
        info["ram_bytes"] = int(next(l.split()[1] for l in open("/proc/meminfo") if l.startswith("MemTotal"))) * 1024
    except (OSError, StopIteration):
        pass
    try:
        import pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        info["gpu"] = pynvml.nvmlDeviceGetName(h)
        info["gpu_memory_bytes"] = int(pynvml.nvmlDeviceGetMemoryInfo(h).total)
        info["pcie"] = f"gen {pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h)} x{pynvml.nvmlDeviceGetCurrPcieLinkWidth(h)}"
        info["driver"] = pynvml.nvmlSystemGetDriverVersion()
    except Exception as exc:  # no GPU: say so in the results
        info["gpu"] = f"none ({type(exc).__name__})"
    return info


class Nvml:
    """Device-level used/free of GPU 0 (what the agent reads too)."""

    def __init__(self) -> None:
        import pynvml
        pynvml.nvmlInit()
        self.nv, self.h = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)

    def read(self) -> tuple[int, int]:
        m = self.nv.nvmlDeviceGetMemoryInfo(self.h)
        return int(m.total), int(m.used)


def make_checkpoint(path: Path, dims: dict) -> None:
    code = ("import sys; sys.path.insert(0, 'tests'); from tiny_models import make_tiny_checkpoint; "
            f"make_tiny_checkpoint({str(path)!r}, 'qwen3_moe', init_std=0.02, **{dims!r})")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


ALLOCATOR = r"""
import sys, time, torch, pynvml
pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(0)
extra, headroom = int(sys.argv[1]), int(sys.argv[2])
torch.cuda.init(); torch.empty(1, device="cuda")          # context first: not part of the timing
sys.stdin.readline()
m = pynvml.nvmlDeviceGetMemoryInfo(h)
nbytes = (m.total - m.used) - headroom + extra             # leaves `extra` less than the headroom
t0 = time.time(); x = torch.empty(nbytes, dtype=torch.uint8, device="cuda"); torch.cuda.synchronize()
t1 = time.time()
while True:
    m = pynvml.nvmlDeviceGetMemoryInfo(h)
    if m.total - m.used >= headroom or time.time() - t1 > 20: break
    time.sleep(0.002)
t2 = time.time()
print(f"{t0} {t1} {t2} {m.total - m.used} {nbytes}", flush=True)
sys.stdin.readline(); del x; torch.cuda.empty_cache(); print("freed", flush=True)
"""


class Client(threading.Thread):
    """Sends greedy completions back to back; records (start, end, completion tokens) of each.

    Token counts come from the response's ``usage`` (a random model's tokens often decode to
    no visible text, so counting streamed chunks would undercount)."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.requests: list[tuple[float, float, int]] = []
        self.errors: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        body = {"model": "bench", "prompt": [5, 17, 42, 99, 7], "max_tokens": self.max_tokens,
                "temperature": 0, "ignore_eos": True}
        with httpx.Client(base_url=self.url, timeout=300) as c:
            while not self.stop.is_set():
                t0 = time.time()
                r = c.post("/v1/completions", json=body)
                if r.status_code != 200:
                    self.errors.append(f"HTTP {r.status_code}: {r.text[:200]}")
                    continue
                self.requests.append((t0, time.time(), r.json()["usage"]["completion_tokens"]))

    def rate(self, t0: float, t1: float) -> float | None:
        """Tokens per second over the requests that ran entirely inside [t0, t1)."""
        inside = [(b - a, n) for a, b, n in self.requests if t0 <= a and b < t1]
        seconds = sum(d for d, _ in inside)
        return round(sum(n for _, n in inside) / seconds, 1) if seconds > 0 else None


def wait(pred, timeout: float, what: str, interval: float = 0.05):
    end = time.time() + timeout
    while time.time() < end:
        try:
            v = pred()
            if v:
                return v
        except httpx.HTTPError:
            pass
        time.sleep(interval)
    raise RuntimeError(f"timed out waiting for {what}")


def agent_metric(port: int, name: str) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                return s.value
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--simulate", action="store_true", help="CPU engine and a simulated GPU")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--expert-inter", type=int, default=512)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--window", type=float, default=4.0, help="seconds per measured phase")
    ap.add_argument("--request-tokens", type=int, default=32, help="tokens per completion request")
    ap.add_argument("--out", default=str(RESULTS / "pressure_gpu.json"))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ft-pressure-"))
    device = "cpu" if args.simulate else "cuda"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "engine"), str(ROOT / "node_agent"),
                                                        os.environ.get("PYTHONPATH", "")])}
    result: dict = {"hardware": hardware(), "mode": "simulated" if args.simulate else "nvml"}
    print("hardware:", result["hardware"])

    t = time.time()
    cal = subprocess.run([sys.executable, "-m", "freetoken_agent.cli", "calibrate", "--json", "--refresh",
                          "--state-dir", str(work / "state")], capture_output=True, text=True, env=env)
    if cal.returncode != 0:
        print(cal.stderr)
    result["calibration"] = json.loads(cal.stdout.splitlines()[-1]) if cal.returncode == 0 else {"error": cal.stderr[-500:]}
    result["calibration_seconds"] = round(time.time() - t, 1)
    print("calibration:", result["calibration"])

    dims = dict(hidden_size=args.hidden, moe_intermediate_size=args.expert_inter, num_experts=args.experts,
                num_experts_per_tok=8, num_hidden_layers=args.layers, intermediate_size=args.expert_inter * 4,
                num_attention_heads=8, num_key_value_heads=4, head_dim=args.hidden // 8,
                max_position_embeddings=8192, vocab_size=320)
    make_checkpoint(work / "model", dims)
    result["model"] = {"family": "qwen3_moe (random weights)", **dims, "dtype": "bfloat16" if not args.simulate else "float32"}

    headroom = 2 * GiB
    gpu_file = work / "gpu.json"
    if args.simulate:
        gpu_file.write_text(json.dumps({"name": "Simulated GPU", "total_bytes": 64 * GiB, "foreign_bytes": 0}))
    port, mport = 23000, 23400
    (work / "models.yaml").write_text(
        f"models:\n- model: bench\n  port: {port}\n  source: {{path: {work / 'model'}}}\n"
        f"  engine: {{device: {device}, dtype: {result['model']['dtype']}, expertCacheShare: 0.9}}\n")
    agent_env = {**env, "FREETOKEN_AGENT_ADMIN_TOKEN": TOKEN, "FREETOKEN_AGENT_HEADROOM_BYTES": str(headroom),
                 "FREETOKEN_AGENT_HEADROOM_FRACTION": "0", "FREETOKEN_AGENT_HYSTERESIS_BYTES": str(GiB // 4),
                 "FREETOKEN_AGENT_COOLDOWN_SECONDS": "3", "FREETOKEN_AGENT_GROW_INTERVAL_SECONDS": "0.5",
                 "FREETOKEN_AGENT_GROW_STEP_FRACTION": "0.5", "FREETOKEN_AGENT_TICK_SECONDS": "0.1"}
    if args.simulate:
        agent_env["FREETOKEN_AGENT_SIMULATED_GPU"] = str(gpu_file)
    agent = subprocess.Popen([sys.executable, "-m", "freetoken_agent.cli", "run", "--node-name", "bench",
                              "--standalone", str(work / "models.yaml"), "--metrics-host", "127.0.0.1",
                              "--metrics-port", str(mport), "--state-dir", str(work / "state"),
                              "--log-level", "DEBUG"],
                             env=agent_env, stdout=open(work / "agent.log", "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    timeline: list[tuple[float, int, int]] = []  # (time, cache bytes, device used bytes)
    stop = threading.Event()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        def engine_up():
            restarts = agent_metric(mport, "freetoken_agent_engine_restarts_total") or 0
            if restarts >= 2:  # the engine cannot start here: stop now, not at the time limit
                raise RuntimeError(f"the engine failed {int(restarts)} times; see its log")
            return admin.get("/health").status_code == 200
        wait(engine_up, 300, "the engine", interval=0.5)
        ec = admin.get("/admin/cache").json()["expert_cache"]
        full = ec["max_experts"] * ec["expert_bytes"]
        wait(lambda: admin.get("/admin/cache").json()["expert_cache"]["capacity_bytes"] == full, 30, "a full cache")
        nvml = None if args.simulate else Nvml()

        def monitor():
            while not stop.is_set():
                cap = admin.get("/admin/cache").json()["expert_cache"]["capacity_bytes"]
                used = nvml.read()[1] if nvml else agent_metric(mport, "freetoken_agent_memory_used_bytes")
                timeline.append((time.time(), cap, int(used or 0)))
                time.sleep(0.05)
        mon = threading.Thread(target=monitor, daemon=True)
        mon.start()
        client = Client(url, max_tokens=args.request_tokens)
        client.start()
        wait(lambda: len(client.requests) > 1, 120, "the first completions")
        t_before = time.time()
        time.sleep(args.window)

        # The owner's program wants all but (headroom - half the cache) of the free memory.
        if args.simulate:
            total = 64 * GiB
            foreign = total - headroom - full // 2 - 0
            t_alloc0 = time.time()
            gpu_file.write_text(json.dumps({"name": "Simulated GPU", "total_bytes": total, "foreign_bytes": foreign}))
            t_alloc = time.time()
            wait(lambda: admin.get("/admin/cache").json()["expert_cache"]["capacity_bytes"] <= full // 2 + ec["expert_bytes"],
                 20, "the shrink", interval=0.002)
            t_release, free_after = time.time(), None
        else:
            alloc = subprocess.Popen([sys.executable, "-c", ALLOCATOR, str(full // 2), str(headroom)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
            time.sleep(3.0)  # CUDA context of the allocator (its ~500 MB count as foreign too)
            alloc.stdin.write("go\n"); alloc.stdin.flush()
            t_alloc0, t_alloc, t_release, free_after, foreign = map(float, alloc.stdout.readline().split())
        time.sleep(args.window)
        t_during_end = time.time()
        if args.simulate:
            gpu_file.write_text(json.dumps({"name": "Simulated GPU", "total_bytes": 64 * GiB, "foreign_bytes": 0}))
        else:
            alloc.stdin.write("free\n"); alloc.stdin.flush(); alloc.stdout.readline()
        t_freed = time.time()
        wait(lambda: admin.get("/admin/cache").json()["expert_cache"]["capacity_bytes"] == full, 60, "the regrowth")
        t_regrown = time.time()
        time.sleep(args.window)
        t_end = time.time()
        client.stop.set()
        shrunk = min(c for _, c, _ in timeline)
        result["pressure"] = {
            "headroom_bytes": headroom, "foreign_allocation_bytes": int(foreign),
            "expert_bytes": ec["expert_bytes"], "cache_full_bytes": full, "cache_shrunk_bytes": shrunk,
            "allocation_seconds": round(t_alloc - t_alloc0, 4),
            "reaction_seconds": round(t_release - t_alloc, 4),
            "free_bytes_after_release": free_after,
            "agent_reaction_seconds_mean": _mean_reaction(mport),
            "regrow_seconds_after_free": round(t_regrown - t_freed, 2),
            "stream_errors": client.errors[:3],
        }
        result["tokens_per_second"] = {
            "before": client.rate(t_before, t_alloc0), "during": client.rate(t_release, t_during_end),
            "after": client.rate(t_regrown, t_end)}
        result["requests"] = len(client.requests)
        # Every request (start, end, tokens), seconds from the first sample: a request that spans
        # a phase (a stall) shows here even when no request fits inside the phase's window.
        t0 = timeline[0][0]
        result["request_log"] = [(round(a - t0, 3), round(b - t0, 3), n) for a, b, n in client.requests]
        result["longest_request_seconds"] = {
            phase: max((round(b - a, 3) for a, b, _ in client.requests if a < hi and b > lo), default=None)
            for phase, lo, hi in (("before", t_before, t_alloc0), ("during", t_alloc0, t_during_end),
                                  ("after", t_regrown, t_end))}
        result["note"] = ("tokens/s = completion tokens / wall time of the requests that ran entirely "
                          "inside a phase (before: until the allocation; during: from the release to the "
                          "foreign memory being freed; after: from the regrowth on); "
                          "reaction = foreign cudaMalloc returned -> NVML free >= headroom (GPU) or "
                          "simulated allocation -> engine reports the smaller cache (--simulate)")
        result["timeline"] = [(round(t - t0, 3), c, u) for t, c, u in timeline[::2]]
        result["events"] = {k: round(v - t0, 3) for k, v in dict(
            before=t_before, alloc=t_alloc, release=t_release, freed=t_freed, regrown=t_regrown, end=t_end).items()}
    except Exception as exc:  # keep what was measured (hardware, calibration) and say what broke
        result["error"] = f"{type(exc).__name__}: {exc}"
        logs = sorted((work / "state" / "logs").glob("*.log"))
        result["engine_log_tail"] = logs[0].read_text(errors="replace")[-1500:] if logs else ""
    finally:
        stop.set()
        agent.send_signal(signal.SIGTERM)
        agent.wait(60)
        result["agent_log_tail"] = (work / "agent.log").read_text(errors="replace")[-6000:]
        out.write_text(json.dumps(result, indent=1, default=str))
    print_table(result)
    plot(result, out.with_suffix(".png"))
    if "error" in result:
        print(f"FAILED: {result['error']}", file=sys.stderr)
        return 1
    return 0


def _mean_reaction(mport: int) -> float | None:
    s, n = agent_metric(mport, "freetoken_agent_pressure_reaction_seconds_sum"), \
        agent_metric(mport, "freetoken_agent_pressure_reaction_seconds_count")
    return round(s / n, 4) if s is not None and n else None


def print_table(r: dict) -> None:
    hw, p, tps, cal = r["hardware"], r.get("pressure", {}), r.get("tokens_per_second", {}), r["calibration"]
    print(f"\n{hw.get('gpu')} / {hw.get('cpu')} ({hw.get('cpu_cores')} cores), mode {r['mode']}")
    cal = cal if isinstance(cal, dict) else {}
    print(f"calibration: pcie {cal.get('pcie_gbps')} GB/s, cpu expert {cal.get('cpu_expert_gbps')} GB/s, "
          f"concurrent {cal.get('concurrent')}, q* {cal.get('fill_fraction')} ({r.get('calibration_seconds')} s)")
    longest = r.get("longest_request_seconds", {})
    print(f"{'phase':<10}{'tokens/s':>10}{'longest request (s)':>22}")
    for k in ("before", "during", "after"):
        v, w = tps.get(k), longest.get(k)
        print(f"{k:<10}{'n/a' if v is None else f'{v:.1f}':>10}{'n/a' if w is None else f'{w:.2f}':>22}")
    print(f"cache {p.get('cache_full_bytes')} -> {p.get('cache_shrunk_bytes')} B; reaction "
          f"{p.get('reaction_seconds')} s (agent side {p.get('agent_reaction_seconds_mean')} s); "
          f"regrown {p.get('regrow_seconds_after_free')} s after the foreign memory was freed")


def plot(r: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    tl = r.get("timeline") or []
    if not tl:
        return
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot([t for t, _, _ in tl], [c / 2**20 for _, c, _ in tl], label="expert cache (MiB)")
    ax2 = ax.twinx()
    ax2.plot([t for t, _, _ in tl], [u / 2**30 for _, _, u in tl], color="tab:red", label="device used (GiB)")
    for name, t in r.get("events", {}).items():
        ax.axvline(t, color="grey", lw=0.6, ls="--")
        ax.text(t, ax.get_ylim()[1], name, fontsize=7, rotation=90, va="top")
    tps = r.get("tokens_per_second", {})
    ax.set_title(f"{r['hardware'].get('gpu')}: tokens/s before {tps.get('before') or 0:.0f}, "
                 f"during {tps.get('during') or 0:.0f}, after {tps.get('after') or 0:.0f}; "
                 f"reaction {r.get('pressure', {}).get('reaction_seconds')} s", fontsize=9)
    ax.set_xlabel("seconds")
    ax.set_ylabel("expert cache (MiB)")
    ax2.set_ylabel("device used (GiB)")
    fig.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
