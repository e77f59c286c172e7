#!/usr/bin/env python3
"""What four llama.cpp slots gain over one at four requests at once, as ratios measured in one run.

The claim ``tune`` finds on a quiet machine (``tests/bench/report/test_tune.py`` checks the tune's flow, not this
number): on a model whose weights outgrow the CPU's cache (the F32 llama-spm 4x256 of ``tests/conftest.py``'s
``memory_bound_model``), ``-np 4`` batches four sequences per weight read, so at c=4 the output tok/s rises and
TTFT falls several-fold against ``-np 1``, which serves the four one after another. Measured as a suite cannot on a
loaded two-core box: both engines run side by side for the whole run, the rounds alternate between them (ABBA),
and each round's ratio is its own (what a neighbour's load does to one round it does to both halves of it), so the
median ratio over the rounds is the figure, with its spread.

    .venv/bin/python perf/npgain.py [--rounds 8 --tokens 32]      # prints the ratios; exit 0

``LLAMA_SERVER_BIN`` or the cached CPU build (``scripts/build-llama-server.sh``); the model is generated (cached).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from proxy.embedded import LlamaServer, make_model
from proxy.embedded.build import build_llama_server

CONCURRENCY = 4


async def _one(client: httpx.AsyncClient, tokens: int) -> tuple[float, int]:
    """TTFT (s) and completion tokens of one streamed request."""
    body = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": tokens, "stream": True}
    body |= {"ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, n = 0.0, 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and '"content"' in line and not ttft:
                ttft = time.perf_counter() - t0
            if '"completion_tokens"' in line:
                n = int(line.split('"completion_tokens":')[1].split(",")[0].split("}")[0])
    return ttft, n


async def _round(url: str, tokens: int) -> tuple[float, float]:
    """Output tok/s and median TTFT (s) of ``CONCURRENCY`` requests at once."""
    async with httpx.AsyncClient(base_url=url, timeout=300, trust_env=False) as client:
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(_one(client, tokens) for _ in range(CONCURRENCY)))
        wall = time.perf_counter() - t0
    return sum(n for _, n in outs) / wall, statistics.median(t for t, _ in outs)


async def _measure(np1: str, np4: str, rounds: int, tokens: int) -> list[tuple[float, float]]:
    await _round(np1, tokens)  # warm-up of each, discarded
    await _round(np4, tokens)
    ratios = []
    for i in range(rounds):
        order = (np1, np4) if i % 2 == 0 else (np4, np1)  # ABBA: a drift in the load hits both alike
        got = {u: await _round(u, tokens) for u in order}
        (tps1, ttft1), (tps4, ttft4) = got[np1], got[np4]
        ratios.append((tps4 / tps1, ttft1 / ttft4))
        print(f"round {i + 1}: c=4 tok/s np1 {tps1:.0f} np4 {tps4:.0f} (x{tps4 / tps1:.2f}); "
              f"TTFT np1 {ttft1 * 1e3:.0f} ms np4 {ttft4 * 1e3:.0f} ms (x{ttft1 / ttft4:.2f} faster)")  # fmt: skip
    return ratios


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    args = p.parse_args(argv)
    binary = build_llama_server()
    model = make_model(vocab="llama-spm", n_layer=4, n_embd=256, n_ff=768, n_head=8, n_head_kv=8, dtype="f32")
    logs = Path(tempfile.mkdtemp(prefix="npgain-"))
    kw = {"binary": binary, "ctx_size": 4096, "threads": 1, "alias": "m"}
    with (
        LlamaServer(model, n_parallel=1, log_path=logs / "np1.log", **kw) as np1,  # type: ignore[arg-type]
        LlamaServer(model, n_parallel=4, log_path=logs / "np4.log", **kw) as np4,  # type: ignore[arg-type]
    ):
        ratios = asyncio.run(_measure(np1.url, np4.url, args.rounds, args.tokens))
    tps = sorted(r[0] for r in ratios)
    ttft = sorted(r[1] for r in ratios)
    print(f"-np 4 / -np 1 at c={CONCURRENCY}, {args.rounds} rounds of {args.tokens} tokens (median [min, max]):")
    print(f"  output tok/s  x{statistics.median(tps):.2f} [{tps[0]:.2f}, {tps[-1]:.2f}]")
    print(f"  TTFT          x{statistics.median(ttft):.2f} faster [{ttft[0]:.2f}, {ttft[-1]:.2f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
