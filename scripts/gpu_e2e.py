"""End to end on a real GPU (issue 7): two CUDA llama-server engines with one variable changed behind
enginemeter in mirror mode, measured against the engines' own figures.

Run by scripts/gpu-e2e.sh on the GPU machine (it builds llama-server and the 7B-shape model first). Steps:

1. engine ``np1`` (``-np 1``) and engine ``np4`` (``-np 4``), same model, all layers on the GPU;
2. enginemeter in front: route ``qwen7b`` -> np1 mirrored to np4, comparison log on, collectors on;
3. agreement: greedy streams through the proxy; per request the proxy's decode tok/s vs llama-server's
   ``timings.predicted_per_second`` and the proxy's upstream TTFT vs the engine's ``prompt_ms`` (+ queue);
4. throughput cost: mirroring off (admin endpoint), the same concurrent load direct to np4 and through the
   proxy pinned to np4, interleaved rounds; aggregate completion tok/s ratio;
5. ``enginemeter bench`` np1 vs np4 -> verdict;
6. everything saved under $OUT (summary.md, summary.json, metrics, comparison log, bench report tarball).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from proxy.embedded import LlamaServer, free_port  # noqa: E402

ALIAS = "qwen7b"
PROMPT = "Explain, step by step, how a transformer language model turns a prompt into its next token."


def log(msg: str) -> None:
    print(f"[gpu-e2e {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def stream_once(
    url: str, *, max_tokens: int, headers: dict[str, str] | None = None, prompt: str = PROMPT
) -> dict[str, Any]:
    """One greedy stream; returns usage, timings and client-side wall time."""
    body = {
        "model": ALIAS,
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first = None
    last: dict[str, Any] = {}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            doc = json.loads(line[6:])
            if first is None and doc.get("choices") and doc["choices"][0].get("delta", {}).get("content"):
                first = time.perf_counter()
            if doc.get("usage"):
                last = doc
    t1 = time.perf_counter()
    return {
        "completion_tokens": last.get("usage", {}).get("completion_tokens", 0),
        "timings": last.get("timings", {}),
        "ttft_s": (first - t0) if first else None,
        "wall_s": t1 - t0,
    }


def load_round(url: str, *, concurrency: int, max_tokens: int, headers: dict[str, str] | None) -> dict[str, float]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        res = list(
            pool.map(
                lambda i: stream_once(url, max_tokens=max_tokens, headers=headers, prompt=f"[{i}-{t0}] {PROMPT}"),
                range(concurrency),
            )
        )
    wall = time.perf_counter() - t0
    tokens = sum(r["completion_tokens"] for r in res)
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu-e2e-out"))
    ap.add_argument("--work", default="/tmp/gpu-e2e")
    ap.add_argument("--deadline", type=float, default=0.0, help="epoch seconds: skip what would not finish before")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--agree-requests", type=int, default=6)
    ap.add_argument("--agree-tokens", type=int, default=256)
    ap.add_argument("--load-concurrency", type=int, default=4)
    ap.add_argument("--load-tokens", type=int, default=256)
    ap.add_argument("--load-rounds", type=int, default=3)
    ap.add_argument(
        "--bench",
        default="--concurrency 1,4 --output-lengths 128 --prompt-lengths short,long --repeats 3 --warmup 1 --cache cold --waves 1",
    )
    args = ap.parse_args()
    out = Path(args.out)
    work = Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "model": args.model}
    gpu_args = ["-ngl", "99", "-fa", "on"]
    engines = [
        LlamaServer(
            args.model,
            binary=args.bin,
            n_parallel=1,
            ctx_size=args.ctx,
            threads=8,
            alias=ALIAS,
            extra_args=[*gpu_args, "--metrics"],
            log_path=work / "np1.log",
            name="np1",
            ready_timeout_s=300,
        ),
        LlamaServer(
            args.model,
            binary=args.bin,
            n_parallel=4,
            ctx_size=args.ctx * 4,
            threads=8,
            alias=ALIAS,
            extra_args=[*gpu_args, "--metrics"],
            log_path=work / "np4.log",
            name="np4",
            ready_timeout_s=300,
        ),
    ]
    proxy_proc = None
    try:
        for e in engines:
            e.start()
            log(f"{e.name} up at {e.url} pid {e.pid}")
        np1, np4 = engines
        pport = free_port()
        proxy = f"http://127.0.0.1:{pport}"
        cfg = work / "enginemeter.yaml"
        cmp_log = work / "comparisons.jsonl"
        cfg.write_text(
            f"""listen: 127.0.0.1:{pport}
admin_key: gpu-e2e
engines:
  - {{name: np1, url: "{np1.url}", kind: llamacpp}}
  - {{name: np4, url: "{np4.url}", kind: llamacpp}}
models:
  - {{alias: {ALIAS}}}
routes:
  - {{models: [{ALIAS}], primary: np1, shadows: [np4], pinnable: [np4], sample_rate: 1.0}}
mirror: {{log_path: "{cmp_log}", max_in_flight: 64}}
collectors: {{gpu: true, gpu_interval: 0.5, engine_interval: 2}}
"""
        )
        with open(work / "proxy.log", "w") as proxy_log:  # the child keeps its own copy of the descriptor
            proxy_proc = subprocess.Popen(
                [sys.executable, "-m", "proxy.cli", "serve", "--config", str(cfg), "--log-level", "warning"],
                stdout=proxy_log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{proxy}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("proxy did not start:\n" + (work / "proxy.log").read_text()[-3000:])
            time.sleep(0.2)
        log(f"proxy up at {proxy}")
        for url in (np1.url, np4.url, proxy):  # warm-up (CUDA graphs, allocations), discarded
            stream_once(url, max_tokens=32)

        # 3. agreement, mirror on: each request runs on np1 (primary) and np4 (shadow)
        for _ in range(args.agree_requests):
            stream_once(proxy, max_tokens=args.agree_tokens)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            lines = cmp_log.read_text().splitlines() if cmp_log.exists() else []
            if len(lines) >= args.agree_requests + 1:
                break
            time.sleep(0.5)
        pairs = [json.loads(x) for x in cmp_log.read_text().splitlines()]
        agree = []
        for p in pairs:
            for role in ("primary", "shadow"):
                side = p[role]
                if (
                    side.get("decode_tps")
                    and side.get("engine_decode_tps")
                    and (side.get("completion_tokens") or 0) >= args.agree_tokens
                ):
                    agree.append(
                        {
                            "engine": side["engine"],
                            "proxy_decode_tps": side["decode_tps"],
                            "engine_decode_tps": side["engine_decode_tps"],
                            "ratio": side["decode_tps"] / side["engine_decode_tps"],
                            "upstream_ttft_ms": 1000 * (side.get("upstream_ttft_s") or 0),
                            "engine_prompt_ms": side.get("engine_prompt_ms"),
                            "ttft_ms": 1000 * (side.get("ttft_s") or 0),
                        }
                    )
        summary["agreement"] = agree
        if agree:
            devs = [abs(a["ratio"] - 1) for a in agree]
            summary["decode_agreement_max_dev"] = max(devs)
            summary["decode_agreement_median_dev"] = statistics.median(devs)
        summary["pairs"] = len(pairs)
        summary["mismatch_counts"] = {
            k: sum(1 for p in pairs if p.get("mismatch", {}).get(k))
            for k in ("prompt_tokens", "completion_tokens", "finish_reason", "output")
        }

        # 4. throughput cost, mirror off: direct to np4 vs through the proxy pinned to np4, interleaved
        httpx.post(
            f"{proxy}/admin/mirror", json={"enabled": False}, headers={"authorization": "Bearer gpu-e2e"}, timeout=10
        ).raise_for_status()
        rounds: dict[str, list[dict[str, float]]] = {"direct": [], "proxy": []}
        for _ in range(args.load_rounds):
            rounds["direct"].append(
                load_round(np4.url, concurrency=args.load_concurrency, max_tokens=args.load_tokens, headers=None)
            )
            rounds["proxy"].append(
                load_round(
                    proxy,
                    concurrency=args.load_concurrency,
                    max_tokens=args.load_tokens,
                    headers={"x-enginemeter-engine": "np4"},
                )
            )
        d = statistics.median(r["tok_s"] for r in rounds["direct"])
        p = statistics.median(r["tok_s"] for r in rounds["proxy"])
        summary["throughput"] = {
            "rounds": rounds,
            "direct_tok_s": d,
            "proxy_tok_s": p,
            "ratio": p / d,
            "concurrency": args.load_concurrency,
            "max_tokens": args.load_tokens,
        }
        httpx.post(
            f"{proxy}/admin/mirror", json={"enabled": True}, headers={"authorization": "Bearer gpu-e2e"}, timeout=10
        )
        (out / "metrics.txt").write_text(httpx.get(f"{proxy}/metrics", timeout=10).text)
        (out / "health.json").write_text(httpx.get(f"{proxy}/health", timeout=10).text)

        # 5. the bench, np1 vs np4 directly (skipped when the device call's time is nearly up)
        bench_dir = work / "bench"
        left = args.deadline - time.time() if args.deadline else 1e9
        if left < 150:
            summary["bench_skipped"] = f"only {left:.0f} s left in the device call"
            args.bench = ""
        cmd = [
            sys.executable,
            "-m",
            "proxy.cli",
            "bench",
            "--engine",
            f"np1={np1.url}",
            "--engine",
            f"np4={np4.url}",
            "--model",
            ALIAS,
            "--quantization",
            "np1=f16",
            "--quantization",
            "np4=f16",
            "--metrics-url",
            f"{proxy}/metrics",
            "--out",
            str(bench_dir),
            "--no-progress",
            *args.bench.split(),
        ]
        t0 = time.perf_counter()
        if args.bench:
            try:
                subprocess.run(cmd, cwd=ROOT, check=False, timeout=max(30.0, left - 40))
            except subprocess.TimeoutExpired:
                summary["bench_cut"] = "timed out; the report holds what finished"
        summary["bench_seconds"] = time.perf_counter() - t0
        report = bench_dir / "report.md"
        if report.exists():
            text = report.read_text()
            summary["bench_verdict"] = [ln for ln in text.splitlines() if ln.startswith("### ") and "**" in ln]
        with tarfile.open(out / "bench.tar.gz", "w:gz") as tar:
            if bench_dir.exists():
                tar.add(bench_dir, arcname="bench")
            tar.add(cmp_log, arcname="comparisons.jsonl")
            for e in engines:
                if e.log_path and Path(e.log_path).exists():
                    tar.add(e.log_path, arcname=Path(e.log_path).name)
            tar.add(work / "proxy.log", arcname="proxy.log")
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=index,name,memory.used,memory.total", "--format=csv"],
                capture_output=True,
                text=True,
            )
            summary["nvidia_smi"] = smi.stdout
        except FileNotFoundError:
            summary["nvidia_smi"] = "nvidia-smi not found"
    finally:
        if proxy_proc is not None:
            proxy_proc.terminate()
            proxy_proc.wait(10)
        for e in engines:
            e.stop()
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k not in ("agreement",)}, indent=2))
    for a in summary.get("agreement", []):
        print(
            f"{a['engine']:>4}  proxy {a['proxy_decode_tps']:8.2f} tok/s  engine {a['engine_decode_tps']:8.2f} tok/s  ratio {a['ratio']:.4f}  upstream TTFT {a['upstream_ttft_ms']:7.1f} ms  engine prompt {a['engine_prompt_ms']} ms"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
