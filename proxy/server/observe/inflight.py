"""The proxy's own record of its traffic, for ``--traffic``: how long it ran with each number of generation requests
in flight. ``enginemeter report --traffic http://PROXY/metrics`` (or a Prometheus server that scrapes it) turns
it into a profile the bench's decision is weighed by (``proxy.bench.live.trafficsource``).

A client's generation request counts from when the gateway starts serving it (routed, body read) to the end of its
answer (the last byte of a stream), fallbacks included, shadow copies not. At every change of the count the time
spent at the count it leaves is added to ``enginemeter_traffic_seconds_total{level}`` — two counter increments a
request, nothing per chunk. Levels are bounded: ``0`` (idle), ``1``, ``2``, ``3-4``, ``5-8``, ... ``65-128``,
``129+``.

Under ``serve --workers N`` the count is the whole proxy's, not a worker's: the workers share it through
``traffic.shm`` in their multiprocess directory (``SharedTraffic``: the number in flight, the time of its last
change on ``time.monotonic()`` — one clock for every process on Linux — and the seconds at each level), read and
changed under an ``flock`` at each request's start and end and at each ``/health`` (microseconds; never per
chunk). The process that makes a change adds the time spent at the level it leaves to its own counter, so the
merged ``enginemeter_traffic_seconds_total`` is the whole proxy's seconds at each level (the supervisor adds its
own ticks, at a dead worker's and at the end, to its counter file), and every worker's ``/health`` says the same
(``"per": "proxy"``). The file also holds each worker's own number in flight (a slot per worker index), so the
supervisor takes a dead worker's requests off the count exactly. ``serve`` prints the profile at its end, one
process or many (``proxy.cli.serve``).

The prompt lengths and answer lengths of the same traffic are the request histograms already exported
(``enginemeter_request_prompt_tokens``, ``..._completion_tokens``, role ``primary``).
"""

from __future__ import annotations

import mmap
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import Counter

from proxy.levels import LEVELS, level_of
from proxy.server.record.sharedstate import LockedMap

#: the shared state's file in the multiprocess directory (``serve --workers N``)
TRAFFIC_FILE = "traffic.shm"
#: magic, number in flight, time of its last change (time.monotonic()), seconds at each level
_HEAD = struct.Struct(f"<4s4xqd{len(LEVELS)}d")
_MAGIC = b"EMT1"
_SLOTS_AT = 128
#: worker indexes with a slot of their own (a worker beyond them: its death cannot be taken off the count)
SLOTS = 1024
_SLOT = struct.Struct("<q")
MAP_BYTES = _SLOTS_AT + SLOTS * _SLOT.size


class SharedTraffic(LockedMap):
    """``traffic.shm``: the whole proxy's number in flight and seconds per level, under ``serve --workers N``.

    Every read and change holds the file's ``flock``. The first process to open the file lays it out
    (``LockedMap``; the supervisor removes an earlier run's file before it starts any worker); the time of the
    last change starts at that moment."""

    def __init__(self, path: Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock

        def layout(mm: mmap.mmap, fresh: bool) -> None:
            if fresh or mm[:4] != _MAGIC:
                _HEAD.pack_into(mm, 0, _MAGIC, 0, clock(), *([0.0] * len(LEVELS)))

        super().__init__(path, MAP_BYTES, layout)

    def read(self) -> tuple[int, float, list[float]]:
        """Under ``locked()``: (number in flight, time of its last change, seconds at each level)."""
        _, n, t, *seconds = _HEAD.unpack_from(self._mm, 0)
        return n, t, seconds

    def tick(self, record: Callable[[int, float], None] | None) -> tuple[int, list[float]]:
        """Under ``locked()``: the time since the last change added to the level of the number in flight (and
        given to ``record(level, seconds)``); (number in flight, seconds at each level)."""
        n, t, seconds = self.read()
        now = self.clock()  # read under the lock: no other process can have written a later time
        dt = now - t
        if dt > 0:
            i = level_of(n)
            seconds[i] += dt
            if record is not None:
                record(i, dt)
            _HEAD.pack_into(self._mm, 0, _MAGIC, n, now, *seconds)
        return n, seconds

    def change(self, by: int, slot: int | None) -> None:
        """Under ``locked()``, after ``tick``: the number in flight (and ``slot``'s own) moved ``by``."""
        # two 8-byte stores: a process killed between them (nanoseconds) leaves the total off by one
        n = max(0, self.read()[0] + by)
        struct.pack_into("<q", self._mm, 8, n)
        if slot is not None and 0 <= slot < SLOTS:
            at = _SLOTS_AT + slot * _SLOT.size
            _SLOT.pack_into(self._mm, at, max(0, _SLOT.unpack_from(self._mm, at)[0] + by))

    def slot(self, slot: int) -> int:
        """Under ``locked()``: worker ``slot``'s own number in flight."""
        return int(_SLOT.unpack_from(self._mm, _SLOTS_AT + slot * _SLOT.size)[0]) if 0 <= slot < SLOTS else 0


class TrafficProfile:
    """Requests in flight over time: this process's, or with ``shared`` (``serve --workers N``) the whole proxy's.

    ``counter``: ``Metrics.traffic``, where this process's ticks go (None: tests, no metrics); ``record(level,
    seconds)``: where they go instead (the supervisor's counter file); ``shared``: ``traffic.shm`` in the
    workers' multiprocess directory; ``slot``: this worker's index, its own count kept there."""

    def __init__(
        self,
        counter: Counter | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        shared: Path | None = None,
        slot: int | None = None,
        record: Callable[[str, float], None] | None = None,
    ) -> None:
        self.counter = counter
        self.clock = clock
        self.n = 0
        self.t = clock()
        self.started = self.t
        self.seconds = [0.0] * len(LEVELS)
        self._children = [counter.labels(name) for name, _, _ in LEVELS] if counter is not None else []
        self._record = record
        self._shared = SharedTraffic(shared, clock) if shared is not None else None
        self.slot = slot

    def _add(self, i: int, dt: float) -> None:
        if self._children:
            self._children[i].inc(dt)
        elif self._record is not None:
            self._record(LEVELS[i][0], dt)

    def _tick(self) -> None:
        now = self.clock()
        dt, self.t = now - self.t, now
        if dt > 0:
            i = level_of(self.n)
            self.seconds[i] += dt
            self._add(i, dt)

    def _change(self, by: int) -> None:
        if self._shared is None:
            self._tick()
            self.n = max(0, self.n + by)
            return
        with self._shared.locked():
            self._shared.tick(self._add)
            self._shared.change(by, self.slot)

    def enter(self) -> None:
        self._change(+1)

    def leave(self) -> None:
        self._change(-1)

    def forget(self, slot: int) -> int:
        """A worker is gone (the supervisor, once it has exited): its requests in flight (``slot``'s count) are
        taken off the whole proxy's; their number. Its time at each level up to now is counted (this process's
        tick). What cannot be known: when each of them would have ended — the count drops at the moment the
        supervisor sees the death, up to a few milliseconds after it."""
        if self._shared is None:
            return 0
        with self._shared.locked():
            self._shared.tick(self._add)
            lost = self._shared.slot(slot)
            if lost:
                self._shared.change(-lost, slot)
        return lost

    def _state(self) -> tuple[int, list[float]]:
        if self._shared is None:
            self._tick()
            return self.n, self.seconds
        with self._shared.locked():
            return self._shared.tick(self._add)

    def health(self) -> dict[str, Any]:
        """``/health``'s ``traffic`` section: the shares of the busy time per level, and idle time: this process's,
        or the whole proxy's under ``--workers`` (``per``: ``proxy``; every worker answers the same)."""
        n, seconds = self._state()
        total = sum(seconds)
        busy = total - seconds[0]
        shares = {
            name: round(s / busy, 4)
            for (name, _, _), s in zip(LEVELS[1:], seconds[1:], strict=True)
            if busy > 0 and s > 0
        }
        return {
            "traffic": {
                "in_flight": n,
                "observed_s": round(total, 1),
                "busy_s": round(busy, 1),
                "idle": round(seconds[0] / total, 4) if total > 0 else None,
                "busy_shares": shares,
                "per": "process" if self._shared is None else "proxy",
            }
        }

    def text(self) -> str:
        """The profile in one line, for ``serve``'s last words."""
        h = self.health()["traffic"]
        if not h["busy_shares"]:
            return "no generation request served"
        shares = ", ".join(f"c={k} {v:.0%}" for k, v in h["busy_shares"].items())
        return f"{shares} of {_s(h['busy_s'])} busy (idle {h['idle']:.0%} of {_s(h['observed_s'])})"

    def close(self) -> None:
        if self._shared is not None:
            self._shared.close()
            self._shared = None


def _s(seconds: float) -> str:
    """Seconds for a person: tenths below a minute (a short demo is not "0 s busy"), whole seconds above."""
    return f"{seconds:.1f} s" if seconds < 60 else f"{seconds:.0f} s"
