"""Launched engines (``proxy/procs/launch.py`` over ``proxy/procs/process.py``): real commands, real processes, real sockets.

A real ``llama-server`` (CPU build, generated tiny model) and the SGLang emulator are launched by their command
lines; commands that exit at once or never become ready stand for the broken launches. "No process left" is
checked on the process group itself (``/proc``), not on our own bookkeeping. GPU memory comes from a driver
stand-in that follows the real processes: every live process of a group this test process started (the launched
engine's) holds ``ENGINE_BYTES``.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from proxy.gpu.memory import GpuMemory
from proxy.gpu.nvml import DeviceReading, NvmlUnavailable, ProcReading
from proxy.procs.launch import Launched, Launcher, parse_launch, parse_launch_arg
from proxy.procs.members import group_members
from proxy.procs.process import EngineExited, LaunchError, ReadyTimeout
from tests.helpers import REPO, LlamaServerFactory, wait_until

GIB = 2**30
TOTAL = 150_754_820_096
BASE_USED = 1 * GIB
ENGINE_BYTES = 15 * GIB
PY = shlex.quote(sys.executable)


class FollowingReader:
    """An NVML reader whose GPU processes are the live processes of every process group led by a child of this
    test process started after the reader was made (each holding ``ENGINE_BYTES``): engines that session
    fixtures started earlier in this process (their own groups) are not on this "GPU". ``stuck`` keeps one
    engine's worth of device memory used after they are gone (a context the driver did not free)."""

    def __init__(self) -> None:
        self.stuck = False
        self.earlier = set(self._leaders())

    @staticmethod
    def _leaders() -> list[int]:
        return [p for p in _children(os.getpid()) if _pgid(p) == p]

    def _pids(self) -> list[int]:
        leaders = [p for p in self._leaders() if p not in self.earlier]
        return sorted({m for g in leaders for m in group_members(g)})

    def devices(self) -> list[DeviceReading]:
        n = len(self._pids()) or (1 if self.stuck else 0)
        used = BASE_USED + n * ENGINE_BYTES
        return [DeviceReading(0, "NVIDIA H200", "GPU-0", TOTAL, used, TOTAL - used, 0, 0.0)]

    def processes(self, index: int) -> list[ProcReading]:
        return [ProcReading(p, ENGINE_BYTES) for p in self._pids()]

    def close(self) -> None:
        pass


def no_nvml() -> GpuMemory:
    def opener() -> FollowingReader:
        raise NvmlUnavailable("NVML init failed: no driver here")

    return GpuMemory(opener=opener)


def launcher(tmp_path: Path, memory: GpuMemory | None = None, **kw: float) -> Launcher:
    kw = {"ready_timeout_s": 60.0, "grace_s": 5.0, "settle_s": 0.2, "settle_timeout_s": 2.0, **kw}
    return Launcher(tmp_path, memory=memory or no_nvml(), cwd=REPO, **kw)


def gone(pgid: int) -> bool:
    return not group_members(pgid)


# ---- the command line ------------------------------------------------------------------------------------


def test_the_command_is_kept_verbatim_and_the_address_comes_from_its_own_flags() -> None:
    cmd = "CUDA_VISIBLE_DEVICES=0 /opt/llama/bin/llama-server -m '/models/q 4.gguf' -ngl 99 --port 8081 -np 4"
    spec = parse_launch("llama", cmd)
    assert spec.command == cmd
    assert spec.argv == ("/opt/llama/bin/llama-server", "-m", "/models/q 4.gguf", "-ngl", "99", "--port", "8081",
                         "-np", "4")  # fmt: skip
    assert spec.env == {"CUDA_VISIBLE_DEVICES": "0"}
    assert (spec.kind, spec.url) == ("llamacpp", "http://127.0.0.1:8081")


@pytest.mark.parametrize(
    ("command", "kind", "url"),
    [
        ("llama-server -m m.gguf", "llamacpp", "http://127.0.0.1:8080"),
        ("python -m sglang.launch_server --model-path M --host 0.0.0.0", "sglang", "http://127.0.0.1:30000"),
        ("python3.12 -m sglang.launch_server --model-path M --port=31000", "sglang", "http://127.0.0.1:31000"),
        ("sglang serve --model-path M --port 30001", "sglang", "http://127.0.0.1:30001"),
        ("vllm serve M --gpu-memory-utilization 0.5", "vllm", "http://127.0.0.1:8000"),
        ("python -m vllm.entrypoints.openai.api_server --model M --host :: --port 8001", "vllm", "http://[::1]:8001"),
        ("python -m fakes.sglang_emulator --backend http://x --port 9000", None, "http://127.0.0.1:9000"),
    ],
)
def test_each_kind_is_told_by_its_command_line_with_its_defaults(command: str, kind: str | None, url: str) -> None:
    spec = parse_launch("e", command)
    assert (spec.kind, spec.url) == (kind, url)


def test_a_port_placeholder_gets_a_free_port_and_the_command_stays_as_written() -> None:
    spec = parse_launch("e", "llama-server -m m.gguf --port {port}", port=lambda: 45678)
    assert spec.port == 45678 and spec.argv[-1] == "45678"
    assert spec.command.endswith("--port {port}")
    assert parse_launch("e", "llama-server --port {port}").port != parse_launch("e", "llama-server --port {port}").port


@pytest.mark.parametrize(
    ("arg", "why"),
    [
        ("llama", "NAME='COMMAND'"),
        ("=llama-server", "NAME='COMMAND'"),
        ("x=python -m my.server", "cannot tell which port"),
        ("x=FOO=1", "no program"),
        ("bad name=llama-server", "launch name"),
        ("x=llama-server -m 'unclosed", "cannot split"),
    ],
)
def test_a_launch_that_cannot_be_read_is_refused_with_the_reason(arg: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_launch_arg(arg)


# ---- real engines ----------------------------------------------------------------------------------------


def test_a_real_llama_server_is_launched_ready_logged_timed_and_stopped(
    llama_server_bin: Path, tiny_model: Path, tmp_path: Path
) -> None:
    reader = FollowingReader()
    memory = GpuMemory(opener=lambda: reader)
    cmd = f"{shlex.quote(str(llama_server_bin))} -m {shlex.quote(str(tiny_model))} -c 512 -t 1 --port {{port}}"
    spec = parse_launch("llama", cmd)
    lau = launcher(tmp_path, memory)

    async def run() -> tuple[Launched, int, str]:
        eng = await lau.start(spec)
        async with httpx.AsyncClient() as c:
            health = (await c.get(f"{eng.url}/health")).json()["status"]
            # a phase, measured as the bench measures "peak while generating"
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 32}
            async with memory.watch("llama", pid=eng.pid, period_s=0.05) as peak:
                assert (await c.post(f"{eng.url}/v1/chat/completions", json=body)).status_code == 200
            assert peak.last is not None
            eng.memory["peak"] = peak.last
            assert peak.samples >= 2 and peak.engine_bytes == ENGINE_BYTES
            assert peak.device_used_bytes == BASE_USED + ENGINE_BYTES
        pgid = eng.pid
        await lau.stop(eng)
        return eng, pgid, health

    eng, pgid, health = asyncio.run(run())
    assert health == "ok" and eng.kind == "llamacpp"
    assert eng.ready_s is not None and 0 < eng.ready_s < 60
    log = (tmp_path / "engines" / "llama.log").read_text()
    assert f"+ {cmd}\n" in log  # the command line verbatim, placeholder and all
    assert "llama_server: model loaded" in log  # the engine's own output
    assert eng.memory["before"].device_used_bytes == BASE_USED
    assert eng.memory["before"].engine_bytes is None
    assert eng.memory["idle"].engine_bytes == ENGINE_BYTES  # attributed by the engine's pid
    assert eng.memory["idle"].engine_pids == (pgid,)
    assert eng.memory["after"].device_used_bytes == BASE_USED and eng.memory_returned is True
    assert eng.returncode == 0 and gone(pgid)
    rec = eng.record()
    assert rec["command"] == cmd and rec["kind"] == "llamacpp" and rec["memory"]["idle"]["engine_bytes"] == ENGINE_BYTES


def test_the_sglang_emulator_launched_by_its_command_line_counts_as_sglang(
    llama_server_factory: LlamaServerFactory, tmp_path: Path
) -> None:
    backend = llama_server_factory(np=2)
    cmd = f"{PY} -m fakes.sglang_emulator --backend {backend.url} --served-model-name tiny --port {{port}}"
    spec = parse_launch("sglang", cmd)
    assert spec.kind is None  # not told by the command line: probed once the port answers

    async def run() -> tuple[Launched, dict[str, object]]:
        async with launcher(tmp_path).running(spec) as eng:
            async with httpx.AsyncClient() as c:
                info = (await c.get(f"{eng.url}/server_info")).json()
        return eng, info

    eng, info = asyncio.run(run())
    assert eng.kind == "sglang" and info["served_model_name"] == "tiny"
    assert eng.ready_s is not None and eng.ready_s > 0
    assert f"+ {cmd}\n" in (tmp_path / "engines" / "sglang.log").read_text()
    assert eng.memory_returned is None and "no driver here" in (eng.memory["idle"].note or "")
    assert gone(eng.pid)


def test_a_command_that_exits_at_once_fails_fast_with_the_logs_last_lines(tmp_path: Path) -> None:
    # the message is built at run time, so the log's "+ COMMAND" header cannot be what the assertions find
    cmd = f"{PY} -c \"import sys; print('error: model file ' + 'not found: /m/x.gguf'); sys.exit(3)\" --port {{port}}"
    t0 = time.monotonic()
    with pytest.raises(EngineExited, match="exited with 3") as info:
        asyncio.run(launcher(tmp_path, ready_timeout_s=120).start(parse_launch("broken", cmd)))
    assert time.monotonic() - t0 < 30  # noticed when it died, not at the deadline
    assert "model file not found" in info.value.log_tail and "model file not found" in str(info.value)
    assert str(tmp_path / "engines" / "broken.log") in str(info.value)


def test_a_real_llama_server_that_cannot_load_its_model_fails_with_its_log(
    llama_server_bin: Path, tmp_path: Path
) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    cmd = f"{llama_server_bin} -m {bad} --port {{port}}"
    with pytest.raises(EngineExited) as info:
        asyncio.run(launcher(tmp_path).start(parse_launch("llama", cmd)))
    assert "load_model" in info.value.log_tail or "failed" in info.value.log_tail.lower()


def test_a_command_that_never_becomes_ready_times_out_and_leaves_no_process(tmp_path: Path) -> None:
    # a parent that answers nothing and a child of its own: both must go
    script = (
        "import subprocess, time; subprocess.Popen(['sleep', '1000']); print('started', flush=True); time.sleep(1000)"
    )
    cmd = f"{PY} -c {shlex.quote(script)} --port {{port}}"
    spec = parse_launch("stuck", cmd)
    seen: list[int] = []

    async def run() -> None:
        lau = launcher(tmp_path, ready_timeout_s=2.0)
        task = asyncio.create_task(lau.start(spec))
        log = tmp_path / "engines" / "stuck.log"
        await until(lambda: "\nstarted\n" in _text(log))  # the line itself: the header quotes the script
        [leader] = _pids_writing_to(log)  # the command itself (its child may not have its stdout yet)
        seen.extend(p for p in _all_pids() if _pgid(p) == leader)
        await task

    with pytest.raises(ReadyTimeout, match="not ready within 2 s") as info:
        asyncio.run(run())
    assert info.value.log_tail.splitlines()[-1] == "started"
    assert len(seen) == 2  # the command and its child were there ...
    assert all(not _alive(p) for p in seen)  # ... and neither is now


def test_a_server_that_answers_but_never_says_ready_times_out_cleanly(tmp_path: Path) -> None:
    # every path answers 503, as a llama-server stuck loading its model would: the kind cannot even be told
    script = (
        "import http.server, sys\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self): self.send_response(503); self.end_headers()\n"
        "port = int(sys.argv[sys.argv.index('--port') + 1])\n"
        "http.server.HTTPServer(('127.0.0.1', port), H).serve_forever()\n"
    )
    spec = parse_launch("loading", f"{PY} -c {shlex.quote(script)} --port {{port}}")
    with pytest.raises(ReadyTimeout):
        asyncio.run(launcher(tmp_path, ready_timeout_s=3.0).start(spec))
    with pytest.raises(httpx.ConnectError):
        httpx.get(spec.url, timeout=2)


def test_a_port_already_in_use_is_refused_before_anything_starts(
    llama_server_factory: LlamaServerFactory, tmp_path: Path
) -> None:
    other = llama_server_factory()
    spec = parse_launch("llama", f"llama-server -m m.gguf --port {other.port}")
    with pytest.raises(LaunchError, match="already listens"):
        asyncio.run(launcher(tmp_path).start(spec))
    assert not (tmp_path / "engines" / "llama.log").exists()


def test_a_cancelled_launch_leaves_no_process(tmp_path: Path) -> None:
    script = "import os, time; print('pid', os.getpid(), flush=True); time.sleep(1000)"
    spec = parse_launch("slow", f"{PY} -c {shlex.quote(script)} --port {{port}}")
    pids: list[int] = []

    async def run() -> None:
        task = asyncio.create_task(launcher(tmp_path).start(spec))
        log = tmp_path / "engines" / "slow.log"
        await until(lambda: "pid " in _text(log))
        pids.append(int(log.read_text().split("pid ")[1].split()[0]))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert pids and not _alive(pids[0]) and gone(pids[0])


def test_ctrl_c_mid_launch_leaves_no_process(tmp_path: Path) -> None:
    """A real Ctrl-C (SIGINT) to a process that is waiting for its launched engine to become ready."""
    engine = "import os, time; print('pid', os.getpid(), flush=True); time.sleep(1000)"
    driver = (
        "import asyncio, shlex, sys\n"
        "from pathlib import Path\n"
        "from proxy.procs.launch import Launcher, parse_launch\n"
        f"spec = parse_launch('slow', {sys.executable!r} + ' -c ' + shlex.quote({engine!r}) + ' --port {{port}}')\n"
        f"asyncio.run(Launcher(Path({str(tmp_path)!r}), grace_s=5).start(spec))\n"
    )
    bench = subprocess.Popen([sys.executable, "-c", driver], cwd=REPO, stderr=subprocess.PIPE)
    log = tmp_path / "engines" / "slow.log"
    wait_until(lambda: "pid " in _text(log), timeout=60)
    pid = int(log.read_text().split("pid ")[1].split()[0])
    assert _alive(pid)
    bench.send_signal(signal.SIGINT)
    _, err = bench.communicate(timeout=60)
    assert bench.returncode != 0 and b"KeyboardInterrupt" in err
    assert not _alive(pid) and gone(pid)


def test_memory_that_does_not_come_back_is_reported(llama_server_bin: Path, tiny_model: Path, tmp_path: Path) -> None:
    reader = FollowingReader()
    lau = launcher(tmp_path, GpuMemory(opener=lambda: reader), memory_timeout_s=1.0)
    spec = parse_launch("leak", f"{llama_server_bin} -m {tiny_model} -c 512 --port {{port}}")

    async def run() -> tuple[Launched, bool | None]:
        eng = await lau.start(spec)
        reader.stuck = True  # the driver keeps a context after the process is gone
        await lau.stop(eng)
        first = eng.memory_returned
        reader.stuck = False
        await lau.stop(eng)  # idempotent: only the memory is read again
        return eng, first

    eng, first = asyncio.run(run())
    assert first is False
    assert eng.memory_returned is True and eng.memory["after"].device_used_bytes == BASE_USED


# ---- helpers ---------------------------------------------------------------------------------------------


async def until(predicate: Callable[[], bool], timeout_s: float = 60.0) -> None:
    """Poll ``predicate`` on the event loop until it is true (``TimeoutError`` at the deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"not true within {timeout_s:g} s")
        await asyncio.sleep(0.01)  # the poll interval


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _stat(pid: int) -> list[str]:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return []
    return stat[stat.rfind(")") + 2 :].split()


def _children(pid: int) -> list[int]:
    return [int(e.name) for e in os.scandir("/proc") if e.name.isdigit() and _stat(int(e.name))[1:2] == [str(pid)]]


def _pgid(pid: int) -> int | None:
    f = _stat(pid)
    return int(f[2]) if len(f) > 2 else None


def _alive(pid: int) -> bool:
    f = _stat(pid)
    return bool(f) and f[0] != "Z"


def _all_pids() -> list[int]:
    return [int(e.name) for e in os.scandir("/proc") if e.name.isdigit()]


def _pids_writing_to(log: Path) -> list[int]:
    """The processes whose stdout is ``log`` and that lead their own process group."""
    out = []
    for pid in _all_pids():
        try:
            if os.readlink(f"/proc/{pid}/fd/1") == str(log) and _pgid(pid) == pid:
                out.append(pid)
        except OSError:
            continue
    return out


def test_the_engine_gets_ctrl_c_unblocked_and_default_handled(tmp_path: Path) -> None:
    """spawn holds a Ctrl-C off while forking by a handler, not a signal mask: the engine inherits neither."""
    from proxy.procs.process import EngineProcess

    proc = EngineProcess([sys.executable, "-c", "import time; time.sleep(1000)"], log_path=tmp_path / "e.log")
    proc.spawn()
    try:
        status = Path(f"/proc/{proc.pid}/status").read_text()
        m = re.search(r"^SigBlk:\s*([0-9a-f]+)", status, re.M)
        assert m is not None and not int(m[1], 16) & (1 << (signal.SIGINT - 1))
    finally:
        assert proc.stop() is not None
    assert gone(proc.pid)
