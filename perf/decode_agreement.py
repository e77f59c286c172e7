"""How closely the proxy's decode tok/s matches llama-server's own ``timings.predicted_per_second``.

Not a test: the tight figure behind tests/server/test_proxy.py's generous bound. One real llama-server (the tiny
generated model, or ``--model``), the proxy as its own process, N sequential greedy streams through it; for
each request the proxy's Result (decode tok/s = (completion_tokens - 1) / (last token - first token), per
proxy read time) next to the engine's figure for the same request (both definitions exclude the first token).

    .venv/bin/python perf/decode_agreement.py --requests 20 --max-tokens 256
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from proxy.embedded import LlamaServer, build_llama_server, make_model  # noqa: E402
from proxy.procs.process import free_port  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--model", default=None, help="GGUF (default: the generated tiny model)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    model = Path(args.model) if args.model else make_model()
    with (
        tempfile.TemporaryDirectory() as tmp,
        LlamaServer(
            model, binary=build_llama_server(), alias="m", threads=args.threads, ctx_size=args.max_tokens + 512
        ) as engine,
    ):
        log = Path(tmp) / "comparisons.jsonl"
        port = free_port()
        cfg = Path(tmp) / "c.yaml"
        # the engine mirrored onto itself: the comparison log then carries each request's proxy and engine figures
        cfg.write_text(
            f"listen: 127.0.0.1:{port}\nengines:\n  - {{name: e, url: '{engine.url}', kind: llamacpp}}\n"
            f"  - {{name: e2, url: '{engine.url}', kind: llamacpp}}\n"
            f"routes:\n  - {{models: ['*'], primary: e, shadows: [e2]}}\nmirror: {{log_path: '{log}'}}\n"
            "collectors: {gpu: false}\n"
        )
        with open(Path(tmp) / "proxy.log", "w") as plog:
            proxy = subprocess.Popen(
                [sys.executable, "-m", "proxy.cli", "serve", "--config", str(cfg), "--log-level", "warning"],
                cwd=ROOT,
                stdout=plog,
                stderr=subprocess.STDOUT,
            )
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 30
            while True:
                try:
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit("proxy did not start")
                time.sleep(0.1)
            body = {
                "model": "m",
                "stream": True,
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": "Tell me a long story."}],
            }
            for _ in range(args.requests):
                with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
                    for _ in r.iter_raw():
                        pass
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if log.exists() and len(log.read_text().splitlines()) >= args.requests:
                    break
                time.sleep(0.2)
        finally:
            proxy.terminate()
            proxy.wait(10)
        ratios = []
        for line in log.read_text().splitlines():
            rec = json.loads(line)
            for side in (rec["primary"], rec["shadow"]):
                if side.get("decode_tps") and side.get("engine_decode_tps"):
                    ratios.append(side["decode_tps"] / side["engine_decode_tps"])
    devs = sorted(abs(r - 1) for r in ratios)
    print(f"requests: {len(ratios)} (each request twice: as primary and as mirrored shadow), {args.max_tokens} tokens")
    print(
        f"proxy / engine decode tok/s: median {statistics.median(ratios):.4f}, min {min(ratios):.4f}, max {max(ratios):.4f}"
    )
    print(
        f"|ratio - 1|: median {statistics.median(devs) * 100:.2f} %, p90 {devs[int(0.9 * (len(devs) - 1))] * 100:.2f} %"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
