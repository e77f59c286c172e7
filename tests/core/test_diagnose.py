"""``enginemeter diagnose`` (``proxy/cli/diagnose.py`` over ``proxy/diagnosis.py``) against real engines.

Real ``llama-server`` processes (CPU build, generated models) are found by their listening port; their command
line, their real log and their GGUF header are read as a user's would be. The GPU side uses recorded NVML
readings attributed to the real process (this machine has no GPU), in the shape of the H200 reading of
shared/reference/gpu.md.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from proxy.bench.run.sweep import slot_values, variants
from proxy.diagnosis import Diagnosis, gather
from proxy.embedded import make_model
from proxy.embedded.gguf_meta import model_shape, read_gguf
from proxy.gpu.memory import GpuMemory
from proxy.gpu.nvml import DeviceReading, ProcReading
from proxy.procs.process import free_port
from tests.helpers import REPO, LlamaServerFactory, wait_until

MIB = 2**20
GIB = 2**30
TOTAL = 150_754_820_096
H200 = "NVIDIA H200"


class OneReading:
    """NVML as recorded: one device, and ``held`` bytes for whichever of ``pids`` is asked about."""

    def __init__(self, pids: list[int], held: int, used: int = 16 * GIB) -> None:
        self.pids, self.held, self.used = pids, held, used

    def devices(self) -> list[DeviceReading]:
        return [DeviceReading(0, H200, "GPU-0", TOTAL, self.used, TOTAL - self.used - 600 * MIB, 600 * MIB, 0.3)]

    def processes(self, index: int) -> list[ProcReading]:
        return [ProcReading(p, self.held) for p in self.pids]

    def close(self) -> None:
        pass


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy.cli", "diagnose", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small GQA model: 4 layers, 8 query heads sharing 2 KV heads of 32 dims (llama-spm vocabulary)."""
    return make_model(
        tmp_path_factory.mktemp("gqa"), vocab="llama-spm", n_layer=4, n_embd=256, n_ff=512, n_head=8, n_head_kv=2
    )


# ---- launch flags, the layer line, load time, KV size: from a real log and the formula ------------------------


@pytest.mark.parametrize(
    ("extra", "np", "ctx", "cache_bytes"),
    [
        ((), 2, 2048, 2.0),
        (("-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"), 4, 4096, 34 / 32),
        (("-kvu",), 3, 3072, 2.0),
    ],
)
def test_diagnose_reads_a_real_llama_server_and_agrees_with_the_formula(
    llama_server_factory: LlamaServerFactory,
    gqa_model: Path,
    tmp_path: Path,
    extra: tuple[str, ...],
    np: int,
    ctx: int,
    cache_bytes: float,
) -> None:
    log = tmp_path / "engine.log"
    engine = llama_server_factory(model=gqa_model, np=np, ctx_size=ctx, extra_args=("-lv", "4", *extra), log_path=log)
    r = cli(engine.url, "--json", "--probes", "2", "--max-tokens", "16")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["kind"] == "llamacpp"
    assert d["process"]["pid"] == engine.pid and d["process"]["how"] == f"listening on port {engine.port}"
    flags = d["flags"]
    assert (flags["ctx_size"], flags["parallel"], flags["threads"]) == (ctx, np, 1)
    if extra:
        assert flags.get("cache_type_k", "f16") == ("q8_0" if "q8_0" in extra else "f16")
        assert flags.get("kv_unified", False) == ("-kvu" in extra)
    assert d["log_path"] == str(log)
    s = d["started"]
    # the layer-count facts: this CPU build has no GPU backend, so no "offloaded" line; 4 layers + output
    assert (s["layers_offloaded"], s["layers_total"]) == (0, 5)
    assert "no GPU backend" in s["evidence"]["layers_offloaded"]
    assert 0 < s["load_s"] < (engine.ready_s or 60)  # loading -> loaded, within launch -> ready
    assert (s["slots"], s["context_per_slot"]) == (np, ctx if "-kvu" in extra else ctx // np)
    # KV: the log's figure against 2 x n_layer x n_head_kv x head_dim x ctx x bytes, from the GGUF's own shape
    formula = 2 * 4 * 2 * 32 * ctx * cache_bytes
    assert d["kv"]["bytes"] == round(formula)
    assert s["kv_cache_bytes"] == pytest.approx(formula, rel=0.03)
    assert d["kv"]["reported_ratio"] == pytest.approx(1.0, abs=0.03)
    assert (d["shape"]["n_head"], d["shape"]["n_head_kv"], d["shape"]["head_dim_k"]) == (8, 2, 32)
    assert d["shape"]["weights_bytes"] == read_gguf(gqa_model).weights_bytes
    # the probes' timing split, from the engine's own timings
    t = d["timing"]
    assert t["ok"] == 2 and t["source"] == "the engine's timings"
    assert t["eval"]["ms_per_token"] > 0 and t["prompt_eval"]["tokens_per_second"] > 0
    assert t["queue"]["concurrent"] == np + 1


def test_diagnose_text_reads_eval_first_then_prompt_eval_then_load(llama_server_factory: LlamaServerFactory) -> None:
    engine = llama_server_factory(np=2, extra_args=("-lv", "4"))
    r = cli(engine.url, "--probes", "1", "--max-tokens", "8")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    order = [
        out.index(k) for k in ("Launch parameters", "  eval ", "  prompt eval ", "  queue ", "  load ", "  KV cache ")
    ]
    assert order == sorted(order)
    assert "-np 2" in out and "-c 2048" in out and "-ngl auto, fit to free memory (default)" in out
    assert "by the formula 2 x 2 layers x 2 KV heads x 16 head dim x 2048 tokens x 2 B (f16)" in out


# ---- resident or not: the GGUF against the process's GPU memory (recorded readings) -------------------------


def _diagnose(url: str, reader: OneReading, **kw: Any) -> Diagnosis:
    memory = GpuMemory(opener=lambda: reader)
    return asyncio.run(gather(url, memory=memory, **kw))


def test_a_model_larger_than_the_processs_gpu_memory_is_not_resident(
    llama_server_factory: LlamaServerFactory, tiny_model: Path
) -> None:
    engine = llama_server_factory(extra_args=("-lv", "4"))
    weights = read_gguf(tiny_model).weights_bytes  # 37.2 MiB
    d = _diagnose(engine.url, OneReading([engine.pid], held=10 * MIB))
    assert d.resident is not None and d.resident.value is False
    assert "holds 10.0 MiB of GPU memory, less than the 37.2 MiB of weights" in d.resident.why
    assert d.gpu is not None and d.gpu.engine_bytes == 10 * MIB < weights


def test_a_process_holding_the_weights_is_resident(llama_server_factory: LlamaServerFactory) -> None:
    engine = llama_server_factory()  # default verbosity: no loader lines, so only the memory says
    d = _diagnose(engine.url, OneReading([engine.pid], held=40 * MIB))
    assert d.resident is not None and d.resident.value is True, d.resident
    assert "start it with -lv 4" in " ".join(d.notes)


def test_memory_is_or_is_not_the_constraint_from_the_engines_gpu(llama_server_factory: LlamaServerFactory) -> None:
    engine = llama_server_factory(np=2, extra_args=("-lv", "4"))
    roomy = _diagnose(engine.url, OneReading([engine.pid], held=40 * MIB, used=16 * GIB))
    assert roomy.memory is not None and roomy.memory.value is False
    assert "memory is not the constraint" in roomy.memory.why and "more slots" in roomy.memory.why
    full = _diagnose(engine.url, OneReading([engine.pid], held=40 * MIB, used=TOTAL - 1 * GIB))
    assert full.memory is not None and full.memory.value is True and "memory is the constraint" in full.memory.why


# ---- what cannot be read is said -------------------------------------------------------------------------


def test_a_log_that_goes_to_a_pipe_is_named_and_log_flag_reads_it(
    llama_server_bin: Path, tiny_model: Path, tmp_path: Path
) -> None:
    port = free_port()
    argv = [str(llama_server_bin), "-m", str(tiny_model), "--port", str(port), "-c", "2048", "-lv", "4"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: _health(port), timeout=60)
        r = cli(f"http://127.0.0.1:{port}", "--json", "--probes", "0")
        d = json.loads(r.stdout)
        assert d["log_path"] is None
        assert any("pipe:" in n and "pass --log FILE" in n for n in d["notes"]), d["notes"]
        assert d["flags"]["ctx_size"] == 2048  # the command line is still read
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    log = tmp_path / "saved.log"
    log.write_bytes(out)
    port2 = free_port()
    proc = subprocess.Popen([*argv[:4], str(port2), *argv[5:]], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: _health(port2), timeout=60)
        d = json.loads(cli(f"http://127.0.0.1:{port2}", "--json", "--probes", "0", "--log", str(log)).stdout)
        assert d["log_path"] == str(log)
        assert d["started"]["kv_cache_bytes"] == pytest.approx(d["kv"]["bytes"], rel=0.03)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_an_engine_on_another_host_is_diagnosed_from_its_endpoints_only(
    llama_server_factory: LlamaServerFactory,
) -> None:
    engine = llama_server_factory()
    d = asyncio.run(gather(engine.url.replace("127.0.0.1", "localhost"), pid=None))
    assert d.process.pid == engine.pid  # localhost is this machine
    far = asyncio.run(gather("http://192.0.2.1:9", timeout_s=0.5))  # TEST-NET: nothing answers
    assert far.kind is None and any("not this machine" in n for n in far.notes)


def test_a_missing_log_file_and_an_unreachable_engine_exit_2() -> None:
    r = cli("http://127.0.0.1:9", "--log", "/nonexistent.log")
    assert r.returncode == 2 and "no such file" in r.stderr
    r = cli(f"http://127.0.0.1:{free_port()}", "--probes", "0")
    assert r.returncode == 2 and "cannot probe" in r.stderr


# ---- the URL a person has, the cause first, the next command ---------------------------------------------


def test_a_base_url_with_v1_is_diagnosed_and_ends_with_the_tune_command(
    llama_server_factory: LlamaServerFactory,
) -> None:
    engine = llama_server_factory(np=2)
    r = cli(engine.url + "/v1/", "--probes", "1", "--max-tokens", "4", "--memory-budget", "72GiB")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"enginemeter diagnose {engine.url}: llama.cpp")
    assert "eval " in r.stdout and "probes failed" not in r.stdout
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("Next: enginemeter tune --launch ") and last.endswith(" --memory-budget 72GiB")
    argv = shlex.split(last.removeprefix("Next: "))
    launch = argv[argv.index("--launch") + 1]
    assert launch.endswith(" -np {2,1,4,8} --port {port}") and "-c 2048" in launch  # its own -np 2 first
    assert " -np 2" not in launch and f"--port {engine.port}" not in launch  # the sweep and {port} replace them
    flag, settings = variants(launch, None, None)  # tune reads it as written
    assert flag == "-np" and [v.value for v in settings] == ["2", "1", "4", "8"]  # tune's baseline: the -np it runs


def test_a_refused_probe_and_a_url_without_scheme_exit_non_zero_with_the_cause_first(
    llama_server_factory: LlamaServerFactory,
) -> None:
    r = cli(f"http://127.0.0.1:{free_port()}/v1")
    assert r.returncode == 2
    assert r.stderr.splitlines()[0].startswith("enginemeter diagnose: cannot probe http://127.0.0.1:")
    assert "connection refused" in r.stderr.splitlines()[0]
    r = cli("127.0.0.1:8080")
    assert r.returncode == 2
    assert r.stderr.splitlines()[0] == (
        "enginemeter diagnose: URL '127.0.0.1:8080' has no scheme: write http://127.0.0.1:8080"
    )
    assert cli("http://127.0.0.1:9", "--memory-budget", "lots").returncode == 2
    engine = llama_server_factory(ctx_size=512)
    r = cli(engine.url, "--probes", "1", "--prompt-words", "2000")  # longer than the context: every probe fails
    assert r.returncode == 1, r.stdout
    assert r.stderr.splitlines()[0].startswith(f"enginemeter diagnose: the probe requests to {engine.url} failed")
    assert "Next: enginemeter tune" in r.stdout  # what could be read without a token still follows


def test_memory_is_judged_against_the_budget_and_tiny_slots_read_sanely(
    llama_server_factory: LlamaServerFactory,
) -> None:
    engine = llama_server_factory(np=2, extra_args=("-lv", "4"))
    memory = GpuMemory(opener=lambda: OneReading([engine.pid], held=40 * MIB, used=16 * GIB))
    d = asyncio.run(gather(engine.url, memory=memory, budget_bytes=40 * GIB))
    assert d.memory is not None and d.memory.value is False
    assert "39.96 GiB free of 40.00 GiB" in d.memory.why and "--memory-budget 40.00 GiB" in d.memory.why
    assert "at 0 MiB" not in d.memory.why and "KiB of KV each" in d.memory.why, d.memory.why
    tight = asyncio.run(gather(engine.url, memory=GpuMemory(opener=lambda: OneReading([engine.pid], held=40 * MIB)),
                               budget_bytes=48 * MIB))  # fmt: skip
    assert tight.memory is not None and tight.memory.value is True, tight.memory


# ---- SGLang: the same facts where it says them -----------------------------------------------------------


def test_sglang_says_its_kv_pool_memory_fraction_and_graphs_through_server_info(
    llama_server_factory: LlamaServerFactory,
) -> None:
    from fakes.sglang_emulator import EmulatorConfig, run_in_thread

    backend = llama_server_factory(np=2)
    with run_in_thread(EmulatorConfig(backend=backend.url, served_model_name="tiny")) as url:
        d = asyncio.run(gather(url))
    s = d.started
    assert d.kind == "sglang"
    assert s.memory_fraction == 0.192  # as the captured 0.5.17 server args say
    assert s.kv_cache_tokens and s.kv_cache_tokens > 0 and s.slots == 2
    assert s.cuda_graphs == "off" and "disable_cuda_graph" in s.evidence["cuda_graphs"]


def _health(port: int) -> bool:
    import httpx

    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_the_gguf_shape_reader_agrees_with_the_generator(gqa_model: Path) -> None:
    s = model_shape(read_gguf(gqa_model))
    assert (s.arch, s.n_layer, s.n_head, s.kv_heads, s.head_dim_k) == ("llama", 4, 8, 2, 32)


@pytest.mark.parametrize(
    ("current", "values"),
    [
        (16, "{16,8,32,64}"),
        (4, "{4,2,8,16}"),
        (2, "{2,1,4,8}"),
        (1, "{1,2,4,8}"),
        (None, "{1,2,4,8}"),
        ("x", "{1,2,4,8}"),
    ],
)
def test_the_suggested_sweep_starts_at_the_engines_own_slot_count(current: int | str | None, values: str) -> None:
    """tune's first value is its baseline: the setting the engine runs now; then half, twice and four times it."""
    assert slot_values(current) == values
    flag, settings = variants(f"llama-server -m m.gguf -np {values} --port {{port}}", None, None)
    assert flag == "-np" and settings[0].value == values[1:].split(",")[0]
