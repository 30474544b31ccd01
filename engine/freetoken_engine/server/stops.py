"""Stop strings over a stream of decoded text.

``StopMatcher.feed(text)`` returns the text that is safe to show: everything before the first
stop string, minus any tail that could still grow into one (held back until the next piece
decides it). Once a stop string is found, ``stopped`` is set and ``matched`` names it; the stop
string itself is never shown (OpenAI and Anthropic both exclude it).
"""
from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Finds the earliest of ``stops`` in the concatenation of fed text.

    Not thread-safe; one per request. ``flush()`` releases the held-back tail at the end of
    generation (a partial match that never completed is ordinary text).
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None
        self._longest = max((len(s) for s in self.stops), default=0)

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self._held + text
        first, which = -1, None
        for stop in self.stops:
            at = buf.find(stop)
            if at != -1 and (first == -1 or at < first):
                first, which = at, stop
        if which is not None:
            self.stopped, self.matched, self._held = True, which, ""
            return buf[:first]
        keep = self._partial_tail(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        out, self._held = ("" if self.stopped else self._held), ""
        return out

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of some stop string."""
        for n in range(min(len(buf), self._longest - 1), 0, -1):
            tail = buf[-n:]
            if any(stop.startswith(tail) for stop in self.stops):
                return n
        return 0
