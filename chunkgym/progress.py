"""Progress lines for long loops: the first step, then at most one every few seconds, and the end.

They go to stderr by default, so tools whose last stdout line is JSON stay parseable; pass
``say=log.info`` inside Hydra jobs to have them in the job log.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

EVERY_S = 10.0


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Progress:
    """``label: done/total note (elapsed s)`` when :meth:`update` is called and ``every_s`` has passed."""

    def __init__(
        self,
        label: str,
        total: int | None = None,
        every_s: float = EVERY_S,
        say: Callable[[str], None] = _stderr,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.label, self.total, self.every_s, self.say, self.clock = label, total, every_s, say, clock
        self.start = clock()
        self._last: float | None = None

    def line(self, done: int, note: str = "") -> str:
        count = f"{done}/{self.total}" if self.total is not None else f"{done}"
        return f"{self.label}: {count}{f' {note}' if note else ''} ({self.clock() - self.start:.0f} s)"

    def update(self, done: int, note: str = "") -> None:
        now = self.clock()
        if self._last is None or now - self._last >= self.every_s:
            self._last = now
            self.say(self.line(done, note))

    def finish(self, done: int, note: str = "") -> None:
        self.say(self.line(done, note))
