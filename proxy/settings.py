"""One frozen Settings object, parsed once at start from a YAML file, ``ENGINEMETER_*`` environment and CLI flags.

Precedence (later wins): built-in defaults < YAML file < environment < CLI flags. Nothing here runs on the
request path: the server reads plain attributes of frozen objects.

The file is validated against :class:`ConfigFile` by pydantic with strict types and unknown keys refused, so
``read: abc``, ``max_in_flight: "3"``, ``gpu: "no"`` or a misspelt ``temprature`` are errors, not guesses.
Every mistake becomes a :class:`SettingsError` whose lines read ``FILE:LINE: key.path: what was expected``.
The file's JSON Schema (``docs/config.schema.json``) and its reference (``docs/config.md``) are generated from
these classes by ``scripts/config_docs.py``; a test fails when either is stale.

``${NAME}`` inside any string of the file is replaced by the environment variable ``NAME`` (for secrets:
``api_key: ${SGLANG_KEY}``); ``$${`` is a literal ``${``; an unset variable is an error.

The section classes (``EngineSettings``, ``RouteSettings``, ``MirrorSettings``, ...) are both the file's
sections and the runtime objects. ``Settings`` is the runtime whole: the file's ``listen`` split into
``host``/``port``, ``api_keys`` as a set, ``sampling_defaults`` as a plain mapping, and the ``quick`` flag.
A new section is one class below plus one field on ``ConfigFile`` and on ``Settings`` (copied by name).
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import json
import math
import os
import re
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import AfterValidator, ConfigDict, Field, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass

from proxy.types import EngineKind

#: llama-server's own hidden defaults (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05). Using them as the
#: proxy's defaults means putting enginemeter in front of llama.cpp changes nothing for existing clients,
#: while every other engine now receives the same explicit values instead of its generation_config.
DEFAULT_SAMPLING: Mapping[str, float] = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}

DEFAULT_LISTEN = "127.0.0.1:8080"

#: unknown keys are refused; types are strict when a file is read (``_ADAPTER.validate_json(strict=True)``),
#: lax for Python callers (tests build these with tuples or lists alike)
_SECTION = ConfigDict(extra="forbid")


class SettingsError(ValueError):
    """The configuration is invalid. Each problem is one line naming where (file:line, flag or environment
    variable), the key path and what was expected; ``str()`` is the first problem plus a count of the rest."""

    def __init__(self, *problems: str) -> None:
        super().__init__(*problems)
        self.problems: tuple[str, ...] = problems

    def __str__(self) -> str:
        more = len(self.problems) - 1
        return self.problems[0] + (f" (and {more} more problem{'s' * (more > 1)})" if more > 0 else "")


# --------------------------------------------------------------------------------------------- field checks


def _url(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"expected a URL like http://host:port, got {value!r}")
    return value.rstrip("/")


def split_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:8080`` for IPv6; an empty host is 127.0.0.1) -> (host, port)."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected HOST:PORT (e.g. {DEFAULT_LISTEN}), got {value!r}")
    return (host or "127.0.0.1").strip("[]"), int(port)


def _listen(value: str) -> str:
    split_listen(value)
    return value


Url = Annotated[str, AfterValidator(_url)]
Listen = Annotated[str, AfterValidator(_listen)]
HeaderName = Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$"), AfterValidator(str.lower)]
Name = Annotated[str, Field(min_length=1)]
Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]


# --------------------------------------------------------------------------------------------- sections


@dataclass(frozen=True, config=_SECTION)
class Timeouts:
    """Per-engine timeouts in seconds (httpx's four)."""

    connect: Seconds = Field(default=5.0, description="open a TCP connection to the engine")
    read: Seconds = Field(default=600.0, description="longest silence between two reads, first token included")
    write: Seconds = Field(default=30.0, description="send the request body")
    pool: Seconds = Field(default=10.0, description="wait for a free connection from the engine's pool")


@dataclass(frozen=True, config=_SECTION)
class EngineSettings:
    """An engine behind the proxy."""

    name: Name = Field(description="the engine's name: metric label, route target, pin header value")
    url: Url = Field(description="base URL, e.g. http://127.0.0.1:8081 (no /v1)")
    kind: EngineKind | None = Field(
        default=None, description="probed when omitted: /props → llamacpp, /server_info → sglang, /version → vllm"
    )
    model: str | None = Field(default=None, description="served model name; probed from /v1/models when omitted")
    api_key: str | None = Field(
        default=None, repr=False, description="sent upstream as a bearer token; write it as ${ENV_VAR}"
    )
    timeouts: Timeouts = Field(default_factory=Timeouts, description="seconds")
    max_connections: int = Field(default=512, ge=1, description="connection pool size to this engine")
    pid: int | None = Field(default=None, ge=1, description="engine process id, for GPU memory attribution")
    pid_file: str | None = Field(default=None, description="file holding the engine's pid (read on each poll)")


@dataclass(frozen=True, config=_SECTION)
class ModelAlias:
    """A client-facing model name and what each engine calls it."""

    alias: Name = Field(description="the model name clients send")
    engines: Mapping[str, str] = Field(
        default_factory=dict, description="engine name → that engine's served model name (default: its probed name)"
    )


@dataclass(frozen=True, config=_SECTION, kw_only=True)
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


@dataclass(frozen=True, config=_SECTION)
class MirrorSettings:
    """Shadow copies and the comparison log."""

    enabled: bool = Field(default=True, description="mirroring on at start (switchable at /admin/mirror)")
    max_in_flight: int = Field(default=64, ge=1, description="copies in flight per shadow engine; more are shed")
    timeout: Seconds = Field(default=600.0, description="seconds a shadow copy may take in all")
    log_path: str | None = Field(default=None, description="comparison log (JSONL, one pair a line); none = off")
    log_max_bytes: int = Field(default=50_000_000, ge=1, description="rotate the log above this size")
    log_backups: int = Field(default=3, ge=0, description="rotated files kept (log.1, log.2, ...)")
    record_text: bool = Field(default=False, description="also log both outputs' text (privacy: off by default)")


@dataclass(frozen=True, config=_SECTION)
class CollectorSettings:
    """Background pollers."""

    gpu: bool = Field(default=True, description="sample GPU memory through NVML")
    gpu_interval: Seconds = Field(default=2.0, description="seconds between NVML samples")
    engine_interval: Seconds = Field(default=10.0, description="seconds between engine-state polls")


@dataclass(frozen=True, config=_SECTION)
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


#: histogram families whose boundaries ``metrics.buckets`` may set (defaults in proxy/server/metrics.py)
BucketKey = Literal["ttft", "e2e", "inter_chunk", "overhead", "tokens", "decode_tps", "prefill_tps"]
BUCKET_KEYS: tuple[BucketKey, ...] = typing.get_args(BucketKey)


def _bounds(value: tuple[float, ...]) -> tuple[float, ...]:
    if not value:
        raise ValueError("expected a non-empty list of numbers")
    if not all(math.isfinite(b) for b in value) or any(a >= b for a, b in itertools.pairwise(value)):
        raise ValueError("boundaries must be finite and strictly increasing (+Inf is implicit)")
    return value


Bounds = Annotated[tuple[float, ...], AfterValidator(_bounds)]


@dataclass(frozen=True, config=_SECTION)
class MetricsSettings:
    """Prometheus histogram boundaries (docs/metrics.md#buckets)."""

    buckets: dict[BucketKey, Bounds] = Field(
        default_factory=dict,
        description="histogram family -> strictly increasing boundaries; a family left out keeps its default",
    )


# --------------------------------------------------------------------------------------------- the file


@dataclass(frozen=True, config=_SECTION)
class ConfigFile:
    """The YAML file. Every key is optional except ``engines`` when no ``--primary`` flag is given."""

    listen: Listen = Field(default=DEFAULT_LISTEN, description="HOST:PORT the proxy binds ([::1]:8080 for IPv6)")
    api_keys: tuple[str, ...] = Field(default=(), description="client bearer keys; empty = no auth")
    admin_key: str | None = Field(default=None, description="bearer key for /admin/*; none = admin endpoints off")
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1, description="larger request bodies get a 413")
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
    metrics: MetricsSettings = Field(default_factory=MetricsSettings, description="histogram boundaries")


_ADAPTER: TypeAdapter[ConfigFile] = TypeAdapter(ConfigFile)


def json_schema() -> dict[str, Any]:
    """The JSON Schema of the YAML file (``docs/config.schema.json``), for editors and ``check-config``."""
    schema = _ADAPTER.json_schema()

    def strip_titles(node: Any) -> None:  # pydantic's "Connect"/"Read" titles only repeat the key
        if isinstance(node, dict):
            for prop in (node.get("properties") or {}).values():
                prop.pop("title", None)
            for v in node.values():
                strip_titles(v)
        elif isinstance(node, list):
            for v in node:
                strip_titles(v)

    strip_titles(schema)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "enginemeter configuration",
        **{k: v for k, v in schema.items() if k != "title"},
    }


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
    max_body_bytes: int = 4 * 1024 * 1024
    default_route: int | None = None
    sampling_defaults: Mapping[str, Any] = Field(default_factory=lambda: dict(DEFAULT_SAMPLING))
    pin_header: str = "x-enginemeter-engine"
    mirror: MirrorSettings = Field(default_factory=MirrorSettings)
    collectors: CollectorSettings = Field(default_factory=CollectorSettings)
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)
    #: True when built from --primary/--shadow only: every client model name routes to the primary
    quick: bool = False

    def engine(self, name: str) -> EngineSettings:
        for e in self.engines:
            if e.name == name:
                return e
        raise KeyError(name)


def _from_file(doc: ConfigFile) -> Settings:
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


# --------------------------------------------------------------------------------------------- reading a file

Loc = tuple[str | int, ...]


class _Problems:
    """Collects ``(loc, message)`` and renders each as ``SOURCE:LINE: path: message``."""

    def __init__(self, source: str, lines: Mapping[Loc, int] | None = None) -> None:
        self.source = source
        self.lines = lines if lines is not None else {}
        self.items: list[str] = []

    def add(self, loc: Loc, message: str) -> None:
        line = next((self.lines[loc[:n]] for n in range(len(loc), -1, -1) if loc[:n] in self.lines), None)
        where = f"{self.source}:{line}" if line is not None else self.source
        self.items.append(f"{where}: {_path(loc)}: {message}" if loc else f"{where}: {message}")

    def raise_if_any(self) -> None:
        if self.items:
            raise SettingsError(*self.items)


def _path(loc: Loc) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return repr(value)


_EXPECTED = {
    "float_type": "a number",
    "float_parsing": "a number",
    "finite_number": "a finite number",
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "tuple_type": "a list",
    "list_type": "a list",
    "set_type": "a list",
    "frozen_set_type": "a list",
    "dict_type": "a mapping",
    "mapping_type": "a mapping",
    "dataclass_type": "a mapping",
    "model_type": "a mapping",
}


def _keys_at(loc: Loc) -> list[str]:
    """The keys the file may have at ``loc`` (for 'unknown key' messages), walked from ConfigFile's types."""
    tp: Any = ConfigFile
    for part in loc:
        while typing.get_origin(tp) is Annotated:
            tp = typing.get_args(tp)[0]
        if isinstance(part, int):
            tp = typing.get_args(tp)[0] if typing.get_args(tp) else Any
        elif dataclasses.is_dataclass(tp):
            tp = typing.get_type_hints(tp, include_extras=True).get(part, Any)
        else:
            return []
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            tp = next((a for a in typing.get_args(tp) if a is not type(None)), Any)
    return [f.name for f in dataclasses.fields(tp)] if dataclasses.is_dataclass(tp) else []


def _describe(err: Any) -> tuple[Loc, str]:
    loc: Loc = tuple(p for p in err["loc"] if p != "[key]")
    kind, value, ctx = err["type"], err.get("input"), err.get("ctx") or {}
    if kind in ("extra_forbidden", "unexpected_keyword_argument"):
        known = _keys_at(loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return loc, f"unknown key{hint}; expected one of: {', '.join(known)}" if known else "unknown key"
    if kind == "missing":
        return loc, "required key missing"
    if kind == "value_error":
        return loc, str(ctx.get("error", err["msg"]))
    if kind == "literal_error":
        return loc, f"expected one of {ctx.get('expected', '?')}, got {_show(value)}"
    if kind == "too_short":
        return loc, f"expected at least {ctx.get('min_length', 1)} item(s), got {_show(value)}"
    if kind in _EXPECTED:
        return loc, f"expected {_EXPECTED[kind]}, got {_show(value)}"
    msg = (
        str(err["msg"]).replace("Input should be", "expected a value").replace("String should", "expected a string to")
    )
    return loc, f"{msg}, got {_show(value)}"


def _read_yaml(path: Path) -> tuple[Any, dict[Loc, int]]:
    """Parse once, keeping each key's line number (1-based) by its path; refuse duplicate keys."""
    source = str(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise SettingsError(f"{source}: cannot read: {exc.strerror or exc}") from None
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SettingsError(f"{where}: not valid YAML: {problem}") from None
    finally:
        loader.dispose()
    lines: dict[Loc, int] = {}
    problems = _Problems(source, lines)

    def walk(n: yaml.Node, loc: Loc) -> None:
        lines.setdefault(loc, n.start_mark.line + 1)
        if isinstance(n, yaml.MappingNode):
            seen: set[str] = set()
            for k, v in n.value:
                key = str(k.value)
                lines[(*loc, key)] = k.start_mark.line + 1
                if key in seen:
                    problems.add((*loc, key), "duplicate key")
                seen.add(key)
                walk(v, (*loc, key))
        elif isinstance(n, yaml.SequenceNode):
            for i, v in enumerate(n.value):
                walk(v, (*loc, i))

    if node is not None:
        walk(node, ())
    problems.raise_if_any()
    return data, lines


_REF = re.compile(r"\$(\$?)\{([^}]*)\}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _substitute(data: Any, env: Mapping[str, str], problems: _Problems, loc: Loc = ()) -> Any:
    """Replace ``${NAME}`` in every string value by the environment variable (``$${`` stays literal)."""
    if isinstance(data, dict):
        return {k: _substitute(v, env, problems, (*loc, str(k))) for k, v in data.items()}
    if isinstance(data, list):
        return [_substitute(v, env, problems, (*loc, i)) for i, v in enumerate(data)]
    if not isinstance(data, str) or "${" not in data:
        return data

    def one(m: re.Match[str]) -> str:
        if m.group(1):
            return "${" + m.group(2) + "}"
        name = m.group(2)
        if not _ENV_NAME.fullmatch(name):
            problems.add(loc, f"${{{name}}} is not a valid environment variable reference")
            return ""
        if name not in env:
            problems.add(loc, f"environment variable {name} is not set (referenced as ${{{name}}})")
            return ""
        return env[name]

    return _REF.sub(one, data)


def parse_file(path: str | Path, *, env: Mapping[str, str] | None = None) -> Settings:
    """Read, substitute, validate and cross-check one YAML file. Raises SettingsError with every problem."""
    env = os.environ if env is None else env
    path = Path(path)
    data, lines = _read_yaml(path)
    problems = _Problems(str(path), lines)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SettingsError(f"{path}:1: expected a mapping of settings at the top level, got {_show(data)}")
    data = _substitute(data, env, problems)
    problems.raise_if_any()
    try:
        # through JSON so strict mode reads YAML lists as the tuples and sets of the classes above
        doc = _ADAPTER.validate_json(json.dumps(data, default=str), strict=True)
    except ValidationError as exc:
        for err in exc.errors(include_url=False):
            problems.add(*_describe(err))
        problems.raise_if_any()
        raise  # unreachable: a ValidationError has at least one error
    settings = _from_file(doc)
    _cross_check(settings, problems)
    problems.raise_if_any()
    return settings


def _cross_check(s: Settings, problems: _Problems) -> None:
    """What one key's type cannot say: references between sections, duplicates."""
    names = [e.name for e in s.engines]
    known = ", ".join(names) or "none"
    for i, name in enumerate(names):
        if name in names[:i]:
            problems.add(("engines", i, "name"), f"duplicate engine name {name!r}")
    for i, r in enumerate(s.routes):
        refs: list[tuple[str, tuple[str, ...]]] = [("primary", (r.primary,)), ("shadows", r.shadows)]
        refs += [("split", tuple(r.split)), ("pinnable", r.pinnable), ("fallback", r.fallback)]
        for key, values in refs:
            for ref in values:
                if ref not in names:
                    problems.add(("routes", i, key), f"unknown engine {ref!r} (engines: {known})")
        if r.split and sum(r.split.values()) <= 0:
            problems.add(("routes", i, "split"), "expected at least one weight above 0")
    aliases = [m.alias for m in s.models]
    for i, m in enumerate(s.models):
        if m.alias in aliases[:i]:
            problems.add(("models", i, "alias"), f"duplicate alias {m.alias!r}")
        for ref in m.engines:
            if ref not in names:
                problems.add(("models", i, "engines", ref), f"unknown engine {ref!r} (engines: {known})")
    if s.default_route is not None and s.default_route >= len(s.routes):
        problems.add(("default_route",), f"expected an index below {len(s.routes)} (the number of routes)")


# --------------------------------------------------------------------------------------------- load


def load(
    config: str | Path | None = None,
    *,
    primary: str | None = None,
    shadow: str | None = None,
    shadow_rate: float | None = None,
    listen: str | None = None,
    log: str | None = None,
    env: Mapping[str, str] | None = None,
    probe: Callable[[str], EngineKind | None] | None = None,
) -> Settings:
    """Parse file, then ``ENGINEMETER_*`` environment, then flags, into one validated Settings.

    Environment: ENGINEMETER_CONFIG, ENGINEMETER_LISTEN, ENGINEMETER_PRIMARY, ENGINEMETER_SHADOW,
    ENGINEMETER_SHADOW_RATE, ENGINEMETER_API_KEYS (comma-separated), ENGINEMETER_ADMIN_KEY,
    ENGINEMETER_MAX_BODY_BYTES. ``primary``/``shadow`` are ``NAME=URL`` or a bare URL (see :func:`quick`);
    ``log`` is the comparison log (``mirror.log_path``); ``probe`` names bare URLs by their engine kind.
    """
    env = os.environ if env is None else env
    config = config or env.get("ENGINEMETER_CONFIG")
    s = parse_file(config, env=env) if config else Settings(engines=(), routes=())
    if v := env.get("ENGINEMETER_LISTEN"):
        s = dataclasses.replace(s, **_host_port(v, "ENGINEMETER_LISTEN"))
    if v := env.get("ENGINEMETER_API_KEYS"):
        s = dataclasses.replace(s, api_keys=frozenset(k.strip() for k in v.split(",") if k.strip()))
    if v := env.get("ENGINEMETER_ADMIN_KEY"):
        s = dataclasses.replace(s, admin_key=v)
    if v := env.get("ENGINEMETER_MAX_BODY_BYTES"):
        if not v.isdigit() or int(v) < 1:
            raise SettingsError(f"ENGINEMETER_MAX_BODY_BYTES: expected a positive integer, got {v!r}")
        s = dataclasses.replace(s, max_body_bytes=int(v))
    primary = primary or env.get("ENGINEMETER_PRIMARY")
    shadow = shadow or env.get("ENGINEMETER_SHADOW")
    if shadow_rate is None and (v := env.get("ENGINEMETER_SHADOW_RATE")):
        try:
            shadow_rate = float(v)
        except ValueError:
            raise SettingsError(f"ENGINEMETER_SHADOW_RATE: expected a number within [0, 1], got {v!r}") from None
    if primary:
        s = quick(s, primary=primary, shadow=shadow, shadow_rate=shadow_rate, probe=probe)
    elif shadow:
        raise SettingsError("--shadow: needs --primary (or ENGINEMETER_PRIMARY)")
    if listen:
        s = dataclasses.replace(s, **_host_port(listen, "--listen"))
    if log:
        s = dataclasses.replace(s, mirror=dataclasses.replace(s.mirror, log_path=log))
    if not s.engines and config:
        raise SettingsError(f"{config}: no engines configured: add an engines: list, or give --primary URL")
    if not s.engines:
        raise SettingsError("no engines configured: give --primary URL, or a config file with an engines: list")
    return s


def _host_port(value: str, source: str) -> dict[str, Any]:
    try:
        host, port = split_listen(value)
    except ValueError as exc:
        raise SettingsError(f"{source}: {exc}") from None
    return {"host": host, "port": port}


def engine_arg(value: str, source: str) -> tuple[str | None, str]:
    """``NAME=URL`` or a bare ``URL`` -> (name or None, url); raises SettingsError naming ``source``."""
    name: str | None = None
    if not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", value) and "=" in value:
        name, _, value = value.partition("=")
        if not name:
            raise SettingsError(f"{source}: expected NAME=URL or URL, got {'=' + value!r}")
    try:
        return name, _url(value)
    except ValueError as exc:
        raise SettingsError(f"{source}: {exc}") from None


def quick(
    s: Settings,
    *,
    primary: str,
    shadow: str | None = None,
    shadow_rate: float | None = None,
    probe: Callable[[str], EngineKind | None] | None = None,
) -> Settings:
    """The quick form: one route for every model name, to ``primary`` (mirrored to ``shadow``).

    Each engine is ``NAME=URL`` or a bare URL. A bare URL is named after its kind when ``probe`` recognises
    one (``llamacpp``, ``sglang``, ``vllm``; ``llamacpp-1``/``llamacpp-2`` when both are the same), else
    ``engine1``/``engine2`` — never ``primary``/``shadow``, which read like the ``role`` label.
    """
    given = [engine_arg(primary, "--primary")] + ([engine_arg(shadow, "--shadow")] if shadow else [])
    kinds: list[EngineKind | None] = [None] * len(given)
    if probe is not None:
        kinds = [probe(url) if name is None else None for name, url in given]
    names: list[str] = []
    for i, ((name, _), kind) in enumerate(zip(given, kinds, strict=True)):
        if name is None and kind is not None and kind != "openai":
            twin = sum(1 for k in kinds if k == kind) > 1
            name = f"{kind}-{i + 1}" if twin else kind
        names.append(name or f"engine{i + 1}")
    if len(names) == 2 and names[0] == names[1]:
        raise SettingsError(f"--shadow: engine name {names[1]!r} is already the primary's")
    engines = tuple(EngineSettings(name=n, url=u, kind=k) for n, (_, u), k in zip(names, given, kinds, strict=True))
    rate = 1.0 if shadow_rate is None else shadow_rate
    if not 0.0 <= rate <= 1.0:
        raise SettingsError(f"--shadow-rate: expected a number within [0, 1], got {rate:g}")
    shadows = tuple(names[1:])
    route = RouteSettings(models=("*",), primary=names[0], shadows=shadows, pinnable=shadows, sample_rate=rate)
    return dataclasses.replace(s, engines=engines, routes=(route,), models=(), quick=True)
