"""Fused CPU decode layers (executor/cpu_decode.py, kernels/cpu/layer.cpp): a decode step of a
plain attention + MoE (or dense MLP) layer in two compiled calls. Nothing a user reads changes:
every family's decode logits equal the unfused path's bit for bit, alone and batched, through
the sliding-window store, and the expert cache counts the same hits."""
from __future__ import annotations

import pytest
import torch

from freetoken_engine import LLM, SamplingParams
from freetoken_engine.cache import kv as kvmod
from freetoken_engine.executor import cpu_decode
from freetoken_engine.llm import Lockstep
from test_kv_window import SMALL
from test_mxfp4_experts import _as_mxfp4
from test_parity import PROMPT, reference_greedy
from tiny_configs import SUPPORTED
from tiny_models import load_reference

#: families whose every layer the fused path takes (q/k norms per head or none; shared experts;
#: dense first layers; biased routers; sliding windows; gpt-oss's sinks, biases and clamped gate),
#: the MoE half alone where the modules run the attention (whole-projection q/k norms, norms
#: after the rotary, gated attention, recurrent layers: the hybrids, Qwen3.6's family among them)
ALL_FUSED = {"qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "ernie4_5_moe", "dots1", "granitemoeshared",
             "granitemoe_swa", "llama", "qwen3", "exaone_moe", "flint", "gpt_oss", "olmoe", "minimax_m2",
             "hunyuan_v1_moe", "qwen3_next", "qwen3_5_moe_text", "granitemoehybrid", "phimoe"}
GREEDY = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture
def fused_runs(monkeypatch):
    """Counts the layer steps the fused path ran."""
    calls = []
    run = cpu_decode.FusedPass.run

    def counted(self, *args):
        out = run(self, *args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(cpu_decode.FusedPass, "run", counted)
    return calls


def pair(folder, dtype: str = "float32", **options) -> tuple[LLM, LLM]:
    return LLM(folder, dtype=dtype, **options), LLM(folder, dtype=dtype, fused_cpu_decode=False, **options)


@pytest.mark.parametrize("model_type", SUPPORTED)
def test_every_family_decodes_the_same_logits_fused_or_not(tiny_checkpoint, model_type, fused_runs):
    fused, plain = pair(tiny_checkpoint(model_type))
    assert torch.equal(fused.forward_logits(PROMPT), plain.forward_logits(PROMPT))
    layers = len(fused.runner.model.model.layers)
    if model_type in ALL_FUSED:                 # every layer of the 12 one-token passes ran fused
        assert fused_runs.count(True) == layers * len(PROMPT)
    assert plain.runner.model.cpu_decode is None


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe", "glm4_moe", "gpt_oss", "qwen3_5_moe_text", "llama"])
def test_bfloat16_decodes_the_same_logits_and_tokens_fused_or_not(tiny_checkpoint, model_type, fused_runs):
    """bfloat16 rounds every step where torch rounds it: the residual adds, the combine's
    products, its sum, the shared expert's add."""
    fused, plain = pair(tiny_checkpoint(model_type), "bfloat16")
    assert torch.equal(fused.forward_logits(PROMPT), plain.forward_logits(PROMPT))
    got = fused.generate(PROMPT, GREEDY)
    want = plain.generate(PROMPT, GREEDY)
    assert got.token_ids == want.token_ids and all(fused_runs)
    assert got.stats["hits"] == want.stats["hits"] and (got.stats["hits"] > 0) == (model_type != "llama")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "glm4_moe", "qwen3_5_moe_text"])
def test_a_batch_of_sequences_decodes_the_same_fused_or_not(tiny_checkpoint, model_type, dtype, fused_runs):
    """Three sequences of different lengths in one pass (each its own rotary, slots and keys),
    eight steps: the same logits every step, and the same expert hits."""
    prompts = [PROMPT, PROMPT[:5], PROMPT[3:] * 2]
    fused, plain = pair(tiny_checkpoint(model_type), dtype)
    a, b = Lockstep(fused, prompts), Lockstep(plain, prompts)
    for _ in range(8):
        assert torch.equal(a.step(), b.step())
    assert a.tokens == b.tokens and fused_runs and all(fused_runs)
    assert fused.runner.cache.stats.hits == plain.runner.cache.stats.hits


@pytest.mark.parametrize("model_type,overrides", [("mixtral", {"sliding_window": 4}), ("granitemoe_swa", {})])
def test_windowed_layers_read_the_window_store_fused(tiny_checkpoint, monkeypatch, model_type, overrides, fused_runs):
    """Windowed layers read their keys through the store's map (a step of its own per pass),
    through a store that sweeps: transformers' tokens, the unfused path's logits."""
    monkeypatch.setattr(kvmod, "BESIDE_TOKENS", 0)      # test_kv_window's smallest store
    monkeypatch.setattr(kvmod, "CACHED_WINDOWS", 1)
    folder = tiny_checkpoint(model_type, **overrides)
    fused, plain = pair(folder, **SMALL)
    assert fused.runner.kv.window_blocks > 0
    assert torch.equal(fused.forward_logits(PROMPT), plain.forward_logits(PROMPT))
    got = fused.generate(PROMPT, SamplingParams(max_new_tokens=60, temperature=0, ignore_eos=True)).token_ids
    assert got == reference_greedy(load_reference(folder), PROMPT, 60)
    assert fused_runs and all(fused_runs)


def test_passes_the_fused_layers_do_not_take_run_the_modules(tiny_checkpoint, fused_runs):
    """A cache smaller than the experts (the expert cache decides each step), more than 8 rows
    in one pass, and prompts run the layers' modules; the tokens stay transformers'."""
    folder = tiny_checkpoint("qwen3_moe")
    want = reference_greedy(load_reference(folder), PROMPT, 12)
    got = LLM(folder, expert_cache_experts=3).generate(PROMPT, SamplingParams(max_new_tokens=12, temperature=0,
                                                                              ignore_eos=True))
    assert got.token_ids == want and got.stats["misses"] > 0 and not fused_runs
    llm = LLM(folder)
    steps = Lockstep(llm, [PROMPT[i:] for i in range(9)])
    steps.step()
    assert not fused_runs                               # 9 rows
    llm.prefill_logits(PROMPT)
    assert not fused_runs
    Lockstep(llm, [PROMPT]).step()
    assert fused_runs and all(fused_runs)


def test_gpt_oss_with_its_experts_in_four_bits_decodes_the_same_fused(tiny_checkpoint, tmp_path, fused_runs):
    """gpt-oss as published (MXFP4 experts kept in four bits in the bank): the fused layers call
    the gated kernel on the 4-bit rows, with the gate/up biases and the output biases' share."""
    mx, _ = _as_mxfp4(tiny_checkpoint("gpt_oss", hidden_size=64, intermediate_size=64, head_dim=16), tmp_path)
    fused, plain = pair(mx)
    assert fused.runner.bank.mxfp4
    assert torch.equal(fused.forward_logits(PROMPT), plain.forward_logits(PROMPT))
    assert fused_runs.count(True) == len(fused.runner.model.model.layers) * len(PROMPT)


def test_the_cli_turns_the_fused_layers_off(tiny_checkpoint, capsys, fused_runs):
    """``--no-fused-cpu-decode``: every layer's modules run; the same tokens as by default."""
    import json

    from freetoken_engine.cli import main
    folder = tiny_checkpoint("qwen3_moe")
    args = ["generate", "--model", str(folder), "--prompt-ids", "5,17,99,200", "--max-new-tokens", "8",
            "--temperature", "0", "--json"]
    runs = []
    for extra in ([], ["--no-fused-cpu-decode"]):
        assert main(args + extra) == 0
        runs.append((json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"], len(fused_runs)))
    (fused_tokens, after_fused), (plain_tokens, after_plain) = runs
    assert fused_tokens == plain_tokens and after_fused > 0 and after_plain == after_fused
