"""A vLLM-shaped ``/metrics`` endpoint and nothing else: the names, types and labels of vLLM 0.26's scheduler
gauges and token counters, so the dashboards' and rules' vLLM queries run against a real Prometheus scrape in
CI without a GPU.

Every label set carries vLLM's own ``engine`` label (the engine-core index, ``"0"``), which collides with the
``engine`` target label that ``deploy/prometheus`` sets; Prometheus keeps the target's and renames vLLM's to
``exported_engine`` (``honor_labels: false``). Serving it here keeps that collision under test.

Values are a pure function of the scrape count (counters grow, gauges cycle), so each scrape differs and every
``rate()`` has something to show. Not an engine: no generation endpoints.

    python -m fakes.vllm_metrics --port 8000 --served-model-name Qwen/Qwen2.5-7B-Instruct
"""

from __future__ import annotations

import argparse
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["exposition", "main", "run_in_thread"]


def exposition(step: int, model: str) -> str:
    """The text of the ``step``-th scrape (0-based)."""
    lab = f'engine="0",model_name="{model}"'
    running, waiting = step % 5, step % 3
    kv = round(0.05 + 0.1 * (step % 9), 4)
    lines = [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{lab}}} {float(running)}",
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{lab}}} {float(waiting)}",
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f"vllm:kv_cache_usage_perc{{{lab}}} {kv}",
        "# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.",
        "# TYPE vllm:num_preemptions_total counter",
        f"vllm:num_preemptions_total{{{lab}}} {float(step // 4)}",
        "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
        "# TYPE vllm:prompt_tokens_total counter",
        f"vllm:prompt_tokens_total{{{lab}}} {float(300 * step)}",
        "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
        "# TYPE vllm:generation_tokens_total counter",
        f"vllm:generation_tokens_total{{{lab}}} {float(64 * step)}",
        "# HELP vllm:request_success_total Count of successfully processed requests.",
        "# TYPE vllm:request_success_total counter",
    ]
    for reason, per_step in (("stop", 3), ("length", 1), ("abort", 0)):
        lines.append(f'vllm:request_success_total{{{lab},finished_reason="{reason}"}} {float(per_step * step)}')
    return "\n".join(lines) + "\n"


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] != "/metrics":
            self.send_error(404)
            return
        body = self.server.next_exposition().encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str, port: int, model: str) -> None:
        super().__init__((host, port), _Handler)
        self.model = model
        self._step = 0
        self._lock = threading.Lock()

    def next_exposition(self) -> str:
        with self._lock:
            step, self._step = self._step, self._step + 1
        return exposition(step, self.model)


@contextmanager
def run_in_thread(model: str = "vllm-model", host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Serve on ``host:port`` (0: any free port) in a thread; yields the base URL."""
    server = _Server(host, port, model)
    thread = threading.Thread(target=server.serve_forever, name="vllm-metrics", daemon=True)
    thread.start()
    try:
        yield f"http://{host}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-model-name", default="vllm-model")
    args = ap.parse_args(argv)
    server = _Server(args.host, args.port, args.served_model_name)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
