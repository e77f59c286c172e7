"""``python -m fakes.sglang_emulator``: flags to an :class:`EmulatorConfig`, serve until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import signal
import threading

from fakes.sglang_emulator.app import run_in_thread
from fakes.sglang_emulator.config import DEFAULT_VERSION, SGLANG_VERSIONS, EmulatorConfig

DESCRIPTION = "An SGLang HTTP front end (0.5.17 as captured, or 0.5.23) whose tokens come from a llama-server."


def _parse_args(argv: list[str] | None) -> EmulatorConfig:
    p = argparse.ArgumentParser(prog="python -m fakes.sglang_emulator", description=DESCRIPTION)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--backend", required=True, help="llama-server base URL, e.g. http://127.0.0.1:8080")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--model-path", default=None)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--max-queued-requests", type=int, default=None)
    p.add_argument("--quantization", default=None, help="reported in /server_info (e.g. fp8), as SGLang does")
    p.add_argument("--load-format", default=None, help="reported in /server_info (e.g. dummy)")
    p.add_argument("--dtype", default=None, help="reported in /server_info (e.g. bfloat16)")
    p.add_argument("--mem-fraction-static", type=float, default=None, help="reported in /server_info, as SGLang does")
    p.add_argument("--enable-metrics", action="store_true")
    p.add_argument("--enable-cache-report", action="store_true")
    p.add_argument("--sglang-version", choices=SGLANG_VERSIONS, default=DEFAULT_VERSION, help="the wire to speak")
    ready = p.add_mutually_exclusive_group()
    ready.add_argument("--ready", dest="ready", action="store_const", const=True, help="serve /ready (0.5.23 has it)")
    ready.add_argument("--no-ready", dest="ready", action="store_const", const=False, help="no /ready (404, as 0.5.17)")
    p.add_argument("--health-idle-s", type=float, default=0.0, help="/health's time when idle (real 0.5.17: ~1.0)")
    p.add_argument("--stream-response-default-include-usage", action="store_true")
    a = p.parse_args(argv)
    return EmulatorConfig(
        backend=a.backend,
        served_model_name=a.served_model_name,
        model_path=a.model_path,
        context_length=a.context_length,
        max_running_requests=a.max_running_requests,
        max_queued_requests=a.max_queued_requests,
        mem_fraction_static=a.mem_fraction_static,
        quantization=a.quantization,
        load_format=a.load_format,
        dtype=a.dtype,
        enable_metrics=a.enable_metrics,
        enable_cache_report=a.enable_cache_report,
        version=a.sglang_version,
        ready_endpoint=a.ready,
        health_idle_s=a.health_idle_s,
        stream_response_default_include_usage=a.stream_response_default_include_usage,
        host=a.host,
        port=a.port,
    )


def main(argv: list[str] | None = None) -> None:
    config = _parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with run_in_thread(config, port=config.port) as url:
        print(f"READY {url}", flush=True)
        stop.wait()
