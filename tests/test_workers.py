"""``serve --workers N`` (proxy/server/workers.py): real processes on a real port, metrics merged over workers."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.parser import text_string_to_metric_families

from proxy.server.workers import default_workers
from tests.helpers import ProcessServer, wait_until

BODY = {"model": "m", "stream": True, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


def _samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [(s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


def _requests_per_worker(directory: Path) -> dict[str, float]:
    """ok-requests counted by each worker's own file (counter_<pid>.db), read without the merge."""
    out: dict[str, float] = {}
    for f in directory.glob("counter_*.db"):
        total = 0.0
        for key, value, *_ in MmapedDict.read_all_values_from_file(str(f)):  # type: ignore[no-untyped-call]
            name, _, labels, _ = json.loads(key)
            if name == "enginemeter_requests" and labels.get("outcome") == "ok":
                total += value
        out[f.stem] = total
    return out


def _engine(tokens: int = 4) -> ProcessServer:
    args = ("--tokens", str(tokens), "--cadence-ms", "1", "--ttft-ms", "1")
    return ProcessServer("fakes.fault_engine", *args, ready_path="/health")


def _proxy(engine_url: str, directory: Path, workers: int, *extra: str, admin_key: str = "") -> ProcessServer:
    env = {"PROMETHEUS_MULTIPROC_DIR": str(directory), "ENGINEMETER_ADMIN_KEY": admin_key}
    return ProcessServer(
        "proxy.cli", "serve", "--primary", engine_url, "--listen", "127.0.0.1:{port}", "--workers", str(workers),
        "--log-level", "warning", *extra, ready_path="/health", env=env, startup_timeout=60,
    )  # fmt: skip


def test_one_scrape_counts_every_request_over_the_workers(tmp_path: Path) -> None:
    n = 40
    directory = tmp_path / "metrics"
    with _engine() as engine, _proxy(engine.url, directory, 2) as proxy:
        for _ in range(n):
            # a new connection each time: SO_REUSEPORT spreads connections (by address hash), not requests
            with httpx.Client(base_url=proxy.url, headers={"connection": "close"}) as client:
                r = client.post("/v1/chat/completions", json=BODY)
                assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
        # the workers' own files: both served, and together they served every request
        per_worker = _requests_per_worker(directory)
        assert len(per_worker) == 2, per_worker
        assert all(v > 0 for v in per_worker.values()), per_worker
        assert sum(per_worker.values()) == n
        # one scrape, whichever worker answers, has the exact count; nothing is left in flight
        text = httpx.get(f"{proxy.url}/metrics", headers={"connection": "close"}).text
        ok = [v for labels, v in _samples(text, "enginemeter_requests_total") if labels["outcome"] == "ok"]
        assert sum(ok) == n
        assert sum(v for _, v in _samples(text, "enginemeter_in_flight_requests")) == 0
        assert [v for _, v in _samples(text, "enginemeter_build_info")] == [1.0]


def test_collectors_run_in_one_worker_and_every_scrape_and_health_show_them(tmp_path: Path) -> None:
    directory = tmp_path / "metrics"
    with _engine() as engine, _proxy(engine.url, directory, 2) as proxy:

        def scrape() -> str:
            return httpx.get(f"{proxy.url}/metrics", headers={"connection": "close"}).text

        # worker 0 polls the engine, then snapshots what its collector exports (once a second)
        wait_until(
            lambda: (
                "enginemeter_engine_up" in (directory / "collectors.prom").read_text()
                if (directory / "collectors.prom").exists()
                else False
            ),
            timeout=30,
            message="worker 0's snapshot",
        )
        for _ in range(12):  # fresh connections: both workers answer some of these
            up = _samples(scrape(), "enginemeter_engine_up")
            assert [v for _, v in up] == [1.0]  # one engine, exported once
            health = httpx.get(f"{proxy.url}/health", headers={"connection": "close"}).json()
            assert len(health["engine_state"]["engines"]) == 1 and "gpu" in health


def test_a_mirror_change_on_one_worker_reaches_every_worker(tmp_path: Path) -> None:
    directory = tmp_path / "metrics"
    with _engine() as engine, _engine() as shadow:
        with _proxy(engine.url, directory, 2, "--shadow", shadow.url, admin_key="k") as proxy:
            auth = {"authorization": "Bearer k", "connection": "close"}
            r = httpx.post(f"{proxy.url}/admin/mirror", json={"sample_rate": 0.25}, headers=auth)
            assert r.status_code == 200 and r.json()["routes"][0]["sample_rate"] == 0.25

            def everywhere() -> bool:
                rates = {
                    httpx.get(f"{proxy.url}/admin/mirror", headers=auth).json()["routes"][0]["sample_rate"]
                    for _ in range(8)
                }
                return rates == {0.25}

            wait_until(everywhere, timeout=10, message="the new rate on every worker")


def test_default_workers_is_within_one_and_eight() -> None:
    assert 1 <= default_workers() <= 8
