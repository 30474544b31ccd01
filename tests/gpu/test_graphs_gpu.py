"""The engine's decode as captured CUDA graphs (``executor/graphs.py``) on a real GPU.

Graphs against the eager engine, same checkpoint, float32: greedy tokens identical and logits
within 1e-4 (the graph masks the padded keys of its context bucket, so only the attention's
summation length differs), for every way a step can be captured: every expert resident, a small
cache filling every miss ("device" mode), and misses computed on the CPU through the sync-free
branch ("branch" mode); across batch sizes, a context bucket boundary, and a resize.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from freetoken_engine import LLM  # noqa: E402

from graph_cases import PROMPTS, lockstep  # noqa: E402


@pytest.mark.parametrize("options,mode", [
    ({}, "device"),                                                      # every expert resident
    ({"expert_cache_experts": 6, "cpu_expert_fraction": 0.0}, "device"),  # fills only
    ({"expert_cache_experts": 3, "cpu_expert_fraction": 0.5}, "branch"),  # CPU pairs in the graph
])
def test_graph_decode_equals_eager_decode(tiny_checkpoint, options, mode):
    folder = tiny_checkpoint("qwen3_moe")
    for batch in (PROMPTS, PROMPTS[:1]):
        eager = LLM(folder, device="cuda", dtype="float32", cuda_graphs=False, **options)
        want, want_logits = lockstep(eager, batch, 16)
        llm = LLM(folder, device="cuda", dtype="float32", **options)
        got, logits = lockstep(llm, batch, 16)
        graphs = llm.runner.graphs
        assert graphs.enabled and graphs.replays >= 12, graphs.replays
        # the batch this test runs (the warm-up's larger batches may need the CPU branch)
        assert {g.mode for (b, _), g in graphs._graphs.items() if b == len(batch)} == {mode}
        assert got == want
        assert (logits - want_logits).abs().max() < 1e-4
        s = llm.runner.expert_stats()
        assert s["fills"] + s["cpu_computed"] == s["misses"]       # the device counters kept counting
        if mode == "branch":
            assert s["cpu_computed"] > 0


@pytest.mark.parametrize("options,mode", [
    ({}, "device"),                                                      # every expert resident
    ({"expert_cache_experts": 3, "cpu_expert_fraction": 0.5}, "branch"),  # CPU pairs in the graph
])
def test_a_large_decode_batch_replays_a_graph_through_the_cache(tiny_checkpoint, options, mode):
    """40 requests decoding together (80 expert pairs a layer: the MoE kernel's block-table
    path) go through the expert cache and a captured graph, not the prefill's whole-layer path:
    the eager engine's tokens, logits within 1e-4."""
    folder = tiny_checkpoint("qwen3_moe")
    prompts = [[(7 * i + 3 * t) % 300 + 3 for t in range(1 + i % 5)] for i in range(40)]
    eager = LLM(folder, device="cuda", dtype="float32", cuda_graphs=False, max_batch=40, **options)
    want, want_logits = lockstep(eager, prompts, 8)
    llm = LLM(folder, device="cuda", dtype="float32", max_batch=40, **options)
    assert llm.runner.experts.prefill_threshold == 41
    got, logits = lockstep(llm, prompts, 8)
    graphs = llm.runner.graphs
    assert graphs.replays >= 6 and {g.mode for (b, _), g in graphs._graphs.items() if b == 40} == {mode}
    assert got == want
    assert (logits - want_logits).abs().max() < 1e-4


def test_split_by_stage_keeps_the_tokens(tiny_checkpoint, monkeypatch):
    """FREETOKEN_STREAM_SPLIT=stage: CPU experts' down projections run on the GPU from the host's
    activations inside the graphs; float32 greedy tokens equal the plain branch's, logits within
    1e-4 (fp32 sums in another order), and the split was used."""
    folder = tiny_checkpoint("qwen3_moe")
    options = {"expert_cache_experts": 3, "cpu_expert_fraction": 0.5}
    want, want_logits = lockstep(LLM(folder, device="cuda", dtype="float32", **options), PROMPTS, 16)
    monkeypatch.setenv("FREETOKEN_STREAM_SPLIT", "stage")
    llm = LLM(folder, device="cuda", dtype="float32", **options)
    got, logits = lockstep(llm, PROMPTS, 16)
    assert got == want and (logits - want_logits).abs().max() < 1e-4
    assert llm.runner.experts.host_branch.br.totals["stage_pairs"] > 0


def test_graphs_are_dropped_and_recaptured_after_a_resize(tiny_checkpoint):
    folder = tiny_checkpoint("qwen3_moe")
    opts = {"expert_cache_experts": 6, "cpu_expert_fraction": 0.5}
    want, _ = lockstep(LLM(folder, device="cuda", dtype="float32", cuda_graphs=False, **opts), PROMPTS, 16,
                       resize_at=8)
    llm = LLM(folder, device="cuda", dtype="float32", **opts)
    got, _ = lockstep(llm, PROMPTS, 16, resize_at=8)
    assert got == want and llm.runner.cache.capacity == 3
    assert llm.runner.graphs.replays >= 10
    llm.runner.experts.sync_stats()                  # the device clock and counters into the cache
    llm.runner.cache.check_integrity(deep=True)


def test_graphs_captured_before_the_first_request_serve_all_of_it(tiny_checkpoint):
    """--graph-warmup 2 --graph-warmup-widths 0: batch sizes 1 and 2 at every width are captured
    when the engine starts,
    the warm-up's dummy steps count in no cache statistic, and a request's decode then replays
    from its first step to its last (no capture mid-request, across the 256 -> 512 width), with
    the eager engine's tokens."""
    folder = tiny_checkpoint("qwen3_moe")
    opts = {"expert_cache_experts": 3, "cpu_expert_fraction": 0.5}
    want, want_logits = lockstep(LLM(folder, device="cuda", dtype="float32", cuda_graphs=False, **opts),
                                 PROMPTS[:2], 16)
    llm = LLM(folder, device="cuda", dtype="float32", graph_warmup=2, graph_warmup_widths=0, **opts)
    graphs = llm.runner.graphs
    keys = {(b, w) for w in graphs.widths() for b in (1, 2)}
    assert graphs.widths() == [256, 512] and set(graphs._graphs) == keys
    assert {g.mode for g in graphs._graphs.values()} == {"branch"}
    s = llm.runner.expert_stats()
    assert s["hits"] == s["misses"] == s["fills"] == s["cpu_computed"] == 0, s
    assert llm.runner.graph_stats()["decode_graph_warmup_seconds"] > 0
    assert llm.runner.kv.used_blocks == 0                       # the scratch block went back
    got, logits = lockstep(llm, PROMPTS[:2], 16)
    assert set(graphs._graphs) == keys and graphs.replays == 16
    assert got == want
    assert (logits - want_logits).abs().max() < 1e-4
    s = llm.runner.expert_stats()
    assert s["misses"] > 0 and s["fills"] + s["cpu_computed"] == s["misses"]


def test_the_narrowest_width_is_captured_at_start_and_a_server_captures_the_rest_while_idle(tiny_checkpoint):
    """The default (--graph-warmup-widths 1): the engine is ready with batch sizes 1..N at the
    narrowest KV width only. An ``LLM`` captures a wider width on first use; a server captures
    every one while idle, counting nothing in the cache's statistics, so that a request across
    the 256 -> 512 width then replays every decode step, with the eager engine's tokens."""
    import asyncio
    import time

    from freetoken_engine import SamplingParams
    from freetoken_engine.config import EngineConfig
    from freetoken_engine.scheduler.service import EngineService

    folder = tiny_checkpoint("qwen3_moe")
    opts = {"expert_cache_experts": 3, "cpu_expert_fraction": 0.5}
    eager = LLM(folder, device="cuda", dtype="float32", cuda_graphs=False, **opts)
    want, _ = lockstep(eager, PROMPTS[:2], 16)
    want_one, _ = lockstep(eager, PROMPTS[:1], 16)
    llm = LLM(folder, device="cuda", dtype="float32", graph_warmup=2, **opts)
    assert set(llm.runner.graphs._graphs) == {(1, 256), (2, 256)} and llm.runner.idle_warm_pending()
    got, _ = lockstep(llm, PROMPTS[:2], 16)
    assert got == want and (2, 512) in llm.runner.graphs._graphs        # captured on first use

    svc = EngineService.start(EngineConfig(model=folder, device="cuda", dtype="float32", graph_warmup=2, **opts),
                              wait=True)
    try:
        graphs = svc.runner.graphs
        deadline = time.monotonic() + 60
        while len(graphs) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert set(graphs._graphs) == {(b, w) for w in (256, 512) for b in (1, 2)}
        assert not svc.scheduler.call(svc.runner.idle_warm_pending).result(10)
        s = svc.scheduler.call(svc.runner.expert_stats).result(10)
        assert s["hits"] == s["misses"] == s["fills"] == s["cpu_computed"] == 0, s
        replays = graphs.replays
        params = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)

        async def run():
            return [ev.token_id async for ev in svc.submit(PROMPTS[0], params) if ev.token_id is not None]
        assert asyncio.run(run()) == want_one[0][:16]                     # the prefill's token + 15 steps
        assert len(graphs) == 4 and graphs.replays - replays == 15     # every decode step replayed
    finally:
        svc.shutdown()


def test_bfloat16_graph_decode_agrees_with_eager(tiny_checkpoint):
    folder = tiny_checkpoint("qwen3_moe")
    opts = {"dtype": "bfloat16", "expert_cache_experts": 3, "cpu_expert_fraction": 0.5}
    want, want_logits = lockstep(LLM(folder, device="cuda", cuda_graphs=False, **opts), PROMPTS, 8)
    got, logits = lockstep(LLM(folder, device="cuda", **opts), PROMPTS, 8)
    assert (logits - want_logits).abs().max() < 0.05 * max(1.0, want_logits.abs().max().item())
    agree = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w)) / sum(map(len, want))
    assert agree >= 0.9


def test_the_metrics_show_decode_running_from_graphs(tiny_checkpoint):
    """What the node dashboard's "Decode steps from CUDA graphs" panel reads: above 0 on a GPU."""
    import asyncio

    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from freetoken_engine import SamplingParams
    from freetoken_engine.config import EngineConfig
    from freetoken_engine.metrics import EngineMetrics
    from freetoken_engine.scheduler.service import EngineService

    svc = EngineService.start(EngineConfig(model=tiny_checkpoint("qwen3_moe"), device="cuda", dtype="float32",
                                           expert_cache_experts=3, cpu_expert_fraction=0.5), wait=True)
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)

    async def run(ids):
        return [ev.token_id async for ev in svc.submit(ids, params) if ev.token_id is not None]

    async def both():
        return await asyncio.gather(run(PROMPTS[1]), run(PROMPTS[2]))

    try:
        got = asyncio.run(both())
        assert [len(t) for t in got] == [12, 12]
        text = generate_latest(EngineMetrics(svc, "tiny").registry).decode()
    finally:
        svc.shutdown()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert fams["freetoken_decode_graphs"].samples[0].value >= 1
    assert fams["freetoken_decode_graph_replays"].samples[0].value >= 8


def test_split_tuning_moves_q_without_changing_tokens(tiny_checkpoint):
    """The split tuner (--split-tuning) changes q* mid-decode, recapturing the graphs each time;
    greedy tokens stay those of a fixed split and logits within float32 noise."""
    folder = tiny_checkpoint("qwen3_moe")
    fixed = LLM(folder, device="cuda", dtype="float32", expert_cache_experts=3)
    want, want_logits = lockstep(fixed, PROMPTS[1:], 150)
    llm = LLM(folder, device="cuda", dtype="float32", expert_cache_experts=3, split_tuning=True)
    got, logits = lockstep(llm, PROMPTS[1:], 150)
    tuner = llm.runner.tuner
    assert tuner is not None and tuner.probes >= 3, tuner.stats()
    assert got == want
    assert (logits - want_logits).abs().max() < 1e-3
    assert llm.runner.expert_stats()["split_tuner"]["probes"] == tuner.probes


@pytest.mark.parametrize("options", [{"cpu_expert_fraction": 0.0}, {"expert_cache_experts": 3, "cpu_expert_fraction": 0.5}],
                         ids=["every-expert-fits", "cpu-branch"])
def test_graphs_captured_while_the_bank_is_read_decode_the_same_tokens(tiny_packed, monkeypatch, options):
    """A packed restart captures its decode graphs while the bank is still being read (every
    expert resident for the warm-up, nothing read from the bank) and pins each piece as it lands;
    it then serves exactly what an engine that loaded everything first serves, from a cold cache.
    The bank's reads wait at a gate that only the end of the warm-up opens."""
    import threading

    from freetoken_engine.executor.runner import ModelRunner
    from freetoken_engine.packed import early
    src, out = tiny_packed
    eager = LLM(src, device="cuda", dtype="float32", cuda_graphs=False, **options)
    want, want_logits = lockstep(eager, PROMPTS, 12)
    gate, seen = threading.Event(), {}
    read, warm = early.Fill._read, ModelRunner.warm_graphs

    def gated(self, name, *rest):
        if name.startswith("bank-"):
            seen.setdefault("released", gate.wait(60))
        read(self, name, *rest)

    def warm_then_release(self, batches, bank_pending=False, **kw):
        seen["pending"] = bank_pending
        seen["captured"] = n = warm(self, batches, bank_pending, **kw)
        gate.set()
        return n
    monkeypatch.setattr(early.Fill, "_read", gated)
    monkeypatch.setattr(ModelRunner, "warm_graphs", warm_then_release)
    llm = LLM(out, device="cuda", dtype="float32", **options)
    assert seen["pending"] and seen["captured"] > 0 and seen["released"]
    bank = llm.runner.bank
    assert bank.pinned and all(bank.w13[i].is_pinned() and bank.w2[i].is_pinned() for i in range(bank.num_layers))
    got, logits = lockstep(llm, PROMPTS, 12)
    assert got == want
    assert (logits - want_logits).abs().max() < 1e-4
    s = llm.runner.expert_stats()
    # it started cold: the 250-token prompt's prefill filled the empty pool, and decode missed
    # what that left out (with every expert fitting, nothing)
    assert llm.runner.experts.filled_free > 0 and s["fills"] + s["cpu_computed"] == s["misses"]
    assert llm.runner.graphs.replays >= 8


@pytest.mark.parametrize("model", ["qwen3_moe", "qwen2_moe", "glm4_moe", "minimax_m2", "granitemoeshared"])
@pytest.mark.parametrize("options", [{"expert_cache_experts": 6, "cpu_expert_fraction": 0.0},   # fills only
                                     {"expert_cache_experts": 6, "cpu_expert_fraction": 0.5}])  # + CPU pairs
def test_hits_beside_the_fills_keep_every_bit(tiny_checkpoint, model, options, monkeypatch):
    """``DeviceControl.overlap_hits``: a layer's hits (and qwen2_moe's shared expert) run on a side
    stream while its fills are copied, inside the decode graphs; the float32 tokens and logits are
    those of every pair in one call after the copies, bit for bit."""
    from freetoken_engine.cache.device_control import DeviceControl
    folder = tiny_checkpoint(model)
    runs = []
    for overlap in (False, True):
        monkeypatch.setattr(DeviceControl, "overlap_hits", overlap)
        llm = LLM(folder, device="cuda", dtype="float32", **options)
        runs.append(lockstep(llm, PROMPTS, 16) + (llm.runner.expert_stats(), llm.runner.graphs.replays))
    (want, want_logits, _, _), (got, logits, stats, replays) = runs
    assert got == want and torch.equal(logits, want_logits)
    assert replays >= 12 and stats["fills"] > 0
    if options["cpu_expert_fraction"] > 0:
        assert stats["cpu_computed"] > 0


def test_more_decode_graphs_take_no_more_memory(tiny_checkpoint):
    """A server keeps a decode graph per batch size and KV width it meets, up to max_batch times
    every width. The graphs write one shared logits buffer, so a graph holds no logits of its own
    (with a 151,936-token vocabulary those were 0.6 MB a sequence, about 2.6 GB for every key at
    max_batch 32). Batch sizes 1..16 captured at a second width, vocabulary 131,072: the memory
    allocated and reserved grows by far less than those 16 graphs' own logits would hold, and a
    replayed decode still gives the eager engine's tokens."""
    vocab = 131072
    folder = tiny_checkpoint("qwen3_moe", vocab_size=vocab)
    llm = LLM(folder, device="cuda", dtype="float32", max_batch=16, graph_warmup=0)
    runner = llm.runner
    assert runner.warm_graphs(16, widths=1) == 16
    torch.cuda.synchronize()
    reserved, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    assert runner.warm_graphs(16, widths=2) == 16          # the same batch sizes, next width
    torch.cuda.synchronize()
    own = sum(range(1, 17)) * vocab * 4                     # 16 graphs' own logits: 71 MB
    grew_allocated = torch.cuda.memory_allocated() - allocated
    grew_reserved = torch.cuda.memory_reserved() - reserved
    print(f"16 more graphs: allocated +{grew_allocated / 1e6:.1f} MB, reserved +{grew_reserved / 1e6:.1f} MB, "
          f"their own logits would be {own / 1e6:.1f} MB")
    assert grew_allocated < own / 16 and grew_reserved < own / 4
    eager = LLM(folder, device="cuda", dtype="float32", cuda_graphs=False, max_batch=16)
    want, _ = lockstep(eager, PROMPTS, 8)
    got, _ = lockstep(llm, PROMPTS, 8)
    assert got == want and runner.graphs.replays >= 6


def test_the_memory_the_decode_graphs_take_is_measured_and_reported(tiny_checkpoint, monkeypatch):
    """Each captured graph holds device memory of its own (its executable image: 12-14 MB for a
    48-layer MoE on the H200, bench/graph_memory.py), so an operator needs to see it. Too little
    to measure in this tiny model, so the device's free memory is made to read 5 MB less per live
    graph: eight captures report 40 MB in the engine's stats, and a decode through them still
    gives the eager engine's tokens."""
    from freetoken_engine.executor.graphs import DecodeGraphs
    live = []
    real_end = torch.cuda.CUDAGraph.capture_end
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_end", lambda g: (real_end(g), live.append(g)))
    monkeypatch.setattr(DecodeGraphs, "_free", lambda self: 10**9 - 5_000_000 * len(live))
    folder = tiny_checkpoint("qwen3_moe")
    llm = LLM(folder, device="cuda", dtype="float32", max_batch=8, graph_warmup=0)
    runner = llm.runner
    assert runner.warm_graphs(8, widths=1) == 8
    assert runner.graph_stats()["decode_graph_bytes"] == 40_000_000
    eager = LLM(folder, device="cuda", dtype="float32", cuda_graphs=False, max_batch=8)
    want, want_logits = lockstep(eager, PROMPTS[:2], 12)
    got, logits = lockstep(llm, PROMPTS[:2], 12)
    assert got == want and (logits - want_logits).abs().max() < 1e-4
    assert runner.graph_stats()["decode_graph_bytes"] == 5_000_000 * len(live) == 45_000_000   # (2, 512) too


def test_the_decode_graphs_stay_within_their_memory_limit(tiny_checkpoint, monkeypatch):
    """``--graph-memory-gb``: once the graphs have taken the limit, a new key (batch size, context
    width) takes the place of the graph replayed least recently, and the warm-up stops there. A
    tiny model's graphs are below what ``cudaMemGetInfo`` resolves, so the device's free memory
    is made to read 5 MB less per graph at the most graphs alive at once (the driver keeps a
    destroyed graph's memory for the next graphs: device run 118). Under a 10 MB limit: two
    graphs at most, ever; batch sizes and widths beyond them still replay after their capture,
    and every token equals the eager engine's."""
    import weakref

    from freetoken_engine.executor.graphs import DecodeGraphs
    alive, peak = weakref.WeakSet(), [0]
    real_end = torch.cuda.CUDAGraph.capture_end

    def end(g):
        real_end(g)
        alive.add(g)
        peak[0] = max(peak[0], len(alive))
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_end", end)
    monkeypatch.setattr(DecodeGraphs, "_free", lambda self: 10**9 - 5_000_000 * peak[0])
    monkeypatch.setattr(DecodeGraphs, "KEEP_STEPS", 2)
    events, real_capture = [], DecodeGraphs.capture

    def capture(self, chunks, key, evict=True):
        real_capture(self, chunks, key, evict)
        events.append((self.clock, key, evict, key in self, sorted(self._graphs), self.dropped, self.refused))
    monkeypatch.setattr(DecodeGraphs, "capture", capture)
    folder = tiny_checkpoint("qwen3_moe")
    llm = LLM(folder, device="cuda", dtype="float32", max_batch=8, graph_warmup=0, graph_memory_gb=0.01)
    runner = llm.runner
    assert runner.warm_graphs(4, widths=1) == 2         # the warm-up stops at the limit, drops nothing
    eager = LLM(folder, device="cuda", dtype="float32", cuda_graphs=False, max_batch=8)
    for prompts in (PROMPTS, PROMPTS[:1], PROMPTS[1:]):   # batch 3 across 256 keys, then 1, then 2
        want, want_logits = lockstep(eager, prompts, 12)
        replays = runner.graphs.replays
        got, logits = lockstep(llm, prompts, 12)
        assert got == want and (logits - want_logits).abs().max() < 1e-4
        assert runner.graphs.replays > replays            # the new keys were captured and replayed
    stats = runner.graph_stats()
    assert peak[0] == 2 and stats["decode_graphs"] == 2
    assert stats["decode_graph_drops"] >= 3 and stats["decode_graph_bytes"] == 10_000_000, events
