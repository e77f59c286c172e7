"""Send the suite to every engine, one variable at a time, and write every result to JSONL as it finishes.

Protocol (docs/bench.md):

- **preflight**: every engine is probed and sent one tiny request before anything else; an engine that is
  unreachable or fails stops the run at once (``PreflightError``: engine, URL, cause);
- **A/A pass**: the baseline runs a second time in every cell repeat (or an engine listed twice under two
  names — same URL — is used as that second pass), so the noise floor is measured in the same run;
- every engine gets the same request body, mapped per kind by ``proxy.normalize`` (``config.build_body``), and
  the same requests, planned once (``proxy.bench.run.schedule``); the suite runs as ``proxy.bench.run.measure`` says;
- prompts longer than the smallest context per slot (measured tokens + max_tokens) are left out, with a note.

Engines given as URLs (resident) run side by side, their repeats interleaved. With any launched engine
(``--launch``) the run is **time-shared** instead (``proxy.bench.run.timeshare``): each engine runs the whole suite
alone, baseline first, the baseline relaunched last as the A/A pass.

JSONL record types: ``run`` (config, engines, cells, what makes two runs comparable), ``engine`` (a time-shared
engine's facts, once it is up), ``launch`` (a launched engine's command, load time, memory moments),
``prompt_tokens``, ``note``, ``request`` (one per request), ``sample`` (one per cell repeat per engine), then the
quality phases' ``logprobs``, ``eval`` and ``quality_note`` (``--agreement``, ``--eval``: ``proxy.bench.quality``),
``end``.
"""

from __future__ import annotations

import asyncio
import secrets
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from proxy.bench import suite
from proxy.bench.run.benchconfig import BenchConfig
from proxy.bench.run.client import Writer
from proxy.bench.run.measure import Ctx, measure, real_engines
from proxy.bench.run.memprobe import MemoryProbe
from proxy.bench.run.prepare import (
    client_for,
    count_tokens,
    engine_info_via_proxy,
    engine_record,
    headers_for,
    preflight,
    quality_engine,
    quality_for,
    run_record,
    setup_aa,
    shared_llamacpp_servers,
)
from proxy.bench.run.schedule import make_plan
from proxy.bench.run.targets import probe
from proxy.bench.run.timeshare import run_time_shared
from proxy.procs.launch import Launcher


async def run_bench(
    cfg: BenchConfig, log: Callable[[str], None] | None = None, *, launcher: Launcher | None = None
) -> Path:
    """Run the whole bench; returns the JSONL path. Cancellation (Ctrl-C) keeps what was written.
    Raises ``PreflightError`` before anything is measured when an engine is unreachable or failing; with
    launched engines, ``LaunchError`` when one does not start (the engines it started are stopped)."""
    say = log or (lambda m: print(m, file=sys.stderr, flush=True))
    cfg.out.mkdir(parents=True, exist_ok=True)
    cfg.baseline = cfg.baseline or cfg.engines[0].name
    if cfg.time_shared:
        return await run_time_shared(cfg, say, launcher)
    path = cfg.out / "results.jsonl"
    # a new id per run: engines keep prompt caches across runs, so a prefix repeated from one run to the next
    # would turn the next run's "cold" requests into cache hits
    run_id = secrets.token_hex(4)
    await asyncio.gather(*(probe(t) for t in cfg.engines))
    if cfg.through:
        await engine_info_via_proxy(cfg)
    shared = shared_llamacpp_servers(cfg)
    if shared and not cfg.no_prompt_cache:
        # two names on one llama.cpp server share one prompt cache: in a cold cell the second name would be served
        # the first one's prompt from cache (the cold prefix is the same on every engine, for token parity)
        cfg.no_prompt_cache = True
        say(f"enginemeter bench: {', '.join(shared)} share one llama.cpp server: cold cells send cache_prompt:false")
    setup_aa(cfg)
    clients = {t.name: client_for(cfg, t) for t in cfg.engines}
    headers = {t.name: headers_for(cfg, t) for t in cfg.engines}
    metrics_client = httpx.AsyncClient(timeout=10, trust_env=False) if cfg.metrics_url else None
    w: Writer | None = None
    interrupted = False
    t_start = time.time()
    try:
        await preflight(cfg, cfg.engines, clients, headers)
        real = real_engines(cfg.engines)
        prompts = suite.load(cfg.suite, cfg.prompt_lengths)
        counted = await count_tokens(cfg, real, prompts)
        pl = make_plan(cfg, prompts, counted, [t.context_per_slot for t in real if t.context_per_slot], run_id)
        max_tokens_all = sorted({c.max_tokens for c in pl.cells})
        w = Writer(path)
        w.write(run_record(cfg, run_id, t_start, pl, [engine_record(cfg, t, max_tokens_all) for t in cfg.engines]))
        for rec in counted + pl.notes:
            w.write(rec)
        ctx = Ctx(cfg, w, run_id, time.perf_counter_ns(), clients, headers, metrics_client)
        await measure(ctx, cfg.engines, pl, MemoryProbe(cfg.metrics_url))
        quality = quality_for(cfg, pl.prompts, w.write, say)
        for t in sorted(real, key=lambda t: t.name != cfg.baseline):  # off the timed cells, one at a time
            await quality_engine(quality, cfg, t, clients[t.name], headers[t.name])
    except (asyncio.CancelledError, KeyboardInterrupt):
        interrupted = True
        raise
    finally:
        for cl in clients.values():
            await cl.aclose()
        if metrics_client is not None:
            await metrics_client.aclose()
        if w is not None:
            w.write({"type": "end", "interrupted": interrupted, "duration_s": time.time() - t_start})
            w.close()
            say(f"enginemeter bench: {'interrupted; ' if interrupted else ''}results in {path}")
    return path
