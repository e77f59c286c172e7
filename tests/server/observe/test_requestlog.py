"""The per-request JSONL log (proxy/server/observe/requestlog.py) through the real proxy: one line per attempt
(primary, shadow, pass-through), no text unless asked, mode 0600, rotated by size."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from fakes.fault_engine import FaultEngineConfig, Knobs, run_in_thread
from proxy.config.configfile import parse_file
from proxy.config.settings import EngineSettings, RequestLogSettings, RouteSettings, Settings, SettingsError, Timeouts
from proxy.server.compose import build_app
from proxy.server.observe.requestlog import RequestLog
from tests.helpers import run_uvicorn_app, wait_until

MSGS = [{"role": "user", "content": "a secret prompt"}]


@pytest.fixture(scope="module")
def fault_engines() -> Iterator[tuple[str, str]]:
    with ExitStack() as stack:
        knobs = Knobs(tokens=4, cadence_ms=1)
        yield (
            stack.enter_context(run_in_thread(FaultEngineConfig(knobs=knobs))),
            stack.enter_context(run_in_thread(FaultEngineConfig(knobs=knobs))),
        )


def serve(stack: ExitStack, engines: tuple[str, str], log: RequestLogSettings) -> tuple[httpx.Client, RequestLog]:
    t = Timeouts(connect=2, read=20)
    settings = Settings(
        engines=(
            EngineSettings(name="p", url=engines[0], kind="llamacpp", model="fault-engine", timeouts=t),
            EngineSettings(name="s", url=engines[1], kind="llamacpp", model="fault-engine", timeouts=t),
        ),
        routes=(RouteSettings(primary="p", shadows=("s",)),),
        request_log=log,
    )
    app = build_app(settings, registry=CollectorRegistry())
    url = stack.enter_context(run_uvicorn_app(app))
    request_log: RequestLog = app.state.request_log
    return stack.enter_context(httpx.Client(base_url=url, timeout=30)), request_log


def lines(path: Path, log: RequestLog, n: int) -> list[dict[str, Any]]:
    def read() -> list[dict[str, Any]]:
        log.writer.flush()
        out = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        return out if len(out) >= n else []

    return wait_until(read)


def test_one_line_per_attempt_without_text(fault_engines: tuple[str, str], tmp_path: Path) -> None:
    path = tmp_path / "logs" / "requests.jsonl"
    with ExitStack() as stack:
        client, log = serve(stack, fault_engines, RequestLogSettings(path=str(path)))
        body: dict[str, Any] = {"model": "m", "messages": MSGS, "max_tokens": 4, "stream": True}
        with client.stream("POST", "/v1/chat/completions", json=body, headers={"x-request-id": "r1"}) as r:
            r.read()
        assert client.post("/tokenize", json={"content": "x y"}, headers={"x-request-id": "r2"}).status_code == 200
        recs = lines(path, log, 3)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    by = {(r["client_request_id"], r["role"]): r for r in recs}  # the proxy owns request_id; the client's id is kept
    p, s, t = by["r1", "primary"], by["r1", "shadow"], by["r2", "primary"]
    assert (p["engine"], p["endpoint"], p["outcome"], p["status"], p["stream"], p["route"]) == ("p", "chat", "ok", 200, True, 0)  # fmt: skip
    assert p["completion_tokens"] == 4 and p["prompt_tokens"] > 0
    assert p["ttft_s"] > 0 and p["tpot_s"] > 0 and p["e2e_s"] >= p["ttft_s"]
    assert (s["engine"], s["outcome"], s["completion_tokens"]) == ("s", "ok", 4)
    assert (t["endpoint"], t["engine"], t["outcome"], t["ttft_s"]) == ("tokenize", "p", "ok", None)
    assert t["e2e_s"] > 0
    text = path.read_text()
    assert "secret" not in text and 'prompt"' not in text and '"text"' not in text


def test_record_text_and_rotation(fault_engines: tuple[str, str], tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    with ExitStack() as stack:
        client, log = serve(stack, fault_engines, RequestLogSettings(path=str(path), record_text=True, max_bytes=1, backups=2))  # fmt: skip
        for i in range(3):
            body: dict[str, Any] = {"model": "m", "messages": MSGS, "max_tokens": 4, "stream": i % 2 == 0}
            r = client.post("/v1/chat/completions", json=body, headers={"x-request-id": f"t{i}"})
            assert r.status_code == 200
        wait_until(lambda: log.writer.flush() and log.writer.written >= 6)
    rotated = [Path(f"{path}.1"), Path(f"{path}.2")]
    assert all(p.exists() for p in rotated)  # one record a file at this size: rotated on every write
    assert not Path(f"{path}.3").exists()
    assert all(stat.S_IMODE(os.stat(p).st_mode) == 0o600 for p in (path, *rotated))
    recs = [json.loads(line) for p in (*reversed(rotated), path) for line in p.read_text().splitlines()]
    assert len(recs) == 3  # the newest three of six: the oldest files were dropped
    assert recs[-1]["client_request_id"] == "t2"
    for rec in recs:
        assert rec["prompt"] == MSGS
        assert isinstance(rec["text"], str) and rec["text"]


def test_settings_sections(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "engines: [{name: sg, url: 'http://127.0.0.1:1', add_timings: true}]\n"
        "request_log: {path: /tmp/r.jsonl, backups: 0}\n"
        "tracing: {enabled: true, sample_ratio: 0.25}\n"
        "add_timings: false\n"
    )
    s = parse_file(cfg, env={})
    assert s.request_log == RequestLogSettings(path="/tmp/r.jsonl", backups=0)
    assert (s.tracing.enabled, s.tracing.sample_ratio, s.tracing.endpoint) == (
        True,
        0.25,
        "http://127.0.0.1:4318/v1/traces",
    )
    assert s.add_timings is False and s.engines[0].add_timings is True
    cfg.write_text(
        "engines: [{name: a, url: 'http://127.0.0.1:1'}]\nrequest_log: {pth: x}\ntracing: {sample_ratio: 2}\n"
    )
    with pytest.raises(SettingsError) as err:
        parse_file(cfg, env={})
    assert err.value.problems == (
        f"{cfg}:2: request_log.pth: unknown key (did you mean 'path'?); expected one of: path, max_bytes, backups, record_text",
        f"{cfg}:3: tracing.sample_ratio: expected a value less than or equal to 1, got 2",
    )


def test_a_log_file_left_readable_by_others_is_made_0600_on_open(
    fault_engines: tuple[str, str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """ "created 0600" held only for new files: a 0644 log (and rotated copy) from an older run stayed 0644."""
    path = tmp_path / "requests.jsonl"
    for p in (path, tmp_path / "requests.jsonl.1"):
        p.write_text('{"prompt": "an older run\'s prompt"}\n')
        p.chmod(0o644)
    with ExitStack() as stack:
        client, log = serve(stack, fault_engines, RequestLogSettings(path=str(path), record_text=True))
        # before any request: the files of the earlier run are no longer readable by others
        wait_until(
            lambda: all(stat.S_IMODE(os.stat(p).st_mode) == 0o600 for p in (path, tmp_path / "requests.jsonl.1"))
        )
        assert client.post("/v1/chat/completions", json={"model": "m", "messages": MSGS}).status_code == 200
        lines(path, log, 3)
        # made again by someone else, 0644, between two lines: set back on the next line's open
        path.unlink()
        path.write_text("")
        path.chmod(0o644)
        assert client.post("/v1/chat/completions", json={"model": "m", "messages": MSGS}).status_code == 200
        lines(path, log, 2)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert log.writer.errors == 0
    assert "had mode 644: set to 600" in caplog.text
