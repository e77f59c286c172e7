"""``bench --launch``: engines enginemeter starts from their command lines and runs one at a time (time-shared),
against real processes — CPU llama-servers on the generated tiny model, the SGLang emulator launched by its
command line, and commands that fail the ways launches fail (exit at once, never ready, Ctrl-C mid-launch,
GPU memory that does not come back). "No process left" is read from ``/proc`` (the process groups), never from
our own bookkeeping; GPU memory comes from the driver stand-in that follows the real processes
(``tests.procs.test_launch.FollowingReader``)."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from proxy.bench.run.benchconfig import BenchConfig, Target
from proxy.bench.run.runner import run_bench
from proxy.bench.run.timeshare import MemoryNotBack
from proxy.cli import main
from proxy.gpu.memory import GpuMemory
from proxy.gpu.nvml import DeviceReading
from proxy.gpu.scraped import PROCESS
from proxy.procs.launch import Launcher
from proxy.procs.members import group_members
from tests.bench.run.test_bench import SMALL, recs, verdict
from tests.helpers import REPO, wait_until
from tests.procs.test_launch import BASE_USED, ENGINE_BYTES, FollowingReader

Factory = Callable[..., Any]
PY = shlex.quote(sys.executable)


def llama(bin_: Path, model: Path, np: int, ctx: int, extra: str = "") -> str:
    return f"{shlex.quote(str(bin_))} -m {shlex.quote(str(model))} -c {ctx} -np {np} -t 1{extra} --port {{port}}"


def gone(pid: int) -> bool:
    return not group_members(pid)


def test_two_llama_servers_launched_one_at_a_time_with_the_aa_relaunch(
    llama_server_bin: Path, tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One variable changed (-np 1 vs -np 2, the same context per slot); the baseline from a bench file, the
    candidate from a flag; each launched alone, the baseline launched again last."""
    np1, np2 = llama(llama_server_bin, tiny_model, 1, 1024), llama(llama_server_bin, tiny_model, 2, 2048)
    cfg = tmp_path / "bench.yaml"
    cfg.write_text(f"engines:\n  - name: np1\n    launch: {json.dumps(np1)}\nrepeats: 5\nconcurrency: [1, 2]\n"
                   "prompt_lengths: [short]\n")  # fmt: skip
    out = tmp_path / "out"
    rc = main(["bench", "--config", str(cfg), "--launch", f"np2={np2}", *SMALL, "--repeats", "3", "--out", str(out)])
    assert rc == 0
    res = out / "results.jsonl"
    (run,) = recs(res, "run")
    assert run["time_shared"] is True and run["config"]["repeats"] == 3  # the flag wins over the file
    assert run["config"]["concurrency"] == [1, 2]  # the file wins over the preset
    stints = recs(res, "stint")
    assert [(s["engine"], s["role"]) for s in stints] == [("np1", "baseline"), ("np2", "candidate"), ("np1-aa", "aa")]
    for a, b in itertools.pairwise(stints):
        assert a["ended"] <= b["started"]  # one at a time: stopped before the next was launched
    for s, cmd in zip(stints, (np1, np2, np1), strict=True):
        la = s["launch"]
        assert la["command"] == cmd  # verbatim, {port} and all
        assert 0 < la["ready_s"] < 60 and la["returncode"] is not None
        assert f"+ {cmd}\n" in Path(la["log"]).read_text()
        assert gone(la["pid"])
    engines = {e["name"]: e for e in recs(res, "engine")}
    assert len({e["url"] for e in engines.values()}) == 3  # a fresh {port} for every launch
    assert [engines[n]["slots"] for n in ("np1", "np2", "np1-aa")] == [1, 2, 1]
    # the requests were planned once: the i-th request of a cell repeat is the same on every launch
    keys: dict[str, dict[tuple[Any, ...], str]] = {}
    for q in recs(res, "request"):
        if q["phase"] == "measure":
            keys.setdefault(q["engine"], {})[(q["concurrency"], q["repeat"], q["index"])] = q["key"]
    assert keys["np1"] and keys["np1"] == keys["np2"] == keys["np1-aa"]
    v = verdict(out)
    (vd,) = v["verdicts"]
    assert vd["comparisons"][0]["noise_floor_source"].startswith("A/A: np1-aa against np1")
    assert [s["engine"] for s in v["time_shared"]["stints"]] == ["np1", "np2", "np1-aa"]
    # the same weights at temperature 0: the greedy outputs agree
    ag = vd["output_agreement"]
    assert ag["pairs"] > 0 and ag["identical"] == ag["pairs"], ag
    md = (out / "report.md").read_text()
    assert "## One engine at a time" in md and "np1 → np2 → np1-aa" in md
    assert "the engines never contended for the GPU (no contention flag applies)" in md
    assert f"np2: `{np2}`" in md and "engines/np2.log" in md and "launch → ready" in md
    assert "A/A noise floor: np1-aa = the baseline launched again after the candidates" in md
    # generated weights: the outputs agree (the JSON above) but say nothing about correctness, and the report says so
    assert "greedy-output agreement np1 vs np2: cannot be judged: np1 and np2 run random weights" in md
    assert "launching np2 (candidate)" in capsys.readouterr().err


def test_memory_moments_of_each_launch_and_the_memory_gate(
    llama_server_bin: Path, tiny_model: Path, tmp_path: Path
) -> None:
    """GPU memory before launch, loaded and idle, peak while generating and after stop, per process: the
    candidate launched alone on its GPU is judged against that GPU's total."""
    reader = LaunchedReader(tmp_path / "engines")
    launcher = Launcher(tmp_path, memory=GpuMemory(opener=lambda: reader), settle_s=0.2, settle_timeout_s=2.0,
                        grace_s=5.0, memory_timeout_s=10.0, cwd=REPO)  # fmt: skip
    cfg = _cfg(tmp_path, [Target("a", None, launch=llama(llama_server_bin, tiny_model, 1, 1024)),
                          Target("b", None, launch=llama(llama_server_bin, tiny_model, 2, 2048))])  # fmt: skip
    asyncio.run(run_bench(cfg, launcher=launcher))
    res = tmp_path / "results.jsonl"
    for s in recs(res, "stint"):
        mem = s["launch"]["memory"]
        assert sum(d["used_bytes"] for d in mem["before"]["devices"]) == BASE_USED
        assert mem["idle"]["engine_bytes"] == ENGINE_BYTES and mem["peak"]["engine_bytes"] == ENGINE_BYTES
        assert sum(d["used_bytes"] for d in mem["after"]["devices"]) == BASE_USED
        assert s["launch"]["memory_returned"] is True and s["gpu_processes_before"] == 0
    samples = recs(res, "sample")
    assert {(s["gpu_mem_source"], s["gpu_mem_peak_bytes"], tuple(s["gpus"])) for s in samples} == {
        (PROCESS, ENGINE_BYTES, (0,))}  # fmt: skip
    from proxy.bench.report.document import load_bench, write_report

    (v,) = write_report(load_bench(res), tmp_path / "rep")["verdicts"]
    mem = next(x for x in v.reasons if x.step == "memory")
    assert mem.outcome == "ok" and "GPU 0, launched alone on it" in mem.text and "15.00 GiB" in mem.text
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "| a | baseline | launched |" in md and "15.00 GiB" in md and "| yes |" in md


class LaunchedReader(FollowingReader):
    """``FollowingReader`` restricted to the engines this test launched: the process groups whose leader writes
    its output to a log under ``logs`` (a fixture's engine of an earlier test is no GPU process here)."""

    def __init__(self, logs: Path) -> None:
        super().__init__()
        self.logs = str(logs)

    def _pids(self) -> list[int]:
        return [p for p in super()._pids() if _log_of(_leader(p)).startswith(self.logs)]


class StickyReader(LaunchedReader):
    """Once an engine has run, one engine's worth of device memory stays used after it is gone."""

    def __init__(self, logs: Path) -> None:
        super().__init__(logs)
        self.seen = False

    def devices(self) -> list[DeviceReading]:
        self.seen = self.seen or bool(self._pids())
        self.stuck = self.seen
        return super().devices()


def test_memory_that_does_not_come_back_stops_before_the_next_launch(
    llama_server_bin: Path, tiny_model: Path, tmp_path: Path
) -> None:
    launcher = Launcher(tmp_path, memory=GpuMemory(opener=lambda: StickyReader(tmp_path / "engines")), settle_s=0.2,
                        settle_timeout_s=1.0,
                        grace_s=5.0, memory_timeout_s=1.0, cwd=REPO)  # fmt: skip
    cfg = _cfg(tmp_path, [Target("a", None, launch=llama(llama_server_bin, tiny_model, 1, 1024)),
                          Target("b", None, launch=llama(llama_server_bin, tiny_model, 1, 1024))])  # fmt: skip
    with pytest.raises(MemoryNotBack, match=r"did not come back .* the next engine would not run alone"):
        asyncio.run(run_bench(cfg, launcher=launcher))
    (stint,) = recs(tmp_path / "results.jsonl", "stint")
    assert stint["engine"] == "a" and stint["launch"]["memory_returned"] is False
    assert not (tmp_path / "engines" / "b.log").exists()  # never launched
    (end,) = recs(tmp_path / "results.jsonl", "end")
    assert "did not come back" in end["stopped"]["cause"]


def test_a_launch_that_exits_at_once_stops_the_bench_with_exit_2_and_its_log(
    llama_server_bin: Path, tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The baseline runs, the candidate's command dies at start: exit 2, its log's last lines, the baseline
    stopped, nothing launched after it; what finished is kept."""
    broken = (
        f"{PY} -c \"import sys; print('error: model file ' + 'not found: /m/x.gguf'); sys.exit(3)\" --port {{port}}"
    )
    t0 = time.monotonic()
    rc = main(["bench", "--launch", f"a={llama(llama_server_bin, tiny_model, 1, 1024)}", "--launch", f"b={broken}",
               *SMALL, "--concurrency", "1", "--prompt-lengths", "short", "--repeats", "1", "--out", str(tmp_path)])  # fmt: skip
    assert rc == 2 and time.monotonic() - t0 < 60
    err = capsys.readouterr().err
    assert "launch failed: b: exited with 3" in err and "model file not found: /m/x.gguf" in err
    assert "enginemeter report --results" in err
    v = verdict(tmp_path)
    assert v["stopped_at"] == {"gate": "launch", "check": "ready"} and "model file not found" in v["log_tail"]
    stints = recs(tmp_path / "results.jsonl", "stint")
    assert [s["engine"] for s in stints] == ["a", "b"] and "exited with 3" in stints[1]["failed"]
    assert gone(stints[0]["launch"]["pid"]) and not (tmp_path / "engines" / "a-aa.log").exists()


def test_a_launch_that_never_becomes_ready_times_out_and_leaves_no_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = ("import os, subprocess, time; c = subprocess.Popen(['sleep', '1000']); "
              "print('pids', os.getpid(), c.pid, flush=True); time.sleep(1000)")  # fmt: skip
    cmd = f"{PY} -c {shlex.quote(script)} --port {{port}}"
    rc = main(["bench", "--launch", f"stuck={cmd}", *SMALL, "--launch-timeout", "3", "--out", str(tmp_path)])
    assert rc == 2
    assert "not ready within 3 s" in capsys.readouterr().err
    log = (tmp_path / "engines" / "stuck.log").read_text()
    pids = [int(x) for x in log.split("\npids ")[1].split()[:2]]
    assert all(not _alive(p) for p in pids)  # the command and its child


def test_ctrl_c_mid_launch_leaves_no_process(tmp_path: Path) -> None:
    script = "import os, time; print('pid', os.getpid(), flush=True); time.sleep(1000)"
    cmd = f"{PY} -c {shlex.quote(script)} --port {{port}}"
    argv = [sys.executable, "-m", "proxy.cli", "bench", "--launch", f"slow={cmd}", "--no-progress", "--out",
            str(tmp_path)]  # fmt: skip
    p = subprocess.Popen(argv, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stderr=subprocess.PIPE)
    try:
        log = tmp_path / "engines" / "slow.log"
        wait_until(lambda: "\npid " in (log.read_text() if log.exists() else ""), timeout=60)
        pid = int(log.read_text().split("\npid ")[1].split()[0])
        assert _alive(pid)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130, err.decode()
    assert not _alive(pid) and gone(pid)


def test_the_sglang_emulator_launched_by_its_command_line_beside_a_resident_engine(
    llama_server_factory: Factory, tmp_path: Path
) -> None:
    """--engine and --launch mixed: the resident llama.cpp is measured in its own stint (and again last, with fresh
    cold prefixes: its prompt cache still holds the first pass), the emulator is launched, probed as SGLang, stopped."""
    resident = llama_server_factory(np=1)
    backend = llama_server_factory(np=2, ctx_size=4096)
    emu = f"{PY} -m fakes.sglang_emulator --backend {backend.url} --served-model-name tiny --port {{port}}"
    rc = main(["bench", "--engine", f"llama={resident.url}", "--launch", f"sglang={emu}", *SMALL, "--concurrency",
               "1", "--prompt-lengths", "short", "--quantization", "llama=F16", "--quantization", "sglang=float16",
               "--out", str(tmp_path)])  # fmt: skip
    assert rc == 0
    res = tmp_path / "results.jsonl"
    stints = recs(res, "stint")
    assert [(s["engine"], s["launch"] is not None) for s in stints] == [("llama", False), ("sglang", True),
                                                                        ("llama-aa", False)]  # fmt: skip
    assert {e["name"]: e["kind"] for e in recs(res, "engine")} == {"llama": "llamacpp", "sglang": "sglang",
                                                                   "llama-aa": "llamacpp"}  # fmt: skip
    assert gone(stints[1]["launch"]["pid"]) and stints[1]["launch"]["kind"] == "sglang"
    cold = {(q["engine"], q["repeat"], q["index"]): q["key"] for q in recs(res, "request") if q["phase"] == "measure"}
    assert all(cold[("sglang", r, i)] == k for (e, r, i), k in cold.items() if e == "llama")
    assert all(cold[("llama-aa", r, i)] != k for (e, r, i), k in cold.items() if e == "llama")
    (v,) = verdict(tmp_path)["verdicts"]
    assert v["candidate"] == "sglang" and v["stopped_at"] != {"gate": "parity", "check": "prompt tokens"}
    assert "| llama | baseline | resident |" in (tmp_path / "report.md").read_text()


# ---- helpers ---------------------------------------------------------------------------------------------


def _cfg(out: Path, engines: list[Target]) -> BenchConfig:
    return BenchConfig(engines=engines, out=out, concurrency=(1,), output_lengths=(8,), prompt_lengths=("short",),
                       repeats=3, warmup=0, cache="cold", max_tokens=8, aa="off", progress=False,
                       launch_timeout_s=60)  # fmt: skip


def _leader(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return pid
    return int(stat[stat.rfind(")") + 2 :].split()[2])


def _log_of(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/fd/1")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2 :].split()[0] != "Z"


def test_ctrl_c_while_a_launched_engine_is_measured_stops_it_and_keeps_what_finished(
    llama_server_bin: Path, tiny_model: Path, tmp_path: Path
) -> None:
    argv = [sys.executable, "-m", "proxy.cli", "bench", "--launch", f"a={llama(llama_server_bin, tiny_model, 1, 1024)}",
            *SMALL, "--concurrency", "1", "--prompt-lengths", "short", "--repeats", "200", "--out", str(tmp_path)]  # fmt: skip
    p = subprocess.Popen(argv, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)  # fmt: skip
    try:
        res = tmp_path / "results.jsonl"
        wait_until(lambda: res.exists() and res.read_text().count('"type":"sample"') >= 3, timeout=60)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130, err.decode()
    (stint,) = recs(res, "stint")
    assert stint["engine"] == "a" and gone(stint["launch"]["pid"])
    assert recs(res, "end")[0]["interrupted"] is True
    assert "**Interrupted run**" in (tmp_path / "report.md").read_text()


def test_preflight_applies_to_a_launched_engine_once_it_is_ready(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ready by its kind's signal (an OpenAI server: /v1/models answers), then the one tiny request fails: exit 2,
    the engine stopped."""
    script = (
        "import http.server, json, os, sys\n"
        "print('pid', os.getpid(), flush=True)\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def reply(self, code, doc):\n"
        "        b = json.dumps(doc).encode(); self.send_response(code)\n"
        "        self.send_header('content-type', 'application/json'); self.send_header('content-length', str(len(b)))\n"
        "        self.end_headers(); self.wfile.write(b)\n"
        "    def do_GET(self): self.reply(200 if self.path == '/v1/models' else 404, {'data': [{'id': 'm'}]})\n"
        "    def do_POST(self): self.reply(503, {'error': {'message': 'model not loaded'}})\n"
        "port = int(sys.argv[sys.argv.index('--port') + 1])\n"
        "http.server.HTTPServer(('127.0.0.1', port), H).serve_forever()\n"
    )
    rc = main(
        ["bench", "--launch", f"bad={PY} -c {shlex.quote(script)} --port {{port}}", *SMALL, "--out", str(tmp_path)]
    )
    assert rc == 2
    assert (
        "preflight failed: engine bad" in capsys.readouterr().err and "model not loaded" in verdict(tmp_path)["cause"]
    )
    assert verdict(tmp_path)["stopped_at"] == {"gate": "preflight", "check": "reachable"}
    pid = int((tmp_path / "engines" / "bad.log").read_text().split("\npid ")[1].split()[0])
    assert not _alive(pid) and gone(pid)
