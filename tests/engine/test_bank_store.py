"""A CPU engine computing in float32 keeps a bfloat16 checkpoint's experts, and the projections of
its attention, dense MLPs and LM head, in bfloat16 (half the host memory and half the bytes a
token reads) and still gives transformers' float32 tokens: the values are the checkpoint's
either way."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from freetoken_engine import LLM, SamplingParams
from freetoken_engine.models import build
from freetoken_engine.models.decoder import DecoderLM
from test_parity import PROMPT, check

GREEDY = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)


def bf16_copy(src: Path, dst: Path, keep_float32: str | None = None) -> Path:
    """``src`` with every float tensor stored in bfloat16, as checkpoints are published; tensors
    whose names contain ``keep_float32`` stay float32 (values bfloat16 cannot hold)."""
    shutil.copytree(src, dst)
    for shard in dst.glob("*.safetensors"):
        tensors = load_file(str(shard))
        save_file({k: v if keep_float32 and keep_float32 in k else v.to(torch.bfloat16)
                   for k, v in tensors.items()}, str(shard), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(dict(cfg, torch_dtype="bfloat16", dtype="bfloat16")))
    return dst


def test_a_bfloat16_checkpoint_keeps_its_experts_in_bfloat16_and_transformers_tokens(tiny_checkpoint, tmp_path):
    folder = bf16_copy(tiny_checkpoint("qwen3_moe"), tmp_path / "bf16")
    tokens = check(folder)                               # logits within 1e-4, greedy tokens equal
    runner = LLM(folder).runner
    bank, model = runner.bank, runner.model
    assert bank.dtype == torch.float32 and bank.w13.dtype == bank.w2.dtype == torch.bfloat16
    assert bank.expert_bytes == 3 * bank.hidden * bank.inter * 2
    attn = model.model.layers[0].self_attn
    assert attn.qkv[0].dtype == attn.o_proj.weight.dtype == model.lm_head.weight.dtype == torch.bfloat16
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.embed(torch.tensor([3, 4])).dtype == torch.float32        # its rows widened as gathered
    assert check(folder, expert_cache_experts=5, cpu_expert_fraction=0.5) == tokens     # through the cache


@pytest.mark.parametrize("model_type", ["qwen2_moe", "deepseek_v3", "qwen3_next", "gpt_oss", "granitemoe", "llama",
                                        "qwen3"])
def test_families_keep_transformers_tokens_from_bfloat16_projections(tiny_checkpoint, tmp_path, model_type):
    """Shared experts (qwen2_moe), latent attention left in float32 beside bfloat16 dense MLPs
    (deepseek_v3), gated attention beside DeltaNet (qwen3_next), attention biases and sinks
    (gpt_oss), an LM head tied to the embedding table and its residual and embedding multipliers
    (granitemoe), dense models (llama, qwen3)."""
    folder = bf16_copy(tiny_checkpoint(model_type), tmp_path / "bf16")
    check(folder, n_new=12, tol=2e-3 if model_type == "qwen3_next" else 1e-4)
    assert torch.bfloat16 in {p.dtype for p in LLM(folder).runner.model.parameters()}


def test_the_bfloat16_bank_gives_the_float32_banks_logits(tiny_checkpoint, tmp_path, monkeypatch):
    folder = bf16_copy(tiny_checkpoint("qwen2_moe"), tmp_path / "bf16")
    llm = LLM(folder)
    assert llm.runner.bank.w13.dtype == torch.bfloat16
    narrow, tokens = llm.forward_logits(PROMPT), llm.generate(PROMPT, GREEDY).token_ids
    monkeypatch.setattr(build, "bank_store", lambda dtype, device, source: dtype)     # the rule before
    monkeypatch.setattr(DecoderLM, "narrowable", lambda self, tied: set())
    wide = LLM(folder)
    assert {p.dtype for p in wide.runner.model.parameters()} == {torch.float32}
    assert wide.runner.bank.w13.dtype == torch.float32
    assert (wide.forward_logits(PROMPT) - narrow).abs().max() < 1e-5
    assert wide.generate(PROMPT, GREEDY).token_ids == tokens


def test_the_reference_experts_take_the_bfloat16_bank(tiny_checkpoint, tmp_path, monkeypatch):
    """Without the compiled kernel the reference converts the pairs' experts as it reads them."""
    folder = bf16_copy(tiny_checkpoint("qwen3_moe"), tmp_path / "bf16")
    monkeypatch.setenv("FREETOKEN_CPU_EXPERT_BACKEND", "reference")
    llm = LLM(folder)
    assert llm.runner.experts.cpu_backend_name == "reference" and llm.runner.bank.w13.dtype == torch.bfloat16
    check(folder)


def test_a_packed_bfloat16_folder_is_read_as_stored(tiny_checkpoint, tmp_path):
    from freetoken_engine.packed import convert
    src = bf16_copy(tiny_checkpoint("qwen3_moe"), tmp_path / "bf16")
    packed = convert(src, tmp_path / "packed", progress=False)
    assert json.loads((packed / "freetoken-packed.json").read_text())["dtype"] == "bfloat16"
    llm = LLM(packed)
    assert llm.runner.bank.w13.dtype == torch.bfloat16 and llm.runner.bank.dtype == torch.float32
    assert llm.generate(PROMPT, GREEDY).token_ids == LLM(src).generate(PROMPT, GREEDY).token_ids
    assert LLM(packed, dtype="bfloat16").runner.bank.w13.dtype == torch.bfloat16


def test_experts_stored_wider_than_the_first_ones_widen_the_bank(tiny_checkpoint, tmp_path):
    """The first layer's experts in bfloat16 choose the bank's dtype; the second layer's in
    float32 (values bfloat16 cannot hold) turn it into a float32 bank, so none is rounded."""
    folder = bf16_copy(tiny_checkpoint("qwen3_moe"), tmp_path / "mixed", keep_float32="layers.1.mlp.experts.")
    assert LLM(folder).runner.bank.w13.dtype == torch.float32
    check(folder)


def test_other_devices_and_dtypes_keep_the_models_dtype():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert build.bank_store(torch.float32, cpu, torch.bfloat16) == torch.bfloat16
    assert build.bank_store(torch.float32, cpu, torch.float16) == torch.float32      # no float16 kernel rows
    assert build.bank_store(torch.float32, cpu, torch.float32) == torch.float32
    assert build.bank_store(torch.bfloat16, cpu, torch.float32) == torch.bfloat16
    assert build.bank_store(torch.float32, cuda, torch.bfloat16) == torch.float32    # the GPU kernels take one dtype
