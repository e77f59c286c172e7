"""Engine state: what each engine says about its own configuration and load, polled at an interval.

Each kind's poll is its dialect's (``proxy.engines``; docs/engines.md lists what each reads): only cheap GETs
with short timeouts, never a generation. A poll replaces the engine's ``EngineState`` whole; the Prometheus
collector reads the latest states and never does I/O. When a poll fails, ``engine_up`` is 0 and busy slots
become absent; the static facts of the last good poll (context length, slots, model) stay, so a drift signal
does not flap while an engine restarts.

Context length is the longest request one engine accepts: llama.cpp's per-slot ``n_ctx`` (``-c`` divided by
``-np`` unless the KV cache is unified), SGLang's and vLLM's ``max_model_len``. Quantization names are compared
by ``proxy.engines.quant_key`` (F16 = FP16 = float16 = half).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import PurePosixPath
from typing import Any

import httpx
from prometheus_client.core import GaugeMetricFamily, Metric

from proxy import engines
from proxy.config.settings import Settings
from proxy.engines import Facts, PollError, quant_key
from proxy.server.record.tasks import held
from proxy.server.request.upstream import Engine

log = logging.getLogger("enginemeter.enginestate")

PREFIX = "enginemeter"
DRIFT_FIELDS = ("context_length", "model", "slots", "quantization")
HEALTH_FIELDS = ("up", "kind", "model", "model_path", "context_length", "slots", "busy_slots", "quantization", "weights_format", "kv_pool_tokens", "build", "error")  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class EngineState(Facts):
    """An engine's ``Facts`` as of its last poll, and how that poll went."""

    name: str
    up: bool = False
    kind: str | None = None
    error: str | None = None
    #: time.monotonic() of the last poll (any outcome), and of the last successful one
    t_poll: float | None = None
    t_ok: float | None = None


# --------------------------------------------------------------------------------------------- drift


def route_label(models: Iterable[str]) -> str:
    return ",".join(models)


def model_identity(settings: Settings, route_models: Iterable[str], engine: str, served: str | None) -> str | None:
    """What "the same model" means for drift. Where one of the route's model aliases (any alias for a ``*``
    route) maps this engine to a served name and the engine serves exactly that name, the alias is the
    identity (the operator declared the engines equivalent); otherwise the served name itself, reduced to its
    file/dir stem, lower-cased."""
    if served is None:
        return None
    route_models = tuple(route_models)
    for m in settings.models:
        if (m.alias in route_models or "*" in route_models) and m.engines.get(engine) == served:
            return f"alias:{m.alias}"
    stem = PurePosixPath(served).name.lower()
    return stem.removesuffix(".gguf")


def drift(settings: Settings, states: Mapping[str, EngineState]) -> list[dict[str, Any]]:
    """Per route with more than one engine and per field: whether the engines' known values differ.
    A field is left out while fewer than two engines of the route report it."""
    out = []
    for r in settings.routes:
        names = list(dict.fromkeys([r.primary, *r.shadows, *r.split]))
        if len(names) < 2:
            continue
        for fld in DRIFT_FIELDS:
            values: dict[str, object] = {}
            for n in names:
                s = states.get(n)
                if s is None:
                    continue
                v: object
                if fld == "model":
                    v = model_identity(settings, r.models, n, s.model)
                elif fld == "quantization":
                    v = quant_key(s.quantization)
                else:
                    v = getattr(s, fld)
                if v is not None:
                    values[n] = v
            if len(values) >= 2:
                differ = len({repr(v) for v in values.values()}) > 1
                out.append({"route": route_label(r.models), "field": fld, "drift": differ, "values": values})
    return out


# --------------------------------------------------------------------------------------------- poller


class EngineStatePoller:
    """Polls every engine at ``interval``; is the Prometheus collector for what it learned."""

    def __init__(self, settings: Settings, engines: Mapping[str, Engine], *, interval: float = 10.0) -> None:
        self.settings = settings
        self.engines = engines
        self.interval = interval
        self.timeout = max(0.5, min(3.0, interval / 2))
        self.states: dict[str, EngineState] = {}
        self.polls = 0

    async def poll(self, engine: Engine) -> EngineState:
        prev = self.states.get(engine.name, EngineState(name=engine.name))
        now = time.monotonic()
        try:
            if engine.kind is None:
                await engine.probe(self.timeout)
            kind = engine.effective_kind
            facts = await engines.dialect(kind).poll(engine.client, self.timeout)
        except (PollError, httpx.HTTPError) as exc:
            err = f"{type(exc).__name__}: {exc}" if isinstance(exc, httpx.HTTPError) else str(exc)
            if prev.up or prev.t_poll is None:
                log.warning("engine %s state poll failed: %s", engine.name, err)
            return replace(prev, up=False, busy_slots=None, error=err, t_poll=now)
        if not prev.up and prev.t_poll is not None:
            log.info("engine %s state poll recovered", engine.name)
        got = asdict(facts)
        got["model"] = facts.model or engine.model
        return EngineState(name=engine.name, up=True, kind=kind, t_poll=now, t_ok=now, **got)

    async def poll_all(self) -> None:
        names = list(self.engines)
        results = await asyncio.gather(*(self.poll(self.engines[n]) for n in names))
        # one dict assignment: the scrape thread sees either the old or the new mapping
        self.states = dict(zip(names, results, strict=True))
        self.polls += 1

    async def run(self) -> None:
        while True:
            t0 = time.monotonic()
            try:
                await self.poll_all()
            except Exception:
                log.exception("engine state poll failed")
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - t0)))

    # ---- exposition ------------------------------------------------------------------------------

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        states = self.states
        if not states:
            return
        up = GaugeMetricFamily(
            f"{PREFIX}_engine_up", "1 if the engine answered its last state poll, else 0.", labels=("engine",)
        )
        info = GaugeMetricFamily(
            f"{PREFIX}_engine_info",
            "Always 1; labels carry what the engine reports about itself (empty: unknown).",
            labels=("engine", "kind", "model", "quantization", "build"),
        )
        ctx = GaugeMetricFamily(
            f"{PREFIX}_engine_context_length", "Longest request the engine accepts, in tokens.", labels=("engine",)
        )
        slots = GaugeMetricFamily(
            f"{PREFIX}_engine_slots",
            "Requests the engine runs at once (llama.cpp slots, SGLang max running requests).",
            labels=("engine",),
        )
        busy = GaugeMetricFamily(
            f"{PREFIX}_engine_busy_slots", "Requests the engine is running now (last poll).", labels=("engine",)
        )
        age = GaugeMetricFamily(
            f"{PREFIX}_engine_state_age_seconds",
            "Seconds since the last successful state poll, at scrape time.",
            labels=("engine",),
        )
        now = time.monotonic()
        for name, s in states.items():
            up.add_metric([name], 1.0 if s.up else 0.0)
            if s.t_ok is None:
                continue
            info.add_metric([name, s.kind or "", s.model or "", s.quantization or "", s.build or ""], 1.0)
            age.add_metric([name], max(0.0, now - s.t_ok))
            if s.context_length is not None:
                ctx.add_metric([name], s.context_length)
            if s.slots is not None:
                slots.add_metric([name], s.slots)
            if s.busy_slots is not None:
                busy.add_metric([name], s.busy_slots)
        dr = GaugeMetricFamily(
            f"{PREFIX}_route_drift",
            "1 when the engines of one route (primary, shadows, split) report different values of `field`.",
            labels=("route", "field"),
        )
        for d in drift(self.settings, states):
            dr.add_metric([d["route"], d["field"]], 1.0 if d["drift"] else 0.0)
        yield from (f for f in (up, info, ctx, slots, busy, age, dr) if f.samples)

    def health(self) -> dict[str, Any]:
        now = time.monotonic()
        out: dict[str, Any] = {}
        for name, s in self.states.items():
            d = {k: getattr(s, k) for k in HEALTH_FIELDS if getattr(s, k) is not None}
            if s.t_ok is not None:
                d["age_s"] = round(now - s.t_ok, 3)
            out[name] = d
        return {
            "engine_state": {"interval_s": self.interval, "engines": out},
            "drift": [d for d in drift(self.settings, self.states) if d["drift"]],
        }

    def running(self) -> contextlib.AbstractAsyncContextManager[None]:
        """Held for the app's lifetime: polls at ``interval`` until exit."""
        return held(self.run)
