"""The engine bench's replayed routing (bench/routing_replay.py): the whole engine routes a decode
step exactly as the generated trace says, and everything else through its real routers."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
routing_replay = pytest.importorskip("routing_replay")

from freetoken_engine import LLM  # noqa: E402
from freetoken_engine.layers.moe import SparseMoE  # noqa: E402
from freetoken_engine.llm import Lockstep  # noqa: E402

PROMPTS = [[5, 17, 42, 99, 7, 3], [11, 12, 13, 14, 15, 16, 17]]


def _routed(monkeypatch) -> list[tuple[int, torch.Tensor]]:
    """Record every router call: (MoE layer, ids [T, k])."""
    calls = []
    real = SparseMoE.route

    def route(self, x):
        weights, ids = real(self, x)
        calls.append((self.moe_layer, ids.clone()))
        return weights, ids
    monkeypatch.setattr(SparseMoE, "route", route)
    return calls


@pytest.mark.parametrize("kind", ["locality", "uniform"])
def test_decode_steps_route_the_trace_and_prefill_the_real_router(tiny_checkpoint, monkeypatch, kind):
    folder = tiny_checkpoint("qwen3_moe")
    plain = Lockstep(LLM(folder, expert_cache_experts=6, cpu_expert_fraction=0.5), PROMPTS)
    llm = LLM(folder, expert_cache_experts=6, cpu_expert_fraction=0.5)
    info = routing_replay.install(llm.runner.model, kind, batches=[len(PROMPTS)], steps=16)
    assert info["kind"] == kind
    calls = _routed(monkeypatch)
    batch = Lockstep(llm, PROMPTS)
    # the prompts' prefill (6 and 7 rows) went through the real routers: the same first tokens
    assert batch.tokens == plain.tokens
    prefill = len(calls)
    steps = 20                                  # past the trace's 16 steps: it wraps around
    for _ in range(steps):
        batch.step()
    trace = routing_replay.traced_ids(llm.runner.model, len(PROMPTS))            # [16, L, 2, k]
    layers = len(llm.runner.model.moe_blocks())
    decode = calls[prefill:]
    assert len(decode) == steps * layers
    for i, (layer, ids) in enumerate(decode):
        step = (i // layers) % trace.shape[0]
        assert layer == i % layers
        assert ids.sort(-1).values.tolist() == trace[step, layer].sort(-1).values.tolist()
    # the trace is not the checkpoint's own routing: the expert cache sees other experts
    own = Lockstep(LLM(folder, expert_cache_experts=6, cpu_expert_fraction=0.5), PROMPTS)
    real = _routed(monkeypatch)
    own.step()
    assert any(ids.sort(-1).values.tolist() != trace[0, layer].sort(-1).values.tolist() for layer, ids in real)


@pytest.mark.parametrize("model_type,overrides", [("glm4_moe", {"n_group": 1, "topk_group": 1}),
                                                   ("ernie4_5_moe", {})])
def test_biased_routers_replay_the_trace(tiny_checkpoint, monkeypatch, model_type, overrides):
    """GLM's and ERNIE's routers (a correction bias, sigmoid or softmax scores) replay a trace too,
    with the bias at zero as the benches write it (bench/fast_load.py); the engine_gpu_decode
    shapes ernie4.5-21b and glm4.5-air time them so."""
    llm = LLM(tiny_checkpoint(model_type, **overrides), expert_cache_experts=6, cpu_expert_fraction=0.5)
    for block in llm.runner.model.moe_blocks():
        block.gate.e_score_correction_bias.zero_()
    routing_replay.install(llm.runner.model, "locality", batches=[len(PROMPTS)], steps=8)
    calls = _routed(monkeypatch)
    batch = Lockstep(llm, PROMPTS)
    prefill = len(calls)
    for _ in range(4):
        batch.step()
    trace = routing_replay.traced_ids(llm.runner.model, len(PROMPTS))
    layers = len(llm.runner.model.moe_blocks())
    decode = calls[prefill:]
    assert len(decode) == 4 * layers
    for i, (layer, ids) in enumerate(decode):
        assert ids.sort(-1).values.tolist() == trace[i // layers, layer].sort(-1).values.tolist()


def test_installing_twice_is_refused(tiny_checkpoint):
    llm = LLM(tiny_checkpoint("qwen3_moe"))
    routing_replay.install(llm.runner.model, "uniform", batches=[1], steps=4)
    with pytest.raises(ValueError, match="already replay"):
        routing_replay.install(llm.runner.model, "uniform", batches=[1], steps=4)


@pytest.mark.parametrize("accuracy", [1.0, 0.5])
def test_guesses_of_the_next_layer_are_the_trace_at_the_set_accuracy(tiny_checkpoint, monkeypatch, accuracy):
    """``install_guesses``: with the engine's prefetch on, each decode step's guess of layer l + 1
    holds the trace's experts of that step and layer with the set accuracy (1.0: exactly them),
    every wrong one an expert the token does not route to, a row's guesses distinct."""
    from freetoken_engine.cache.offload import OffloadedExperts
    monkeypatch.setenv("FREETOKEN_EXPERT_PREFETCH", "all")
    llm = LLM(tiny_checkpoint("qwen3_moe"), expert_backend="triton", expert_cache_experts=6, cpu_expert_fraction=0.5)
    routing_replay.install(llm.runner.model, "uniform", batches=[len(PROMPTS)], steps=64)
    routing_replay.install_guesses(llm.runner.model, accuracy)
    guesses = []
    real = OffloadedExperts.guess

    def guess(self, layer, ids):
        guesses.append((layer, ids.clone()))
        return real(self, layer, ids)
    monkeypatch.setattr(OffloadedExperts, "guess", guess)
    batch = Lockstep(llm, PROMPTS)
    before = len(guesses)                       # the prompts' prefill: the real routers' guesses
    steps = 16
    for _ in range(steps):
        batch.step()
    trace = routing_replay.traced_ids(llm.runner.model, len(PROMPTS))
    layers = len(llm.runner.model.moe_blocks())
    decode = guesses[before:]
    assert len(decode) == steps * (layers - 1) and layers > 1
    right = total = 0
    for i, (layer, ids) in enumerate(decode):
        step = i // (layers - 1)
        assert layer == i % (layers - 1) + 1
        want = trace[step, layer]
        for row, traced in zip(ids.tolist(), want.tolist()):
            assert len(set(row)) == len(row)
            right += len(set(row) & set(traced))
            total += len(row)
    if accuracy == 1.0:
        assert right == total
    else:
        assert 0.35 < right / total < 0.65
    assert llm.runner.experts.control.prefetch_counters()["fills"] > 0
    batch.close()
