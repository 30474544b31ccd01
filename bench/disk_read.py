"""The disk's own read speed, the reference every load figure of the fast-start benchmarks is
compared with (``fast_load.py``, ``fast_restart.py``), and the page-cache drop before each side."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def evict(folder: Path) -> bool:
    """Drop ``folder``'s files from the page cache (``POSIX_FADV_DONTNEED``), nothing else: a
    restart on a running machine, whose libraries are where the last process left them."""
    ok = True
    for f in Path(folder).iterdir():
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                ok = False
            finally:
                os.close(fd)
    return ok


def dd_read(files: list[Path]) -> tuple[float, str]:
    """Seconds for dd to read the files one after another (O_DIRECT when the filesystem allows)."""
    t0 = time.perf_counter()
    mode = "iflag=direct"
    for f in files:
        r = subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=16M", "iflag=direct", "status=none"],
                           capture_output=True)
        if r.returncode != 0:
            mode = "page cache (no O_DIRECT here)"
            subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=16M", "status=none"], check=True)
    return time.perf_counter() - t0, mode


def parallel_direct_read(files: list[Path], threads: int, fresh: bool = False):
    """Read the files in 16 MiB blocks on ``threads`` threads, O_DIRECT, no checksum, into one
    reused buffer per thread, or (``fresh``) into new memory as large as the files, whose first
    touch costs page faults like any load does. Returns the destination (freed untimed)."""
    from concurrent.futures import ThreadPoolExecutor

    from freetoken_engine.packed.memory import aligned_empty
    block = 16 << 20
    jobs = [(f, off) for f in files for off in range(0, f.stat().st_size, block)]
    dest = aligned_empty(len(jobs) * block) if fresh else None
    bufs = [aligned_empty(block) for _ in range(threads)]
    fds = {}
    for f in files:
        try:
            fds[f] = os.open(f, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            fds[f] = os.open(f, os.O_RDONLY)

    def work(k: int) -> None:
        mv = memoryview(bufs[k].numpy())
        for j in range(k, len(jobs), threads):
            f, off = jobs[j]
            n = min(block, f.stat().st_size - off)
            if dest is not None:
                mv = memoryview(dest[j * block:(j + 1) * block].numpy())
            os.preadv(fds[f], [mv[:n]], off)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, range(threads)))
    for fd in fds.values():
        os.close(fd)
    return dest
