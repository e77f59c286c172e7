"""No engine outlives the enginemeter that started it (``proxy/procs/leftovers.py``), issue 47 item 4: real owner
processes killed with SIGKILL, real engines (``llama-server`` under ``serve``'s embedded default; a shell whose own
child stands for SGLang's and vLLM's workers), "alive" read from ``/proc``, never from our own bookkeeping."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from proxy.procs import leftovers
from proxy.procs.members import group_members, start_time
from proxy.procs.process import EngineProcess
from tests.helpers import REPO, ProcessServer, wait_until

#: an engine that starts a worker of its own (in its process group, no parent-death signal: it was forked by
#: the engine, and a fork clears it) and waits
FAMILY = ["sh", "-c", "sleep 600 & wait"]


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's own state directory: records of engines other tests run are not this test's business."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    return tmp_path / "state" / "enginemeter" / "engines"


def _owner(tmp_path: Path, argv: list[str]) -> subprocess.Popen[str]:
    """A python process that starts ``argv`` as an engine, prints its pid, then waits to be killed."""
    code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from proxy.procs.process import EngineProcess\n"
        f"p = EngineProcess({argv!r}, log_path=Path({str(tmp_path / 'engine.log')!r}))\n"
        "p.spawn()\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n"  # killed by the test long before
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)


def test_an_engine_dies_with_its_killed_owner_and_the_next_start_ends_what_it_started(
    tmp_path: Path, state: Path
) -> None:
    owner = _owner(tmp_path, FAMILY)
    try:
        assert owner.stdout is not None
        leader = int(owner.stdout.readline())
        wait_until(lambda: len(group_members(leader)) == 2, timeout=10, message="the engine and its worker")
        (rec,) = state.glob("*.json")
        assert json.loads(rec.read_text())["owner"] == owner.pid and oct(rec.stat().st_mode & 0o777) == "0o600"
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        # the parent-death signal: the engine itself goes at once; its own worker is left in its group
        wait_until(lambda: start_time(leader) is None, timeout=5, message="the engine died with its owner")
        (worker,) = group_members(leader)
        # the next start (any engine, any enginemeter) first ends what the killed run left
        nxt = EngineProcess(["sleep", "600"], log_path=tmp_path / "next.log")
        nxt.spawn()
        try:
            assert group_members(leader) == [] and start_time(worker) is None
            assert not rec.exists()
            (mine,) = state.glob("*.json")  # the next engine's own record: its owner (this test) is alive
            leftovers.sweep()
            assert nxt.is_running() and mine.exists()
        finally:
            nxt.stop()
        assert list(state.glob("*.json")) == []  # a stopped engine's record goes with it
    finally:
        owner.kill()
        owner.communicate()


def test_a_record_whose_pid_was_reused_kills_nothing(tmp_path: Path, state: Path) -> None:
    """The record of a killed run names a pid that now belongs to another process (its start time differs)."""
    bystander = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        state.mkdir(parents=True)
        start = start_time(bystander.pid)
        assert start is not None
        dead_owner = {"owner": 999_999_999, "owner_start": 1}
        (state / f"{bystander.pid}.json").write_text(
            json.dumps({"pid": bystander.pid, "start": start - 1, "name": "x", **dead_owner})
        )
        (state / "9.json").write_text("{not json")
        assert leftovers.sweep() == []
        assert bystander.poll() is None and list(state.glob("*.json")) == []
    finally:
        bystander.kill()
        bystander.wait()


def test_an_engine_started_from_a_short_lived_thread_outlives_the_thread(tmp_path: Path, state: Path) -> None:
    """Linux sends the parent-death signal when the thread that forked ends: ``asyncio.to_thread`` and the like
    must not take their engine with them (it is forked on a long-lived thread)."""
    p = EngineProcess(["sleep", "600"], log_path=tmp_path / "e.log")
    tasks = len(os.listdir("/proc/self/task"))
    t = threading.Thread(target=p.spawn)
    t.start()
    t.join()
    try:
        # the short-lived thread is gone from the kernel too; the starter thread stays
        wait_until(lambda: len(os.listdir("/proc/self/task")) <= tasks + 1, timeout=5)
        with pytest.raises(subprocess.TimeoutExpired):
            p._proc.wait(timeout=0.5)  # type: ignore[union-attr]  # a bounded check that it stays alive
    finally:
        p.stop()


def test_kill_9_of_serve_leaves_no_embedded_engine_and_the_next_serve_sweeps(
    tmp_path: Path, state: Path, llama_server_bin: Path
) -> None:
    """Issue 47: after ``kill -9`` of ``serve`` (the embedded default) both llama-servers lived on under PID 1 and
    the next ``serve`` started two more."""
    env = {"XDG_STATE_HOME": str(tmp_path / "state"), "LLAMA_SERVER_BIN": str(llama_server_bin)}
    args = ("serve", "--listen", "127.0.0.1:{port}", "--workdir", str(tmp_path / "w"))
    old = ProcessServer("proxy.cli", *args, ready_path="/health", env=env, startup_timeout=120)
    with old:
        engines = wait_until(lambda: _engines_of(state, old.pid), timeout=10, message="two engines recorded")
        os.kill(old.pid, signal.SIGKILL)
        wait_until(lambda: not any(group_members(e) for e in engines), timeout=5, message="no engine after 5 s")
    assert _engines_of(state, old.pid) == engines  # killed: it could not remove its records
    with ProcessServer("proxy.cli", *args, ready_path="/health", env=env, startup_timeout=120) as new:
        assert _engines_of(state, old.pid) == []  # swept at the next start
        assert len(_engines_of(state, new.pid)) == 2


def _engines_of(state: Path, owner: int) -> list[int]:
    pids = [d["pid"] for d in (json.loads(p.read_text()) for p in state.glob("*.json")) if d["owner"] == owner]
    return sorted(pids) if len(pids) == 2 else []


def test_sigterm_of_serve_ends_a_worker_that_does_not_stop_within_the_shutdown_timeout(tmp_path: Path) -> None:
    """Issue 47: a SIGTERMed ``serve`` once left a worker listening for ~40 s. A worker that cannot stop (here:
    SIGSTOPped, so it never sees the SIGTERM) is killed once the shutdown timeout and a margin have passed."""
    env = {"TMPDIR": str(tmp_path)}
    args = ("--listen", "127.0.0.1:{port}", "--workers", "2", "--shutdown-timeout", "1", "--log-level", "info")
    with ProcessServer("fakes.fault_engine", "--tokens", "4", ready_path="/health") as engine:
        serve = ProcessServer("proxy.cli", "serve", "--primary", engine.url, *args, ready_path="/health", env=env)
        with serve:
            workers = wait_until(lambda: _workers_of(serve.pid), timeout=30, message="two workers")
            os.kill(workers[0], signal.SIGSTOP)
            os.kill(serve.pid, signal.SIGTERM)
            # the shutdown timeout (1 s) + the margin (supervisor.KILL_MARGIN_S) + slack for a loaded box
            wait_until(lambda: not any(start_time(w) for w in workers), timeout=8, message="no worker left")
            assert serve.process._proc is not None and serve.process._proc.wait(timeout=10) == 0
        out = serve.output()
        assert "did not finish within the shutdown timeout: killing it" in out, out


def _workers_of(supervisor: int) -> list[int]:
    """``serve``'s worker processes (multiprocessing's spawn children), once there are two."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            if d.name.isdigit() and int(fields[1]) == supervisor and b"spawn_main" in (d / "cmdline").read_bytes():
                found.append(int(d.name))
        except (OSError, IndexError, ValueError):
            continue
    return sorted(found) if len(found) == 2 else []
