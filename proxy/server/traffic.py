"""The proxy's own record of its traffic, for ``--traffic``: how long it ran with each number of generation requests
in flight. ``enginemeter report --traffic http://PROXY/metrics`` (or a Prometheus server that scrapes it) turns
it into a profile the bench's decision is weighed by (``proxy.bench.live.traffic``).

A client's generation request counts from when the gateway starts serving it (routed, body read) to the end of its
answer (the last byte of a stream), fallbacks included, shadow copies not. At every change of the count the time
spent at the count it leaves is added to ``enginemeter_traffic_seconds_total{level}`` — two counter increments a
request, nothing per chunk. Levels are bounded: ``0`` (idle), ``1``, ``2``, ``3-4``, ``5-8``, ... ``65-128``,
``129+``. Under ``serve --workers N`` each worker counts its own requests in flight: the levels are per worker (the
total in flight is up to N times higher); the comparison or request log gives the whole proxy's profile.

The prompt lengths and answer lengths of the same traffic are the request histograms already exported
(``enginemeter_request_prompt_tokens``, ``..._completion_tokens``, role ``primary``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prometheus_client import Counter

from proxy.levels import LEVELS, level_of


class TrafficProfile:
    """Requests in flight in this process over time; ``counter``: ``Metrics.traffic`` (None: tests, no metrics)."""

    def __init__(self, counter: Counter | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.counter = counter
        self.clock = clock
        self.n = 0
        self.t = clock()
        self.started = self.t
        self.seconds = [0.0] * len(LEVELS)
        self._children = [counter.labels(name) for name, _, _ in LEVELS] if counter is not None else []

    def _tick(self) -> None:
        now = self.clock()
        dt, self.t = now - self.t, now
        if dt > 0:
            i = level_of(self.n)
            self.seconds[i] += dt
            if self._children:
                self._children[i].inc(dt)

    def enter(self) -> None:
        self._tick()
        self.n += 1

    def leave(self) -> None:
        self._tick()
        self.n = max(0, self.n - 1)

    def health(self) -> dict[str, Any]:
        """``/health``'s ``traffic`` section: the shares of this process's busy time per level, and idle time."""
        self._tick()
        total = sum(self.seconds)
        busy = total - self.seconds[0]
        shares = {name: round(s / busy, 4) for (name, _, _), s in zip(LEVELS[1:], self.seconds[1:], strict=True)
                  if busy > 0 and s > 0}  # fmt: skip
        return {"traffic": {"in_flight": self.n, "observed_s": round(total, 1), "busy_s": round(busy, 1),
                            "idle": round(self.seconds[0] / total, 4) if total > 0 else None, "busy_shares": shares,
                            "per": "process"}}  # fmt: skip

    def text(self) -> str:
        """The profile in one line, for ``serve``'s last words."""
        h = self.health()["traffic"]
        if not h["busy_shares"]:
            return "no generation request served"
        shares = ", ".join(f"c={k} {v:.0%}" for k, v in h["busy_shares"].items())
        return f"{shares} of {_s(h['busy_s'])} busy (idle {h['idle']:.0%} of {_s(h['observed_s'])})"


def _s(seconds: float) -> str:
    """Seconds for a person: tenths below a minute (a short demo is not "0 s busy"), whole seconds above."""
    return f"{seconds:.1f} s" if seconds < 60 else f"{seconds:.0f} s"
