"""A route's switch from its primary (the baseline) to a candidate engine: the two ways and their settings.

- ``rollout``: both engines resident; the candidate's share of the live traffic grows step by step, every request
  mirrored to the other engine, rolled back by itself (``proxy.server.switch.rollout``; docs/routing.md#rollout).
- ``swap``: one engine resident at a time (one GPU too small for both): the proxy stops the baseline, launches the
  candidate, holds the traffic meanwhile, watches the candidate against the baseline's figures from before and
  swaps back by itself (``proxy.server.switch.swapper``; docs/routing.md#swap). Both engines are launched by
  ``serve`` (``engines[].launch``).
"""

from __future__ import annotations

import itertools
from typing import Annotated, Literal

from pydantic import AfterValidator, Field
from pydantic.dataclasses import dataclass

from proxy.config.fields import SECTION, Name, Seconds

#: the rollout's default steps: the candidate's share of the route's live traffic, shadow first
DEFAULT_STEPS: tuple[float, ...] = (0.0, 0.01, 0.1, 0.5, 1.0)
RolloutState = Literal["running", "paused", "aborted"]
RolloutGate = Literal["not_slower", "not_worse"]


def _steps(value: tuple[float, ...]) -> tuple[float, ...]:
    if not value:
        raise ValueError("expected a non-empty list of shares")
    if any(not 0.0 <= v <= 1.0 for v in value) or any(a >= b for a, b in itertools.pairwise(value)):
        raise ValueError("shares must be within [0, 1] and strictly increasing")
    if value[-1] != 1.0:
        raise ValueError("the last step must be 1 (a rollout ends with the candidate serving the whole route)")
    return value


@dataclass(frozen=True, config=SECTION)
class RolloutSettings:
    """A guarded switch of the route from its primary to a candidate engine, step by step; docs/routing.md#rollout."""

    candidate: Name = Field(description="the engine the route moves to (the primary is the baseline)")
    steps: Annotated[tuple[float, ...], AfterValidator(_steps)] = Field(
        default=DEFAULT_STEPS, description="the candidate's share of the route's traffic at each step; 0 = shadow only"
    )
    state: RolloutState = Field(
        default="running",
        description="running, paused or aborted; applied at start when it differs from what the last start applied",
    )
    gate: RolloutGate = Field(
        default="not_slower",
        description="what a step needs to advance, with its pairs: not_slower (no stream decided slower) or "
        "not_worse (every stream's interval below +mirror.min_effect: shown, not only not refuted)",
    )
    min_pairs: int = Field(
        default=30, ge=30, description="paired requests a regime needs at a step before it can pass (30 at least)"
    )
    min_requests: int = Field(
        default=20,
        ge=0,
        description="requests the candidate must serve at a step (share above 0) before it may advance",
    )
    min_dwell_s: float = Field(default=60.0, ge=0, allow_inf_nan=False, description="seconds at a step, at least")
    regime_share: float = Field(
        default=0.1, gt=0, le=1, description="a regime with this share of a step's pairs must be not worse to advance"
    )
    error_budget: float = Field(
        default=0.02, ge=0, lt=1, description="share of the candidate's requests at a step that may fail"
    )
    min_errors: int = Field(default=3, ge=1, description="failures before the error budget can roll back")
    state_file: str | None = Field(
        default=None,
        description="the rollout's state, shared by workers and restarts; "
        "none = $XDG_STATE_HOME/enginemeter/rollout-<host>-<port>-route<N>.json",
    )


SwapState = Literal["ready", "running", "aborted"]
SwapGate = Literal["not_slower", "not_worse"]


@dataclass(frozen=True, config=SECTION)
class SwapSettings:
    """A switch on one GPU: the baseline (the route's primary) is stopped and the candidate launched in its place,
    the traffic held meanwhile, then watched and swapped back by itself; docs/routing.md#swap. Both engines are
    launched by ``serve`` (``engines[].launch``)."""

    candidate: Name = Field(
        description="the engine the route moves to (launched by serve; the primary is the baseline)"
    )
    state: SwapState = Field(
        default="ready",
        description="ready (the baseline serves; POST /admin/rollout start swaps), running (swap at start, or carry on) "
        "or aborted (stay on, or go back to, the baseline); applied at start when it differs from what the last start "
        "applied",
    )
    queue_max_requests: int = Field(
        default=256,
        ge=0,
        description="requests held (per serving process) while no engine can take them; more get 503 with Retry-After",
    )
    queue_max_wait_s: Seconds = Field(
        default=300.0,
        description="seconds a request may be held; the switch plan sets it from the candidate's measured load time",
    )
    drain_timeout_s: Seconds = Field(
        default=120.0,
        description="seconds the baseline's requests in flight may take to finish; past it the swap is abandoned "
        "(never a stream cut)",
    )
    memory_timeout_s: Seconds = Field(
        default=120.0, description="seconds to wait for the stopped engine's GPU memory to come back"
    )
    ready_timeout_s: Seconds = Field(
        default=900.0, description="seconds the launched engine may take to become ready (load, compile, warm-up)"
    )
    warmup_requests: int = Field(
        default=2, ge=0, description="short requests sent to the launched engine before it gets the traffic"
    )
    gate: SwapGate = Field(
        default="not_slower",
        description="what the watch needs to pass: not_slower (no regime decided slower) or not_worse (every "
        "exercised regime's interval below +mirror.min_effect)",
    )
    baseline_window: int = Field(
        default=200,
        ge=30,
        description="the baseline's last requests per regime kept before the swap, what the candidate is watched against",
    )
    min_requests: int = Field(
        default=30,
        ge=30,
        description="requests per exercised regime the candidate must serve before the watch can pass",
    )
    min_dwell_s: float = Field(default=300.0, ge=0, allow_inf_nan=False, description="seconds of watch, at least")
    regime_share: float = Field(
        default=0.1, gt=0, le=1, description="a regime with this share of the watched requests must not be slower"
    )
    error_budget: float = Field(
        default=0.02, ge=0, lt=1, description="share of the candidate's requests in the watch that may fail"
    )
    min_errors: int = Field(default=3, ge=1, description="failures before the error budget can swap back")
    state_file: str | None = Field(
        default=None,
        description="the swap's state, shared by workers and restarts; "
        "none = $XDG_STATE_HOME/enginemeter/swap-<host>-<port>-route<N>.json",
    )
