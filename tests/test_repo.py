"""Repository layout contracts."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_no_root_folder_shadows_the_standard_library():
    shadowing = [p.name for p in ROOT.iterdir()
                 if p.is_dir() and p.name in sys.stdlib_module_names and (p / "__init__.py").exists()]
    assert not shadowing
    # From the repository root, with the cwd first on sys.path, stdlib imports still work.
    for module in ("collections", "operator", "json"):
        r = subprocess.run([sys.executable, "-S", "-c", f"import {module}; print({module}.__file__)"],
                           cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 0 and str(ROOT) not in r.stdout, r.stderr


def test_source_roots_have_no_init_and_packages_do():
    for root, pkg in (("engine", "freetoken_engine"), ("node_agent", "freetoken_agent"),
                      ("operator", "freetoken_operator")):
        assert not (ROOT / root / "__init__.py").exists()
        assert (ROOT / root / pkg / "__init__.py").exists()


def test_import_contracts_hold():
    lint = Path(sys.executable).parent / "lint-imports"
    r = subprocess.run([str(lint), str(ROOT / ".importlinter")], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_cpu_kernels_cache_key_covers_every_source_file():
    """The compiled CPU kernel is cached under a hash of its sources (kernels/cpu/build.py): a
    header missing from that list would let an edited kernel load the stale library."""
    from freetoken_engine.kernels.cpu import build
    cpu = ROOT / "engine" / "freetoken_engine" / "kernels" / "cpu"
    on_disk = {p.name for p in cpu.iterdir() if p.suffix in (".h", ".cpp")}
    assert on_disk == set(build.SOURCES)
    assert {src for _, src, _ in build._UNITS} <= on_disk
