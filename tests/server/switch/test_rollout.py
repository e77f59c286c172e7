"""The guarded switch (proxy/server/switch/rollout.py) through the real proxy: real engines as processes, real sockets.

- fault engines (``python -m fakes.fault_engine``, each its own process): a faster candidate goes through every
  step to ``complete`` by itself; a slower one rolls back by itself at the first step and says why; a candidate
  killed mid-rollout sends its share back with no client error beyond the requests it held; pinned requests keep
  their engine and stay out of the count; the admin endpoint's commands and its bad input; a proxy restart
  carries on where the state file says, and says so; the request log, /metrics and /health show the state;
- ``enginemeter serve --workers 2``: one share for both workers, an abort on one worker reaches the other at its
  next request, a restarted worker routes by the current share;
- two llama-server engines (``-np 1`` baseline, ``-np 4`` candidate) behind ``enginemeter serve`` at
  concurrency 4: the share reaches 100 % by itself; the candidate killed mid-rollout rolls back.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.parser import text_string_to_metric_families

from proxy.config.configfile import parse_file
from proxy.config.settings import EngineSettings, RouteSettings, Settings, SettingsError
from tests.helpers import LlamaServerFactory, ProcessServer, ProxyFactory, wait_until

ADMIN_KEY = "rollout-admin"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
MSGS = [{"role": "user", "content": "Tell me about lighthouses."}]
PIN = "x-enginemeter-engine"


@contextmanager
def fault_engine(ttft_ms: float, cadence_ms: float, tokens: int = 12) -> Iterator[ProcessServer]:
    args = ("--tokens", str(tokens), "--ttft-ms", str(ttft_ms), "--cadence-ms", str(cadence_ms))
    with ProcessServer("fakes.fault_engine", *args, ready_path="/health") as server:
        yield server


def config(base: str, cand: str, tmp: Path, **rollout: Any) -> dict[str, Any]:
    """A config file's document: route 0 from ``base`` to ``cand``, short steps, state in ``tmp``."""
    rollout = {"candidate": "cand", "steps": [0.0, 0.5, 1.0], "min_dwell_s": 0, "min_requests": 5,
               "state_file": str(tmp / "rollout.json"), **rollout}  # fmt: skip
    timeouts = {"connect": 2, "read": 30}
    return {
        "engines": [
            {"name": "base", "url": base, "timeouts": timeouts},
            {"name": "cand", "url": cand, "timeouts": timeouts},
        ],
        "routes": [{"primary": "base", "rollout": rollout}],
        "admin_key": ADMIN_KEY,
        "mirror": {"timeout": 30},
        "request_log": {"path": str(tmp / "requests.jsonl")},
    }


def settings_of(cfg: dict[str, Any], tmp: Path) -> Settings:
    (tmp / "enginemeter.yaml").write_text(yaml.safe_dump(cfg))
    return parse_file(tmp / "enginemeter.yaml", env={})


class ProcessProxy(ProcessServer):
    """``enginemeter serve --config`` as its own process (``--workers N``)."""

    def __init__(self, cfg: dict[str, Any], tmp: Path, workers: int = 1) -> None:
        path = tmp / "enginemeter.yaml"
        path.write_text(yaml.safe_dump(cfg))
        super().__init__(
            "proxy.cli", "serve", "--config", str(path), "--listen", "127.0.0.1:{port}", "--workers", str(workers),
            "--log-level", "warning", ready_path="/health", startup_timeout=60,
            env={"PROMETHEUS_MULTIPROC_DIR": str(tmp / f"metrics-{workers}")} if workers > 1 else None,
        )  # fmt: skip


@dataclass
class Traffic:
    """Clients at a fixed concurrency until stopped: each answer's engine and whether the client saw an error."""

    url: str
    concurrency: int = 4
    max_tokens: int = 8
    #: a connection per request (``serve --workers``: the kernel spreads connections, not requests)
    close: bool = False
    #: each client starts a request at most every ``pace_s`` (0: as soon as the last one ended)
    pace_s: float = 0.0
    served: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _pool: ThreadPoolExecutor | None = None

    def one(self, client: httpx.Client) -> None:
        body = {"model": "m", "stream": True, "max_tokens": self.max_tokens, "messages": MSGS}
        try:
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                text = r.read().decode()
                engine = r.headers.get("x-enginemeter-engine", "?")
            if r.status_code != 200 or '"error"' in text or not text.rstrip().endswith("data: [DONE]"):
                self.failures.append(f"{engine} {r.status_code} {text[-200:]}")
            else:
                self.served.append(engine)
        except httpx.HTTPError as exc:
            self.failures.append(repr(exc))

    def _loop(self) -> None:
        headers = {"connection": "close"} if self.close else {}
        with httpx.Client(base_url=self.url, timeout=60, headers=headers) as client:
            while not self._stop.is_set():
                started = time.monotonic()
                self.one(client)
                # the traffic's shape (an open-ish arrival rate, as live users make), not a synchronisation
                self._stop.wait(max(0.0, self.pace_s - (time.monotonic() - started)))

    def __enter__(self) -> Traffic:
        self._pool = ThreadPoolExecutor(self.concurrency)
        self._futures = [self._pool.submit(self._loop) for _ in range(self.concurrency)]
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._pool is not None
        for f in self._futures:
            f.result(timeout=120)
        self._pool.shutdown()


def rollout(url: str, **body: Any) -> dict[str, Any]:
    """GET (no body) or POST /admin/rollout; the single route's rollout."""
    if body:
        r = httpx.post(f"{url}/admin/rollout", json=body, headers=ADMIN, timeout=10)
        assert r.status_code == 200, r.text
        doc: dict[str, Any] = r.json()
        return doc
    r = httpx.get(f"{url}/admin/rollout", headers=ADMIN, timeout=10)
    assert r.status_code == 200, r.text
    [doc] = r.json()["rollouts"]
    return doc


def wait_state(url: str, pred: Callable[[dict[str, Any]], bool], timeout: float, what: str) -> dict[str, Any]:
    last: list[dict[str, Any]] = [{}]

    def check() -> dict[str, Any]:
        last[0] = d = rollout(url)
        return d if pred(d) else {}

    try:
        return wait_until(check, timeout=timeout, interval=0.1, message=what)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}; the rollout: {json.dumps(last[0], indent=1)}") from None


def log_records(tmp: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (tmp / "requests.jsonl").read_text().splitlines()]


# ============================================================================================ the config


def test_config_mistakes_in_a_rollout_are_one_line_each(tmp_path: Path) -> None:
    cfg = config("http://127.0.0.1:1", "http://127.0.0.1:2", tmp_path)
    assert settings_of(cfg, tmp_path).routes[0].rollout is not None
    bad: list[tuple[dict[str, Any], str]] = [
        ({"steps": [0, 0.5, 0.5, 1]}, "routes[0].rollout.steps: shares must be within [0, 1] and strictly increasing"),
        ({"steps": [0, 0.5]}, "routes[0].rollout.steps: the last step must be 1"),
        ({"steps": []}, "routes[0].rollout.steps: expected a non-empty list"),
        ({"candidate": "nope"}, "routes[0].rollout.candidate: unknown engine 'nope'"),
        ({"candidate": "base"}, "routes[0].rollout.candidate: the candidate 'base' is the route's primary"),
        ({"state": "stopped"}, "routes[0].rollout.state: expected one of"),
        ({"gate": "tie"}, "routes[0].rollout.gate: expected one of"),
        ({"min_pairs": 10}, "routes[0].rollout.min_pairs"),
        ({"error_budget": 1.5}, "routes[0].rollout.error_budget"),
        ({"min_dwel_s": 1}, "routes[0].rollout.min_dwel_s: unknown key (did you mean 'min_dwell_s'?)"),
    ]
    for change, expected in bad:
        doc = json.loads(json.dumps(cfg))
        doc["routes"][0]["rollout"].update(change)
        with pytest.raises(SettingsError) as err:
            settings_of(doc, tmp_path)
        assert any(expected in line for line in err.value.problems), (change, err.value.problems)
    doc = json.loads(json.dumps(cfg))
    doc["routes"][0]["split"] = {"base": 1, "cand": 1}
    doc["routes"].append({"models": ["other"], "primary": "cand", "rollout": {**doc["routes"][0]["rollout"],
                                                                               "candidate": "base"}})  # fmt: skip
    with pytest.raises(SettingsError) as err:
        settings_of(doc, tmp_path)
    problems = err.value.problems
    assert any("routes[0].split: a route with a rollout has no split" in p for p in problems), problems
    assert any("routes[1].rollout.state_file: another route's rollout uses" in p for p in problems), problems


# ============================================================================================ fault engines


def test_a_faster_candidate_reaches_the_whole_route_by_itself(proxy_factory: ProxyFactory, tmp_path: Path) -> None:
    with fault_engine(ttft_ms=30, cadence_ms=4) as base, fault_engine(ttft_ms=5, cadence_ms=1) as cand:
        p = proxy_factory(settings_of(config(base.url, cand.url, tmp_path), tmp_path))
        assert rollout(p.url)["share"] == 0.0
        with Traffic(p.url) as t:
            done = wait_state(p.url, lambda d: d["state"] == "complete", 120, "the rollout to complete")
        assert not t.failures, t.failures
        events = [(e["event"], e["share"]) for e in done["events"]]
        assert events == [("started", 0.0), ("advanced", 0.5), ("advanced", 1.0), ("completed", 1.0)], events
        assert done["share"] == 1.0 and done["cause"] == "none" and done["rollbacks"]["slower"] == 0
        # complete: the candidate serves everything, mirrored to nobody
        served = [p.client.post("/v1/chat/completions", json={"model": "m", "max_tokens": 2, "messages": MSGS})
                  for _ in range(5)]  # fmt: skip
        assert {r.headers["x-enginemeter-engine"] for r in served} == {"cand"}
        assert p.value("enginemeter_rollout_share", route="0", baseline="base", candidate="cand") == 1.0
        assert p.value("enginemeter_rollout_state", route="0", state="complete") == 1.0
        assert p.value("enginemeter_rollout_step", route="0") == 2
        # the request log says which step routed each request; the candidate served at share 0.5 and 1
        recs = [r for r in log_records(tmp_path) if r["role"] == "primary"]
        assert {r["rollout"]["share"] for r in recs} == {0.0, 0.5, 1.0}
        assert {r["engine"] for r in recs if r["rollout"]["share"] == 0.0} == {"base"}
        assert {r["engine"] for r in recs if r["rollout"]["share"] == 0.5} == {"base", "cand"}
        health = p.client.get("/health").json()
        assert health["rollout"][0]["state"] == "complete"


def test_a_slower_candidate_rolls_back_by_itself_at_the_first_step_and_says_why(
    proxy_factory: ProxyFactory, tmp_path: Path
) -> None:
    with fault_engine(ttft_ms=5, cadence_ms=1) as base, fault_engine(ttft_ms=20, cadence_ms=4) as cand:
        p = proxy_factory(settings_of(config(base.url, cand.url, tmp_path), tmp_path))
        with Traffic(p.url) as t:
            back = wait_state(p.url, lambda d: d["state"] != "running", 120, "the rollout to leave `running`")
            n_back = len(t.served)
            # rolled back: every request after it goes to the baseline, and the candidate gets no more copies
            wait_until(lambda: len(t.served) >= n_back + 20, timeout=60)
        assert not t.failures, t.failures
        assert back["state"] == "rolled_back" and back["cause"] == "slower" and back["share"] == 0.0, back
        assert back["step"] == 0 and "cand is slower than base" in back["detail"], back["detail"]
        assert [e["event"] for e in back["events"]] == ["started", "rolled_back"]
        assert set(t.served) == {"base"}
        copies = len(p.of("shadow", "cand"))
        for _ in range(3):
            r = p.client.post("/v1/chat/completions", json={"model": "m", "max_tokens": 2, "messages": MSGS})
            assert r.headers["x-enginemeter-engine"] == "base"
        assert len(p.of("shadow", "cand")) == copies
        assert p.value("enginemeter_rollout_rollbacks_total", route="0", cause="slower") == 1
        assert p.value("enginemeter_rollout_cause", route="0", cause="slower") == 1
        assert p.value("enginemeter_rollout_share", route="0", baseline="base", candidate="cand") == 0


def test_a_candidate_killed_mid_rollout_gives_its_share_back(proxy_factory: ProxyFactory, tmp_path: Path) -> None:
    with fault_engine(ttft_ms=30, cadence_ms=8) as base, fault_engine(ttft_ms=5, cadence_ms=2) as cand:
        p = proxy_factory(settings_of(config(base.url, cand.url, tmp_path, min_requests=10**6), tmp_path))
        with Traffic(p.url) as t:
            wait_state(p.url, lambda d: d["step"] == 1 and d["served"] >= 10, 120, "half the traffic on the candidate")
            os.kill(cand.pid, signal.SIGKILL)
            back = wait_state(p.url, lambda d: d["state"] != "running", 60, "the rollout to leave `running`")
            n_back = len(t.served) + len(t.failures)
            wait_until(lambda: len(t.served) + len(t.failures) >= n_back + 20, timeout=60)
        assert back["state"] == "rolled_back" and back["cause"] == "errors", back
        assert back["step"] == 1 and back["errors"] >= 3, back
        # only the streams the candidate held when it died fail (at most one per client); every other request,
        # those it would have served afterwards included, was served
        assert len(t.failures) <= t.concurrency, t.failures
        assert all(f.startswith("cand 200 ") for f in t.failures), t.failures
        assert set(t.served[-20:]) == {"base"}
        print(f"\nkilled candidate: {len(t.failures)} client errors, rolled back after {back['errors']} errors")
        assert p.value("enginemeter_rollout_rollbacks_total", route="0", cause="errors") == 1


def test_pinned_requests_keep_their_engine_and_stay_out_of_the_count(
    proxy_factory: ProxyFactory, tmp_path: Path
) -> None:
    with fault_engine(ttft_ms=5, cadence_ms=1) as base, fault_engine(ttft_ms=5, cadence_ms=1) as cand:
        p = proxy_factory(settings_of(config(base.url, cand.url, tmp_path), tmp_path))
        body = {"model": "m", "max_tokens": 2, "messages": MSGS}
        for _ in range(5):
            r = p.client.post("/v1/chat/completions", json=body, headers={PIN: "cand"})
            assert r.status_code == 200 and r.headers["x-enginemeter-engine"] == "cand"
        wait_until(lambda: len(p.of("primary")) >= 5)
        doc = rollout(p.url)
        assert doc["attempts"] == 0 and doc["pairs"] == {}, doc
        # the rollout's share is 0: unpinned requests go to the baseline, and their copies to the candidate
        r = p.client.post("/v1/chat/completions", json=body)
        assert r.headers["x-enginemeter-engine"] == "base"
        wait_until(lambda: (d := rollout(p.url))["pairs"] == {"decode": 1} and d["attempts"] == 1)
        # a pin outside the route's engines is still refused
        r = p.client.post("/v1/chat/completions", json=body, headers={PIN: "other"})
        assert r.status_code == 400 and r.json()["error"]["enginemeter"] is True
        recs = [r for r in log_records(tmp_path) if r["role"] == "primary"]
        assert [r["rollout"] for r in recs[:5]] == [None] * 5


def test_admin_commands_and_bad_input(proxy_factory: ProxyFactory, tmp_path: Path) -> None:
    with fault_engine(ttft_ms=5, cadence_ms=1) as base, fault_engine(ttft_ms=5, cadence_ms=1) as cand:
        p = proxy_factory(settings_of(config(base.url, cand.url, tmp_path, steps=[0.5, 1.0]), tmp_path))
        assert rollout(p.url)["share"] == 0.5
        doc = rollout(p.url, action="pause")
        assert doc["state"] == "paused" and doc["cause"] == "admin" and doc["share"] == 0.5
        assert rollout(p.url, action="pause")["state"] == "paused"  # again: nothing changes
        assert rollout(p.url, action="resume")["state"] == "running"
        doc = rollout(p.url, action="abort", route=0)
        assert doc["state"] == "aborted" and doc["share"] == 0.0 and doc["rollbacks"]["admin"] == 1
        for _ in range(4):  # share 0 at once: the next request is the baseline's
            r = p.client.post("/v1/chat/completions", json={"model": "m", "max_tokens": 2, "messages": MSGS})
            assert r.headers["x-enginemeter-engine"] == "base"
        bad: list[tuple[dict[str, str], Any, int, str | None]] = [
            ({}, {"action": "pause"}, 401, None),
            (ADMIN, {"action": "resume"}, 409, None),  # aborted: resume does not apply
            (ADMIN, {"action": "pause"}, 409, None),
            (ADMIN, {"action": "restart"}, 400, "action"),
            (ADMIN, {}, 400, "action"),
            (ADMIN, {"action": "start", "route": 3}, 400, "route"),
            (ADMIN, {"action": "start", "route": "0"}, 400, "route"),
            (ADMIN, {"action": "start", "share": 1}, 400, "share"),
            (ADMIN, [1], 400, None),
            (ADMIN, "{not json", 400, None),
        ]
        for headers, body, status, param in bad:
            kw: dict[str, Any] = {"content": body} if isinstance(body, str) else {"json": body}
            r = httpx.post(f"{p.url}/admin/rollout", headers=headers, timeout=10, **kw)
            assert r.status_code == status, (body, r.text)
            err = r.json()["error"]
            assert err["enginemeter"] is True and err["param"] == param, (body, err)
        doc = rollout(p.url, action="start")
        assert doc["state"] == "running" and doc["step"] == 0 and doc["share"] == 0.5
        assert [e["event"] for e in doc["events"]] == ["started", "paused", "resumed", "aborted", "started"]


def test_admin_endpoint_without_rollouts_or_key_is_a_404(proxy_factory: ProxyFactory, tmp_path: Path) -> None:
    with fault_engine(ttft_ms=5, cadence_ms=1) as base:
        s = Settings(engines=(EngineSettings(name="base", url=base.url),), routes=(RouteSettings(primary="base"),),
                     admin_key=ADMIN_KEY)  # fmt: skip
        p = proxy_factory(s)
        r = httpx.get(f"{p.url}/admin/rollout", headers=ADMIN)
        assert r.status_code == 404 and r.json()["error"]["enginemeter"] is True
        assert "rollout" not in p.client.get("/health").json()


def test_every_rollout_metric_is_documented_and_exported(proxy_factory: ProxyFactory, tmp_path: Path) -> None:
    doc = (Path(__file__).resolve().parents[3] / "docs" / "metrics.md").read_text()
    section = doc[doc.index("## Rollout") :]
    section = section[: section.index("\n## ")]
    documented = set(re.findall(r"^\| `(enginemeter_[a-z_]+)`", section, re.M))
    assert len(documented) >= 8
    with fault_engine(ttft_ms=5, cadence_ms=1) as base, fault_engine(ttft_ms=5, cadence_ms=1) as cand:
        p = proxy_factory(settings_of(config(base.url, cand.url, tmp_path), tmp_path))
        text = p.client.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text) if f.name.startswith("enginemeter_rollout")}
    exported = {f"{f.name}_total" if f.type == "counter" else f.name for f in families.values()}
    assert exported == documented
    # every closed label set is there from the start (0 rollbacks, not "no data")
    rollbacks = {s.labels["cause"]: s.value for s in families["enginemeter_rollout_rollbacks"].samples}
    assert rollbacks == {"slower": 0, "errors": 0, "admin": 0, "config": 0}


def test_a_restarted_proxy_carries_on_at_its_step_and_says_so(tmp_path: Path) -> None:
    with fault_engine(ttft_ms=30, cadence_ms=4) as base, fault_engine(ttft_ms=5, cadence_ms=1) as cand:
        cfg = config(base.url, cand.url, tmp_path, min_requests=10**6)
        with ProcessProxy(cfg, tmp_path) as proxy:
            with Traffic(proxy.url) as t:
                wait_state(proxy.url, lambda d: d["step"] == 1, 120, "step 1")
            assert not t.failures
        # a new proxy on the same state file: step 1 at share 0.5 (not the config's first step), its test anew
        with ProcessProxy(cfg, tmp_path) as proxy:
            doc = rollout(proxy.url)
            assert (doc["state"], doc["step"], doc["share"]) == ("running", 1, 0.5), doc
            assert doc["events"][-1]["event"] == "restored" and doc["pairs"] == {}, doc["events"]
        # the config pauses it: applied once, at the next start; an admin resume afterwards is not undone by it
        cfg["routes"][0]["rollout"]["state"] = "paused"
        with ProcessProxy(cfg, tmp_path) as proxy:
            doc = rollout(proxy.url)
            assert (doc["state"], doc["cause"], doc["share"]) == ("paused", "config", 0.5), doc
            assert rollout(proxy.url, action="resume")["state"] == "running"
        with ProcessProxy(cfg, tmp_path) as proxy:
            assert rollout(proxy.url)["state"] == "running"
        # a changed plan starts again from its first step
        cfg["routes"][0]["rollout"]["steps"] = [0.0, 0.25, 1.0]
        with ProcessProxy(cfg, tmp_path) as proxy:
            doc = rollout(proxy.url)
            assert (doc["step"], doc["share"], doc["steps"]) == (0, 0.0, [0.0, 0.25, 1.0]), doc


# ============================================================================================ --workers 2


def worker_pids(supervisor: int) -> list[int]:
    """The supervisor's worker processes (multiprocessing's spawn children; not its resource tracker)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (d / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == supervisor and b"spawn_main" in cmdline:
            pids.append(int(d.name))
    return sorted(pids)


def served_by_worker(directory: Path, pid: int) -> dict[str, float]:
    """engine -> primary requests worker ``pid`` counted in its own multiprocess file."""
    out: dict[str, float] = {}
    path = directory / f"counter_{pid}.db"
    if path.exists():
        for key, value, *_ in MmapedDict.read_all_values_from_file(str(path)):  # type: ignore[no-untyped-call]
            name, _, labels, _ = json.loads(key)
            if name == "enginemeter_requests" and labels.get("role") == "primary" and value:
                out[labels["engine"]] = out.get(labels["engine"], 0) + value
    return out


def fresh(url: str, n: int) -> set[str]:
    """The engines that served ``n`` requests, each on a connection of its own (so both workers get some)."""
    engines = set()
    for _ in range(n):
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": "m", "max_tokens": 2, "messages": MSGS},
                       headers={"connection": "close"}, timeout=30)  # fmt: skip
        assert r.status_code == 200, r.text
        engines.add(r.headers["x-enginemeter-engine"])
    return engines


def test_two_workers_keep_one_share_and_a_restarted_worker_takes_it_up(tmp_path: Path) -> None:
    directory = tmp_path / "metrics-2"
    with fault_engine(ttft_ms=30, cadence_ms=4) as base, fault_engine(ttft_ms=5, cadence_ms=1) as cand:
        with ProcessProxy(config(base.url, cand.url, tmp_path), tmp_path, workers=2) as proxy:
            workers = worker_pids(proxy.pid)
            assert len(workers) == 2, workers
            # clients on connections of their own: both workers route, pair and count, into one state
            with Traffic(proxy.url, close=True) as t:
                done = wait_state(proxy.url, lambda d: d["state"] == "complete", 120, "the rollout to complete")
            assert not t.failures, t.failures
            assert [e["event"] for e in done["events"]] == ["started", "advanced", "advanced", "completed"]
            assert all("base" in served_by_worker(directory, w) for w in workers), "both workers served"
            assert fresh(proxy.url, 12) == {"cand"}
            # a worker killed and restarted routes by the current share (all to the candidate), not from step 0
            victim = workers[0]
            os.kill(victim, signal.SIGKILL)
            wait_until(lambda: len(w := worker_pids(proxy.pid)) == 2 and victim not in w, timeout=30)
            [new] = set(worker_pids(proxy.pid)) - set(workers)
            wait_until(lambda: fresh(proxy.url, 4) == {"cand"} and served_by_worker(directory, new), timeout=30)
            assert served_by_worker(directory, new).keys() == {"cand"}
            assert rollout(proxy.url)["state"] == "complete"
            # an abort that one worker takes applies to the next request of every worker
            httpx.post(f"{proxy.url}/admin/rollout", json={"action": "abort"}, headers={**ADMIN, "connection": "close"})
            assert fresh(proxy.url, 12) == {"base"}
            text = httpx.get(f"{proxy.url}/metrics", headers={"connection": "close"}).text
            assert 'enginemeter_rollout_rollbacks_total{cause="admin",route="0"} 1.0' in text
            assert 'enginemeter_rollout_state{route="0",state="aborted"} 1.0' in text


# ============================================================================================ llama-server


#: four clients, each starting a request every half second at most. Unpaced, the clients drive the serving
#: engine flat out and the other one gets its copies at that pace: on two shared cores np4's batching gains little
#: throughput over np1, so np4 as the shadow sat at saturation and queued, and read as slower (5 runs of 12 under a
#: colleague's test suite). Live traffic arrives at its own rate, below both engines' capacity.
PACED: dict[str, Any] = {"max_tokens": 32, "pace_s": 0.5}


def llama_config(base: str, cand: str, tmp: Path, **rollout: Any) -> dict[str, Any]:
    cfg = config(base, cand, tmp, **{"steps": [0.0, 0.1, 0.5, 1.0], "min_requests": 3, **rollout})
    cfg["models"] = [{"alias": "m", "engines": {"base": "tiny", "cand": "tiny"}}]
    return cfg


def test_llama_np4_candidate_takes_the_route_by_itself_at_concurrency_4(
    llama_server_factory: LlamaServerFactory, tmp_path: Path
) -> None:
    base, cand = llama_server_factory(np=1), llama_server_factory(np=4)
    cfg = llama_config(base.url, cand.url, tmp_path)
    # the steps, not the speed: at this pace on two shared cores np4's batching gains nothing over np1, and a CI
    # run under its own suite's load read np4 as x1.5 slower per output token (interval x1.1-x2.0) at the shadow
    # step. A band of x1.9 either way leaves only a gross slowdown to stop it; the default band's rollback is
    # test_llama_np1_candidate_is_slower_at_concurrency_4_and_rolls_back.
    cfg["mirror"]["min_effect"] = 0.9
    with ProcessProxy(cfg, tmp_path) as proxy:
        with Traffic(proxy.url, **PACED) as t:
            done = wait_state(proxy.url, lambda d: d["state"] != "running", 240, "the rollout to end")
        assert not t.failures, t.failures[:3]
        assert done["state"] == "complete", json.dumps(done, indent=1)
        assert [(e["event"], e["share"]) for e in done["events"]] == [
            ("started", 0.0), ("advanced", 0.1), ("advanced", 0.5), ("advanced", 1.0), ("completed", 1.0)
        ]  # fmt: skip
        assert set(t.served) == {"base", "cand"} and fresh(proxy.url, 4) == {"cand"}
        shares = {r["rollout"]["share"] for r in log_records(tmp_path) if r["role"] == "primary"}
        assert shares == {0.0, 0.1, 0.5, 1.0}


def test_llama_np1_candidate_is_slower_at_concurrency_4_and_rolls_back(
    llama_server_factory: LlamaServerFactory, tmp_path: Path
) -> None:
    base, cand = llama_server_factory(np=4), llama_server_factory(np=1)
    with ProcessProxy(llama_config(base.url, cand.url, tmp_path), tmp_path) as proxy:
        with Traffic(proxy.url, max_tokens=64) as t:
            back = wait_state(proxy.url, lambda d: d["state"] != "running", 240, "the rollout to end")
        assert not t.failures, t.failures[:3]
        assert back["state"] == "rolled_back" and back["cause"] == "slower" and back["step"] <= 1, back
        assert "cand is slower than base" in back["detail"] and "under load" in back["detail"], back["detail"]
        assert fresh(proxy.url, 4) == {"base"}
        assert "ROLLED BACK" in proxy.output()


def test_llama_candidate_killed_mid_rollout_sends_its_share_back(
    llama_server_factory: LlamaServerFactory, tmp_path: Path
) -> None:
    base, cand = llama_server_factory(np=1), llama_server_factory(np=4)
    # half the traffic on the candidate from the start, and no copies: this is about its death, not its speed
    # (on two cores shared with other work a speed verdict can come first: the rollback is then `slower`)
    cfg = llama_config(base.url, cand.url, tmp_path, steps=[0.5, 1.0])
    cfg["routes"][0]["sample_rate"] = 0.0
    with ProcessProxy(cfg, tmp_path) as proxy:
        with Traffic(proxy.url, **{**PACED, "max_tokens": 96}) as t:  # longer streams: some are in flight
            wait_state(proxy.url, lambda d: d["served"] >= 8, 120, "the candidate serving")
            os.kill(cand.pid, signal.SIGKILL)
            back = wait_state(proxy.url, lambda d: d["state"] != "running", 60, "the rollout to end")
            n = len(t.served) + len(t.failures)
            wait_until(lambda: len(t.served) + len(t.failures) >= n + 12, timeout=120)
        assert back["state"] == "rolled_back" and back["cause"] == "errors" and back["step"] == 0, back
        # the streams the candidate held when it died fail (at most one per client), after their first byte (200,
        # an in-band error); every request after that is served, those routed to the dead candidate included
        assert len(t.failures) <= t.concurrency, t.failures
        assert all(f.startswith("cand 200 ") for f in t.failures), t.failures
        assert set(t.served[-12:]) == {"base"}
        print(f"\nkilled llama candidate: {len(t.failures)} client errors, rolled back after {back['errors']} errors")
