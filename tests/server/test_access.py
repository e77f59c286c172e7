"""Who may read ``/health``'s detail and ``/metrics`` (proxy/server/access.py): a real ``serve`` process with a
configuration file, an engine behind Basic auth with a pid and a comparison log, raw requests with and without
keys."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest

from tests.helpers import ProcessServer, wait_until

KEY, ADMIN = "sk-client-1", "adm-1"


@contextmanager
def keyed_proxy(tmp_path: Path, extra: str = "", workers: int = 1) -> Iterator[tuple[ProcessServer, ProcessServer]]:
    """A fault engine behind ``http://operator:pw@…`` with its pid configured, a shadow, a comparison log in
    ``tmp_path``; the proxy with a client key and an admin key."""
    with ExitStack() as stack:
        a = stack.enter_context(ProcessServer("fakes.fault_engine", ready_path="/health"))
        b = stack.enter_context(ProcessServer("fakes.fault_engine", ready_path="/health"))
        cfg = tmp_path / "enginemeter.yaml"
        cfg.write_text(
            f"api_keys: [{KEY}]\nadmin_key: {ADMIN}\n"
            "engines:\n"
            f"  - {{name: a, url: 'http://operator:pw@127.0.0.1:{a.port}', kind: llamacpp, pid: {a.pid}}}\n"
            f"  - {{name: b, url: 'http://127.0.0.1:{b.port}', kind: llamacpp}}\n"
            "routes:\n  - {primary: a, shadows: [b]}\n"
            f"mirror: {{log_path: '{tmp_path / 'cmp.jsonl'}'}}\n" + extra
        )
        proxy = ProcessServer(
            "proxy.cli", "serve", "--config", str(cfg), "--listen", "127.0.0.1:{port}", "--workers", str(workers),
            ready_path="/health", startup_timeout=60,
        )  # fmt: skip
        yield stack.enter_context(proxy), a


def _get(url: str, key: str | None = None) -> httpx.Response:
    headers = {"connection": "close", **({"authorization": f"Bearer {key}"} if key else {})}
    return httpx.get(url, headers=headers, timeout=10)


@pytest.mark.parametrize("workers", [1, 2])
def test_health_without_a_key_shows_no_url_path_or_pid(tmp_path: Path, workers: int) -> None:
    """Issue 35: /health without a key (api_keys set) showed engine URLs with their user name, engine pids, log
    paths, the comparison log path and model paths: the layout of the host."""
    with keyed_proxy(tmp_path, workers=workers) as (proxy, engine):
        # the detail, with a client key or the admin key: everything the issue listed is in it
        def detailed() -> str:
            text = _get(f"{proxy.url}/health", KEY).text
            assert str(engine.pid) in text  # the diagnosis has read the engine's process (worker 0's, a snapshot)
            return text

        full = wait_until(detailed, timeout=30, message="/health's detail with the engine's pid")
        for secret in ("operator:***@127.0.0.1", str(tmp_path), "cmp.jsonl", str(engine.pid)):
            assert secret in full, secret
        assert json.loads(full)["engines"] == _get(f"{proxy.url}/health", ADMIN).json()["engines"]  # the admin key too
        # without a key, or with a wrong one: liveness only, whichever worker answers
        for key in (None, "wrong", "", f"{KEY}x") * 4:
            r = _get(f"{proxy.url}/health", key)
            assert r.status_code == 200
            assert set(r.json()) == {"status", "version"}, r.text
            assert r.json()["status"] in ("ok", "degraded")
            for secret in ("operator", "127.0.0.1", str(tmp_path), "/", str(engine.pid)):
                assert secret not in r.text.replace(r.json()["version"], ""), (secret, r.text)
        # /metrics is public by default (Prometheus expects it): names, no URL
        m = _get(f"{proxy.url}/metrics")
        assert m.status_code == 200 and "enginemeter_requests_total" in m.text and "127.0.0.1" not in m.text


def test_health_public_shows_the_detail_to_anyone(tmp_path: Path) -> None:
    with keyed_proxy(tmp_path, "health: public\n") as (proxy, _):
        body = _get(f"{proxy.url}/health").json()
        assert "engines" in body and body["engines"][0]["url"].startswith("http://operator:***@")


def test_metrics_key_needs_a_key_to_scrape(tmp_path: Path) -> None:
    with keyed_proxy(tmp_path, "metrics: {access: key}\n") as (proxy, _):
        for key in (None, "wrong"):
            r = _get(f"{proxy.url}/metrics", key)
            assert r.status_code == 401
            err = r.json()["error"]
            assert err["enginemeter"] is True and "metrics.access: key" in err["message"]
        for key in (KEY, ADMIN):
            r = _get(f"{proxy.url}/metrics", key)
            assert r.status_code == 200 and "enginemeter_build_info" in r.text


def test_metrics_key_without_any_key_to_check_is_refused_at_start(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("metrics: {access: key}\nengines:\n  - {name: a, url: 'http://127.0.0.1:9'}\n")
    run = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "serve", "--config", str(cfg), "--listen", "127.0.0.1:0"],
        capture_output=True, text=True, timeout=60, check=False, env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [
        f"enginemeter: {cfg}: metrics.access: key needs a key to check scrapes against: set api_keys (or "
        "ENGINEMETER_API_KEYS) or admin_key"
    ]


def test_the_report_reads_a_keyed_proxy_with_its_key_from_the_environment(tmp_path: Path) -> None:
    """``report --proxy`` reads /health's detail: from a proxy with api_keys only with ENGINEMETER_PROXY_KEY."""
    with keyed_proxy(tmp_path) as (proxy, _):
        body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        auth = {"authorization": f"Bearer {KEY}", "connection": "close"}
        for _ in range(4):
            assert httpx.post(f"{proxy.url}/v1/chat/completions", json=body, headers=auth).status_code == 200
        log = tmp_path / "cmp.jsonl"
        wait_until(lambda: log.exists() and log.read_text().count('"type":"pair"') == 4, timeout=20)

        def report(**env: str) -> subprocess.CompletedProcess[str]:
            argv = ["report", "--log", str(log), "--proxy", proxy.url, "--out", str(tmp_path / "out")]
            return subprocess.run([sys.executable, "-m", "proxy.cli", *argv], capture_output=True, text=True,
                                  timeout=120, check=False, env={"PATH": "/usr/bin:/bin", **env})  # fmt: skip

        assert "with ENGINEMETER_PROXY_KEY set to a client key" in proxy.output()  # the banner says so
        without = report()
        assert "set ENGINEMETER_PROXY_KEY to one of its api_keys" in without.stderr, without.stderr
        with_key = report(ENGINEMETER_PROXY_KEY=KEY)
        assert with_key.returncode == 0, with_key.stderr
        assert "did not answer" not in with_key.stderr and "ENGINEMETER_PROXY_KEY" not in with_key.stderr
