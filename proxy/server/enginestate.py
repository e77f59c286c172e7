"""Engine state: what each engine says about its own configuration and load, polled at an interval.

Only cheap GETs with short timeouts, never a generation (SGLang's ``/health`` generates; we never call it):

- llama.cpp: ``/props`` (per-slot ``n_ctx``, ``total_slots``, ``model_path``, ``build_info``), ``/slots``
  (busy = ``is_processing`` count; 501 with ``--no-slots``, then busy is unknown), ``/v1/models`` (served id,
  ``meta.ftype``).
- SGLang: ``/server_info`` (falls back to ``/get_server_info``), ``/model_info`` (falls back to
  ``/get_model_info``), ``/v1/models`` (``max_model_len``).
- vLLM: ``/v1/models`` (``max_model_len``), ``/version``, and ``vllm:num_requests_running`` from ``/metrics``.
- anything else: ``/v1/models``.

A poll replaces the engine's ``EngineState`` whole; the Prometheus collector reads the latest states and never
does I/O. When a poll fails, ``engine_up`` is 0 and busy slots become absent; the static facts of the last
good poll (context length, slots, model) stay, so a drift signal does not flap while an engine restarts.

Context length is the longest request one engine accepts: llama.cpp's per-slot ``n_ctx`` (``-c`` divided by
``-np`` unless the KV cache is unified), SGLang's and vLLM's ``max_model_len``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import PurePosixPath
from typing import Any

import httpx
from prometheus_client.core import GaugeMetricFamily, Metric

from proxy.server.upstream import Engine
from proxy.settings import Settings

log = logging.getLogger("enginemeter.enginestate")

PREFIX = "enginemeter"
DRIFT_FIELDS = ("context_length", "model", "slots", "quantization")
HEALTH_FIELDS = ("up", "kind", "model", "model_path", "context_length", "slots", "busy_slots", "quantization", "build", "error")  # fmt: skip


@dataclass(frozen=True)
class EngineState:
    name: str
    up: bool = False
    kind: str | None = None
    #: served model id (``/v1/models`` ``data[0].id``)
    model: str | None = None
    model_path: str | None = None
    context_length: int | None = None
    #: llama.cpp total slots; SGLang max running requests; vLLM: unknown
    slots: int | None = None
    busy_slots: int | None = None
    quantization: str | None = None
    build: str | None = None
    error: str | None = None
    #: time.monotonic() of the last poll (any outcome), and of the last successful one
    t_poll: float | None = None
    t_ok: float | None = None


class PollError(Exception):
    pass


def _int(v: object) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str) and v.isdigit():
        return int(v)
    return None


def _str(v: object) -> str | None:
    return v if isinstance(v, str) and v else None


async def _get_json(client: httpx.AsyncClient, path: str, timeout: float) -> Any:
    """GET ``path`` -> parsed JSON. Raises PollError (status or body) or httpx.HTTPError (transport)."""
    r = await client.get(path, timeout=timeout)
    if r.status_code != 200:
        raise PollError(f"HTTP {r.status_code} from {path}")
    try:
        return r.json()
    except ValueError as exc:
        raise PollError(f"{path} did not return JSON") from exc


async def _first_json(client: httpx.AsyncClient, paths: Iterable[str], timeout: float) -> Any:
    last: PollError | None = None
    for p in paths:
        try:
            return await _get_json(client, p, timeout)
        except PollError as exc:
            last = exc
    assert last is not None
    raise last


def _model_card(doc: Any) -> dict[str, Any]:
    data = doc.get("data") if isinstance(doc, dict) else None
    if isinstance(data, list) and data and isinstance(data[0], dict):
        return data[0]
    return {}


async def poll_llamacpp(client: httpx.AsyncClient, timeout: float) -> dict[str, Any]:
    props = await _get_json(client, "/props", timeout)
    if not isinstance(props, dict):
        raise PollError("/props is not an object")
    dgs = props.get("default_generation_settings")
    n_ctx = _int(dgs.get("n_ctx")) if isinstance(dgs, dict) else None
    card: dict[str, Any] = {}
    with contextlib.suppress(PollError, httpx.HTTPError):
        card = _model_card(await _get_json(client, "/v1/models", timeout))
    meta = card.get("meta") if isinstance(card.get("meta"), dict) else {}
    busy = None
    with contextlib.suppress(PollError, httpx.HTTPError):
        slots = await _get_json(client, "/slots", timeout)
        if isinstance(slots, list):
            busy = sum(1 for s in slots if isinstance(s, dict) and s.get("is_processing") is True)
            if n_ctx is None and slots and isinstance(slots[0], dict):
                n_ctx = _int(slots[0].get("n_ctx"))
    assert isinstance(meta, dict)
    return {
        "model": _str(card.get("id")) or _str(props.get("model_alias")),
        "model_path": _str(props.get("model_path")),
        "context_length": n_ctx,
        "slots": _int(props.get("total_slots")),
        "busy_slots": busy,
        "quantization": _str(props.get("model_ftype")) or _ftype(meta.get("ftype")),
        "build": _str(props.get("build_info")),
    }


def _ftype(v: object) -> str | None:
    # llama.cpp's /v1/models meta.ftype is the numeric llama_ftype; name the common ones
    names = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
             12: "Q3_K_M", 15: "Q4_K_M", 17: "Q5_K_M", 18: "Q6_K", 32: "BF16"}  # fmt: skip
    if isinstance(v, str):
        return v or None
    i = _int(v)
    return None if i is None else names.get(i, f"ftype{i}")


async def poll_sglang(client: httpx.AsyncClient, timeout: float) -> dict[str, Any]:
    info = await _first_json(client, ("/server_info", "/get_server_info"), timeout)
    if not isinstance(info, dict):
        raise PollError("/server_info is not an object")
    minfo: dict[str, Any] = {}
    with contextlib.suppress(PollError, httpx.HTTPError):
        m = await _first_json(client, ("/model_info", "/get_model_info"), timeout)
        minfo = m if isinstance(m, dict) else {}
    card: dict[str, Any] = {}
    with contextlib.suppress(PollError, httpx.HTTPError):
        card = _model_card(await _get_json(client, "/v1/models", timeout))
    states = info.get("internal_states")
    st0 = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}
    served = info.get("served_model_name")
    if isinstance(served, list):
        served = served[0] if served else None
    return {
        "model": _str(card.get("id")) or _str(minfo.get("served_model_name")) or _str(served),
        "model_path": _str(minfo.get("model_path")) or _str(info.get("model_path")),
        "context_length": _int(card.get("max_model_len")) or _int(info.get("context_length")),
        # the scheduler's resolved value when it reports one; the server argument otherwise
        "slots": _int(st0.get("max_running_requests")) or _int(info.get("max_running_requests")),
        "busy_slots": _int(st0.get("num_running_reqs")),
        "quantization": _str(info.get("quantization")) or _dtype(info.get("dtype")),
        "build": _str(info.get("version")),
    }


def _dtype(v: object) -> str | None:
    s = _str(v)
    return None if s is None or s == "auto" else s


_VLLM_RUNNING = re.compile(r"^vllm:num_requests_running(?:\{[^}]*\})?\s+([0-9.eE+-]+)", re.M)


async def poll_vllm(client: httpx.AsyncClient, timeout: float) -> dict[str, Any]:
    card = _model_card(await _get_json(client, "/v1/models", timeout))
    build = None
    with contextlib.suppress(PollError, httpx.HTTPError):
        v = await _get_json(client, "/version", timeout)
        build = _str(v.get("version")) if isinstance(v, dict) else None
    busy = None
    with contextlib.suppress(httpx.HTTPError):
        r = await client.get("/metrics", timeout=timeout)
        found = _VLLM_RUNNING.findall(r.text) if r.status_code == 200 else []
        busy = round(sum(float(x) for x in found)) if found else None
    return {
        "model": _str(card.get("id")),
        "model_path": _str(card.get("root")),
        "context_length": _int(card.get("max_model_len")),
        "busy_slots": busy,
        "build": build,
    }


async def poll_openai(client: httpx.AsyncClient, timeout: float) -> dict[str, Any]:
    card = _model_card(await _get_json(client, "/v1/models", timeout))
    return {"model": _str(card.get("id")), "context_length": _int(card.get("max_model_len"))}


POLLERS = {"llamacpp": poll_llamacpp, "sglang": poll_sglang, "vllm": poll_vllm, "openai": poll_openai}


# --------------------------------------------------------------------------------------------- drift


_QUANT_ALIASES = {"float16": "f16", "half": "f16", "fp16": "f16", "bfloat16": "bf16", "float32": "f32",
                  "fp32": "f32", "float": "f32", "mostly_f16": "f16", "mostly_bf16": "bf16"}  # fmt: skip


def quant_key(q: str | None) -> str | None:
    if q is None:
        return None
    k = q.strip().lower().replace(" - ", "_").replace(" ", "_")
    return _QUANT_ALIASES.get(k, k)


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
        prev = self.states.get(engine.name, EngineState(engine.name))
        now = time.monotonic()
        try:
            if engine.kind is None:
                await engine.probe(self.timeout)
            kind = engine.effective_kind
            got = await POLLERS[kind](engine.client, self.timeout)
        except (PollError, httpx.HTTPError) as exc:
            err = f"{type(exc).__name__}: {exc}" if isinstance(exc, httpx.HTTPError) else str(exc)
            if prev.up or prev.t_poll is None:
                log.warning("engine %s state poll failed: %s", engine.name, err)
            return replace(prev, up=False, busy_slots=None, error=err, t_poll=now)
        if not prev.up and prev.t_poll is not None:
            log.info("engine %s state poll recovered", engine.name)
        got.setdefault("model", None)
        if got["model"] is None:
            got["model"] = engine.model
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
        up = GaugeMetricFamily(f"{PREFIX}_engine_up", "1 if the engine answered its last state poll, else 0.", labels=("engine",))  # fmt: skip
        info = GaugeMetricFamily(
            f"{PREFIX}_engine_info",
            "Always 1; labels carry what the engine reports about itself (empty: unknown).",
            labels=("engine", "kind", "model", "quantization", "build"),
        )
        ctx = GaugeMetricFamily(f"{PREFIX}_engine_context_length", "Longest request the engine accepts, in tokens.", labels=("engine",))  # fmt: skip
        slots = GaugeMetricFamily(f"{PREFIX}_engine_slots", "Requests the engine runs at once (llama.cpp slots, SGLang max running requests).", labels=("engine",))  # fmt: skip
        busy = GaugeMetricFamily(f"{PREFIX}_engine_busy_slots", "Requests the engine is running now (last poll).", labels=("engine",))  # fmt: skip
        age = GaugeMetricFamily(f"{PREFIX}_engine_state_age_seconds", "Seconds since the last successful state poll, at scrape time.", labels=("engine",))  # fmt: skip
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

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Held for the app's lifetime: polls at ``interval`` until exit."""
        task = asyncio.ensure_future(self.run())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
