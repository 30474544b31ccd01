"""English text for fitting the routers and for held-out perplexity, from Debian packages.

Both come from documentation that Debian ships as plain text, installable offline:

    apt-get install python3.11-doc gnu-standards debian-reference-en

- FITTING text: the Python 3.11 tutorial, HOWTOs and FAQ (reST sources in `python3.11-doc`)
  and the GNU Coding Standards (`gnu-standards`).
- HELD-OUT text: the Debian Reference, English original (`debian-reference-en`). The fitting
  never reads it; perplexity and routing statistics are measured on it.

`fitting_text()` / `heldout_text()` raise FileNotFoundError naming the package to install.
"""

from __future__ import annotations

import gzip
import re
from pathlib import Path

PY_DOC = Path("/usr/share/doc/python3.11/html/_sources")
GNU_STANDARDS = Path("/usr/share/doc/gnu-standards/standards.text.gz")
DEBIAN_REFERENCE = Path("/usr/share/debian-reference/debian-reference.en.txt.gz")

FITTING_NAME = "Python 3.11 tutorial+howto+faq (Debian python3.11-doc) + GNU Coding Standards (Debian gnu-standards)"
HELDOUT_NAME = "The Debian Reference, English (Debian debian-reference-en 2.100), from chapter 1 on"


def _need(path: Path, package: str) -> Path:
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: apt-get install {package}")
    return path


def _clean(text: str) -> str:
    text = re.sub(r"[ \t]+\n", "\n", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip() + "\n"


def fitting_text() -> str:
    """The router-fitting corpus, deterministic order (see module docstring)."""
    parts = []
    root = _need(PY_DOC, "python3.11-doc")
    for sub in ("tutorial", "howto", "faq"):
        for f in sorted((root / sub).glob("*.rst.txt")):
            parts.append(f.read_text(encoding="utf-8", errors="replace"))
    with gzip.open(_need(GNU_STANDARDS, "gnu-standards"), "rt", encoding="utf-8", errors="replace") as f:
        parts.append(f.read())
    return _clean("\n\n".join(parts))


def heldout_text() -> str:
    """The held-out corpus: the Debian Reference body (its table of contents dropped)."""
    with gzip.open(_need(DEBIAN_REFERENCE, "debian-reference-en"), "rt", encoding="utf-8") as f:
        text = f.read().replace("\u00a0", " ")
    # The body starts at the "Chapter 1." heading (the table of contents has no such line).
    start = re.search(r"^Chapter 1\. ", text, flags=re.M)
    if start is None:
        raise ValueError(f"{DEBIAN_REFERENCE}: no 'Chapter 1.' heading; unexpected version")
    return _clean(text[start.start():])


def windows(ids: list[int], length: int, count: int) -> list[list[int]]:
    """The first `count` non-overlapping windows of `length` tokens of `ids`."""
    out = [ids[i:i + length] for i in range(0, len(ids) - length + 1, length)]
    return out[:count]
