"""Finding the engine processes a test started, from /proc (no extra tools)."""
from __future__ import annotations

import os
from pathlib import Path


def engine_pids(port: int) -> list[int]:
    """Pids of ``freetoken serve`` processes whose command line names ``--port PORT``."""
    needle = f"--port\0{port}\0".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if b"serve" in cmd and needle in cmd:
                pids.append(int(entry))
    return pids
