"""The record of one request on one engine: what happened, when, and what the engine said. Frozen.

One ``Result`` is produced for every request attempt, whatever its outcome (``proxy.types.Outcome``), and goes to
the metrics and — for mirrored pairs — to the comparison.
"""

from __future__ import annotations

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
    error: str | None = None
    #: usage events removed from the client's stream (it did not ask for usage)
    usage_stripped: int = 0
    #: events re-serialized instead of byte-rewritten (unusual engine formatting, usage on a content event)
    reserialized: int = 0
    #: the client's ``x-request-id``, if it sent one (echoed, forwarded to the engine; never used for pairing)
    client_request_id: str | None = None
