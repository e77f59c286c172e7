"""The GPU harness's checking steps (scripts/gpu/), run here as the GPU machine runs them: as programs, against
real CPU llama-servers. ``live.py`` must fail loudly -- exit 1 and the cause printed -- when an engine is down
(the 2026-12-03 run's live step reported "0 errors" while the proxy's /health said degraded), and pass with the
proxy's figures checked when every engine is up; ``session.py`` holds engines launched by ``proxy.procs.launch`` while
commands run against them, and reports a launch that dies with its log. GPU memory here is a recorded reading
replayed through the proxy's NVML seam (``--fake-nvml``): it exercises the comparison, not a GPU."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from proxy.embedded import LlamaServer
from tests.helpers import LlamaServerFactory

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "scripts" / "gpu"


def run(*argv: str | Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, *map(str, argv)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)  # fmt: skip


def rows(check_txt: Path) -> dict[str, str]:
    """check.txt's rows: check name -> PASS | FAIL | SKIP."""
    out = {}
    for line in check_txt.read_text().splitlines():
        for verdict in ("  PASS  ", "  FAIL  ", "  SKIP  "):
            if verdict in line:
                out[line.split(verdict)[0].strip()] = verdict.strip()
    return out


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again when the block ends: nothing listens there


def test_live_checks_the_proxy_against_two_real_engines(
    llama_server: LlamaServer, llama_server_factory: LlamaServerFactory, tmp_path: Path
) -> None:
    second = llama_server_factory(np=1)
    out = tmp_path / "live"
    # the decode bound is generous: on this loaded 2-core machine a tiny model's stream arrives in bursts (CI saw
    # one 128-token stream of two read in a single burst: 8,060 vs 948 tok/s). 512 tokens (~0.5 s a stream) and
    # the median of three keep one starved read from deciding
    r = run(GPU / "live.py", "--out", out, "--engine", f"big={llama_server.url}", "--pid", f"big={llama_server.pid}",
            "--engine", f"small={second.url}", "--pid", f"small={second.pid}", "--requests", "3", "--concurrency",
            "1", "--max-tokens", "512", "--decode-tolerance", "0.5", "--fake-nvml")  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    got = rows(out / "check.txt")
    assert got == {"health before": "PASS", "requests": "PASS", "decode": "PASS",
                   "memory (recorded reading)": "PASS", "health after": "PASS"}, got  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    assert summary["passed"] is True
    assert len(summary["decode"]) == 3  # every request compared with the engine's own timings
    memory = {line.split("  ")[0]: line for line in (out / "memory.txt").read_text().splitlines()}
    # each engine attributed its own pid by port (the other engine's pid is not in its row)
    assert f"source=port pids=[{llama_server.pid}]" in memory["engine big attribution"]
    assert f"source=port pids=[{second.pid}]" in memory["engine small attribution"]
    logged = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert {x["client_request_id"] for x in logged} == {"live-0", "live-1", "live-2"}


def test_live_traffic_through_several_workers_is_recorded_as_the_whole_proxy_saw_it(
    llama_server: LlamaServer, tmp_path: Path
) -> None:
    """The 2026-12-06 GPU run: a client holding 64 requests in flight through 8 workers was recorded as at most
    "9-16" (each worker counted its own). The proxy's record must be the whole proxy's: live.py's check compares it,
    level by level, with the exact profile of the request log."""
    out = tmp_path / "live"
    # the traffic record is the point here: the decode check (its own test above) gets a loaded box's tolerance,
    # and the segments are long enough that a descheduled worker's few milliseconds stay inside the 5-point bound
    r = run(GPU / "live.py", "--out", out, "--engine", f"big={llama_server.url}", "--profile", "1:4,6:8",
            "--max-tokens", "24", "--workers", "2", "--decode-tolerance", "0.25", timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    got = rows(out / "check.txt")
    assert got["traffic"] == "PASS" and got["traffic vs log"] == "PASS", got
    summary = json.loads((out / "summary.json").read_text())
    assert summary["traffic_source"] == "serve's shutdown line"
    # "traffic vs log" is the point: the record, level by level, is the request log's exact profile (workers that
    # counted each their own would record half the level). The client's six in flight reach the 5-8 level on a
    # quiet box; on a loaded one they may not, but the requests must still have overlapped across the workers
    levels = [float(part.split("=")[0].removeprefix("c")) for part in (out / "traffic.txt").read_text().split(",")]
    assert max(levels) > 2, levels


def test_live_fails_loudly_when_an_engine_is_down(llama_server: LlamaServer, tmp_path: Path) -> None:
    out = tmp_path / "live"
    down = f"http://127.0.0.1:{closed_port()}"
    r = run(GPU / "live.py", "--out", out, "--engine", f"up={llama_server.url}", "--engine", f"gone={down}",
            "--requests", "1", "--max-tokens", "8")  # fmt: skip
    assert r.returncode == 1, r.stdout + r.stderr
    assert "live: FAILED" in r.stderr
    assert "engine gone" in r.stderr and "down" in r.stderr  # the cause, named
    assert rows(out / "check.txt")["health before"] == "FAIL"
    assert json.loads((out / "summary.json").read_text())["passed"] is False
    assert "degraded" in (out / "health-before.json").read_text()


def test_session_holds_a_launched_engine_while_commands_run(
    llama_server_bin: Path, tiny_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "session"
    seen = tmp_path / "seen.txt"
    probe = f"{sys.executable} -c \"import sys, urllib.request as u; print(u.urlopen(sys.argv[1] + '/health').status)\""
    r = run(GPU / "session.py", "--out", out,
            "--launch", f"llama={llama_server_bin} -m {tiny_model} -c 1024 -np 1 -t 1 --port {{port}}", "--",
            f"{probe} {{url:llama}} > {seen}", "test -s {log:llama} && kill -0 {pid:llama}")  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert seen.read_text().strip() == "200"
    doc = json.loads((out / "session.json").read_text())
    (launch,) = doc["launches"]
    assert launch["name"] == "llama" and launch["kind"] == "llamacpp" and launch["ready_s"] > 0
    assert launch["command"].endswith("--port {port}")  # kept verbatim
    assert [c["returncode"] for c in doc["commands"]] == [0, 0]
    pid = int(doc["commands"][1]["command"].rsplit(" ", 1)[1])
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()


def test_session_reports_a_launch_that_dies(llama_server_bin: Path, tmp_path: Path) -> None:
    out = tmp_path / "session"
    r = run(GPU / "session.py", "--out", out, "--launch",
            f"broken={llama_server_bin} -m {tmp_path / 'missing.gguf'} --port {{port}}", "--", "true")  # fmt: skip
    assert r.returncode == 2, r.stdout + r.stderr
    assert "launch failed" in r.stderr and "exited with" in r.stderr
    assert (out / "engines" / "broken.log").exists()
    assert json.loads((out / "session.json").read_text())["launch_failed"].startswith("broken: exited with")
