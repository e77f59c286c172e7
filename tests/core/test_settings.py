"""proxy/config/settings.py: the file's validation (real files), ${ENV} references, the quick form, precedence."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from proxy import normalize
from proxy.config.configfile import load, parse_file
from proxy.config.settings import (
    ConfigFile,
    EngineSettings,
    MirrorSettings,
    RouteSettings,
    SamplingDefaults,
    Settings,
    SettingsError,
    Timeouts,
    json_schema,
)
from proxy.types import EngineKind
from tests.helpers import REPO

ENGINE = 'engines: [{name: a, url: "http://127.0.0.1:1"}]\n'


def test_quick_form_routes_everything_to_the_primary() -> None:
    s = load(primary="http://127.0.0.1:8081", shadow="http://127.0.0.1:8082", env={})
    assert s.quick
    assert (s.host, s.port) == ("127.0.0.1", 8080)
    assert [e.name for e in s.engines] == ["engine1", "engine2"]  # not primary/shadow: those are roles
    (route,) = s.routes
    assert route.models == ("*",) and route.primary == "engine1" and route.shadows == ("engine2",)
    assert route.sample_rate == 1.0
    assert s.mirror.log_path is None  # load() writes nothing by itself; the CLI picks the default log


@pytest.mark.parametrize(
    ("primary", "shadow", "kinds", "names"),
    [
        ("llama=http://127.0.0.1:1", "sgl=http://127.0.0.1:2/", {}, ["llama", "sgl"]),
        ("http://127.0.0.1:1", "http://127.0.0.1:2", {"1": "llamacpp", "2": "sglang"}, ["llamacpp", "sglang"]),
        ("http://127.0.0.1:1", "http://127.0.0.1:2", {"1": "llamacpp", "2": "llamacpp"}, ["llamacpp-1", "llamacpp-2"]),
        ("http://127.0.0.1:1", "http://127.0.0.1:2", {"1": "openai"}, ["engine1", "engine2"]),
        ("a=http://127.0.0.1:1", "http://127.0.0.1:2?x=y", {"2?x=y": "vllm"}, ["a", "vllm"]),
    ],
)
def test_quick_form_names(primary: str, shadow: str, kinds: dict[str, EngineKind], names: list[str]) -> None:
    def probe(url: str) -> EngineKind | None:
        return kinds.get(url.rsplit(":", 1)[1])

    s = load(primary=primary, shadow=shadow, env={}, probe=probe)
    assert [e.name for e in s.engines] == names
    assert s.routes[0].primary == names[0] and s.routes[0].shadows == (names[1],)
    assert s.engines[1].url.startswith("http://127.0.0.1:2")


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"primary": "a=ftp://x"}, "--primary: expected a URL like http://host:port, got 'ftp://x'"),
        ({"primary": "=http://x:1"}, "--primary: expected NAME=URL or URL, got '=http://x:1'"),
        ({"primary": "a=http://x:1", "shadow": "a=http://x:2"}, "--shadow: engine name 'a' is already the primary's"),
        ({"shadow": "http://x:2"}, "--shadow: needs --primary (or ENGINEMETER_PRIMARY)"),
        ({"primary": "http://x:1", "shadow_rate": 1.5}, "--shadow-rate: expected a number within [0, 1], got 1.5"),
        ({"primary": "http://x:1", "listen": "nowhere"}, "--listen: expected HOST:PORT (e.g. 127.0.0.1:8080), got"),
        ({}, "no engines configured: give --primary URL, or a config file with an engines: list"),
    ],
)
def test_bad_flags(kw: dict[str, object], message: str) -> None:
    with pytest.raises(SettingsError) as info:
        load(env={}, **kw)  # type: ignore[arg-type]
    assert str(info.value).startswith(message)


def test_yaml_env_and_flags_precedence(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        """
listen: 0.0.0.0:9000
api_keys: [k1]
engines:
  - {name: llama, url: "http://127.0.0.1:1", kind: llamacpp, timeouts: {read: 30}}
  - {name: sgl, url: "http://127.0.0.1:2/", api_key: "${SGL_KEY}"}
models:
  - {alias: qwen, engines: {llama: q-gguf, sgl: Qwen/Qwen2}}
routes:
  - {models: [qwen], primary: llama, shadows: [sgl], sample_rate: 0.5, sticky_header: X-Session}
sampling_defaults: {temperature: 0.0, top_k: 20}
mirror: {log_path: "$${HOME}/cmp.jsonl"}
"""
    )
    env = {"ENGINEMETER_LISTEN": "127.0.0.1:9100", "SGL_KEY": "sk-secret"}
    s = load(cfg, env=env, listen=None)
    assert (s.host, s.port) == ("127.0.0.1", 9100)
    assert s.api_keys == frozenset({"k1"})
    assert s.engine("llama").timeouts.read == 30.0 and isinstance(s.engine("llama").timeouts.read, float)
    assert s.engine("sgl").kind is None and s.engine("sgl").url == "http://127.0.0.1:2"
    assert s.engine("sgl").api_key == "sk-secret"
    assert "sk-secret" not in repr(s)  # secrets stay out of logs and tracebacks
    assert s.routes[0].shadows == ("sgl",) and s.routes[0].sticky_header == "x-session"
    assert dict(s.sampling_defaults) == {"temperature": 0.0, "top_k": 20}
    assert isinstance(s.sampling_defaults["top_k"], int)
    assert s.mirror.log_path == "${HOME}/cmp.jsonl"  # $${ is a literal ${
    assert s.models[0].engines == {"llama": "q-gguf", "sgl": "Qwen/Qwen2"}
    s = load(cfg, env=env, listen="127.0.0.1:9200", log=str(tmp_path / "l.jsonl"))
    assert s.port == 9200 and s.mirror.log_path == str(tmp_path / "l.jsonl")


def test_defaults_without_routes_or_sampling(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(ENGINE)
    s = load(cfg, env={})
    assert s.routes == (RouteSettings(models=("*",), primary="a"),)
    assert dict(s.sampling_defaults) == {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
    assert (s.host, s.port) == ("127.0.0.1", 8080) and not s.quick


# Every mistake the issue lists, and their neighbours: one line naming file:line, the key path, what was expected.
BAD = [
    ("engines:\n  - name: a\n    url: http://x:1\n    timeouts: {read: abc}\n",
     "bad.yaml:4: engines[0].timeouts.read: expected a number, got 'abc'"),
    (ENGINE + "models:\n  - engines: {a: q}\n", "bad.yaml:3: models[0].alias: required key missing"),
    (ENGINE + "mirror:\n  max_in_flight: \"3\"\n", "bad.yaml:3: mirror.max_in_flight: expected an integer, got '3'"),
    (ENGINE + "collectors: {gpu: \"no\"}\n", "bad.yaml:2: collectors.gpu: expected true or false, got 'no'"),
    (ENGINE + "sampling_defaults: {temprature: 0.5}\n",
     "bad.yaml:2: sampling_defaults.temprature: unknown key (did you mean 'temperature'?); expected one of: "
     "temperature, top_k, top_p, min_p, repeat_penalty, repetition_penalty, presence_penalty, frequency_penalty, "
     "seed, max_tokens"),
    ('engines: [{name: a, url: "http://x:1", api_key: "${ENGINEMETER_TEST_UNSET}"}]\n',
     "bad.yaml:1: engines[0].api_key: environment variable ENGINEMETER_TEST_UNSET is not set "
     "(referenced as ${ENGINEMETER_TEST_UNSET})"),
    ("engines: [{name: a, url: 'ftp://x'}]\n", "bad.yaml:1: engines[0].url: expected a URL like http://host:port, got 'ftp://x'"),
    ("engines: [{name: a, url: 'http://x:1', kind: tgi}]\n",
     "bad.yaml:1: engines[0].kind: expected one of 'llamacpp', 'sglang', 'vllm' or 'openai', got 'tgi'"),
    (ENGINE + "routes:\n  - {primary: b}\n", "bad.yaml:3: routes[0].primary: unknown engine 'b' (engines: a)"),
    (ENGINE + "routes:\n  - {primary: a, shadow: a}\n",
     "bad.yaml:3: routes[0].shadow: unknown key (did you mean 'shadows'?); expected one of: models, primary, "
     "shadows, split, sticky_header, pinnable, fallback, sample_rate, rollout, swap"),
    (ENGINE + "routes:\n  - {models: [x]}\n", "bad.yaml:3: routes[0].primary: required key missing"),
    (ENGINE + "routes:\n  - {primary: a, sample_rate: 1.5}\n",
     "bad.yaml:3: routes[0].sample_rate: expected a value less than or equal to 1, got 1.5"),
    (ENGINE + "routes:\n  - {primary: a, models: qwen}\n", "bad.yaml:3: routes[0].models: expected a list, got 'qwen'"),
    (ENGINE + "models:\n  - {alias: m, engines: {b: x}}\n", "bad.yaml:3: models[0].engines.b: unknown engine 'b' (engines: a)"),
    (ENGINE + "listen: nowhere\n", "bad.yaml:2: listen: expected HOST:PORT (e.g. 127.0.0.1:8080), got 'nowhere'"),
    (ENGINE + "default_route: 2\n", "bad.yaml:2: default_route: expected an index below 1 (the number of routes)"),
    (ENGINE + "engines: []\n", "bad.yaml:2: engines: duplicate key"),
    (ENGINE + "max_body_bytes: 1e6\n", "bad.yaml:2: max_body_bytes: expected an integer, got '1e6'"),
    (ENGINE + "api_keys: ['']\n", "bad.yaml:2: api_keys[0]: expected a string to have at least 1 character, got ''"),
    ("engines: [{name: a, url: 'http://x:1'}, {name: a, url: 'http://x:2'}]\n",
     "bad.yaml:1: engines[1].name: duplicate engine name 'a'"),
    ("engines: [{name: a, url: 'http://x:1', colour: red}]\n",
     "bad.yaml:1: engines[0].colour: unknown key; expected one of: name, url, launch, kind, model, api_key, "
     "timeouts, max_connections, pid, pid_file, add_timings"),
    (ENGINE + "mirrors: {}\n", "bad.yaml:2: mirrors: unknown key (did you mean 'mirror'?); expected one of: listen, "
     "api_keys, admin_key, health, max_body_bytes, engines, models, routes, default_route, sampling_defaults, pin_header, "
     "mirror, collectors, metrics, request_log, tracing, add_timings"),
    ("engines: [{name: a, url: 'http://x:1'}\n", "bad.yaml:2: not valid YAML: expected ',' or ']', but got '<stream end>'"),
    ("- a\n", "bad.yaml:1: expected a mapping of settings at the top level, got a list"),
    ("routes: []\n", "bad.yaml: no engines configured: add an engines: list, or give --primary URL"),
    ("", "bad.yaml: no engines configured: add an engines: list, or give --primary URL"),
]  # fmt: skip


@pytest.mark.parametrize(("doc", "message"), BAD)
def test_bad_config_is_one_line_naming_file_line_and_key(tmp_path: Path, doc: str, message: str) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(doc)
    with pytest.raises(SettingsError) as info:
        load(cfg, env={})
    text = str(info.value)
    assert "\n" not in text
    assert text == (f"{tmp_path}/{message}" if message.startswith("bad.yaml") else message)


def test_every_problem_is_reported(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(ENGINE + "mirror: {max_in_flight: '3', timeout: 0}\ncollectors: {gpu: 'no'}\n")
    with pytest.raises(SettingsError) as info:
        parse_file(cfg, env={})
    assert [p.split(": ", 2)[1] for p in info.value.problems] == [
        "mirror.max_in_flight",
        "mirror.timeout",
        "collectors.gpu",
    ]
    assert str(info.value).endswith("(and 2 more problems)")


def test_missing_file_and_env_overrides(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"^/nonexistent/c\.yaml: cannot read: No such file or directory$"):
        load("/nonexistent/c.yaml", env={})
    with pytest.raises(SettingsError, match=r"^ENGINEMETER_MAX_BODY_BYTES: expected a positive integer, got 'big'$"):
        load(primary="http://x:1", env={"ENGINEMETER_MAX_BODY_BYTES": "big"})
    with pytest.raises(SettingsError, match=r"^ENGINEMETER_LISTEN: expected HOST:PORT"):
        load(primary="http://x:1", env={"ENGINEMETER_LISTEN": "8080"})
    cfg = tmp_path / "c.yaml"
    cfg.write_text(ENGINE)
    s = load(env={"ENGINEMETER_CONFIG": str(cfg), "ENGINEMETER_API_KEYS": "a, b", "ENGINEMETER_LISTEN": "[::1]:81"})
    assert s.api_keys == frozenset({"a", "b"}) and (s.host, s.port) == ("::1", 81)


def test_python_construction_stays_as_before() -> None:
    """Other modules and tests build these directly: lists become tuples, ints floats, and they stay frozen."""
    r = RouteSettings(models=["m"], primary="a", shadows=["b"], split={"a": 1, "b": 3})  # type: ignore[arg-type]
    assert r.models == ("m",) and r.shadows == ("b",) and r.split == {"a": 1.0, "b": 3.0}
    t = Timeouts(connect=2, read=10)
    assert (t.connect, t.read, t.pool) == (2.0, 10.0, 10.0)
    s = Settings(engines=(EngineSettings(name="a", url="http://x:1/", timeouts=t),), routes=(r,))
    assert s.engine("a").url == "http://x:1" and s.mirror == MirrorSettings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.port = 1  # type: ignore[misc]
    assert dataclasses.replace(MirrorSettings(), log_path="x").log_path == "x"


def test_sampling_defaults_keys_are_the_defaultable_params() -> None:
    assert {f.name for f in dataclasses.fields(SamplingDefaults)} == normalize.DEFAULTABLE


def test_schema_refuses_unknown_keys_everywhere() -> None:
    schema = json_schema()
    assert schema["additionalProperties"] is False
    assert all(d.get("additionalProperties") is False for d in schema["$defs"].values())
    assert set(schema["properties"]) == {f.name for f in dataclasses.fields(ConfigFile)}


def test_committed_schema_and_reference_are_current() -> None:
    """docs/config.schema.json and docs/config.md are generated from the classes: regenerate when this fails."""
    committed = json.loads((REPO / "docs" / "config.schema.json").read_text())
    assert committed == json_schema(), "run: python scripts/config_docs.py"
    run = subprocess.run(
        [sys.executable, "scripts/config_docs.py", "--check"], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("doc", ["README.md", "docs/routing.md", "docs/metrics.md"])
def test_yaml_examples_in_the_docs_are_valid(tmp_path: Path, doc: str) -> None:
    blocks = re.findall(r"```yaml\n(.*?)```", (REPO / doc).read_text(), re.S)
    assert blocks
    for i, block in enumerate(blocks):
        cfg = tmp_path / f"{i}.yaml"
        cfg.write_text(block)
        parse_file(cfg, env={"ENGINEMETER_ADMIN": "x"})


@pytest.mark.parametrize("keys", ["", " ", ",", "a,,b", "a, "])
def test_blank_api_keys_from_the_environment_are_an_error(tmp_path: Path, keys: str) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("api_keys: [sk-file]\n" + ENGINE)
    with pytest.raises(SettingsError, match=r"^ENGINEMETER_API_KEYS (is blank|has a blank key)"):
        load(str(cfg), env={"ENGINEMETER_API_KEYS": keys})
    assert load(str(cfg), env={}).api_keys == frozenset({"sk-file"})  # unset: the file's keys


def test_a_blank_key_in_the_file_is_an_error(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text('api_keys: ["  "]\n' + ENGINE)
    with pytest.raises(SettingsError, match=r"c\.yaml:1: api_keys\[0\]: expected a non-blank key"):
        parse_file(cfg, env={})


def test_redact_url_hides_passwords_in_malformed_urls_too() -> None:
    from proxy.errors import redact_url

    assert redact_url("http://user:pw@host:1/x") == "http://user:***@host:1/x"
    assert redact_url("htp://user:S3CRET@h") == "htp://user:***@h"
    assert redact_url("user:S3CRET@10.0.0.5:8081") == "user:***@10.0.0.5:8081"
    assert redact_url("http:/user:S3CRET@h") == "http:/user:***@h"
    assert redact_url("http://u:a:b@h") == "http://u:***@h"
    assert redact_url("http://host:8081/v1") == "http://host:8081/v1"
