"""Where one thread's wall time goes: a background thread samples that thread's Python stack
every few milliseconds (``sys._current_frames``), and ``summary`` counts, per time window, the
innermost frames and the innermost frames of a chosen package. A sample lands whenever the
sampler gets the GIL, so a long call that holds the GIL is seen at its end, and one that releases
it (I/O, most CUDA and torch calls, a wait) is seen while it runs.

    sampler = StackSampler(threading.get_ident(), t0).start()
    ...
    sampler.stop()
    print(sampler.summary({"build": (1.2, 3.4)}, package="freetoken_engine"))
"""
from __future__ import annotations

import sys
import threading
import time
from collections import Counter


class StackSampler:
    def __init__(self, thread_id: int, t0: float, interval: float = 0.005, depth: int = 40):
        self.thread_id, self.t0, self.interval, self.depth = thread_id, t0, interval, depth
        self.samples: list[tuple[float, tuple[str, ...]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def start(self) -> "StackSampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            frame = sys._current_frames().get(self.thread_id)
            stack = []
            while frame is not None and len(stack) < self.depth:
                code = frame.f_code
                stack.append(f"{_short(code.co_filename)}:{frame.f_lineno} {code.co_name}")
                frame = frame.f_back
            self.samples.append((time.perf_counter() - self.t0, tuple(stack)))

    def summary(self, windows: dict[str, tuple[float, float]], package: str = "freetoken_engine",
                top: int = 8) -> dict:
        """Per window: samples, the innermost frames, the innermost three (callers after the
        frame) and the innermost ``package`` frames, most frequent first, each with its share."""
        out = {}
        for name, (a, b) in windows.items():
            inside = [s for t, s in self.samples if a <= t < b and s]
            n = len(inside)
            leaf = Counter(s[0] for s in inside)
            own = Counter(next((f for f in s if package in f), s[-1]) for s in inside)
            three = Counter(" < ".join(s[:3]) for s in inside)
            out[name] = {"seconds": round(b - a, 3), "samples": n,
                         "innermost": [(f, round(c / max(1, n), 3)) for f, c in leaf.most_common(top)],
                         "innermost_3": [(f, round(c / max(1, n), 3)) for f, c in three.most_common(top)],
                         package: [(f, round(c / max(1, n), 3)) for f, c in own.most_common(top)]}
        return out


def _short(path: str) -> str:
    for marker in ("site-packages/", "freetoken_engine/", "lib/python"):
        at = path.rfind(marker)
        if at >= 0:
            return path[at:]
    return path
