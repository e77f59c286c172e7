"""``serve`` swapping the engines it launches, with real processes: the proxy (``python -m proxy.cli serve``), its
launched engines (the fault engine, a llama.cpp look-alike with exact timing, by command line; llama-server on the
tiny model) and clients at concurrency 2.

Marked ``engine``: each test starts processes and waits for phases (seconds), which belongs to scripts/test.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import REPO, ProcessServer, wait_until

pytestmark = pytest.mark.engine

ADMIN = "swap-admin"
AUTH = {"authorization": f"Bearer {ADMIN}"}


def fault(marker: str, *, cadence_ms: float = 5, ttft_ms: float = 5, tokens: int = 8) -> str:
    """The fault engine's launch command; ``marker`` (its model name) finds its process."""
    return (
        f"PYTHONPATH={REPO} {sys.executable} -m fakes.fault_engine --port {{port}} --model {marker} "
        f"--tokens {tokens} --cadence-ms {cadence_ms:g} --ttft-ms {ttft_ms:g}"
    )


def config(tmp: Path, base: str, cand: str, **swap: Any) -> Path:
    doc = {
        "admin_key": ADMIN,
        "engines": [{"name": "base", "launch": base}, {"name": "cand", "launch": cand}],
        "routes": [{"models": ["*"], "primary": "base", "swap": {"candidate": "cand", **swap}}],
    }
    path = tmp / "swap.yaml"
    path.write_text(json.dumps(doc))  # JSON is YAML
    return path


def request_log(cfg: Path, tmp: Path) -> Path:
    """The config's request log turned on; its path."""
    path = tmp / "requests.jsonl"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "request_log": {"path": str(path)}}))
    return path


def serve(tmp: Path, cfg: Path, workers: int = 1) -> ProcessServer:
    env = {"XDG_STATE_HOME": str(tmp / "state"), "TMPDIR": str(tmp)}
    return ProcessServer(
        "proxy.cli", "serve", "--config", str(cfg), "--listen", "127.0.0.1:{port}", "--workers", str(workers),
        "--log-level", "info", ready_path="/health", env=env, startup_timeout=120,
    )  # fmt: skip


def swap_state(url: str) -> dict[str, Any]:
    doc: dict[str, Any] = httpx.get(f"{url}/health", timeout=10).json()["swap"][0]
    return doc


def wait_phase(url: str, *phases: str, timeout: float = 60) -> dict[str, Any]:
    def reached() -> dict[str, Any] | None:
        s = swap_state(url)
        return s if s["phase"] in phases else None

    found = wait_until(reached, timeout, 0.05, message=f"phase in {phases}")
    assert found is not None
    return found


def start(url: str) -> None:
    r = httpx.post(f"{url}/admin/rollout", json={"action": "start"}, headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text


def processes(marker: str) -> list[int]:
    """Live processes whose command line holds ``marker``."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if marker.encode() in (d / "cmdline").read_bytes() and b"pytest" not in (d / "cmdline").read_bytes():
                    stat = (d / "stat").read_text()
                    if stat.rsplit(")", 1)[1].split()[0] != "Z":
                        out.append(int(d.name))
            except OSError:
                pass
    return out


@dataclass
class Clients:
    """``n`` clients sending short streams back to back until stopped; every answer kept."""

    url: str
    n: int = 2
    #: the client's model name (None: the body has none)
    model: str | None = None
    answers: list[tuple[int, str | None, dict[str, Any] | None]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def _run(self) -> None:
        body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}
        if self.model is not None:
            body["model"] = self.model
        with httpx.Client(base_url=self.url, timeout=120) as c:
            while not self.stop.is_set():
                try:
                    with c.stream("POST", "/v1/chat/completions", json=body) as r:
                        text = r.read().decode()
                        err = json.loads(text) if r.status_code != 200 else None
                        self.answers.append((r.status_code, r.headers.get("x-enginemeter-engine"), err))
                        if r.status_code == 503:
                            self.answers[-1][2]["retry_after"] = r.headers.get("retry-after")  # type: ignore[index]
                except httpx.HTTPError as exc:
                    self.answers.append((0, None, {"error": repr(exc)}))

    @contextmanager
    def running(self) -> Iterator[Clients]:
        threads = [threading.Thread(target=self._run) for _ in range(self.n)]
        for t in threads:
            t.start()
        try:
            yield self
        finally:
            self.stop.set()
            for t in threads:
                t.join(60)

    def served_by(self, engine: str) -> int:
        return sum(1 for s, e, _ in self.answers if s == 200 and e == engine)


def test_a_swap_under_load_answers_every_request_and_reports_its_outage(tmp_path: Path) -> None:
    cfg = config(tmp_path, fault("base-a1"), fault("cand-a1"), min_dwell_s=1, warmup_requests=1)
    log = request_log(cfg, tmp_path)
    with serve(tmp_path, cfg) as proxy, Clients(proxy.url).running() as clients:
        wait_until(lambda: clients.served_by("base") >= 60, 30)
        start(proxy.url)
        done = wait_phase(proxy.url, "complete", "rolled_back")
        wait_until(lambda: clients.served_by("cand") >= 20, 30)
        assert processes("base-a1") == [] and len(processes("cand-a1")) == 1  # one engine resident
        metrics = httpx.get(f"{proxy.url}/metrics").text
    assert done["phase"] == "complete", done
    assert [a for a in clients.answers if a[0] != 200] == []
    assert done["outage_s"] is not None and 0 < done["outage_s"] < 30
    assert set(done["phase_s"]) >= {"draining", "stopping", "launching", "warming", "watching"}
    said = proxy.output()
    assert "swap of route 0 (base → cand): watching → complete" in said and "outage" in said
    assert 'enginemeter_swap_phase{phase="complete",route="0"} 1.0' in metrics
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    held = [x["swap"] for x in lines if x["swap"]["phase"] != "baseline" and x["engine"] == "cand"]
    assert held and all(x["swap"]["engine"] == x["engine"] for x in lines)
    assert max(h["held_s"] for h in held) > 0.1  # held through the swap, answered by the candidate
    documented = re.findall(r"^\| `(enginemeter_swap_\w+)`", (REPO / "docs" / "metrics.md").read_text(), re.M)
    assert len(documented) == 10 and all(f"# TYPE {name} " in metrics for name in documented)
    assert "\nenginemeter_swap_back_outage_seconds" not in metrics  # no swap back yet: no sample
    assert processes("cand-a1") == []  # serve stopped its engine with itself


def test_a_slower_candidate_is_swapped_back_by_the_watch(tmp_path: Path) -> None:
    cfg = config(tmp_path, fault("base-s1"), fault("cand-s1", cadence_ms=25, ttft_ms=25), min_dwell_s=60)
    with serve(tmp_path, cfg) as proxy, Clients(proxy.url).running() as clients:
        wait_until(lambda: clients.served_by("base") >= 100, 30)
        start(proxy.url)
        done = wait_phase(proxy.url, "rolled_back", "complete", timeout=90)
        n = clients.served_by("base")
        wait_until(lambda: clients.served_by("base") > n + 5, 30)  # the baseline serves again
        back = wait_until(lambda: swap_state(proxy.url)["back_outage_s"], 30, 0.05, message="the way back's outage")
        metrics = httpx.get(f"{proxy.url}/metrics").text
    assert (done["phase"], done["cause"]) == ("rolled_back", "slower"), done
    assert "slower" in done["detail"] and done["rollbacks"]["slower"] == 1
    assert [a for a in clients.answers if a[0] != 200] == []
    assert "watching → reverting" in proxy.output() and "the way back's outage" in proxy.output()
    # the candidate's last answer -> the baseline's first again: its stop and the baseline's launch, not zero
    assert 0 < back < 30 and f'enginemeter_swap_back_outage_seconds{{route="0"}} {back}' in metrics
    assert done["outage_s"] is not None  # the swap's own stays beside it


def test_the_watch_counts_the_requests_timed_while_the_proxy_was_starved(tmp_path: Path) -> None:
    """The proxy's process stopped (``SIGSTOP``) for 0.3 s at a time during the watch, as a host whose CPU is taken
    starves it: the requests in flight meanwhile are counted in the watch's decision, and the request log marks them."""
    cfg = config(tmp_path, fault("base-p1"), fault("cand-p1"), min_dwell_s=10, warmup_requests=1)
    log = request_log(cfg, tmp_path)
    # a wide band: the stops and a loaded box never make the same engine "slower", so the pass states the count
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "mirror": {"min_effect": 0.9}}))
    with serve(tmp_path, cfg) as proxy, Clients(proxy.url).running() as clients:
        wait_until(lambda: clients.served_by("base") >= 60, 30)
        start(proxy.url)
        wait_phase(proxy.url, "watching")
        for _ in range(3):
            more = clients.served_by("cand") + 10
            wait_until(lambda: clients.served_by("cand") >= more, 30)  # noqa: B023  # the candidate serves between stops
            os.kill(proxy.pid, signal.SIGSTOP)
            try:
                threading.Event().wait(0.3)  # the fault's length, not a synchronisation
            finally:
                os.kill(proxy.pid, signal.SIGCONT)
        done = wait_phase(proxy.url, "complete", "rolled_back", timeout=60)
    assert done["phase"] == "complete", done
    m = re.search(
        r"the proxy's event loop stalled \(≥ 20 ms\) while (\d+) of the candidate's (\d+) requests", done["detail"]
    )
    assert m is not None, done
    assert 2 <= int(m[1]) < int(m[2]), done  # each stop caught the requests in flight, never all of them
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert sum(x["loop_stalled"] for x in lines if x["engine"] == "cand") >= int(m[1])


def test_a_candidate_killed_during_the_watch_is_swapped_back(tmp_path: Path) -> None:
    cfg = config(tmp_path, fault("base-k1"), fault("cand-k1"), min_dwell_s=600)
    with serve(tmp_path, cfg) as proxy, Clients(proxy.url).running() as clients:
        wait_until(lambda: clients.served_by("base") >= 20, 30)
        start(proxy.url)
        wait_phase(proxy.url, "watching")
        wait_until(lambda: clients.served_by("cand") >= 5, 30)
        (pid,) = processes("cand-k1")
        os.kill(pid, signal.SIGKILL)
        done = wait_phase(proxy.url, "rolled_back")
        n = clients.served_by("base")
        wait_until(lambda: clients.served_by("base") > n + 5, 30)
    assert done["cause"] == "died", done
    assert len(processes("base-k1")) == 0  # stopped with serve


def test_past_the_queue_bound_a_held_request_gets_the_proxys_503_with_retry_after(tmp_path: Path) -> None:
    # the candidate's warm-up takes 2 s: requests held longer than 0.3 s are answered 503
    slow = fault("cand-q1", ttft_ms=2000)
    cfg = config(tmp_path, fault("base-q1"), slow, queue_max_wait_s=0.3, warmup_requests=1, min_dwell_s=600)
    with serve(tmp_path, cfg) as proxy:
        with Clients(proxy.url).running() as clients:
            wait_until(lambda: clients.served_by("base") >= 10, 30)
            start(proxy.url)
            wait_phase(proxy.url, "warming")
            body = {"messages": [{"role": "user", "content": "x"}]}
            with pytest.raises(httpx.TimeoutException):  # a client that hangs up while held
                httpx.post(f"{proxy.url}/v1/chat/completions", json=body, timeout=0.05)
            wait_phase(proxy.url, "watching")
        sent = len(clients.answers) + 1

        def every_request_counted() -> dict[str, float] | None:
            c: dict[str, float] = swap_state(proxy.url)["counts"]
            return c if c.get("served", 0) + c.get("rejected", 0) + c.get("hung_up", 0) == sent else None

        counts = wait_until(every_request_counted, 10, 0.1, message=f"{sent} requests counted")
    refused = [a for a in clients.answers if a[0] == 503]
    assert refused, clients.answers[-5:]
    err = refused[0][2]
    assert err is not None and err["error"]["enginemeter"] is True and int(err["retry_after"]) >= 1
    assert {a[0] for a in clients.answers} <= {200, 503}
    assert counts is not None and counts["held"] >= counts["rejected"] >= 1 and counts["hung_up"] >= 1
    assert counts["served"] == sum(1 for a in clients.answers if a[0] == 200)


def test_two_workers_agree_on_one_phase_and_the_supervisor_owns_the_engines(tmp_path: Path) -> None:
    cfg = config(tmp_path, fault("base-w2"), fault("cand-w2"), min_dwell_s=1)
    with serve(tmp_path, cfg, workers=2) as proxy, Clients(proxy.url).running() as clients:
        wait_until(lambda: clients.served_by("base") >= 40, 30)
        start(proxy.url)
        wait_phase(proxy.url, "complete", "rolled_back")
        seen = {(s["phase"], s["epoch"]) for s in (swap_state(proxy.url) for _ in range(20))}
        wait_until(lambda: clients.served_by("cand") >= 20, 30)
        (pid,) = processes("cand-w2")
        parent = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
    assert len(seen) == 1 and next(iter(seen))[0] == "complete", seen
    assert [a for a in clients.answers if a[0] != 200] == []
    assert parent == str(proxy.pid)  # the supervisor owns the engine, never a worker


def test_sigterm_of_serve_mid_swap_leaves_no_engine_behind(tmp_path: Path) -> None:
    # started by the config (state: running), not by the admin route
    cfg = config(tmp_path, fault("base-t1"), fault("cand-t1", ttft_ms=5000), warmup_requests=1, state="running")
    proxy = serve(tmp_path, cfg).start()
    try:
        wait_phase(proxy.url, "warming")
        assert len(processes("cand-t1")) == 1
        os.kill(proxy.pid, signal.SIGTERM)
        wait_until(lambda: proxy.process.returncode is not None, 60)
        assert processes("cand-t1") == [] and processes("base-t1") == []
    finally:
        proxy.stop()


def test_a_candidate_whose_command_fails_leaves_the_baseline_serving(
    tmp_path: Path, llama_server_bin: Path, tiny_model: Path
) -> None:
    common = f"{llama_server_bin} --port {{port}} -c 1024 -np 2 -t 1 --alias tiny"
    cfg = config(tmp_path, f"{common} -m {tiny_model}", f"{common} -m {tmp_path}/no-such-model.gguf")
    with serve(tmp_path, cfg) as proxy, Clients(proxy.url).running() as clients:
        wait_until(lambda: clients.served_by("base") >= 10, 60)
        start(proxy.url)
        done = wait_phase(proxy.url, "rolled_back", "watching", timeout=120)
        n = clients.served_by("base")
        wait_until(lambda: clients.served_by("base") > n + 5, 60)
    assert (done["phase"], done["cause"]) == ("rolled_back", "start_failed"), done
    assert [a for a in clients.answers if a[0] != 200] == []


def test_serve_swaps_one_llama_server_for_another_under_load(
    tmp_path: Path, llama_server_bin: Path, tiny_model: Path
) -> None:
    common = f"{llama_server_bin} -m {tiny_model} --port {{port}} -c 2048 -t 1 --alias tiny"
    cfg = config(tmp_path, f"{common} -np 2", f"{common} -np 2 -b 512", min_dwell_s=1, warmup_requests=2)
    with serve(tmp_path, cfg) as proxy, Clients(proxy.url).running() as clients:
        wait_until(lambda: clients.served_by("base") >= 40, 60)
        start(proxy.url)
        done = wait_phase(proxy.url, "complete", "rolled_back", timeout=120)
        wait_until(lambda: clients.served_by("cand") >= 10, 60)
    assert [a for a in clients.answers if a[0] != 200] == []
    assert done["outage_s"] is not None, done
    print(f"outage {done['outage_s']:.3f} s; phases {done['phase_s']}; end {done['phase']} ({done['cause']})")


def answered_by(url: str) -> str | None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    engine: str | None = r.headers.get("x-enginemeter-engine")
    return engine


def test_a_restart_mid_swap_returns_to_the_baseline_and_a_complete_swap_stays_on_the_candidate(
    tmp_path: Path,
) -> None:
    state = str(tmp_path / "swap-state.json")
    slow = config(tmp_path, fault("base-r1"), fault("cand-r1", ttft_ms=5000), warmup_requests=1, state_file=state)
    with serve(tmp_path, slow) as proxy:
        start(proxy.url)
        wait_phase(proxy.url, "warming")
    with serve(tmp_path, slow) as proxy:  # restarted mid-swap: back to the baseline, never without an engine
        s = swap_state(proxy.url)
        assert (s["phase"], s["cause"]) == ("rolled_back", "restarted"), s
        assert answered_by(proxy.url) == "base"
    quick = config(tmp_path, fault("base-r1"), fault("cand-r1"), min_dwell_s=0, min_requests=30, state_file=state)
    with serve(tmp_path, quick) as proxy, Clients(proxy.url).running() as clients:
        wait_until(lambda: clients.served_by("base") >= 40, 30)
        start(proxy.url)
        wait_phase(proxy.url, "complete")
    with serve(tmp_path, quick) as proxy:  # a complete swap: the candidate is launched at start
        assert swap_state(proxy.url)["phase"] == "complete"
        assert answered_by(proxy.url) == "cand" and processes("base-r1") == []


def test_a_damaged_state_file_starts_the_route_safe_on_the_baseline(tmp_path: Path) -> None:
    state = tmp_path / "swap-state.json"
    state.write_bytes(b'{"v": 1, "phase": "watc')  # cut in half
    Path(f"{state}.shm").write_bytes(b"\0" * 100)
    cfg = config(tmp_path, fault("base-d1"), fault("cand-d1"), state="running", state_file=str(state))
    with serve(tmp_path, cfg) as proxy:
        s = swap_state(proxy.url)
        assert (s["phase"], s["cause"]) == ("rolled_back", "damaged"), s
        assert answered_by(proxy.url) == "base" and processes("cand-d1") == []
    assert "could not be read" in proxy.output()


def test_serve_launches_a_routes_engine_and_stops_it_at_the_end(tmp_path: Path) -> None:
    doc = {"engines": [{"name": "solo", "launch": fault("solo-l1")}], "routes": [{"models": ["*"], "primary": "solo"}]}
    cfg = tmp_path / "launch.yaml"
    cfg.write_text(json.dumps(doc))
    with serve(tmp_path, cfg) as proxy:
        assert answered_by(proxy.url) == "solo" and len(processes("solo-l1")) == 1
    assert processes("solo-l1") == []


def test_a_stream_that_outlasts_the_drain_bound_is_never_cut_the_swap_is_abandoned(tmp_path: Path) -> None:
    cfg = config(tmp_path, fault("base-n1", cadence_ms=400), fault("cand-n1"), drain_timeout_s=0.5)
    with serve(tmp_path, cfg) as proxy, Clients(proxy.url, n=1).running() as clients:
        wait_until(lambda: len(clients.answers) >= 1, 30)  # a stream of ~3 s is in flight from here on
        start(proxy.url)
        done = wait_phase(proxy.url, "rolled_back", "watching")
        n = len(clients.answers)
        wait_until(lambda: len(clients.answers) > n, 30)
    assert (done["phase"], done["cause"]) == ("rolled_back", "drain_timeout"), done
    assert [a for a in clients.answers if a[0] != 200] == [] and processes("cand-n1") == []


def test_an_abort_during_the_watch_swaps_back(tmp_path: Path) -> None:
    cfg = config(tmp_path, fault("base-b1"), fault("cand-b1"), min_dwell_s=600)
    with serve(tmp_path, cfg) as proxy, Clients(proxy.url).running() as clients:
        wait_until(lambda: clients.served_by("base") >= 10, 30)
        start(proxy.url)
        wait_phase(proxy.url, "watching")
        r = httpx.post(f"{proxy.url}/admin/rollout", json={"action": "abort"}, headers=AUTH, timeout=10)
        assert r.status_code == 200 and r.json()["command"] == "abort"
        done = wait_phase(proxy.url, "rolled_back")
        n = clients.served_by("base")
        wait_until(lambda: clients.served_by("base") > n + 5, 30)
        assert processes("cand-b1") == []
    assert done["cause"] == "aborted" and done["rollbacks"]["aborted"] == 1
    assert [a for a in clients.answers if a[0] != 200] == []
