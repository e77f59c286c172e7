"""The mirror's pairing table: a primary's and its shadows' Results matched by request id, in a bounded table.

The primary half is the *last* primary Result of the request: a primary that failed before any token on an
engine with fallbacks after it is held as tentative, since the next engine may still serve. A pair is handed
to ``emit`` as soon as the final primary and a shadow are both in; entries expire ``ttl`` seconds after the
request (tentative halves are paired then), and the table holds at most ``MAX_PENDING`` entries (the oldest is
evicted). A lost half goes to ``lost(shadow)``.

**Observed concurrency.** The table counts, per primary engine, the *client's* requests in flight there (an entry
is in flight from ``add`` until its final primary Result, whatever its shadows still do) and the requests started so
far. A pair's concurrency is (in flight at its start, overlapping): the first is the client's requests in flight at
the primary when it started, itself included; the second adds those started before its primary finished — every
client request that shared the primary with it at some moment, so 1 means it ran alone. Mirrored copies never
count: a slow shadow still in flight does not make the next request "under load". O(1) per request.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from proxy.normalize import Normalized
from proxy.server.record.result import Result

MAX_PENDING = 10_000
#: a primary with one of these outcomes and no token may be followed by a fallback attempt
_FALLBACK_OUTCOMES = frozenset({"connect_error", "timeout", "upstream_broken", "engine_error"})


@dataclass
class Pending:
    created: float  # time.monotonic()
    engines: tuple[str, ...]  # the decision's serving engine + fallbacks
    expected: set[str]  # shadow engines whose Result is still to be compared
    shadows: dict[str, Result] = field(default_factory=dict)
    primary: Result | None = None
    primary_final: bool = False
    prompt: Any = None
    t_start: float = 0.0  # time.time() of the primary's receipt (its t_received_ns), as its e2e_s counts from
    #: the primary engine -> (client requests in flight on it at the start, itself included; started count then)
    load: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: the primary engine whose in-flight count this request still holds (None once its primary is final)
    serving: str | None = None
    #: client requests that overlapped it at the primary, fixed when its primary finished (None: not yet)
    overlap: int | None = None
    #: (role, engine) -> the normalized request that engine got (what sampling it really ran)
    norms: dict[tuple[str, str], Normalized] = field(default_factory=dict)
    #: the rollout state that routed the request (``proxy.server.switch.rolloutstate.Ticket``); None: no rollout
    rollout: Any = None


def primary_is_final(r: Result, engines: tuple[str, ...]) -> bool:
    if r.outcome not in _FALLBACK_OUTCOMES or r.n_token_events > 0:
        return True
    if r.outcome == "engine_error" and 0 < r.status < 500:
        return True  # 4xx: the proxy does not fall back
    return not engines or r.engine == engines[-1]


Emit = Callable[[Pending, Result, Result, tuple[int, int]], None]


class PairTable:
    def __init__(self, ttl: float, emit: Emit, lost: Callable[[str], None]) -> None:
        self.ttl = ttl
        self._emit = emit
        self._lost = lost
        self._pending: dict[str, Pending] = {}
        #: primary engine -> [client requests in flight there, client requests started there]
        self._load: dict[str, list[int]] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def get(self, request_id: str) -> Pending | None:
        return self._pending.get(request_id)

    def add(self, request_id: str, entry: Pending) -> None:
        old = self._pending.pop(request_id, None)
        if old is not None:  # a client reused its x-request-id while the first was pending
            self._expire(old)
        while len(self._pending) >= MAX_PENDING:
            key = next(iter(self._pending))
            self._expire(self._pending.pop(key))
        name = entry.engines[0]
        n = self._load.setdefault(name, [0, 0])
        n[0] += 1
        n[1] += 1
        entry.load = {name: (n[0], n[1])}
        entry.serving = name
        self._pending[request_id] = entry

    def forget(self, request_id: str, shadow: str) -> None:
        e = self._pending.get(request_id)
        if e is not None:
            e.expected.discard(shadow)
            if not e.expected:
                self._done(request_id, e)

    def on_result(self, r: Result) -> None:
        e = self._pending.get(r.request_id)
        if e is None:
            return
        if r.role == "primary":
            e.primary = r
            e.primary_final = primary_is_final(r, e.engines)
            if e.primary_final:
                self._release(e)
        elif r.role == "shadow" and r.engine in e.expected:
            e.shadows[r.engine] = r
        else:
            return
        if e.primary is not None and e.primary_final:
            self._pair(e)
            if not e.expected:
                self._done(r.request_id, e)

    def concurrency(self, e: Pending, engines: tuple[str, str] | None = None) -> tuple[int, int]:
        """(client requests in flight at the primary at its start, those overlapping it there): the pair's
        regime. ``engines`` is accepted for the caller's symmetry; only the primary's count is the client's."""
        snap = next(iter(e.load.values()), None)
        if snap is None:
            return 1, 1
        if e.overlap is None:
            self._release(e)
        return snap[0], e.overlap if e.overlap is not None else snap[0]

    def _release(self, e: Pending) -> None:
        """The request's primary is final: it stops counting as in flight there, and its overlap is fixed."""
        name = e.serving
        if name is None:
            return
        e.serving = None
        n = self._load[name]
        n[0] -= 1
        snap = e.load.get(name)
        if snap is not None:
            e.overlap = snap[0] + n[1] - snap[1]

    def _pair(self, e: Pending) -> None:
        assert e.primary is not None
        for name, shadow in list(e.shadows.items()):
            del e.shadows[name]
            e.expected.discard(name)
            self._emit(e, e.primary, shadow, self.concurrency(e, (e.primary.engine, name)))

    def _done(self, request_id: str, e: Pending) -> None:
        if self._pending.get(request_id) is e:
            del self._pending[request_id]
        self._release(e)

    def _expire(self, e: Pending) -> None:
        if e.primary is not None:
            self._pair(e)  # a tentative primary: nothing better came
        for name in e.expected:
            self._lost(name)
        e.expected.clear()
        self._release(e)

    def sweep(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        while self._pending:
            key, e = next(iter(self._pending.items()))
            if now - e.created < self.ttl:
                break  # insertion order is creation order
            del self._pending[key]
            self._expire(e)
