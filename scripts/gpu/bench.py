"""Issue 11, the decision: ``enginemeter bench`` over llama.cpp, SGLang and vLLM, all three resident on the one
GPU, taking turns (the bench sends to one engine at a time; nothing mirrored). llama.cpp is listed twice under
two names (``llamacpp`` and ``llamacpp_aa``, same URL) so the run holds an A/A noise-floor pass.

    python3 scripts/gpu/bench.py --out DIR [--concurrency 1,4,16,64 --max-tokens 48 ...]

GPU memory per engine comes from an enginemeter proxy started here only as a metrics source (collectors on,
every engine configured, no mirroring; the bench does not send through it): --metrics-url its /metrics.
Writes DIR/results.jsonl (raw per-request records), DIR/report.md + charts if matplotlib is there,
DIR/command.txt, DIR/env.json (card, driver, versions), DIR/proxy.log.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
ENGINES = [
    ("llamacpp", "http://127.0.0.1:8081", "llamacpp", "FP16"),
    ("llamacpp_aa", "http://127.0.0.1:8081", "llamacpp", "FP16"),
    ("sglang", "http://127.0.0.1:30000", "sglang", "FP16"),
    ("vllm", "http://127.0.0.1:8000", "vllm", "FP16"),
]


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def env_info() -> dict[str, object]:
    info: dict[str, object] = {"date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
    try:
        info["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,memory.used,clocks.max.sm", "--format=csv"],
            capture_output=True, text=True, timeout=20,
        ).stdout  # fmt: skip
    except OSError as exc:
        info["nvidia_smi"] = repr(exc)
    for name, url, _k, _q in ENGINES:
        for p in ("/version", "/props", "/get_server_info"):
            try:
                r = httpx.get(url + p, timeout=10, trust_env=False)
                if r.status_code == 200:
                    doc = r.json()
                    keys = ("version", "build_info", "total_slots", "max_running_requests", "context_length",
                            "mem_fraction_static", "dtype", "attention_backend", "disable_cuda_graph")  # fmt: skip
                    info[f"{name}{p}"] = {k: doc.get(k) for k in keys if k in doc}
            except (httpx.HTTPError, ValueError):
                pass
    return info


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompt-lengths", default="short,long")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "env.json").write_text(json.dumps(env_info(), indent=1))

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = [f"listen: 127.0.0.1:{port}", "engines:"]
    for name, url, kind, _q in ENGINES:
        cfg += [f"  - name: {name}", f"    url: {url}", f"    kind: {kind}"]
    cfg += ["routes:", '  - models: ["*"]', "    primary: llamacpp", "mirror: {enabled: false}",
            "collectors: {gpu: true, gpu_interval: 0.5, engine_interval: 5.0}"]  # fmt: skip
    (a.out / "metrics-proxy.yaml").write_text("\n".join(cfg) + "\n")
    with open(a.out / "proxy.log", "wb") as proxy_log:  # the child keeps its own copy of the descriptor
        proxy = subprocess.Popen(
            [sys.executable, "-m", "proxy.cli", "serve", "--config", str(a.out / "metrics-proxy.yaml")],
            cwd=ROOT, stdout=proxy_log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    metrics_url = f"http://127.0.0.1:{port}/metrics"
    for _ in range(100):
        try:
            if httpx.get(metrics_url, timeout=2, trust_env=False).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.3)
    time.sleep(2)
    try:
        (a.out / "metrics-before.txt").write_text(httpx.get(metrics_url, timeout=10, trust_env=False).text)
    except httpx.HTTPError as exc:
        log(f"metrics proxy: {exc!r}; memory from NVML instead")
        metrics_url = ""

    argv = [sys.executable, "-m", "proxy.cli", "bench"]
    for name, url, _k, q in ENGINES:
        argv += ["--engine", f"{name}={url}", "--quantization", f"{name}={q}"]
    argv += [
        "--baseline", "llamacpp", "--model", "m7b", "--memory-budget", "72GiB",
        "--concurrency", a.concurrency, "--output-lengths", str(a.max_tokens), "--max-tokens", str(a.max_tokens),
        "--prompt-lengths", a.prompt_lengths, "--cache", "both", "--repeats", str(a.repeats), "--waves", "1",
        "--warmup", str(a.warmup), "--out", str(a.out), "--no-progress",
    ]  # fmt: skip
    if metrics_url:
        argv += ["--metrics-url", metrics_url]
    (a.out / "command.txt").write_text(shlex.join(argv) + "\n")
    log(shlex.join(argv))
    t0 = time.monotonic()
    p = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "MPLBACKEND": "Agg"})
    try:
        rc = p.wait()
    except KeyboardInterrupt:
        p.send_signal(signal.SIGINT)
        rc = p.wait()
    log(f"bench rc {rc} in {time.monotonic() - t0:.0f} s")
    with contextlib.suppress(httpx.HTTPError, ValueError):
        (a.out / "metrics-after.txt").write_text(httpx.get(metrics_url, timeout=10, trust_env=False).text)
    proxy.terminate()
    proxy.wait(10)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
