"""Issue 11, live: enginemeter (this checkout's source) in front of the real engines, llama.cpp primary, every
request mirrored (sample_rate 1, comparison log on) -- first to SGLang, then to vLLM.

    python3 scripts/gpu/live.py --out DIR [--requests 24 --concurrency 4 --max-tokens 64]

Per shadow, under DIR/<shadow>/: enginemeter.yaml, proxy.log, health.json (enginemeter's /health before and
after the traffic), metrics.txt (enginemeter's /metrics after), compare.jsonl (the comparison log),
client.json (what the client saw per request). DIR/summary.json has the headline figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
ENGINES = {
    "llamacpp": ("http://127.0.0.1:8081", "llamacpp"),
    "sglang": ("http://127.0.0.1:30000", "sglang"),
    "vllm": ("http://127.0.0.1:8000", "vllm"),
}
PROMPTS = [
    "Explain, step by step, how a transformer language model turns a prompt into its next token.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "List five uses of a GPU outside of graphics and explain each in a sentence.",
    "请用三句话介绍长城的历史。",
]


def log(msg: str) -> None:
    print(f"[live {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def config(port: int, shadow: str, log_path: Path) -> str:
    lines = [f"listen: 127.0.0.1:{port}", "engines:"]
    for name, (url, kind) in ENGINES.items():
        if name in ("llamacpp", shadow):
            kind = os.environ.get(f"LIVE_KIND_{name}", kind)  # dry runs: a CPU llama-server stands in
            lines += [f"  - name: {name}", f"    url: {url}", f"    kind: {kind}"]
    lines += [
        "routes:",
        '  - models: ["*"]',
        "    primary: llamacpp",
        f"    shadows: [{shadow}]",
        f"    pinnable: [{shadow}]",
        "    sample_rate: 1.0",
        "mirror:",
        "  enabled: true",
        f"  log_path: {log_path}",
        "  record_text: true",
        "collectors: {gpu: true, gpu_interval: 1.0, engine_interval: 2.0}",
    ]
    return "\n".join(lines) + "\n"


def one(url: str, i: int, max_tokens: int) -> dict[str, Any]:
    stream = i % 3 != 2
    body: dict[str, Any] = {
        "model": "m7b",
        "messages": [{"role": "user", "content": f"[{i}] {PROMPTS[i % len(PROMPTS)]}"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    t0 = time.perf_counter()
    first = None
    usage = None
    status = None
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300, trust_env=False) as r:
            status = r.status_code
            if stream:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        doc = json.loads(line[6:])
                        if first is None and doc.get("choices") and doc["choices"][0].get("delta", {}).get("content"):
                            first = time.perf_counter() - t0
                        if doc.get("usage"):
                            usage = doc["usage"]
            else:
                usage = json.loads(r.read()).get("usage")
    except httpx.HTTPError as exc:
        return {"i": i, "stream": stream, "error": repr(exc)}
    return {
        "i": i,
        "stream": stream,
        "status": status,
        "ttft_s": first,
        "e2e_s": time.perf_counter() - t0,
        "usage": usage,
    }


def run_shadow(shadow: str, out: Path, n: int, conc: int, max_tokens: int) -> dict[str, Any]:
    d = out / shadow
    d.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cmp_log = d / "compare.jsonl"
    cfg = d / "enginemeter.yaml"
    cfg.write_text(config(port, shadow, cmp_log))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(d / "proxy.log", "wb") as proxy_log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            [sys.executable, "-m", "proxy.cli", "serve", "--config", str(cfg), "--log-level", "info"],
            cwd=ROOT,
            stdout=proxy_log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    url = f"http://127.0.0.1:{port}"
    res: dict[str, Any] = {"shadow": shadow, "url": url}
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 60:
            try:
                if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code in (200, 503):
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"proxy exited {proc.returncode}")
            time.sleep(0.3)
        time.sleep(5)  # two engine polls
        h0 = httpx.get(f"{url}/health", timeout=10, trust_env=False)
        res["health_before"] = {
            "status": h0.status_code,
            "body": h0.json() if h0.headers.get("content-type", "").startswith("application/json") else h0.text,
        }
        log(f"{shadow}: enginemeter /health {h0.status_code}")
        t1 = time.perf_counter()
        with ThreadPoolExecutor(conc) as pool:
            client = list(pool.map(lambda i: one(url, i, max_tokens), range(n)))
        res["client_wall_s"] = time.perf_counter() - t1
        # a pinned request to the shadow, and one disconnect through the proxy
        pinned = httpx.post(
            f"{url}/v1/chat/completions",
            json={
                "model": "m7b",
                "messages": [{"role": "user", "content": "pinned"}],
                "max_tokens": 8,
                "temperature": 0,
            },
            headers={"x-enginemeter-engine": shadow},
            timeout=120,
            trust_env=False,
        )
        res["pinned"] = {"status": pinned.status_code, "body": pinned.text[:1500]}
        # drain the mirror
        t2 = time.monotonic()
        while time.monotonic() - t2 < 60:
            lines = cmp_log.read_text().count("\n") if cmp_log.exists() else 0
            if lines >= n:
                break
            time.sleep(0.5)
        time.sleep(3)
        h1 = httpx.get(f"{url}/health", timeout=10, trust_env=False)
        res["health_after"] = {
            "status": h1.status_code,
            "body": h1.json() if h1.headers.get("content-type", "").startswith("application/json") else h1.text,
        }
        m = httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text
        (d / "metrics.txt").write_text(m)
        (d / "health.json").write_text(
            json.dumps({"before": res["health_before"], "after": res["health_after"]}, indent=1)
        )
        (d / "client.json").write_text(json.dumps(client, indent=1))
        res["client_errors"] = sum(1 for c in client if c.get("error") or c.get("status") != 200)
        res["compare_lines"] = cmp_log.read_text().count("\n") if cmp_log.exists() else 0
        res["metric_names"] = sorted({ln.split(" ")[2] for ln in m.splitlines() if ln.startswith("# TYPE")})
        log(f"{shadow}: {n} requests, {res['client_errors']} errors, {res['compare_lines']} comparison lines")
    except Exception as exc:
        res["error"] = repr(exc)
        log(f"{shadow}: FAILED {exc!r}")
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--shadows", default="sglang,vllm")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    summary = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    for s in a.shadows.split(","):
        summary[s] = run_shadow(s, a.out, a.requests, a.concurrency, a.max_tokens)
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
