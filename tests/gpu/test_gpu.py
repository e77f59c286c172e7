"""GPU collectors: recorded NVML readings injected into the sampler; attribution against real processes and
real listening sockets; the scrape never waits for NVML; no NVML -> metrics absent, /health says why.

The recorded figures are the H200 reading of shared/reference/gpu.md (7B-shape F16 llama-server, -ngl 99):
device used 16.03 GB of 150.75 GB, the engine's process 15.37 GB.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pynvml
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from proxy.config.settings import CollectorSettings, EngineSettings, MirrorSettings, RouteSettings, Settings
from proxy.gpu import attribution, nvml
from proxy.gpu.monitor import GpuMonitor
from proxy.gpu.nvml import DeviceReading, NvmlUnavailable, ProcReading
from tests.helpers import start_proxy, wait_until

GB = 10**9
TOTAL = 150_754_820_096  # 143776 MiB
H200 = "NVIDIA H200"


def dev(index: int = 0, used: int = 16_030_000_000, util: float | None = 0.37) -> DeviceReading:
    reserved = 600 * 2**20
    return DeviceReading(index, H200, f"GPU-{index:04d}", TOTAL, used, TOTAL - used - reserved, reserved, util)


Step = tuple[list[DeviceReading], dict[int, list[ProcReading]]] | BaseException


class RecordedReader:
    """Replays one step per sample: readings, or an exception raised mid-sample (after devices())."""

    def __init__(self, steps: list[Step]) -> None:
        self.steps = steps
        self.i = -1
        self.closed = False
        self.calls = 0

    def devices(self) -> list[DeviceReading]:
        self.calls += 1
        self.i = min(self.i + 1, len(self.steps) - 1)
        step = self.steps[self.i]
        if isinstance(step, BaseException):
            raise step
        return step[0]

    def processes(self, index: int) -> list[ProcReading]:
        step = self.steps[self.i]
        assert not isinstance(step, BaseException)
        return step[1].get(index, [])

    def close(self) -> None:
        self.closed = True


def val(reg: CollectorRegistry, metric: str, /, **labels: str) -> float | None:
    return reg.get_sample_value(metric, labels)


def monitor(engines: list[EngineSettings], reader: RecordedReader, reg: CollectorRegistry) -> GpuMonitor:
    mon = GpuMonitor(engines, interval=0.05, opener=lambda: reader)
    reg.register(mon)
    assert mon.open()
    return mon


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    """A real process standing in for an engine's GPU worker (its parent is this test process)."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield p
    p.kill()
    p.wait()


@pytest.fixture
def listener() -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """A separate process listening on a TCP port, like an engine's HTTP server; prints its port."""
    code = (
        "import socket, sys, time\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
        "print(s.getsockname()[1], flush=True)\n"
        "time.sleep(120)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert p.stdout is not None
    port = int(p.stdout.readline())
    yield p, port
    p.kill()
    p.wait()
    p.stdout.close()


# --------------------------------------------------------------------------------------------- sampling


def test_devices_and_engine_memory_from_a_recorded_reading(child: subprocess.Popen[bytes]) -> None:
    reg = CollectorRegistry()
    reader = RecordedReader([([dev()], {0: [ProcReading(child.pid, 15_370_000_000), ProcReading(999_999, GB)]})])
    mon = monitor([EngineSettings(name="llama", url="http://10.255.0.1:1", pid=child.pid)], reader, reg)
    assert mon.sample_once()
    g = {"gpu": "0", "name": H200}
    assert val(reg, "enginemeter_gpu_memory_used_bytes", **g) == 16_030_000_000
    assert val(reg, "enginemeter_gpu_memory_total_bytes", **g) == TOTAL
    assert val(reg, "enginemeter_gpu_memory_free_bytes", **g) == TOTAL - 16_030_000_000 - 600 * 2**20
    assert val(reg, "enginemeter_gpu_memory_reserved_bytes", **g) == 600 * 2**20
    assert val(reg, "enginemeter_gpu_utilization_ratio", **g) == pytest.approx(0.37)
    assert val(reg, "enginemeter_engine_gpu_memory_used_bytes", engine="llama", gpu="0") == 15_370_000_000
    assert val(reg, "enginemeter_engine_gpu_memory_peak_bytes", engine="llama", gpu="0") == 15_370_000_000
    assert val(reg, "enginemeter_engine_gpu_processes", engine="llama") == 1
    # pid 999999 belongs to no engine
    assert val(reg, "enginemeter_gpu_other_processes_memory_used_bytes", gpu="0") == GB
    assert val(reg, "enginemeter_gpu_sample_success") == 1
    age = val(reg, "enginemeter_gpu_sample_age_seconds")
    assert age is not None and 0 <= age < 60


def test_processes_appearing_and_vanishing_keep_the_peak(child: subprocess.Popen[bytes]) -> None:
    reg = CollectorRegistry()
    pid = child.pid
    reader = RecordedReader(
        [
            ([dev(used=600_000_000)], {}),  # engine started, no CUDA context yet
            ([dev(used=9 * GB)], {0: [ProcReading(pid, 8 * GB)]}),  # weights loading
            ([dev(used=16 * GB)], {0: [ProcReading(pid, 15 * GB)]}),  # resident + KV cache
            ([dev(used=600_000_000)], {}),  # engine exited
        ]
    )
    mon = monitor([EngineSettings(name="llama", url="http://10.255.0.1:1", pid=os.getpid())], reader, reg)
    seen = []
    for _ in range(4):
        assert mon.sample_once()
        seen.append(
            (
                val(reg, "enginemeter_engine_gpu_memory_used_bytes", engine="llama", gpu="0"),
                val(reg, "enginemeter_engine_gpu_memory_peak_bytes", engine="llama", gpu="0"),
                val(reg, "enginemeter_engine_gpu_processes", engine="llama"),
            )
        )
    # the GPU process is a child of the configured pid: attributed through the ppid chain
    assert seen == [(0, 0, 0), (8 * GB, 8 * GB, 1), (15 * GB, 15 * GB, 1), (0, 15 * GB, 0)]


def test_nvml_error_mid_run_drops_current_values_then_recovers(child: subprocess.Popen[bytes]) -> None:
    reg = CollectorRegistry()
    good = ([dev()], {0: [ProcReading(child.pid, 15 * GB)]})
    lost = pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
    reader = RecordedReader([good, lost, lost, good])
    mon = monitor([EngineSettings(name="llama", url="http://10.255.0.1:1", pid=child.pid)], reader, reg)
    assert mon.sample_once()
    assert not mon.sample_once()
    assert not mon.sample_once()
    # a failed sample never looks like an empty GPU: the current figures are gone, not zero
    assert val(reg, "enginemeter_gpu_memory_used_bytes", gpu="0", name=H200) is None
    assert val(reg, "enginemeter_engine_gpu_memory_used_bytes", engine="llama", gpu="0") is None
    assert val(reg, "enginemeter_gpu_sample_success") == 0
    assert val(reg, "enginemeter_gpu_sample_errors_total") == 2
    assert val(reg, "enginemeter_engine_gpu_memory_peak_bytes", engine="llama", gpu="0") == 15 * GB
    h = mon.health()["gpu"]
    assert h["enabled"] is True
    assert h["last_sample_ok"] is False
    assert "GPU is lost" in h["last_error"]
    assert mon.sample_once()
    assert val(reg, "enginemeter_gpu_sample_success") == 1
    assert val(reg, "enginemeter_engine_gpu_memory_used_bytes", engine="llama", gpu="0") == 15 * GB


def test_processes_query_failing_is_a_failed_sample() -> None:
    class Flaky(RecordedReader):
        def processes(self, index: int) -> list[ProcReading]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)

    reg = CollectorRegistry()
    mon = monitor([], Flaky([([dev()], {})]), reg)
    assert not mon.sample_once()
    assert val(reg, "enginemeter_gpu_sample_success") == 0
    assert val(reg, "enginemeter_gpu_memory_used_bytes", gpu="0", name=H200) is None


def test_unknown_process_memory_and_unsupported_utilization() -> None:
    """usedGpuMemory None (NVML_VALUE_NOT_AVAILABLE) and no utilization (MIG): those series are absent."""
    reg = CollectorRegistry()
    reader = RecordedReader([([dev(util=None)], {0: [ProcReading(os.getpid(), None)]})])
    mon = monitor([EngineSettings(name="me", url="http://10.255.0.1:1", pid=os.getpid())], reader, reg)
    assert mon.sample_once()
    assert val(reg, "enginemeter_gpu_utilization_ratio", gpu="0", name=H200) is None
    assert val(reg, "enginemeter_engine_gpu_memory_used_bytes", engine="me", gpu="0") is None
    assert val(reg, "enginemeter_engine_gpu_processes", engine="me") == 1


def test_two_gpus_two_engines() -> None:
    reg = CollectorRegistry()
    a = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    b = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        reader = RecordedReader(
            [
                (
                    [dev(0), dev(1, used=40 * GB)],
                    {0: [ProcReading(a.pid, 15 * GB)], 1: [ProcReading(b.pid, 30 * GB), ProcReading(b.pid, 30 * GB)]},
                )
            ]
        )
        engines = [
            EngineSettings(name="llama", url="http://10.255.0.1:1", pid=a.pid),
            EngineSettings(name="sglang", url="http://10.255.0.1:2", pid=b.pid),
        ]
        mon = monitor(engines, reader, reg)
        assert mon.sample_once()
    finally:
        for p in (a, b):
            p.kill()
            p.wait()
    used = "enginemeter_engine_gpu_memory_used_bytes"
    assert val(reg, used, engine="llama", gpu="0") == 15 * GB
    assert val(reg, used, engine="llama", gpu="1") == 0
    assert val(reg, used, engine="sglang", gpu="0") == 0
    # one context listed twice by NVML is counted once
    assert val(reg, used, engine="sglang", gpu="1") == 30 * GB
    assert val(reg, "enginemeter_gpu_memory_used_bytes", gpu="1", name=H200) == 40 * GB


# --------------------------------------------------------------------------------------------- attribution


def test_attribution_by_pid_file(tmp_path: Path, child: subprocess.Popen[bytes]) -> None:
    pid_file = tmp_path / "engine.pid"
    pid_file.write_text(f"{child.pid}\n")
    reg = CollectorRegistry()
    reader = RecordedReader([([dev()], {0: [ProcReading(child.pid, 5 * GB)]})] * 2)
    mon = monitor([EngineSettings(name="llama", url="http://10.255.0.1:1", pid_file=str(pid_file))], reader, reg)
    assert mon.sample_once()
    assert val(reg, "enginemeter_engine_gpu_memory_used_bytes", engine="llama", gpu="0") == 5 * GB
    assert mon.health()["gpu"]["engines"]["llama"]["source"] == "pid_file"
    # the pid file is re-read every sample (engine restarted as another process): the old one is not the engine's
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        pid_file.write_text(f"{other.pid}\n")
        assert mon.sample_once()
    finally:
        other.kill()
        other.wait()
    assert val(reg, "enginemeter_engine_gpu_memory_used_bytes", engine="llama", gpu="0") == 0
    assert val(reg, "enginemeter_gpu_other_processes_memory_used_bytes", gpu="0") == 5 * GB


def test_attribution_by_listening_port(listener: tuple[subprocess.Popen[bytes], int]) -> None:
    proc, port = listener
    reg = CollectorRegistry()
    reader = RecordedReader([([dev()], {0: [ProcReading(proc.pid, 7 * GB), ProcReading(os.getpid(), GB)]})])
    engines = [EngineSettings(name="llama", url=f"http://127.0.0.1:{port}")]
    mon = monitor(engines, reader, reg)
    assert mon.sample_once()
    assert val(reg, "enginemeter_engine_gpu_memory_used_bytes", engine="llama", gpu="0") == 7 * GB
    assert val(reg, "enginemeter_gpu_other_processes_memory_used_bytes", gpu="0") == GB
    att = mon.health()["gpu"]["engines"]["llama"]
    assert att["source"] == "port"
    assert att["pids"] == [proc.pid]
    assert att["gpu_pids"] == [proc.pid]


def test_two_names_for_one_server_both_show_its_memory(listener: tuple[subprocess.Popen[bytes], int]) -> None:
    """An A/A twin (two engine names, one URL): the bench reads each name's memory, so both get the server's."""
    proc, port = listener
    reg = CollectorRegistry()
    reader = RecordedReader([([dev()], {0: [ProcReading(proc.pid, 7 * GB), ProcReading(os.getpid(), GB)]})])
    url = f"http://127.0.0.1:{port}"
    mon = monitor([EngineSettings(name="a", url=url), EngineSettings(name="a-twin", url=url)], reader, reg)
    assert mon.sample_once()
    for name in ("a", "a-twin"):
        assert val(reg, "enginemeter_engine_gpu_memory_used_bytes", engine=name, gpu="0") == 7 * GB
        assert mon.health()["gpu"]["engines"][name]["gpu_pids"] == [proc.pid]
    assert val(reg, "enginemeter_gpu_other_processes_memory_used_bytes", gpu="0") == GB


def test_port_lookup_finds_ipv4_and_ipv6_listeners_and_ignores_connections() -> None:
    v4 = socket.socket()
    v4.bind(("127.0.0.1", 0))
    v4.listen()
    port = v4.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))  # an ESTABLISHED socket on the same port
    try:
        assert attribution.pids_holding(attribution.listening_inodes(port)) == {os.getpid()}
        assert len(attribution.listening_inodes(port)) == 1
    finally:
        client.close()
        v4.close()
    assert attribution.listening_inodes(port) == set()
    if not socket.has_ipv6:
        return
    try:
        v6 = socket.socket(socket.AF_INET6)
        v6.bind(("::1", 0))
    except OSError:
        return
    with v6:
        v6.listen()
        port6 = v6.getsockname()[1]
        assert attribution.pids_holding(attribution.listening_inodes(port6)) == {os.getpid()}


def test_nothing_listening_and_remote_hosts_are_explained() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening
    reg = CollectorRegistry()
    engines = [
        EngineSettings(name="local", url=f"http://localhost:{port}"),
        EngineSettings(name="remote", url="http://10.255.0.1:8000"),
    ]
    reader = RecordedReader([([dev()], {0: [ProcReading(os.getpid(), GB)]})])
    mon = monitor(engines, reader, reg)
    assert mon.sample_once()
    att = mon.health()["gpu"]["engines"]
    assert att["local"]["note"] == f"no local process listens on port {port}"
    assert "not this host" in att["remote"]["note"]
    # an engine we cannot find has no per-engine series at all (unknown, not zero)
    assert val(reg, "enginemeter_engine_gpu_memory_used_bytes", engine="local", gpu="0") is None
    assert val(reg, "enginemeter_engine_gpu_processes", engine="local") == 0


def test_is_local_host() -> None:
    assert attribution.is_local_host("127.0.0.1")
    assert attribution.is_local_host("localhost")
    assert attribution.is_local_host("::1") or not socket.has_ipv6
    assert attribution.is_local_host("0.0.0.0")
    assert not attribution.is_local_host("10.255.0.1")  # TEST-NET-ish private address no interface here has
    assert not attribution.is_local_host("no-such-host.invalid")


def test_parent_pid_handles_odd_process_names(tmp_path: Path) -> None:
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "stat").write_text("42 (my (odd) name) S 7 42 42 0 -1\n")
    assert attribution.parent_pid(42, tmp_path) == 7
    assert attribution.parent_pid(43, tmp_path) is None
    assert attribution.parent_pid(os.getpid()) == os.getppid()


# --------------------------------------------------------------------------------------------- no NVML, threads


def test_no_nvml_means_absent_metrics_and_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    def opener() -> nvml.NvmlReader:
        raise NvmlUnavailable("NVML init failed: NVML Shared Library Not Found")

    reg = CollectorRegistry()
    mon = GpuMonitor([EngineSettings(name="llama", url="http://127.0.0.1:1")], opener=opener)
    reg.register(mon)
    with caplog.at_level("INFO", logger="enginemeter.gpu"):
        assert not mon.open()
        assert not mon.sample_once()
    assert [r.getMessage() for r in caplog.records] == [
        "GPU collectors off: NVML init failed: NVML Shared Library Not Found"
    ]
    assert b"enginemeter_" not in generate_latest(reg)
    assert mon.health() == {"gpu": {"enabled": False, "reason": "NVML init failed: NVML Shared Library Not Found"}}


def test_disabled_by_configuration() -> None:
    mon = GpuMonitor([], enabled=False, opener=lambda: RecordedReader([]))
    assert not mon.open()
    assert mon.health()["gpu"]["reason"] == "disabled by configuration (collectors.gpu: false)"


def test_real_pynvml_opens_or_says_why() -> None:
    """On a machine without an NVIDIA driver the real reader refuses with a reason; with one, it reads."""
    try:
        reader = nvml.PynvmlReader()
    except NvmlUnavailable as exc:
        why = str(exc)
        assert "NVML" in why
        return
    try:
        devices = reader.devices()
        assert devices
        assert all(0 < d.used_bytes <= d.total_bytes for d in devices)
        reader.processes(0)
    finally:
        reader.close()


class BlockingReader(RecordedReader):
    """devices() blocks until released, like a wedged driver."""

    def __init__(self, steps: list[Step]) -> None:
        super().__init__(steps)
        self.release = threading.Event()
        self.entered = threading.Event()

    def devices(self) -> list[DeviceReading]:
        if self.calls >= 1:
            self.entered.set()
            self.release.wait(30)
        return super().devices()


def test_sampler_thread_and_a_scrape_that_never_waits_for_nvml() -> None:
    reg = CollectorRegistry()
    reader = BlockingReader([([dev()], {})])
    mon = GpuMonitor([], interval=0.01, opener=lambda: reader)
    reg.register(mon)
    assert mon.open()
    mon.start()
    try:
        # the thread took the first sample, then wedged inside NVML on the second
        assert reader.entered.wait(10)
        t0 = time.monotonic()
        text = generate_latest(reg)
        assert time.monotonic() - t0 < 1.0
        assert b'enginemeter_gpu_memory_used_bytes{gpu="0",name="NVIDIA H200"}' in text
    finally:
        reader.release.set()
        mon.stop()
    assert reader.closed
    assert mon.status.samples >= 2


def test_the_app_feeds_metrics_and_health(child: subprocess.Popen[bytes]) -> None:
    reader = RecordedReader([([dev()], {0: [ProcReading(child.pid, 15 * GB)]})])
    settings = Settings(
        engines=(EngineSettings(name="llama", url="http://127.0.0.1:9", kind="llamacpp", model="m", pid=child.pid),),
        routes=(RouteSettings(primary="llama"),),
        collectors=CollectorSettings(gpu=True, gpu_interval=0.02, engine_interval=60),
    )
    with ExitStack() as stack:
        p = start_proxy(stack, settings, nvml=lambda: reader)
        mon = p.gateway.gpu
        assert mon is not None
        wait_until(lambda: mon.status.samples >= 1)
        text = p.client.get("/metrics").text
        assert 'enginemeter_engine_gpu_memory_used_bytes{engine="llama",gpu="0"} 1.5e+10' in text
        h = p.client.get("/health").json()
        assert h["gpu"]["enabled"] is True
        assert h["gpu"]["engines"]["llama"]["gpu_pids"] == [child.pid]
    # lifespan exit stopped the thread and closed NVML
    assert reader.closed
    assert mon._thread is None


@pytest.mark.parametrize(("shadow_gpu", "contended"), [(0, True), (1, False)])
def test_mirrored_pairs_say_whether_primary_and_shadow_share_a_gpu(
    tmp_path: Path, shadow_gpu: int, contended: bool
) -> None:
    """Two engines on one GPU compete: the comparison record and enginemeter_pair_contended say so (and say
    "not contended" when the NVML attribution puts them on different GPUs)."""
    from fakes.fault_engine import FaultEngineConfig, Knobs, run_in_thread

    a = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    b = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    procs = {0: [ProcReading(a.pid, 15 * GB)], 1: []}
    procs[shadow_gpu].append(ProcReading(b.pid, 20 * GB))
    reader = RecordedReader([([dev(0), dev(1)], procs)])
    log = tmp_path / "pairs.jsonl"
    try:
        with (
            run_in_thread(FaultEngineConfig(model="m", knobs=Knobs(tokens=3, cadence_ms=1))) as p_url,
            run_in_thread(FaultEngineConfig(model="m", knobs=Knobs(tokens=3, cadence_ms=1))) as s_url,
            ExitStack() as stack,
        ):
            settings = Settings(
                engines=(
                    EngineSettings(name="llama", url=p_url, kind="llamacpp", model="m", pid=a.pid),
                    EngineSettings(name="sglang", url=s_url, kind="llamacpp", model="m", pid=b.pid),
                ),
                routes=(RouteSettings(primary="llama", shadows=("sglang",)),),
                collectors=CollectorSettings(gpu=True, gpu_interval=0.02, engine_interval=60),
                mirror=MirrorSettings(log_path=str(log)),
            )
            p = start_proxy(stack, settings, nvml=lambda: reader)
            gpu = p.gateway.gpu
            assert gpu is not None
            wait_until(lambda: gpu.status.samples >= 1)
            body = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
            assert p.client.post("/v1/chat/completions", json=body).status_code == 200
            wait_until(lambda: log.exists() and '"type":"pair"' in log.read_text())
            gauge = p.value("enginemeter_pair_contended", primary="llama", shadow="sglang")
    finally:
        for proc in (a, b):
            proc.kill()
            proc.wait()
    record = next(r for r in map(json.loads, log.read_text().splitlines()) if r["type"] == "pair")
    assert record["contended"] is contended
    assert record["gpus"] == {"primary": [0], "shadow": [shadow_gpu]}
    assert gauge == (1 if contended else 0)
