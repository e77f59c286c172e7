"""A llama.cpp-shaped ``timings`` block measured by the proxy, for engines that send none (SGLang, vLLM, openai).

llama-server puts ``timings`` on its last stream event and in its non-stream body; tools read it. With
``add_timings`` on (globally or per engine), the relay adds the same keys where the engine's event or body has no
``timings`` of its own: on the stream's final usage-only event (``choices: []``; never on vLLM's continuous
per-chunk usage), so the client must ask for usage, as with llama.cpp's
``stream_options.include_usage``; and in the non-stream body. llama.cpp's own blocks are never touched; an
attempt to a ``llamacpp`` engine never gets the flag.

What each field means when the proxy measured it (``"measured_by": "enginemeter"`` marks the block), all from
``proxy.timing`` clocks on the proxy host, so network time to the engine is included:

============================  ===========================================================================
``prompt_n``                  ``usage.prompt_tokens - cached`` (the tokens the engine had to prefill)
``cache_n``                   ``usage.prompt_tokens_details.cached_tokens`` (0 when the engine says none)
``prompt_ms``                 stream: upstream TTFT = request sent upstream -> first token event, so queueing
                              and the first decode step are in it (llama.cpp's excludes its queue);
                              non-stream: null (no token events to split prefill from decode)
``prompt_per_token_ms``       ``prompt_ms / prompt_n``; ``prompt_per_second`` = ``1000 * prompt_n / prompt_ms``
``predicted_n``               ``usage.completion_tokens``
``predicted_ms``              stream: first token event -> last token event; non-stream: null
``predicted_per_token_ms``    ``predicted_ms / (predicted_n - 1)``: TPOT (the first token is the prompt's)
``predicted_per_second``      ``1000 * (predicted_n - 1) / predicted_ms``: the proxy's decode tok/s
``total_ms``                  request sent upstream -> this event / the whole body read (not in llama.cpp's)
============================  ===========================================================================

A figure that cannot be computed (no usage, a single token) is ``null``. Built once per attempt, at its end.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from proxy.config.settings import Settings
from proxy.server.request.upstream import Engine
from proxy.timing import StreamTimer, Usage
from proxy.types import Role

MEASURED_BY = "enginemeter"


def _ms(a_ns: int, b_ns: int) -> float | None:
    return round((b_ns - a_ns) / 1e6, 3) if a_ns and b_ns and b_ns >= a_ns else None


def _div(a: float | None, b: float | None, scale: float = 1.0) -> float | None:
    return round(scale * a / b, 3) if a is not None and b else None


def timings_block(timer: StreamTimer, usage: Usage | None, *, stream: bool) -> dict[str, Any]:
    """The block for an attempt timed by ``timer`` that reported ``usage``; ``stream``: token clocks exist."""
    now = time.perf_counter_ns()
    prompt = usage.prompt_tokens if usage is not None else None
    cached = (usage.cached_tokens or 0) if usage is not None else None
    predicted = usage.completion_tokens if usage is not None else None
    prompt_n = prompt - min(cached or 0, prompt) if prompt is not None else None
    prompt_ms = _ms(timer.t_sent_ns, timer.t_first_token_ns) if stream else None
    predicted_ms = _ms(timer.t_first_token_ns, timer.t_last_token_ns) if stream else None
    decoded = predicted - 1 if predicted is not None and predicted > 1 else None
    return {
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": _div(prompt_ms, prompt_n),
        "prompt_per_second": _div(prompt_n, prompt_ms, 1000.0),
        "predicted_n": predicted,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": _div(predicted_ms, decoded),
        "predicted_per_second": _div(decoded, predicted_ms, 1000.0),
        "cache_n": cached,
        "total_ms": _ms(timer.t_sent_ns, now),
        "measured_by": MEASURED_BY,
    }


class Flaggable(Protocol):
    """An attempt, as far as the timings block goes (``proxy.server.request.relay.Attempt``)."""

    engine: Engine
    role: Role
    add_timings: bool


class AddTimings:
    """``Attempts.on_new`` hook: flags the primary attempts whose engine gets the block (``add_timings``: the
    engine's own setting, else the global one; never a ``llamacpp`` engine, which sends its own)."""

    def __init__(self, settings: Settings) -> None:
        self.default = settings.add_timings
        self.engines = {e.name: e.add_timings for e in settings.engines}

    def enabled(self, engine: str) -> bool:
        own = self.engines.get(engine)
        return self.default if own is None else own

    def any(self) -> bool:
        return any(self.enabled(name) for name in self.engines)

    def __call__(self, attempt: Flaggable) -> None:
        e = attempt.engine
        if attempt.role == "primary" and e.effective_kind != "llamacpp" and self.enabled(e.name):
            attempt.add_timings = True
