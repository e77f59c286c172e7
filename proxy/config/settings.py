"""One frozen Settings object, parsed once at start from a YAML file, ``ENGINEMETER_*`` environment and CLI flags.

Precedence (later wins): built-in defaults < YAML file < environment < CLI flags. Nothing here runs on the
request path: the server reads plain attributes of frozen objects.

The classes below are the file's schema, validated by pydantic against :class:`ConfigFile` with strict types and
unknown keys refused: ``read: abc``, ``max_in_flight: "3"``, ``gpu: "no"`` or a misspelt ``temprature`` are
errors, not guesses. ``proxy.config.configfile`` reads a file (``${NAME}`` references; each mistake a line
``FILE:LINE: key.path: what was expected`` of a :class:`SettingsError`), the environment and the flags into a
``Settings``. The file's JSON Schema (``docs/config.schema.json``) and reference (``docs/config.md``) are
generated from these classes by ``scripts/config_docs.py``; a test fails when either is stale.

The section classes (``EngineSettings``, ``RouteSettings``, ``MirrorSettings``, ...) are both the file's
sections and the runtime objects. ``Settings`` is the runtime whole: the file's ``listen`` split into
``host``/``port``, ``api_keys`` as a set, ``sampling_defaults`` as a plain mapping, and the ``quick`` flag.
A new section is one class below plus one field on ``ConfigFile`` and on ``Settings`` (copied by name).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import typing
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, TypeAdapter
from pydantic.dataclasses import dataclass

from proxy.config.fields import (
    DEFAULT_LISTEN,
    SECTION,
    HeaderName,
    Key,
    Listen,
    Name,
    Seconds,
    Url,
    split_listen,
)
from proxy.config.switching import RolloutSettings, SwapSettings
from proxy.types import EngineKind

#: llama-server's own hidden defaults (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05). Using them as the
#: proxy's defaults means putting enginemeter in front of llama.cpp changes nothing for existing clients,
#: while every other engine now receives the same explicit values instead of its generation_config.
DEFAULT_SAMPLING: Mapping[str, float] = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}

#: a request header the proxy honours: ``off`` = serve this request but send no copy to the shadows (the bench
#: sends it through a proxy, so its own requests never reach a shadow or the comparison log)
MIRROR_HEADER = "x-enginemeter-mirror"


class SettingsError(ValueError):
    """The configuration is invalid. Each problem is one line naming where (file:line, flag or environment
    variable), the key path and what was expected; ``str()`` is the first problem plus a count of the rest."""

    def __init__(self, *problems: str) -> None:
        super().__init__(*problems)
        self.problems: tuple[str, ...] = problems

    def __str__(self) -> str:
        more = len(self.problems) - 1
        return self.problems[0] + (f" (and {more} more problem{'s' * (more > 1)})" if more > 0 else "")


# --------------------------------------------------------------------------------------------- sections


@dataclass(frozen=True, config=SECTION)
class Timeouts:
    """Per-engine timeouts in seconds (httpx's four)."""

    connect: Seconds = Field(default=5.0, description="open a TCP connection to the engine")
    read: Seconds = Field(default=600.0, description="longest silence between two reads, first token included")
    write: Seconds = Field(default=30.0, description="send the request body")
    pool: Seconds = Field(default=10.0, description="wait for a free connection from the engine's pool")


@dataclass(frozen=True, config=SECTION)
class EngineSettings:
    """An engine behind the proxy."""

    name: Name = Field(description="the engine's name: metric label, route target, pin header value")
    url: Url = Field(
        default="",
        description="base URL, e.g. http://127.0.0.1:8081 (no /v1); for a launched engine, serve sets it from the "
        "port it gives the command",
    )
    launch: str | None = Field(
        default=None,
        description="start the engine from this command (verbatim; {port}: a free port), as bench --launch does; "
        "serve owns it: started when a route needs it, stopped with the proxy",
    )
    kind: EngineKind | None = Field(
        default=None, description="probed when omitted: /props → llamacpp, /server_info → sglang, /version → vllm"
    )
    model: str | None = Field(default=None, description="served model name; probed from /v1/models when omitted")
    api_key: str | None = Field(
        default=None,
        repr=False,
        description="sent upstream as a bearer token on every route; write it as ${ENV_VAR}. Without it, "
        "user:password@ in the url is sent as Basic auth",
    )
    timeouts: Timeouts = Field(default_factory=Timeouts, description="seconds")
    max_connections: int = Field(default=512, ge=1, description="connection pool size to this engine")
    pid: int | None = Field(default=None, ge=1, description="engine process id, for GPU memory attribution")
    pid_file: str | None = Field(default=None, description="file holding the engine's pid (read on each poll)")
    add_timings: bool | None = Field(
        default=None,
        description="add a proxy-measured llama.cpp-shaped `timings` block to its answers; none = the global add_timings",
    )


@dataclass(frozen=True, config=SECTION)
class ModelAlias:
    """A client-facing model name and what each engine calls it."""

    alias: Name = Field(description="the model name clients send")
    engines: Mapping[str, str] = Field(
        default_factory=dict, description="engine name → that engine's served model name (default: its probed name)"
    )


@dataclass(frozen=True, config=SECTION, kw_only=True)
class RouteSettings:
    """Which engine serves which model aliases; see docs/routing.md."""

    models: tuple[str, ...] = Field(default=("*",), min_length=1, description='model aliases, or ["*"] for any')
    primary: Name = Field(description="the engine that answers the client (unless split or pinned)")
    shadows: tuple[str, ...] = Field(default=(), description="engines every request is mirrored to")
    split: Mapping[str, Annotated[float, Field(ge=0, allow_inf_nan=False)]] = Field(
        default_factory=dict, description="engine → weight; requests are spread by weight (empty: the primary)"
    )
    sticky_header: HeaderName = Field(
        default="x-session-id", description="header that keeps a session on one engine (else the `user` field)"
    )
    pinnable: tuple[str, ...] = Field(
        default=(), description="more engines a client may pin (primary, split, fallback: always)"
    )
    fallback: tuple[str, ...] = Field(default=(), description="engines tried in turn when one fails before any byte")
    sample_rate: float = Field(default=1.0, ge=0, le=1, description="fraction of requests mirrored to the shadows")
    rollout: RolloutSettings | None = Field(
        default=None, description="move the route to a candidate engine step by step, rolling back by itself"
    )
    swap: SwapSettings | None = Field(
        default=None,
        description="move the route to a candidate engine on one GPU: stop the primary, launch the candidate, hold "
        "the traffic meanwhile, watch, swap back by itself",
    )


@dataclass(frozen=True, config=SECTION)
class MirrorSettings:
    """Shadow copies and the comparison log."""

    enabled: bool = Field(default=True, description="mirroring on at start (switchable at /admin/mirror)")
    max_in_flight: int = Field(default=64, ge=1, description="copies in flight per shadow engine; more are shed")
    timeout: Seconds = Field(default=600.0, description="seconds a shadow copy may take in all")
    log_path: str | None = Field(default=None, description="comparison log (JSONL, one pair a line); none = off")
    log_max_bytes: int = Field(default=50_000_000, ge=1, description="rotate the log above this size")
    log_backups: int = Field(default=3, ge=0, description="rotated files kept (log.1, log.2, ...)")
    record_text: bool = Field(default=False, description="also log both outputs' text (privacy: off by default)")
    min_effect: float = Field(
        default=0.05, ge=0, lt=1, description="live verdict (/health): the smallest relative difference it calls"
    )


@dataclass(frozen=True, config=SECTION)
class RequestLogSettings:
    """The per-request log: one JSON line per attempt, mode 0600 (docs/requests.md#request-log)."""

    path: str | None = Field(default=None, description="JSONL file, one line per attempt; none = off")
    max_bytes: int = Field(default=50_000_000, ge=1, description="rotate the log above this size")
    backups: int = Field(default=3, ge=0, description="rotated files kept (log.1, log.2, ...)")
    record_text: bool = Field(
        default=False, description="also log the client's prompt and each output's text (privacy: off by default)"
    )


@dataclass(frozen=True, config=SECTION)
class TracingSettings:
    """OpenTelemetry traces over OTLP/HTTP; needs ``pip install 'enginemeter[otel]'`` (docs/requests.md#traces)."""

    enabled: bool = Field(default=False, description="a server span per request, a client span per attempt")
    endpoint: Url = Field(default="http://127.0.0.1:4318/v1/traces", description="OTLP/HTTP traces endpoint")
    sample_ratio: float = Field(
        default=1.0, ge=0, le=1, description="share of new traces kept; a client's traceparent decides its own"
    )
    service_name: Name = Field(default="enginemeter", description="the service.name resource attribute")


@dataclass(frozen=True, config=SECTION)
class CollectorSettings:
    """Background pollers."""

    gpu: bool = Field(default=True, description="sample GPU memory through NVML")
    gpu_interval: Seconds = Field(default=2.0, description="seconds between NVML samples")
    engine_interval: Seconds = Field(default=10.0, description="seconds between engine-state polls")


@dataclass(frozen=True, config=SECTION)
class SamplingDefaults:
    """Values filled in for every sampling param a client omits, for every engine (counted as ``defaulted``).
    Giving this section replaces the built-in set; ``null`` leaves a param unset."""

    temperature: float | None = Field(default=None, ge=0, description="every engine")
    top_k: int | None = Field(default=None, description="self-hosted engines; 0 or less = off (0 or -1 per engine)")
    top_p: float | None = Field(default=None, ge=0, le=1, description="every engine")
    min_p: float | None = Field(default=None, ge=0, le=1, description="self-hosted engines")
    repeat_penalty: float | None = Field(default=None, description="llama.cpp's (last 64 tokens); never converted")
    repetition_penalty: float | None = Field(
        default=None, description="SGLang's/vLLM's (prompt + output); never converted"
    )
    presence_penalty: float | None = Field(default=None, description="every engine")
    frequency_penalty: float | None = Field(default=None, description="every engine")
    seed: int | None = Field(default=None, description="every engine")
    max_tokens: int | None = Field(default=None, ge=1, description="every engine")

    def as_mapping(self) -> dict[str, Any]:
        return {f.name: v for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None}


#: histogram families whose boundaries ``metrics.buckets`` may set (defaults in proxy/server/record/metrics.py)
BucketKey = Literal["ttft", "e2e", "inter_chunk", "overhead", "tokens", "decode_tps", "prefill_tps"]
BUCKET_KEYS: tuple[BucketKey, ...] = typing.get_args(BucketKey)


def _bounds(value: tuple[float, ...]) -> tuple[float, ...]:
    if not value:
        raise ValueError("expected a non-empty list of numbers")
    if not all(math.isfinite(b) for b in value) or any(a >= b for a, b in itertools.pairwise(value)):
        raise ValueError("boundaries must be finite and strictly increasing (+Inf is implicit)")
    return value


Bounds = Annotated[tuple[float, ...], AfterValidator(_bounds)]


@dataclass(frozen=True, config=SECTION)
class MetricsSettings:
    """Who may scrape ``/metrics``, and the Prometheus histogram boundaries (docs/metrics.md#buckets)."""

    access: Literal["public", "key"] = Field(
        default="public",
        description="public: anyone may scrape /metrics (Prometheus' default); key: a scrape needs a bearer key "
        "(an api_keys key or the admin key; Prometheus: authorization.credentials_file)",
    )
    buckets: dict[BucketKey, Bounds] = Field(
        default_factory=dict,
        description="histogram family -> strictly increasing boundaries; a family left out keeps its default",
    )


@dataclass(frozen=True, config=SECTION)
class ConfigFile:
    """The YAML file. Every key is optional except ``engines`` when no ``--primary`` flag is given."""

    listen: Listen = Field(default=DEFAULT_LISTEN, description="HOST:PORT the proxy binds ([::1]:8080 for IPv6)")
    api_keys: tuple[Key, ...] = Field(default=(), description="client bearer keys (each non-blank); none = no auth")
    admin_key: Key | None = Field(
        default=None, description="bearer key for /admin/* (non-blank); none = admin endpoints off"
    )
    health: Literal["key", "public"] = Field(
        default="key",
        description="key: with api_keys set, /health without a key (client or admin) answers only status and "
        "version, the detail (engine URLs, pids, paths) needs one; public: the detail to anyone",
    )
    max_body_bytes: int = Field(
        default=4 * 1024 * 1024,
        ge=1,
        description="larger request bodies get a 413 at once (from the declared content-length; above: what follows)",
    )
    engines: tuple[EngineSettings, ...] = Field(default=(), description="the engines behind the proxy")
    models: tuple[ModelAlias, ...] = Field(default=(), description="client-facing model aliases")
    routes: tuple[RouteSettings, ...] = Field(default=(), description="default: every model → the first engine")
    default_route: int | None = Field(default=None, ge=0, description="route index for unknown models; none = 404")
    sampling_defaults: SamplingDefaults = Field(
        default=SamplingDefaults(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
        description="filled in for every param a client omits (default: llama.cpp's own)",
        json_schema_extra={"default": dict(DEFAULT_SAMPLING)},
    )
    pin_header: HeaderName = Field(default="x-enginemeter-engine", description="request header naming the engine")
    mirror: MirrorSettings = Field(default_factory=MirrorSettings, description="shadow copies, the comparison log")
    collectors: CollectorSettings = Field(default_factory=CollectorSettings, description="background pollers")
    metrics: MetricsSettings = Field(
        default_factory=MetricsSettings, description="who may scrape /metrics, histogram boundaries"
    )
    request_log: RequestLogSettings = Field(
        default_factory=RequestLogSettings, description="one JSON line per attempt; off unless path is set"
    )
    tracing: TracingSettings = Field(default_factory=TracingSettings, description="OpenTelemetry traces; off")
    add_timings: bool = Field(
        default=False,
        description="add a proxy-measured llama.cpp-shaped `timings` block where an engine sends none "
        "(engines[].add_timings wins); docs/requests.md#the-timings-block",
    )


CONFIG_ADAPTER: TypeAdapter[ConfigFile] = TypeAdapter(ConfigFile)


def json_schema() -> dict[str, Any]:
    """The JSON Schema of the YAML file (``docs/config.schema.json``), for editors and ``check-config``."""
    schema = CONFIG_ADAPTER.json_schema()
    _strip_titles(schema)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "enginemeter configuration",
        **{k: v for k, v in schema.items() if k != "title"},
    }


def _strip_titles(node: Any) -> None:
    """pydantic's "Connect"/"Read" titles only repeat the key."""
    if isinstance(node, dict):
        for prop in (node.get("properties") or {}).values():
            prop.pop("title", None)
        node = list(node.values())
    if isinstance(node, list):
        for v in node:
            _strip_titles(v)


# --------------------------------------------------------------------------------------------- runtime


@dataclass(frozen=True)
class Settings:
    """Everything the server reads, built once by :func:`load` (tests build it directly)."""

    engines: tuple[EngineSettings, ...]
    routes: tuple[RouteSettings, ...]
    models: tuple[ModelAlias, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8080
    api_keys: frozenset[str] = Field(default=frozenset(), repr=False)
    admin_key: str | None = Field(default=None, repr=False)
    #: /health's detail without a key when ``api_keys`` are set: "key" (no) or "public" (proxy.server.access)
    health: Literal["key", "public"] = "key"
    max_body_bytes: int = 4 * 1024 * 1024
    default_route: int | None = None
    sampling_defaults: Mapping[str, Any] = Field(default_factory=lambda: dict(DEFAULT_SAMPLING))
    pin_header: str = "x-enginemeter-engine"
    mirror: MirrorSettings = Field(default_factory=MirrorSettings)
    collectors: CollectorSettings = Field(default_factory=CollectorSettings)
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)
    request_log: RequestLogSettings = Field(default_factory=RequestLogSettings)
    tracing: TracingSettings = Field(default_factory=TracingSettings)
    #: add a proxy-measured ``timings`` block for engines that send none (``EngineSettings.add_timings`` wins)
    add_timings: bool = False
    #: True when built from --primary/--shadow only: every client model name routes to the primary
    quick: bool = False
    #: this proxy run's id in the comparison log (``enginemeter serve`` makes one for all its workers; None: the
    #: mirror draws its own)
    run_id: str | None = None

    def engine(self, name: str) -> EngineSettings:
        for e in self.engines:
            if e.name == name:
                return e
        raise KeyError(name)


def from_config_file(doc: ConfigFile) -> Settings:
    host, port = split_listen(doc.listen)
    special = {"listen", "api_keys", "sampling_defaults"}
    same = {f.name: getattr(doc, f.name) for f in dataclasses.fields(doc) if f.name not in special}
    routes = doc.routes or ((RouteSettings(primary=doc.engines[0].name),) if doc.engines else ())
    return Settings(
        **{**same, "routes": routes},
        host=host,
        port=port,
        api_keys=frozenset(doc.api_keys),
        sampling_defaults=doc.sampling_defaults.as_mapping(),
    )
