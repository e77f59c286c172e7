from __future__ import annotations

from pathlib import Path

import pytest

from proxy.settings import SettingsError, load


def test_quick_form_routes_everything_to_the_primary() -> None:
    s = load(primary="http://127.0.0.1:8081", shadow="http://127.0.0.1:8082", env={})
    assert s.quick
    assert (s.host, s.port) == ("127.0.0.1", 8080)
    assert [e.name for e in s.engines] == ["primary", "shadow"]
    (route,) = s.routes
    assert route.models == ("*",) and route.primary == "primary" and route.shadows == ("shadow",)
    assert route.sample_rate == 1.0


def test_yaml_env_and_flags_precedence(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        """
listen: 0.0.0.0:9000
api_keys: [k1]
engines:
  - {name: llama, url: "http://127.0.0.1:1", kind: llamacpp, timeouts: {read: 30}}
  - {name: sgl, url: "http://127.0.0.1:2"}
models:
  - {alias: qwen, engines: {llama: q-gguf, sgl: Qwen/Qwen2}}
routes:
  - {models: [qwen], primary: llama, shadows: [sgl], sample_rate: 0.5}
sampling_defaults: {temperature: 0.0}
"""
    )
    s = load(cfg, env={"ENGINEMETER_LISTEN": "127.0.0.1:9100"}, listen=None)
    assert (s.host, s.port) == ("127.0.0.1", 9100)
    assert s.api_keys == frozenset({"k1"})
    assert s.engine("llama").timeouts.read == 30
    assert s.engine("sgl").kind is None
    assert s.routes[0].shadows == ("sgl",)
    assert dict(s.sampling_defaults) == {"temperature": 0.0}
    s = load(cfg, env={"ENGINEMETER_LISTEN": "127.0.0.1:9100"}, listen="127.0.0.1:9200")
    assert s.port == 9200


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ("engines: [{name: a, url: 'ftp://x'}]", "must look like"),
        ("engines: [{name: a, url: 'http://x:1', kind: tgi}]", "not one of"),
        ("engines: [{name: a, url: 'http://x:1'}]\nroutes: [{primary: b}]", "unknown engine"),
        ("engines: [{name: a, url: 'http://x:1', colour: red}]", "unknown key"),
        ("listen: nowhere", "HOST:PORT"),
        ("routes: []", "no engines"),
    ],
)
def test_bad_config_names_the_key(tmp_path: Path, doc: str, message: str) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(doc)
    with pytest.raises(SettingsError, match=message):
        load(cfg, env={})
