"""First-use conversion: SmolLM2-135M-Instruct GGUF + committed fitted artifacts -> MoE folder.

    build_default_moe(out_dir, progress=False) -> Path

Steps (a few seconds on 2 cores): check the GGUF's sha256 against the one the artifacts were
fitted on, dequantize the GGUF (`models.gguf.load_gguf`), split each MLP into experts by the
fitted neuron permutation, add the fitted routers, write a `freetoken_llama_moe` folder
(config.json, model.safetensors in float32, tokenizer files).

Raises `ArtifactMismatch` when the GGUF is not the file the artifacts were fitted on,
FileNotFoundError when the package or the artifacts are missing, `models.gguf.GGUFError` for
an unreadable GGUF.
"""

from __future__ import annotations

import json
from pathlib import Path

from .moe import moe_config, moe_tensors
from .source import DEFAULT_EXPERTS, INSTALL_HINT, artifact_paths, sha256_file, smollm2_gguf_path


class ArtifactMismatch(ValueError):
    """The GGUF on disk differs from the one the committed routers were fitted on."""


def load_artifacts(num_experts: int = DEFAULT_EXPERTS):
    """(metadata dict, perms [L, I] int64, routers [L, E, H] float32) of the committed fit."""
    from safetensors.torch import load_file

    tensors_path, meta_path = artifact_paths(num_experts)
    if not tensors_path.is_file() or not meta_path.is_file():
        raise FileNotFoundError(f"fitted MoE artifacts missing: {tensors_path} (run python -m "
                                "freetoken_engine.convert.fit)")
    meta = json.loads(meta_path.read_text())
    t = load_file(str(tensors_path))
    return meta, t["perms"].long(), t["routers"].float()


def build_default_moe(out_dir: str | Path, progress: bool = False, gguf_path: Path | None = None,
                      num_experts: int = DEFAULT_EXPERTS, top_k: int | None = None) -> Path:
    """Write the default MoE folder into `out_dir` (created; should be empty or absent)."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    from ..models.gguf import load_gguf, write_tokenizer_files

    out = Path(out_dir)
    bar = tqdm(total=4, desc="freetoken: converting the default model", unit="step", disable=not progress)
    try:
        gguf_path = gguf_path or smollm2_gguf_path()
        meta, perms, routers = load_artifacts(num_experts)
        bar.set_postfix_str("checking the GGUF")
        digest = sha256_file(gguf_path)
        if digest != meta["gguf_sha256"]:
            raise ArtifactMismatch(
                f"{gguf_path} has sha256 {digest[:16]}..., but the MoE routers were fitted on "
                f"{meta['gguf_sha256'][:16]}...: reinstall the expected package ({INSTALL_HINT}) "
                "or refit (python -m freetoken_engine.convert.fit)")
        bar.update()
        bar.set_postfix_str("dequantizing")
        model = load_gguf(gguf_path)
        bar.update()
        bar.set_postfix_str("splitting experts")
        tensors = moe_tensors(model.tensors, perms, routers)
        cfg = moe_config(model.config, routers.shape[1], top_k or meta["num_experts_per_tok"])
        cfg["freetoken_moefication"] = {
            "source": gguf_path.name, "gguf_sha256": digest,
            "fitting_text": meta.get("fitting_text"), "method": meta.get("method"),
        }
        bar.update()
        bar.set_postfix_str("writing")
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        write_tokenizer_files(model, out)
        bar.update()
    finally:
        bar.close()
    return out
