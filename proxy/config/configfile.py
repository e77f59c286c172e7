"""Reading the configuration: a YAML file (validated against ``proxy.config.settings.ConfigFile``, every mistake one
line ``FILE:LINE: key.path: what was expected``), ``${NAME}`` references, ``ENGINEMETER_*`` environment and CLI
flags, into one frozen :class:`proxy.config.settings.Settings`. Runs once at start, never on the request path.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import TypeAdapter, ValidationError

from proxy.config.crosscheck import Loc, cross_check
from proxy.config.fields import check_url, split_listen
from proxy.config.settings import (
    CONFIG_ADAPTER,
    ConfigFile,
    EngineSettings,
    RouteSettings,
    Settings,
    SettingsError,
    from_config_file,
)
from proxy.types import EngineKind

# --------------------------------------------------------------------------------------------- reading a file


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


class _Hidden:
    """A secret's value in an error message: never the value itself."""

    def __init__(self, value: Any) -> None:
        kinds = {int: "a number", float: "a number", str: "a string"}
        if value == "":
            self.kind = "''"  # nothing to hide
        else:
            self.kind = kinds.get(type(value)) or _show(value if isinstance(value, bool | dict | list) else None)

    def __repr__(self) -> str:
        return self.kind if self.kind == "''" else f"{self.kind} (the value is not shown: a secret)"


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


def _keys_at(loc: Loc, root: Any = ConfigFile) -> list[str]:
    """The keys the file may have at ``loc`` (for 'unknown key' messages), walked from ``root``'s types."""
    tp: Any = root
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


#: keys whose values are secrets: a mistake in one never shows the value
SECRET_KEYS = frozenset({"api_key", "api_keys", "admin_key"})


def _describe(err: Any, root: Any = ConfigFile) -> tuple[Loc, str]:
    loc: Loc = tuple(p for p in err["loc"] if p != "[key]")
    kind, value, ctx = err["type"], err.get("input"), err.get("ctx") or {}
    if SECRET_KEYS.intersection(p for p in loc if isinstance(p, str)):
        value = _Hidden(value)
    if kind in ("extra_forbidden", "unexpected_keyword_argument"):
        known = _keys_at(loc[:-1], root)
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

    out = _REF.sub(one, data)
    if out != out.strip() and SECRET_KEYS.intersection(str(part) for part in loc):
        # a variable read from a file often ends in a newline: kept, it would be part of the key
        problems.add(loc, "the value has leading or trailing whitespace after ${...} substitution; a key keeps none")
    return out


def read_document(
    path: str | Path, adapter: TypeAdapter[Any], root: Any, *, env: Mapping[str, str] | None = None
) -> tuple[Any, _Problems]:
    """Read, substitute and validate one YAML file against ``adapter`` (whose type is ``root``, for 'unknown key'
    hints): the document, and the problem collector (with line numbers) for the caller's cross-checks. Raises
    SettingsError with every problem. The proxy's config and the bench's file (``proxy.bench.run.benchfile``) share it."""
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
        doc = adapter.validate_json(json.dumps(data, default=str), strict=True)
    except ValidationError as exc:
        for err in exc.errors(include_url=False):
            problems.add(*_describe(err, root))
        problems.raise_if_any()
        raise  # unreachable: a ValidationError has at least one error
    return doc, problems


def parse_file(path: str | Path, *, env: Mapping[str, str] | None = None) -> Settings:
    """Read, substitute, validate and cross-check one YAML file. Raises SettingsError with every problem."""
    doc, problems = read_document(path, CONFIG_ADAPTER, ConfigFile, env=env)
    settings = from_config_file(doc)
    cross_check(settings, problems.add)
    _state_file_problems(settings, problems.add)
    problems.raise_if_any()
    return settings


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
    if (v := env.get("ENGINEMETER_API_KEYS")) is not None:
        s = dataclasses.replace(s, api_keys=_env_keys(v))
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
    if s.metrics.access == "key" and not (s.api_keys or s.admin_key):
        # checked here, after the environment: ENGINEMETER_API_KEYS may bring the keys a file does not hold
        raise SettingsError(
            f"{config or 'settings'}: metrics.access: key needs a key to check scrapes against: set api_keys (or "
            "ENGINEMETER_API_KEYS) or admin_key"
        )
    return s


def _state_file_problems(s: Settings, add: Callable[[Loc, str], None]) -> None:
    """A rollout's state file that could not be opened (a directory, under a file, not writable), checked without
    creating anything: the proxy would otherwise fail at its start with a traceback."""
    for i, route in enumerate(s.routes):
        state_file = route.rollout.state_file if route.rollout is not None else None
        if state_file and (problem := _unopenable(Path(state_file).expanduser())):
            add(("routes", i, "rollout", "state_file"), problem)


def _unopenable(path: Path) -> str | None:
    for p in (path, path.with_name(f"{path.name}.shm")):
        if p.is_dir():
            return f"{p} is a directory"
        if p.exists() and not os.access(p, os.R_OK | os.W_OK):
            return f"{p} cannot be read and written by this user"
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is not a directory: {path} cannot be created"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"the directory {parent} is not writable by this user: {path} cannot be created"
    return None


def _env_keys(value: str) -> frozenset[str]:
    """``ENGINEMETER_API_KEYS``: comma-separated keys, each non-blank. A set variable replaces the file's keys, so
    a blank one (``""``, ``" "``, ``","``, ``"a,,b"``) is refused rather than read as "no keys", which would turn
    authentication off (as an empty key in the file is refused); unset the variable to keep the file's keys."""
    keys = [k.strip() for k in value.split(",")]
    if not all(keys):
        where = "is blank" if not any(keys) else f"has a blank key (key {keys.index('') + 1} of {len(keys)})"
        raise SettingsError(
            f"ENGINEMETER_API_KEYS {where}: expected comma-separated non-blank keys; unset it to keep the config "
            "file's api_keys (an empty list of keys turns authentication off)"
        )
    return frozenset(keys)


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
        return name, check_url(value)
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
