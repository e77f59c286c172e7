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

import logging
import math
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
#: a count or a time beyond these is garbage, not traffic (a proxy does not hold a million requests, nor run 300 years)
_MAX_COUNT = 1 << 20
_MAX_SECONDS = 1e10

log = logging.getLogger("enginemeter.traffic")


class SharedTraffic(LockedMap):
    """``traffic.shm``: the whole proxy's number in flight and seconds per level, under ``serve --workers N``.

    Every read and change holds the file's ``flock``. The first process to open the file lays it out
    (``LockedMap``; the supervisor removes an earlier run's file before it starts any worker); the time of the
    last change starts at that moment. A file found cut or garbled (a NaN, an infinite or negative count, a time
    from the future) is laid out again from zero, logged once per process: the figures it held are lost, nothing
    else (``damage``: how many times)."""

    def __init__(self, path: Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.damage = 0

        def layout(shared: LockedMap, fresh: bool) -> None:
            if fresh or self._head() is None:
                self._fresh()

        super().__init__(path, MAP_BYTES, layout)

    def _fresh(self) -> None:
        self.pwrite(_HEAD.pack(_MAGIC, 0, self.clock(), *([0.0] * len(LEVELS))), 0)

    def _head(self) -> tuple[int, float, list[float]] | None:
        raw = self.pread(_HEAD.size, 0)
        if len(raw) < _HEAD.size:
            return None
        magic, n, t, *seconds = _HEAD.unpack(raw)
        sane = magic == _MAGIC and 0 <= n <= _MAX_COUNT and math.isfinite(t) and t <= self.clock() + 1
        if not sane or not all(math.isfinite(s) and 0 <= s <= _MAX_SECONDS for s in seconds):
            return None
        return n, t, seconds

    def read(self) -> tuple[int, float, list[float]]:
        """Under ``locked()``: (number in flight, time of its last change, seconds at each level); a damaged file
        is laid out again first (its figures are lost)."""
        head = self._head() if not self.damaged() else None
        if head is None:
            self.damage += 1
            if self.damage == 1:
                log.error("%s was cut or garbled: its traffic figures start again from zero", TRAFFIC_FILE)
            self.relay()
            return 0, self.clock(), [0.0] * len(LEVELS)
        return head

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
            self.pwrite(_HEAD.pack(_MAGIC, n, now, *seconds), 0)
        return n, seconds

    def change(self, by: int, slot: int | None) -> None:
        """Under ``locked()``, after ``tick``: the number in flight (and ``slot``'s own) moved ``by``."""
        # two 8-byte stores: a process killed between them (nanoseconds) leaves the total off by one
        n = max(0, self.read()[0] + by)
        self.pwrite(struct.pack("<q", n), 8)
        if slot is not None and 0 <= slot < SLOTS:
            self.pwrite(_SLOT.pack(max(0, self.slot(slot) + by)), _SLOTS_AT + slot * _SLOT.size)

    def slot(self, slot: int) -> int:
        """Under ``locked()``: worker ``slot``'s own number in flight (0 when cut or garbled)."""
        raw = self.pread(_SLOT.size, _SLOTS_AT + slot * _SLOT.size) if 0 <= slot < SLOTS else b""
        n = int(_SLOT.unpack(raw)[0]) if len(raw) == _SLOT.size else 0
        return n if 0 <= n <= _MAX_COUNT else 0


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
        #: changes the shared file refused (a full disk): logged once
        self.refused = 0
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
        try:
            with self._shared.locked():
                self._shared.tick(self._add)
                self._shared.change(by, self.slot)
        except OSError as exc:  # a full or read-only disk: this change of the count is lost, the request is not
            self._refused(exc)

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
        try:
            with self._shared.locked():
                self._shared.tick(self._add)
                lost = self._shared.slot(slot)
                if lost:
                    self._shared.change(-lost, slot)
        except OSError as exc:
            self._refused(exc)
            return 0
        return lost

    def _refused(self, exc: OSError) -> None:
        self.refused += 1
        if self.refused == 1:
            log.error("%s cannot be written (%s): the traffic figures miss what happens meanwhile", TRAFFIC_FILE, exc)

    def _state(self) -> tuple[int, list[float]]:
        if self._shared is None:
            self._tick()
            return self.n, self.seconds
        try:
            with self._shared.locked():
                return self._shared.tick(self._add)
        except OSError as exc:  # /health still answers: with nothing, rather than with a 500
            self._refused(exc)
            return 0, [0.0] * len(LEVELS)

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
