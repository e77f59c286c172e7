"""The record of one request on one engine: what happened, when, and what the engine said. Frozen.

One ``Result`` is produced for every request attempt, whatever its outcome (``proxy.types.Outcome``), and goes to
the metrics and — for mirrored pairs — to the comparison.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

from proxy.timing import EngineTimings, StreamTiming, Usage
from proxy.types import EndpointLabel, EngineKind, Outcome, Role


@dataclass(frozen=True, slots=True)
class Result:
    #: the proxy's own id for the request (pairs primary and shadow; sent back as x-enginemeter-request-id)
    request_id: str
    engine: str
    engine_kind: EngineKind
    role: Role
    model: str  # bounded label: configured alias / engine model name, else "other"
    endpoint: EndpointLabel  # a generation endpoint, or a pass-through one (no tokens, no text)
    stream: bool
    outcome: Outcome
    status: int
    timing: StreamTiming
    usage: Usage | None
    engine_timings: EngineTimings | None
    finish_reason: str | None
    n_token_events: int
    greedy: bool
    #: output text, collected only when the request is part of a compared pair
    text: str | None = None
    #: cumulative end offsets (code points) of each token event's text in ``text`` (same condition)
    text_ends: tuple[int, ...] | None = None
    error: str | None = None
    #: usage events removed from the client's stream (it did not ask for usage)
    usage_stripped: int = 0
    #: events re-serialized instead of byte-rewritten (unusual engine formatting, usage on a content event)
    reserialized: int = 0
    #: the client's ``x-request-id``, if it sent one (echoed, forwarded to the engine; never used for pairing)
    client_request_id: str | None = None
    #: the proxy's event loop stalled while the request was timed (``LoopWatch.stalled_since``): its figures hold
    #: the proxy's wait as well as the engine's
    loop_stalled: bool = False


_ids = itertools.count()
_id_prefix = os.urandom(8).hex()


def _new_prefix() -> None:
    global _id_prefix
    _id_prefix = os.urandom(8).hex()


# a forked child draws its own (``serve --workers`` spawns, but a fork must not repeat the parent's ids either)
os.register_at_fork(after_in_child=_new_prefix)


def new_request_id() -> str:
    """A request id unique across processes and restarts: 16 random hex digits drawn once per process, then a
    counter (32 hex digits, like ``uuid4().hex``). ``uuid4`` reads the kernel's random source per call, and
    cost 7 % of the proxy's CPU at 1,000 requests/s on the 2-core VM; a ``getpid`` per call (to notice a fork)
    was another syscall a request."""
    return f"{_id_prefix}{next(_ids):016x}"
