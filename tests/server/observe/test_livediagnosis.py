"""``serve``'s live diagnosis (``proxy/server/observe/livediagnosis.py``): a real proxy in front of real llama-server processes,
the diagnosis in ``/health`` and ``/metrics``; GPU readings recorded (the H200 shape of shared/reference/gpu.md)
and attributed to the real engine process by its port."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from proxy.config.configfile import load
from proxy.config.settings import Settings
from proxy.embedded import LlamaServer
from proxy.embedded.gguf_meta import read_gguf
from proxy.gpu.nvml import DeviceReading, ProcReading
from proxy.procs.process import free_port
from proxy.server.app import make_engines
from proxy.server.observe.livediagnosis import LiveDiagnosis
from tests.helpers import LlamaServerFactory, ProxyFactory, wait_until
from tests.system.test_metrics_doc import documented

DOC = Path(__file__).resolve().parents[3] / "docs" / "metrics.md"
MIB = 2**20
TOTAL = 150_754_820_096
USED = 16_030_000_000
RESERVED = 600 * MIB


class Recorded:
    """One H200 as recorded; the engine's process (looked up by pid at each read) holds ``held`` bytes."""

    def __init__(self, pids: list[int], held: int) -> None:
        self.pids, self.held = pids, held

    def devices(self) -> list[DeviceReading]:
        return [DeviceReading(0, "NVIDIA H200", "GPU-0", TOTAL, USED, TOTAL - USED - RESERVED, RESERVED, 0.4)]

    def processes(self, index: int) -> list[ProcReading]:
        return [ProcReading(p, self.held) for p in self.pids]

    def close(self) -> None:
        pass


def documented_section() -> set[str]:
    text = DOC.read_text()
    section = text[text.index("### Engine diagnosis") : text.index("### Verified on a real GPU")]
    return set(re.findall(r"^\| `(enginemeter_[a-z_]+)`", section, re.M))


def samples(url: str) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in fam.samples:
            if s.labels.get("engine") == "llama":
                out[s.name] = s.value
    return out


def settings_for(url: str) -> Settings:
    return load(primary=f"llama={url}", env={})


def test_the_proxy_exposes_a_local_llama_servers_diagnosis(
    llama_server_factory: LlamaServerFactory, tiny_model: Path, proxy_factory: ProxyFactory
) -> None:
    engine = llama_server_factory(np=2, extra_args=("-lv", "4"))
    reader = Recorded([engine.pid], held=10 * MIB)
    p = proxy_factory(settings_for(engine.url), nvml=lambda: reader)

    def diagnosed() -> dict[str, Any] | None:
        found: dict[str, Any] | None = httpx.get(f"{p.url}/health").json().get("diagnosis", {}).get("llama")
        return found

    found = wait_until(diagnosed, timeout=30)
    assert found is not None
    d = found
    assert d["pid"] == engine.pid and d["log"] == str(engine.log_path)
    assert d["flags"] == {"model": str(tiny_model), "ctx_size": 2048, "parallel": 2, "threads": 1, "verbosity": 4}
    assert (d["layers_offloaded"], d["layers_total"]) == (0, 3)
    weights = read_gguf(tiny_model).weights_bytes
    assert d["weights_bytes"] == weights and d["kv_cache_bytes"] == 2**19
    assert d["resident"] is False and "37.2 MiB of weights" in d["resident_why"]
    assert d["memory_constraint"] is False
    wait_until(lambda: "enginemeter_engine_gpu_headroom_bytes" in samples(p.url), timeout=30)
    m = samples(p.url)
    assert m["enginemeter_engine_layers_offloaded"] == 0 and m["enginemeter_engine_layers"] == 3
    assert m["enginemeter_engine_weights_bytes"] == weights
    assert m["enginemeter_engine_kv_cache_bytes"] == 2**19
    assert 0 < m["enginemeter_engine_load_seconds"] < (engine.ready_s or 60)
    assert m["enginemeter_engine_gpu_headroom_bytes"] == TOTAL - USED - RESERVED
    # every metric of the doc's section is exported here (tests/system/test_metrics_doc.py leaves the section to this
    # test), and everything exported here is documented
    assert len(documented_section()) == 6 and documented_section() <= set(m)
    assert not {n for n in m if n.startswith("enginemeter_")} - set(documented())


def test_what_cannot_be_told_is_absent_not_zero(
    llama_server_factory: LlamaServerFactory, proxy_factory: ProxyFactory
) -> None:
    engine = llama_server_factory()  # default verbosity: no loader lines; no NVML readings at all
    p = proxy_factory(settings_for(engine.url))
    wait_until(lambda: "llama" in httpx.get(f"{p.url}/health").json().get("diagnosis", {}), timeout=30)
    m = samples(p.url)
    assert "enginemeter_engine_weights_bytes" in m and "enginemeter_engine_load_seconds" in m
    assert "enginemeter_engine_kv_cache_bytes" in m  # the formula, from /props' slots x context per slot
    for absent in (
        "enginemeter_engine_layers_offloaded",
        "enginemeter_engine_layers",
        "enginemeter_engine_gpu_headroom_bytes",
    ):
        assert absent not in m
    notes = httpx.get(f"{p.url}/health").json()["diagnosis"]["llama"]["notes"]
    assert any("-lv 4" in n for n in notes)


def test_a_restarted_engine_is_diagnosed_again(llama_server_bin: Path, tiny_model: Path, tmp_path: Path) -> None:
    port = free_port()

    def start(np: int) -> LlamaServer:
        return LlamaServer(tiny_model, binary=llama_server_bin, n_parallel=np, port=port, ctx_size=1024 * np,
                           extra_args=["-lv", "4"], log_path=tmp_path / f"np{np}.log").start()  # fmt: skip

    settings = settings_for(f"http://127.0.0.1:{port}")

    async def run() -> tuple[int, int, int | None, object, object]:
        engines = make_engines(settings)
        live = LiveDiagnosis(engines, None)
        e = engines["llama"]
        first = start(1)
        try:
            await e.probe()
            await live.refresh(e)
            one = live.results["llama"]
            await live.refresh(e)  # same process: the same diagnosis object, nothing gathered again
            same = live.results["llama"]
        finally:
            first.stop()
        second = start(2)
        try:
            await live.refresh(e)
            two = live.results["llama"]
        finally:
            second.stop()
            await e.aclose()
        return first.pid, second.pid, two.started.slots, one is same, two.process.pid

    pid1, pid2, slots, unchanged, diagnosed_pid = asyncio.run(run())
    assert unchanged is True and pid1 != pid2
    assert diagnosed_pid == pid2 and slots == 2
