"""One restart as a user sees it, in its own process (run by ``fast_restart.first_request``):
import the engine, ``LLM(folder)``, then two requests; prints one JSON line of timings.

    python bench/restart_probe.py FOLDER DEVICE MODE

MODE: "plain" or "preload[:N]" (``freetoken_engine.preload`` first, as the CLI does, with the
device: its CUDA context is made during the imports), followed by any of these A/B switches:
"/serial" (the engine's order before the decode graphs were captured during the bank's read: the
bank read and pinned first, then the graphs), "/nocuda" (preload without the device: torch makes
the CUDA context after its import, the order before), "/allwidths" (decode graphs of every KV
width captured before ready, ``graph_warmup_widths=0``, the engine's default before), "/nokey"
(Triton's cache key computed at the first launch, not beside the build: ``prewarm``), "/span1"
(the bank read one 16 MiB block per ``preadv``, ``early.SPAN = 1``), "/4k" (the bank on 4 KiB pages,
``FREETOKEN_HUGE_PAGES=off``: the mapping before the twenty-fifth stop), "/stacks" (the main
thread's stack sampled every 5 ms, ``stack_sampler.py``; the JSON gains ``stacks``: per phase of
the start, its most frequent frames), "/warm1" (only batch size 1's decode graph captured at the
start, ``graph_warmup=1``; the default captures 1-4), "/nowarm" (torch's first CUDA calls not
made ahead, ``executor/cuda_warm.py``), "/nokeycache" (Triton's cache key computed beside the
build as before the twenty-sixth stop, not read from the engine's cache: ``prewarm``), "/nomap"
(a CPU engine's bank read into anonymous memory, ``FREETOKEN_MAP_BANK=off``: the start before
the twenty-seventh stop; the default maps the bank's files, ``packed/early.py``).
"""
import json, os, sys, time
t0 = time.perf_counter()
mode, *switches = sys.argv[3].split("/")
if "4k" in switches:
    os.environ["FREETOKEN_HUGE_PAGES"] = "off"
if "nomap" in switches:
    os.environ["FREETOKEN_MAP_BANK"] = "off"
serial, nocuda, allwidths = ("serial" in switches), ("nocuda" in switches), ("allwidths" in switches)
if "stacks" in switches:
    import threading
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from stack_sampler import StackSampler
    sampler = StackSampler(threading.get_ident(), t0).start()
import freetoken_engine
spans = [int(w[4:]) for w in switches if w.startswith("span") and w[4:].isdigit()]
if spans:
    from freetoken_engine.packed import early as early_read      # torch-free
    early_read.SPAN = spans[0]
if mode.startswith("preload"):      # what freetoken generate / serve do for a packed folder
    freetoken_engine.preload(sys.argv[1], *[int(n) for n in mode.split(":")[1:]],
                             device=None if nocuda else sys.argv[2])
from freetoken_engine.executor import cuda_warm                  # torch-free
if "nowarm" in switches:
    cuda_warm.start = lambda device: None
from freetoken_engine import LLM, SamplingParams
t_import = time.perf_counter()
if "nokeycache" in switches:
    import functools, tempfile
    from freetoken_engine.kernels.triton import prewarm
    prewarm.start = functools.partial(prewarm.start, cache=__import__("pathlib").Path(tempfile.mkdtemp()), backend=False)
if "nokey" in switches:
    from freetoken_engine.kernels.triton import prewarm
    prewarm.start = lambda: (None, {})
import freetoken_engine.packed.reader as reader
from freetoken_engine.packed import early
from freetoken_engine.executor import runner
load, loaded, marks = reader.load_packed, [], {}
def timed_load(*args, **kwargs):
    loaded.append(load(*args, **kwargs))     # its stats are complete once the bank is in
    return loaded[-1]
reader.load_packed = timed_load
fill_wait = early.Fill.wait
def timed_wait(self):
    secs = fill_wait(self)
    marks["read_started"], marks["read_finished"] = self.started - t0, self.finished - t0
    return secs
early.Fill.wait = timed_wait
warm = runner.ModelRunner.warm_graphs
def timed_warm(self, *args, **kwargs):
    marks["graphs_started"] = time.perf_counter() - t0
    n = warm(self, *args, **kwargs)
    marks["graphs_finished"] = time.perf_counter() - t0
    return n
runner.ModelRunner.warm_graphs = timed_warm
start_model = runner.start_model
def timed_start_model(*args, **kwargs):
    marks["start_model_called"] = time.perf_counter() - t0
    out = start_model(*args, **kwargs)
    marks["start_model_returned"] = time.perf_counter() - t0
    return out
runner.start_model = timed_start_model
if serial:                          # the order before: the bank read and pinned, then the graphs
    start = runner.start_model
    def start_then_finish(*args, **kwargs):
        model, bank, cfg, rest = start(*args, **kwargs)
        rest.finish()
        return model, bank, cfg, runner.BankRead()
    runner.start_model = start_then_finish
llm = LLM(sys.argv[1], device=sys.argv[2], dtype="bfloat16", graph_warmup_widths=0 if allwidths else 1,
          **({"graph_warmup": 1} if "warm1" in switches else {}))
t1 = time.perf_counter()
stacks = None
if "stacks" in switches:
    sampler.stop()
    m = marks
    stacks = sampler.summary({"imports": (0, t_import - t0),
                              "to_start_model": (t_import - t0, m["start_model_called"]),
                              "start_model": (m["start_model_called"], m["start_model_returned"]),
                              "to_graphs": (m["start_model_returned"], m.get("graphs_started", t1 - t0)),
                              "graphs": (m.get("graphs_started", t1 - t0), m.get("graphs_finished", t1 - t0)),
                              "to_ready": (m.get("graphs_finished", t1 - t0), t1 - t0)})
graphs_at_ready = llm.runner.graph_stats()["decode_graphs"]
from freetoken_engine.packed import early_cuda
load_stats = loaded[-1].stats
params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
first = llm.generate(list(range(3, 35)), params)
t2 = time.perf_counter()
second = llm.generate(list(range(40, 72)), params)
t3 = time.perf_counter()
print(json.dumps({"ready_seconds": t1 - t0, "import_seconds": t_import - t0, "first_request_seconds": t2 - t1, "second_request_seconds": t3 - t2,
                  "load": {k: load_stats.get(k) for k in ("seconds", "read_seconds", "waited_seconds", "preloaded", "threads", "pin_seconds", "pin_after_read_seconds", "mapped_bytes", "direct_bytes")},
                  "timeline": {k: round(v, 3) for k, v in marks.items()},
                  "graph_warmup_seconds": llm.runner.graph_stats()["decode_graph_warmup_seconds"],
                  "graphs_at_ready": graphs_at_ready, "early_cuda": early_cuda.status(),
                  "cuda_warm": cuda_warm.status(),
                  "first_request_stats": {k: first.stats.get(k) for k in ("hits", "misses", "fills", "cpu_computed")},
                  "first_tokens": first.token_ids,
                  "tokens": len(first.token_ids), "stacks": stacks}))
