"""One frozen Settings object, parsed once from a YAML file, environment overrides and CLI flags.

Precedence (later wins): built-in defaults < YAML file < environment (``ENGINEMETER_*``) < CLI flags.
Everything is validated here, at start-up, so the request path never has to.

YAML shape (every key optional except ``engines`` when no ``--primary`` flag is given)::

    listen: 127.0.0.1:8080
    api_keys: [sk-team-a]            # client bearer keys; empty = no auth
    admin_key: s3cret                # guards /admin/*; empty = admin endpoints off
    max_body_bytes: 4194304
    engines:
      - name: llama
        url: http://127.0.0.1:8081
        kind: llamacpp               # llamacpp | sglang | vllm | openai; probed when omitted
        model: qwen2.5-7b            # served model name; probed from /v1/models when omitted
        api_key: ...                 # sent upstream as a bearer token
        timeouts: {connect: 5, read: 600, write: 30, pool: 10}
        max_connections: 512
        pid: 1234                    # or pid_file: /run/llama.pid  (GPU memory attribution)
    models:                          # client-facing aliases
      - alias: qwen-7b
        engines: {llama: qwen2.5-7b, sglang: Qwen/Qwen2.5-7B-Instruct}
    routes:
      - models: [qwen-7b]            # or ["*"]
        primary: llama
        shadows: [sglang]
    default_route: null              # route index used for unknown models; null = 404
    sampling_defaults: {temperature: 0.8, top_k: 40, top_p: 0.95, min_p: 0.05}
    metrics:
      buckets: {ttft: [0.1, 0.2, 0.5, 1, 2, 5]}   # histogram boundaries per family (docs/metrics.md#buckets)
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

import yaml

from proxy.types import ENGINE_KINDS, EngineKind

#: llama-server's own hidden defaults (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05). Using them as the
#: proxy's defaults means putting enginemeter in front of llama.cpp changes nothing for existing clients,
#: while every other engine now receives the same explicit values instead of its generation_config.
DEFAULT_SAMPLING: Mapping[str, float] = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}


class SettingsError(ValueError):
    """The configuration is invalid; the message names the offending key."""


@dataclass(frozen=True)
class Timeouts:
    connect: float = 5.0
    read: float = 600.0
    write: float = 30.0
    pool: float = 10.0


@dataclass(frozen=True)
class EngineSettings:
    name: str
    url: str
    kind: EngineKind | None = None
    model: str | None = None
    api_key: str | None = None
    timeouts: Timeouts = field(default_factory=Timeouts)
    max_connections: int = 512
    pid: int | None = None
    pid_file: str | None = None


@dataclass(frozen=True)
class ModelAlias:
    alias: str
    #: engine name -> that engine's served model name (missing: the engine's own/probed name)
    engines: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RouteSettings:
    #: client model aliases this route serves; "*" matches any model
    models: tuple[str, ...] = ("*",)
    primary: str = ""
    shadows: tuple[str, ...] = ()
    #: optional weighted split over engines: engine -> weight; empty = always the primary
    split: Mapping[str, float] = field(default_factory=dict)
    #: header whose value makes the split sticky (falls back to the OpenAI `user` field)
    sticky_header: str = "x-session-id"
    #: engines a client may pin with the pin header (primary and split engines are always allowed)
    pinnable: tuple[str, ...] = ()
    #: try the next engine when the chosen one fails before the first byte
    fallback: tuple[str, ...] = ()
    sample_rate: float = 1.0


@dataclass(frozen=True)
class MirrorSettings:
    enabled: bool = True
    max_in_flight: int = 64
    timeout: float = 600.0
    log_path: str | None = None
    log_max_bytes: int = 50_000_000
    log_backups: int = 3
    record_text: bool = False


@dataclass(frozen=True)
class CollectorSettings:
    gpu: bool = True
    gpu_interval: float = 2.0
    engine_interval: float = 10.0


#: histogram families whose boundaries ``metrics.buckets`` may set (defaults in proxy/server/metrics.py)
BUCKET_KEYS = ("ttft", "e2e", "inter_chunk", "overhead", "tokens", "decode_tps", "prefill_tps")


@dataclass(frozen=True)
class MetricsSettings:
    #: family (one of BUCKET_KEYS) -> strictly increasing, finite boundaries; a missing family keeps its default
    buckets: Mapping[str, tuple[float, ...]] = field(default_factory=dict)


def _metrics(raw: Mapping[str, Any]) -> MetricsSettings:
    _known(raw, {"buckets"}, "metrics")
    buckets: dict[str, tuple[float, ...]] = {}
    for key, value in _mapping(raw.get("buckets"), "metrics.buckets").items():
        where = f"metrics.buckets.{key}"
        if key not in BUCKET_KEYS:
            raise SettingsError(f"{where}: unknown histogram family; known: {', '.join(BUCKET_KEYS)}")
        if not isinstance(value, Sequence) or isinstance(value, str) or not value:
            raise SettingsError(f"{where}: expected a non-empty list of numbers")
        try:
            bounds = tuple(float(v) for v in value)
        except (TypeError, ValueError) as exc:
            raise SettingsError(f"{where}: expected numbers ({exc})") from exc
        if not all(math.isfinite(b) for b in bounds) or any(a >= b for a, b in itertools.pairwise(bounds)):
            raise SettingsError(f"{where}: boundaries must be finite and strictly increasing (+Inf is implicit)")
        buckets[key] = bounds
    return MetricsSettings(buckets=buckets)


@dataclass(frozen=True)
class Settings:
    engines: tuple[EngineSettings, ...]
    routes: tuple[RouteSettings, ...]
    models: tuple[ModelAlias, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8080
    api_keys: frozenset[str] = frozenset()
    admin_key: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    default_route: int | None = None
    sampling_defaults: Mapping[str, Any] = field(default_factory=lambda: dict(DEFAULT_SAMPLING))
    pin_header: str = "x-enginemeter-engine"
    mirror: MirrorSettings = field(default_factory=MirrorSettings)
    collectors: CollectorSettings = field(default_factory=CollectorSettings)
    metrics: MetricsSettings = field(default_factory=MetricsSettings)
    #: True when built from --primary/--shadow only: every client model name routes to the primary
    quick: bool = False

    def engine(self, name: str) -> EngineSettings:
        for e in self.engines:
            if e.name == name:
                return e
        raise KeyError(name)


# --------------------------------------------------------------------------------------------- parsing


def _check_url(url: object, where: str) -> str:
    if not isinstance(url, str):
        raise SettingsError(f"{where}: url must be a string")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise SettingsError(f"{where}: url {url!r} must look like http://host:port")
    return url.rstrip("/")


def _listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise SettingsError(f"listen: {value!r} must be HOST:PORT")
    return (host or "127.0.0.1").strip("[]"), int(port)


def _mapping(value: object, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SettingsError(f"{where}: expected a mapping")
    return cast(Mapping[str, Any], value)


def _strs(value: object, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        raise SettingsError(f"{where}: expected a list of strings")
    return tuple(value)


def _known(raw: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = set(raw) - allowed
    if unknown:
        raise SettingsError(f"{where}: unknown key(s) {sorted(unknown)}")


def _engine(raw: Mapping[str, Any], i: int) -> EngineSettings:
    where = f"engines[{i}]"
    _known(
        raw,
        {"name", "url", "kind", "model", "api_key", "timeouts", "max_connections", "pid", "pid_file"},
        where,
    )
    kind = raw.get("kind")
    if kind is not None and kind not in ENGINE_KINDS:
        raise SettingsError(f"{where}.kind: {kind!r} is not one of {', '.join(ENGINE_KINDS)}")
    t = _mapping(raw.get("timeouts"), f"{where}.timeouts")
    _known(t, {"connect", "read", "write", "pool"}, f"{where}.timeouts")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise SettingsError(f"{where}.name is required")
    return EngineSettings(
        name=name,
        url=_check_url(raw.get("url"), where),
        kind=cast(EngineKind | None, kind),
        model=raw.get("model"),
        api_key=raw.get("api_key"),
        timeouts=Timeouts(**{k: float(v) for k, v in t.items()}),
        max_connections=int(raw.get("max_connections", 512)),
        pid=int(raw["pid"]) if raw.get("pid") is not None else None,
        pid_file=raw.get("pid_file"),
    )


def _route(raw: Mapping[str, Any], i: int) -> RouteSettings:
    where = f"routes[{i}]"
    _known(
        raw,
        {
            "models",
            "primary",
            "shadows",
            "shadow",
            "split",
            "sticky_header",
            "pinnable",
            "fallback",
            "sample_rate",
        },
        where,
    )
    split = {str(k): float(v) for k, v in _mapping(raw.get("split"), f"{where}.split").items()}
    if any(w < 0 for w in split.values()) or (split and sum(split.values()) <= 0):
        raise SettingsError(f"{where}.split: weights must be >= 0 and not all zero")
    rate = float(raw.get("sample_rate", 1.0))
    if not 0.0 <= rate <= 1.0:
        raise SettingsError(f"{where}.sample_rate must be within [0, 1]")
    primary = raw.get("primary")
    if not isinstance(primary, str):
        raise SettingsError(f"{where}.primary is required")
    return RouteSettings(
        models=_strs(raw.get("models", ["*"]), f"{where}.models") or ("*",),
        primary=primary,
        shadows=_strs(raw.get("shadows", raw.get("shadow")), f"{where}.shadows"),
        split=split,
        sticky_header=str(raw.get("sticky_header", "x-session-id")).lower(),
        pinnable=_strs(raw.get("pinnable"), f"{where}.pinnable"),
        fallback=_strs(raw.get("fallback"), f"{where}.fallback"),
        sample_rate=rate,
    )


def _validate(s: Settings) -> Settings:
    names = [e.name for e in s.engines]
    if not names:
        raise SettingsError("no engines configured: give --primary URL or an engines: list in the config")
    if len(set(names)) != len(names):
        raise SettingsError(f"engines: duplicate names in {names}")
    for i, r in enumerate(s.routes):
        for ref in (r.primary, *r.shadows, *r.split, *r.pinnable, *r.fallback):
            if ref not in names:
                raise SettingsError(f"routes[{i}] names unknown engine {ref!r}")
    aliases = [m.alias for m in s.models]
    if len(set(aliases)) != len(aliases):
        raise SettingsError("models: duplicate alias")
    for m in s.models:
        for ref in m.engines:
            if ref not in names:
                raise SettingsError(f"models[{m.alias}] names unknown engine {ref!r}")
    if s.default_route is not None and not 0 <= s.default_route < len(s.routes):
        raise SettingsError("default_route must index routes")
    if s.max_body_bytes <= 0:
        raise SettingsError("max_body_bytes must be positive")
    return s


def from_mapping(raw: Mapping[str, Any], *, base: Settings | None = None) -> Settings:
    """Build Settings from a parsed YAML document."""
    _known(
        raw,
        {
            "listen",
            "api_keys",
            "admin_key",
            "max_body_bytes",
            "engines",
            "models",
            "routes",
            "default_route",
            "sampling_defaults",
            "pin_header",
            "mirror",
            "collectors",
            "metrics",
        },
        "config",
    )
    engines = tuple(_engine(_mapping(e, f"engines[{i}]"), i) for i, e in enumerate(raw.get("engines") or []))
    routes = tuple(_route(_mapping(r, f"routes[{i}]"), i) for i, r in enumerate(raw.get("routes") or []))
    if engines and not routes:
        routes = (RouteSettings(models=("*",), primary=engines[0].name),)
    models = []
    for i, m in enumerate(raw.get("models") or []):
        m = _mapping(m, f"models[{i}]")
        _known(m, {"alias", "engines"}, f"models[{i}]")
        models.append(
            ModelAlias(alias=str(m["alias"]), engines=dict(_mapping(m.get("engines"), f"models[{i}].engines")))
        )
    mirror = _mapping(raw.get("mirror"), "mirror")
    _known(mirror, {f for f in MirrorSettings.__dataclass_fields__}, "mirror")
    coll = _mapping(raw.get("collectors"), "collectors")
    _known(coll, {f for f in CollectorSettings.__dataclass_fields__}, "collectors")
    s = base or Settings(engines=(), routes=())
    host, port = _listen(str(raw["listen"])) if "listen" in raw else (s.host, s.port)
    defaults = dict(s.sampling_defaults)
    if "sampling_defaults" in raw:
        defaults = dict(_mapping(raw["sampling_defaults"], "sampling_defaults"))
    return replace(
        s,
        engines=engines or s.engines,
        routes=routes or s.routes,
        models=tuple(models) or s.models,
        host=host,
        port=port,
        api_keys=frozenset(_strs(raw.get("api_keys"), "api_keys")) or s.api_keys,
        admin_key=raw.get("admin_key", s.admin_key),
        max_body_bytes=int(raw.get("max_body_bytes", s.max_body_bytes)),
        default_route=raw.get("default_route", s.default_route),
        sampling_defaults=defaults,
        pin_header=str(raw.get("pin_header", s.pin_header)).lower(),
        mirror=replace(s.mirror, **mirror),
        collectors=replace(s.collectors, **coll),
        metrics=_metrics(_mapping(raw["metrics"], "metrics")) if "metrics" in raw else s.metrics,
    )


def load(
    config: str | Path | None = None,
    *,
    primary: str | None = None,
    shadow: str | None = None,
    shadow_rate: float | None = None,
    listen: str | None = None,
    env: Mapping[str, str] | None = None,
) -> Settings:
    """Parse file, then ``ENGINEMETER_*`` environment, then flags, into one validated Settings.

    Environment: ENGINEMETER_CONFIG, ENGINEMETER_LISTEN, ENGINEMETER_PRIMARY, ENGINEMETER_SHADOW,
    ENGINEMETER_SHADOW_RATE, ENGINEMETER_API_KEYS (comma-separated), ENGINEMETER_ADMIN_KEY,
    ENGINEMETER_MAX_BODY_BYTES.
    """
    env = os.environ if env is None else env
    config = config or env.get("ENGINEMETER_CONFIG")
    s = Settings(engines=(), routes=())
    if config:
        try:
            doc = yaml.safe_load(Path(config).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise SettingsError(f"cannot read config {config}: {exc}") from exc
        s = from_mapping(_mapping(doc, "config"), base=s)
    if v := env.get("ENGINEMETER_LISTEN"):
        s = replace(s, host=_listen(v)[0], port=_listen(v)[1])
    if v := env.get("ENGINEMETER_API_KEYS"):
        s = replace(s, api_keys=frozenset(k.strip() for k in v.split(",") if k.strip()))
    if v := env.get("ENGINEMETER_ADMIN_KEY"):
        s = replace(s, admin_key=v)
    if v := env.get("ENGINEMETER_MAX_BODY_BYTES"):
        s = replace(s, max_body_bytes=int(v))
    primary = primary or env.get("ENGINEMETER_PRIMARY")
    shadow = shadow or env.get("ENGINEMETER_SHADOW")
    if shadow_rate is None and env.get("ENGINEMETER_SHADOW_RATE"):
        shadow_rate = float(env["ENGINEMETER_SHADOW_RATE"])
    if primary:
        s = quick(s, primary=primary, shadow=shadow, shadow_rate=shadow_rate)
    elif shadow:
        raise SettingsError("--shadow needs --primary")
    if listen:
        host, port = _listen(listen)
        s = replace(s, host=host, port=port)
    return _validate(s)


def quick(s: Settings, *, primary: str, shadow: str | None = None, shadow_rate: float | None = None) -> Settings:
    """The quick form: one route for every model name, to ``primary`` (mirrored to ``shadow``)."""
    engines = [EngineSettings(name="primary", url=_check_url(primary, "--primary"))]
    if shadow:
        engines.append(EngineSettings(name="shadow", url=_check_url(shadow, "--shadow")))
    rate = 1.0 if shadow_rate is None else shadow_rate
    if not 0.0 <= rate <= 1.0:
        raise SettingsError("--shadow-rate must be within [0, 1]")
    route = RouteSettings(
        models=("*",),
        primary="primary",
        shadows=("shadow",) if shadow else (),
        pinnable=("shadow",) if shadow else (),
        sample_rate=rate,
    )
    return replace(s, engines=tuple(engines), routes=(route,), models=(), quick=True)
