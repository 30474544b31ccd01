"""Small JSON files in the engine's cache directory (``env.cache_dir``): the calibration, the CPU
rate on a model's experts, a packed folder's verified stamps, Triton's cache key. Written
atomically (a temporary file named by the process, then a rename), so a reader never sees half a
file and two processes writing the same one do not share a temporary file. Nothing here imports
torch."""
from __future__ import annotations

import json
import os
from pathlib import Path


def read_json(path: Path):
    """The JSON value stored at ``path``; None when it is missing, unreadable or not JSON."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def write_json(path: Path, value) -> None:
    """Store ``value`` at ``path`` atomically, making its folder; OSError when that fails."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)
