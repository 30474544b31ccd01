"""``--model file.gguf``: a GGUF file (llama, qwen2, qwen3, qwen3moe, qwen2moe, minimax-m2 or glm4moe architecture), dequantized once into
a Hugging Face folder in the engine cache (keyed by the file's size and modification time), a layer
at a time, then loaded like any other checkpoint folder."""
from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

from .. import env
from ..errors import ConfigError

_DONE = ".complete"


def gguf_folder(path: Path) -> Path:
    """The converted folder for ``path``, converting it on first use (atomic rename)."""
    from .gguf import GGUFError, convert_gguf
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    target = env.cache_dir() / "gguf" / f"{path.stem}-{key}"
    if (target / _DONE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        convert_gguf(path, tmp)
        (tmp / _DONE).write_text("ok\n")
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
    except GGUFError as exc:
        raise ConfigError(str(exc)) from None
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"cannot read GGUF file {path}: {exc}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
