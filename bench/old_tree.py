"""The "before" side of an A/B benchmark: another revision's tree, checked out for the run."""
from __future__ import annotations

import contextlib
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def old_tree(rev: str, tree: Path | None = None):
    """A folder holding revision ``rev``'s files: ``tree`` as given (where git is absent, e.g. the
    GPU machine: ``git archive REV engine bench`` unpacked there), else a temporary ``git
    worktree``, removed afterwards."""
    if tree is not None:
        yield tree.resolve()
        return
    path = Path(tempfile.mkdtemp()) / "old"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(path), rev], check=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], check=False)
