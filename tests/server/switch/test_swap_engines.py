"""A swap's engines as the clients meet them, with real processes (the serve of ``test_swap_serve``): a launched
vLLM (the emulator, faithful to vLLM 0.26's answers) that refuses any model name but its own, once it serves; a
baseline that does not start again after the swap back (the route says ``failed``, the proxy answers 503, an admin
command retries).

Marked ``engine``: each test starts processes and waits for phases (seconds), which belongs to scripts/test.
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from tests.helpers import REPO, ProcessServer, wait_until
from tests.server.switch.test_swap_serve import (
    AUTH,
    Clients,
    config,
    fault,
    processes,
    serve,
    start,
    swap_state,
    wait_phase,
)

pytestmark = pytest.mark.engine

PIN = "x-enginemeter-engine"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_clients_keep_their_model_name_across_a_swap_to_an_engine_that_refuses_others(tmp_path: Path) -> None:
    # vLLM answers 404 "model `x` does not exist" to any name but its served one; llama.cpp takes any
    args = ("--model", "backend-m1", "--tokens", "8", "--ttft-ms", "5", "--cadence-ms", "5")
    backend = ProcessServer("fakes.fault_engine", *args, ready_path="/health")
    vllm = (
        f"PYTHONPATH={REPO} {sys.executable} -m fakes.vllm_emulator /models/cand-m1 --served-model-name cand-m1 "
        f"--max-model-len 4096 --backend {{backend}} --port {{port}}"
    )
    with backend:
        cand = vllm.replace("{backend}", backend.url)
        # the baseline slower than the candidate: the watch keeps the candidate serving
        cfg = config(tmp_path, fault("base-m1", ttft_ms=40, cadence_ms=20), cand, min_dwell_s=600)
        with serve(tmp_path, cfg) as proxy, Clients(proxy.url, model="my-model").running() as clients:
            wait_until(lambda: clients.served_by("base") >= 10, 30)
            start(proxy.url)
            wait_until(lambda: clients.served_by("cand") >= 20, 30)  # no /health meanwhile: it probes engines
            r = httpx.post(f"{proxy.url}/v1/chat/completions", json={**CHAT, "model": "my-model"}, timeout=30)
            # a pin passes the swap's gate too: to the engine serving, served; to the one stopped, the proxy's 503
            pins = {
                name: httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT, headers={PIN: name}, timeout=30)
                for name in ("cand", "base")
            }
            s = swap_state(proxy.url)
        refused = httpx.post(f"{backend.url}/v1/chat/completions", json=CHAT, timeout=10)  # the backend takes any
    assert refused.status_code == 200
    assert [a for a in clients.answers if a[0] != 200] == [], [a for a in clients.answers if a[0] != 200][:3]
    assert s["phase"] == "watching", s
    assert r.status_code == 200 and r.headers["x-enginemeter-engine"] == "cand", r.text
    assert r.json()["model"] == "my-model"  # the client's name in the answer, the engine's on the way there
    assert pins["cand"].status_code == 200 and pins["cand"].headers["x-enginemeter-engine"] == "cand"
    assert pins["base"].status_code == 503 and pins["base"].json()["error"]["enginemeter"] is True, pins["base"].text
    assert "'base' is stopped" in pins["base"].json()["error"]["message"] and pins["base"].headers["retry-after"]
    out = proxy.output()
    assert "engine cand serves the model `cand-m1`" in out


def test_the_emulated_vllm_refuses_a_name_it_does_not_serve(tmp_path: Path) -> None:
    """What the test above guards against, shown on the candidate alone: the proxy must rename, not the engine."""
    backend = ProcessServer("fakes.fault_engine", "--model", "backend-m2", ready_path="/health")
    with backend:
        args = ("/models/cand-m2", "--served-model-name", "cand-m2", "--max-model-len", "4096")
        vllm = ProcessServer("fakes.vllm_emulator", *args, "--backend", backend.url, ready_path="/health")
        with vllm:
            r = httpx.post(f"{vllm.url}/v1/chat/completions", json={**CHAT, "model": "my-model"}, timeout=10)
    assert r.status_code == 404 and "does not exist" in r.text


def test_a_baseline_that_does_not_start_again_leaves_the_route_failed_and_an_admin_retries(tmp_path: Path) -> None:
    once = tmp_path / "started-once"  # the baseline starts once; while this file is there, it exits at start
    base = (
        f"PYTHONPATH={REPO} sh -c 'test -e {once} && exit 3; touch {once}; exec {sys.executable} -m "
        f'fakes.fault_engine "$@"\' base-f1 --port {{port}} --model base-f1 --tokens 8 --cadence-ms 5 --ttft-ms 5'
    )
    cand = "sh -c 'exit 4' cand-f1 --port {port}"  # the candidate never starts: the swap goes back
    cfg = config(tmp_path, base, cand)
    with serve(tmp_path, cfg) as proxy:
        before = httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT, timeout=30)
        start(proxy.url)
        failed = wait_phase(proxy.url, "failed", "rolled_back")
        r = httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT, timeout=10)
        health = httpx.get(f"{proxy.url}/health", timeout=10).json()
        metrics = httpx.get(f"{proxy.url}/metrics", timeout=10).text
        once.unlink()
        again = httpx.post(f"{proxy.url}/admin/rollout", json={"action": "abort"}, headers=AUTH, timeout=10)
        # the retry: failed → reverting → rolled_back (or failed again)
        done = wait_until(lambda: (x := swap_state(proxy.url))["epoch"] >= failed["epoch"] + 2 and x, 60)
        after = httpx.post(f"{proxy.url}/v1/chat/completions", json=CHAT, timeout=30)
        # every request counted once: two served (before and after), one refused
        counts = wait_until(lambda: (c := swap_state(proxy.url)["counts"]).get("served") == 2 and c, 10)
    assert (failed["phase"], failed["cause"]) == ("failed", "start_failed"), failed
    assert "did not start again" in failed["detail"] and failed["rollbacks"]["start_failed"] == 0
    assert r.status_code == 503, r.text  # the proxy's answer, not a connection error to a dead engine
    err = r.json()["error"]
    assert err["enginemeter"] is True and "no engine" in err["message"] and int(r.headers["retry-after"]) >= 1
    assert health["status"] == "degraded" and health["swap"][0]["phase"] == "failed"
    assert 'enginemeter_swap_phase{phase="failed",route="0"} 1.0' in metrics
    assert before.status_code == 200 and again.status_code == 200
    assert (done["phase"], done["cause"]) == ("rolled_back", "start_failed") and done["rollbacks"]["start_failed"] == 1
    assert after.status_code == 200 and after.headers["x-enginemeter-engine"] == "base"
    assert (counts["served"], counts["rejected"], counts["held"], counts["hung_up"]) == (2, 1, 0, 0), counts
    assert processes("base-f1") == []
