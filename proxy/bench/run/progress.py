"""A one-line progress bar on stderr (a line per 10 % when stderr is not a terminal)."""

from __future__ import annotations

import sys
import time
from typing import IO


class Progress:
    def __init__(self, total: int, enabled: bool = True, stream: IO[str] | None = None) -> None:
        self.total = max(1, total)
        self.done = 0
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.t0 = time.monotonic()
        self._last_pct = -1
        self.label = ""

    def step(self, n: int = 1) -> None:
        self.done += n
        self.show()

    def show(self) -> None:
        if not self.enabled:
            return
        frac = min(1.0, self.done / self.total)
        pct = int(frac * 100)
        el = time.monotonic() - self.t0
        eta = el / frac - el if frac > 0 else 0
        bar = "#" * int(frac * 30) + "." * (30 - int(frac * 30))
        line = f"[{bar}] {self.done}/{self.total} {pct:3d}% {el:5.0f}s eta {eta:4.0f}s {self.label}"
        if self.tty:
            self.stream.write("\r" + line[:150].ljust(150))
            self.stream.flush()
        elif pct // 10 != self._last_pct // 10 or self.done == self.total:
            self.stream.write(line + "\n")
            self.stream.flush()
        self._last_pct = pct

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
