"""What each dialect reads from an engine's command line and start-up log (``proxy/engines/startup.py`` and the
``parse_log``/``launch_flags`` of ``proxy/engines/{llamacpp,sglang,vllm}.py``).

The logs are the real ones of the H200 run (docs/gpu-results/three-engines/logs/engines/): SGLang 0.5.17 and vLLM
0.26.0 in eager mode, llama.cpp 11434 (CUDA) at its default verbosity, plus a CPU llama-server's ``-lv 4`` log
made here. Lines the H200 logs do not hold (CUDA graph capture, llama.cpp's loader on CUDA) are written with the
engines' own format strings, quoted beside each.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from proxy.engines import llamacpp, sglang, started, vllm
from proxy.engines.llamacpp import launch_flags
from proxy.engines.startup import LogFacts, flag_value, last_launch, python_module, size_bytes
from tests.helpers import REPO, LlamaServerFactory

LOGS = REPO / "docs" / "gpu-results" / "three-engines" / "logs" / "engines"
#: the 27B run's engines as ``proxy.procs.launch`` logged them (``OUT/engines/NAME.log``)
RAW27 = REPO / "docs" / "gpu-results" / "h200-2026-12-03-27b" / "raw"
GIB = 2**30


def test_flags_in_every_spelling_the_last_one_winning() -> None:
    argv = ["llama-server", "-c", "4096", "--ctx-size=8192", "-np", "4", "-ngl", "all", "-fa", "on", "-kvu"]
    assert flag_value(argv, "-c", "--ctx-size") == "8192"
    assert launch_flags(argv) == {"ctx_size": 8192, "parallel": 4, "gpu_layers": "all", "flash_attn": "on",
                                  "kv_unified": True}  # fmt: skip
    assert python_module(["/opt/venv/bin/python3.12", "-u", "-m", "sglang.launch_server"]) == "sglang.launch_server"
    assert python_module(["python", "script.py", "-m", "x"]) is None


def test_the_last_start_of_an_appended_log_is_read() -> None:
    text = "\n+ llama-server -c 1\nold line\n\n+ llama-server -c 2\nnew line\n"
    assert last_launch(text) == "new line\n"
    assert last_launch("no header\n") == "no header\n"


def test_sizes_are_binary_units_as_the_engines_compute_them() -> None:
    assert size_bytes("6.57", "GB") == round(6.57 * GIB)
    assert size_bytes("0.50", "MiB") == 2**19


def test_llamacpp_default_verbosity_log_gives_load_time_and_slots_and_says_what_is_missing() -> None:
    text = gzip.decompress((LOGS / "llama.log.gz").read_bytes()).decode()
    f = llamacpp.DIALECT.parse_log(last_launch(text))
    assert f.load_s == pytest.approx(2.152942 - 0.027551, abs=1e-6)  # "loading model" -> "model loaded"
    assert (f.slots, f.context_per_slot, f.kv_unified) == (64, 8192, True)
    assert f.layers_offloaded is None and f.kv_cache_bytes is None
    assert any("-lv 4" in n for n in f.notes)


def test_llamacpp_loader_lines_on_cuda() -> None:
    # llama-model.cpp:1926 "%s: offloaded %d/%d layers to GPU"; :1933 "%s: %12s model buffer size = %8.2f MiB";
    # llama-kv-cache.cpp:301 "%s: size = %7.2f MiB (%6u cells, %3d layers, %2u/%u seqs), K (%s): ..., V (%s): ..."
    log = """\
0.00.020.100 I srv    load_model: loading model '/m/q4.gguf'
0.00.120.000 I llama_model_load_from_file_impl: using device CUDA0 (NVIDIA H200) (0000:19:00.0) - 142000 MiB free
0.01.200.000 I load_tensors: offloaded 33/33 layers to GPU
0.01.200.100 I load_tensors:        CUDA0 model buffer size = 13563.02 MiB
0.01.200.200 I load_tensors:   CPU_Mapped model buffer size =   500.00 MiB
0.01.500.000 I llama_context: n_ctx                 = 32768
0.01.500.100 I llama_context: flash_attn            = auto
0.01.600.000 I llama_kv_cache: size = 4096.00 MiB ( 32768 cells,  32 layers,  4/1 seqs), K (f16): 2048.00 MiB, V (f16): 2048.00 MiB
0.01.700.000 I resolve_fused_ops: Flash Attention enabled
0.02.100.000 I srv    load_model: initializing, n_slots = 4, n_ctx_slot = 32768, kv_unified = 'true'
0.02.150.000 I srv  llama_server: model loaded
"""
    f = llamacpp.DIALECT.parse_log(log)
    assert (f.layers_offloaded, f.layers_total) == (33, 33)
    assert f.weights_bytes == round(13563.02 * 2**20) and f.weights_host_bytes == 500 * 2**20
    assert (f.kv_cache_bytes, f.kv_cache_tokens, f.kv_cache_type) == (4096 * 2**20, 32768, "f16")
    assert (f.context, f.flash_attention, f.devices) == (32768, "enabled", ("CUDA0 (NVIDIA H200)",))
    assert f.load_s == pytest.approx(2.15 - 0.0201)


def test_llamacpp_cuda_at_lv4_on_the_h200_27b_run() -> None:
    """The real -lv 4 log of the 27B run's diagnose (CUDA build on the H200): every layer offloaded, the KV pool,
    flash attention, and CUDA graphs compiled in (``USE_GRAPHS = 1``) -- not "on": a release build does not log
    whether they run (ggml-cuda's "disabling CUDA graphs" lines are debug builds' only)."""
    log = REPO / "docs" / "gpu-results" / "h200-2026-12-03-27b" / "raw" / "diag" / "llama.log.gz"
    text = gzip.decompress(log.read_bytes()).decode()
    f = llamacpp.DIALECT.parse_log(text)
    assert (f.layers_offloaded, f.layers_total, f.slots, f.context_per_slot) == (59, 59, 16, 196608)
    assert (f.kv_cache_tokens, f.kv_unified, f.flash_attention) == (196608, True, "enabled")
    assert f.cuda_graphs is not None and f.cuda_graphs.startswith("compiled in")
    assert "USE_GRAPHS = 1" in f.evidence["cuda_graphs"]
    # a line that says they were disabled wins, wherever it stands
    off = llamacpp.DIALECT.parse_log(text + "\nggml_cuda: disabling CUDA graphs due to GPU architecture\n")
    assert off.cuda_graphs == "off"


def test_llamacpp_cpu_build_at_lv4_has_no_offload_line(
    llama_server_factory: LlamaServerFactory, tmp_path: Path
) -> None:
    engine = llama_server_factory(np=2, extra_args=("-lv", "4"), log_path=tmp_path / "e.log")
    f = llamacpp.DIALECT.parse_log(last_launch(engine.log_path.read_text()))
    assert (f.layers_offloaded, f.layers_total, f.weights_bytes) == (0, 3, 0)
    assert f.weights_host_bytes and f.weights_host_bytes > 0
    assert (f.kv_cache_bytes, f.kv_cache_tokens, f.context) == (2**19, 2048, 2048)
    assert f.flash_attention == "enabled" and f.notes == (
        "this llama-server has no GPU backend: every layer runs on the CPU",
    )


def test_sglang_0517_log() -> None:
    f = sglang.DIALECT.parse_log((LOGS / "sglang.log").read_text())
    assert (f.load_s, f.weights_bytes) == (0.34, round(13.51 * GIB))
    assert (f.kv_cache_tokens, f.kv_cache_bytes, f.kv_cache_type) == (107716, round(6.57 * GIB) * 2, "float16")
    assert (f.slots, f.context_per_slot, f.memory_fraction) == (4096, 8192, 0.192)
    assert f.cuda_graphs == "off"  # started with --disable-cuda-graph


def test_sglang_27b_kv_pool_from_the_launched_engines_log(tmp_path: Path) -> None:
    """SGLang 0.5.17, 27B bf16 at --mem-fraction-static 0.484 on the H200: its KV pool in tokens and bytes, read from
    the log file as the bench and the report read it (``proxy.engines.started``), gzipped as collect.sh keeps
    some logs too. What a share's excess costs in tokens rests on it (``proxy.bench.verdict.gates``)."""
    log = RAW27 / "sglang" / "engines" / "sglang.log"
    # "KV Cache is allocated. dtype: torch.bfloat16, #tokens: 77941, K size: 8.62 GB, V size: 8.62 GB"
    f = started(log, "sglang")
    assert (f.kv_cache_tokens, f.kv_cache_bytes, f.kv_cache_type) == (77941, round(8.62 * GIB) * 2, "bfloat16")
    assert (f.memory_fraction, f.context_per_slot) == (0.484, 196608)
    (tmp_path / "sglang.log.gz").write_bytes(gzip.compress(log.read_bytes()))
    assert started(tmp_path / "sglang.log", "sglang") == f
    assert started(tmp_path / "absent.log", "sglang") == LogFacts() == started(log, None)


def test_sglang_graph_capture_lines() -> None:
    # cuda_graph_runner.py: f"Capture cuda graph end. Time elapsed: {t:.2f} s. mem usage={m:.2f} GB. avail mem=.."
    log = (
        "[2026-12-03 06:30:00] Capture cuda graph end. Time elapsed: 3.70 s. mem usage=0.55 GB. avail mem=76.20 GB.\n"
        "[2026-12-03 06:31:02] Capture cuda graph end. Time elapsed: 62.00 s. mem usage=1.37 GB. avail mem=74.80 GB.\n"
    )
    f = sglang.DIALECT.parse_log(log)
    assert (f.cuda_graphs, f.graph_capture_s, f.graph_bytes) == ("on", 65.7, round(0.55 * GIB) + round(1.37 * GIB))
    timings = "[x] Engine startup timings (s): load_weight=1.00, cuda_graph={prefill=62.00, decode=3.70, draft=0.00}"
    assert sglang.DIALECT.parse_log(timings).graph_capture_s == 65.7


def test_vllm_0260_log_and_graph_capture() -> None:
    f = vllm.DIALECT.parse_log((LOGS / "vllm.log").read_text())
    assert (f.load_s, f.weights_bytes) == (2.650973, round(13.49 * GIB))
    assert (f.kv_cache_bytes, f.kv_cache_tokens, f.context_per_slot) == (round(12.25 * GIB), 100352, 8192)
    assert (f.memory_fraction, f.cuda_graphs) == (0.192, "off")  # --enforce-eager
    # gpu_model_runner.py: "Graph capturing finished in %.0f secs, took %.2f GiB"
    g = vllm.DIALECT.parse_log("(EngineCore pid=1) INFO 12-03 [x] Graph capturing finished in 9 secs, took 0.52 GiB\n")
    assert (g.cuda_graphs, g.graph_capture_s, g.graph_bytes) == ("on", 9.0, round(0.52 * GIB))


def test_sglang_and_vllm_say_their_start_up_over_http_as_captured() -> None:
    """SGLang's /server_info and vLLM's /metrics as the real 0.5.17 and 0.26.0 answered on the H200."""
    import asyncio
    import json

    import httpx

    fixtures = REPO / "tests" / "fixtures" / "engines"
    info = json.loads(json.loads((fixtures / "sglang-0.5.17" / "endpoints.json").read_text())["/server_info"]["body"])
    metrics = (fixtures / "vllm-0.26.0" / "metrics.txt").read_text()

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/server_info":
            return httpx.Response(200, json=info)
        if request.url.path == "/metrics":
            return httpx.Response(200, text=metrics)
        return httpx.Response(404)

    async def run() -> tuple[object, object]:
        async with httpx.AsyncClient(base_url="http://e", transport=httpx.MockTransport(answer)) as c:
            return await sglang.DIALECT.startup(c, 1.0), await vllm.DIALECT.startup(c, 1.0)

    s, v = asyncio.run(run())
    assert isinstance(s, LogFacts) and isinstance(v, LogFacts)
    assert (s.memory_fraction, s.kv_cache_tokens, s.slots, s.context_per_slot) == (0.192, 107716, 4096, 8192)
    assert s.kv_cache_bytes == round(13.149 * GIB) and s.weights_bytes == round(13.508 * GIB)
    assert s.cuda_graphs == "off" and s.load_s == pytest.approx(0.336, abs=1e-3)
    assert (v.memory_fraction, v.kv_cache_tokens) == (0.192, 100352)
