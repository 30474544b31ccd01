"""Engine processes in tests: finding those a test started, from /proc (no extra tools), and
running ``freetoken serve`` until it is healthy."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
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


@contextlib.contextmanager
def serving(args: list[str], timeout: float = 180):
    """``freetoken serve ARGS`` in a subprocess on a free loopback port, until /health says ok;
    yields (url, process) and kills it after (unless the test ended it)."""
    import httpx
    import pytest
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "freetoken_engine.cli", "serve", "--port", str(port), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"freetoken serve exited: {proc.stdout.read()[-2000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).json().get("status") == "ok":
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("freetoken serve did not become healthy")
            time.sleep(0.2)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def python_json(code: str, *args: str, timeout: float = 180):
    """Run ``code`` in a new Python process (``python -c code args...``), assert it exits 0 (its
    stderr as the message), and return the JSON value on the last line it printed."""
    import json
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])
