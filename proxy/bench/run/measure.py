"""The suite on a set of engines: warm-ups, cache phases, every cell warmed up and repeated, each request written
as it finishes. The resident bench measures all its engines in one call (the repeats of a cell interleaved in a
balanced order); the time-shared bench calls it once per launched engine, with the same ``Plan``.

- warm-up requests first, discarded; cache-cold: the plan's unique prefix per request (the *same* prefix on
  every engine), optionally ``cache_prompt: false`` to llama.cpp, the prompt cache flushed before each phase;
  cache-warm: the bare prompts, primed once per engine;
- **every cell is warmed up** on every engine server before its first repeat: one wave at the cell's
  concurrency, discarded (a new concurrency, prompt length or output length is a new shape for the engine:
  CUDA graphs, buffers, batch sizes; measured without it, the first repeat differs from all the others);
- every cell is repeated in a **balanced order from the first repeat** (Williams rows of a Latin square, the
  A/A twin an engine like the others, each cell starting on another row);
- **foreign load**: before and during each repeat what each engine says it is running is read against what
  the bench has in flight (``proxy.bench.run.busy``); a repeat run beside another client is flagged.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import httpx

from proxy.bench.run.benchconfig import BenchConfig, CellSpec, Target, build_body
from proxy.bench.run.busy import BusyWatch, InFlight
from proxy.bench.run.client import LoopLag, RequestOutcome, Writer, send_one
from proxy.bench.run.memprobe import MemorySource
from proxy.bench.run.progress import Progress
from proxy.bench.run.records import request_record, sample_record
from proxy.bench.run.schedule import Job, Plan, prompts_for
from proxy.bench.run.targets import flush_cache
from proxy.bench.suite import Prompt
from proxy.redact import redact_url

Fire = Callable[[Target, Prompt, str, int, bool], Any]


@dataclass
class Ctx:
    """What every measurement of one run shares: its settings, writer, id, clock origin and clients."""

    cfg: BenchConfig
    w: Writer
    run_id: str
    t0_ns: int
    clients: Mapping[str, httpx.AsyncClient]
    headers: Mapping[str, dict[str, str]]
    metrics_client: httpx.AsyncClient | None = None


def williams(n: int, row: int) -> list[int]:
    """Row ``row`` of a Williams design for ``n`` treatments: over ``n`` rows (``2n`` when ``n`` is odd) every
    engine takes every position once and follows every other engine once (first-order carry-over balanced)."""
    first = [0]
    lo, hi = 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    period = n if n % 2 == 0 else 2 * n
    r = row % period
    seq = [(x + r) % n for x in first]
    return seq[::-1] if r >= n else seq


def _with_prefix(p: Prompt, prefix: str) -> tuple[dict[str, str], ...]:
    if not prefix:
        return p.messages
    msgs = [dict(m) for m in p.messages]
    for m in msgs:
        if m["role"] == "user":
            m["content"] = prefix + m["content"]
            break
    return tuple(msgs)


def real_engines(engines: Sequence[Target]) -> list[Target]:
    """The engine servers among ``engines``: a second pass pinned to its engine shares that engine's."""
    return [t for t in engines if not (t.aa_of and t.pin)]


async def measure(
    ctx: Ctx,
    engines: list[Target],
    pl: Plan,
    mem: MemorySource,
    *,
    fresh_prefixes: Callable[[Target], bool] = lambda t: t.aa_of is not None,
    skip: Collection[CellSpec] = (),
    label: str = "",
) -> None:
    """Run the plan on ``engines``. ``fresh_prefixes(t)``: whether ``t`` is a second pass on an engine that may
    still cache the first pass's prefixes (it gets ``aa_jobs``); ``skip``: cells left out for these engines."""
    cfg, w = ctx.cfg, ctx.w
    real = real_engines(engines)
    prompts = pl.prompts
    cells = [c for c in pl.cells if c not in skip]
    n_prime = len(prompts) if cfg.cache in ("warm", "both") else 0
    servers = {t.url: t.kind for t in real if t.url}
    n_warm = sum(min(c.requests(cfg), c.concurrency) for c in cells) * len(servers)
    total = (
        len(real) * (cfg.warmup + n_prime) + n_warm + len(engines) * sum(c.requests(cfg) * cfg.repeats for c in cells)
    )
    prog = Progress(total, cfg.progress)
    inflight = InFlight()
    busy = BusyWatch(servers, inflight)
    lag = LoopLag()  # the client's own scheduling delay, given to every request (proxy.bench.run.client)

    async def fire(t: Target, prompt: Prompt, prefix: str, max_tokens: int, cold: bool) -> RequestOutcome:
        body = json.dumps(build_body(cfg, t, _with_prefix(prompt, prefix), max_tokens, cold=cold)).encode()
        server = t.url or ""
        inflight.up(server)
        try:
            return lag.annotate(await send_one(ctx.clients[t.name], body, ctx.headers[t.name]))
        finally:
            inflight.down(server)

    async with lag.watching():
        try:
            for t in real:  # warm-up: discarded from every figure (a second pass shares its engine's)
                prog.label = f"{label}warm-up {t.name}"
                for i in range(cfg.warmup):
                    p = prompts[i % len(prompts)]
                    o = await fire(t, p, f"[{secrets.token_hex(4)} warmup {ctx.run_id}] ", cfg.max_tokens, True)
                    w.write(request_record(t, o, ctx.t0_ns, phase="warmup", prompt=p.id))
                    prog.step()
            for cache in ("cold", "warm"):
                phase_cells = [c for c in cells if c.cache == cache]
                if not phase_cells:
                    continue
                for t in real:
                    note = await flush_cache(t)
                    if note:
                        w.write({"type": "note", "engine": t.name, "phase": cache, "text": note})
                if cache == "warm":  # prime every engine's prompt cache with each bare prompt once (discarded)
                    for t in real:
                        prog.label = f"{label}priming {t.name}"
                        for p in prompts:
                            o = await fire(t, p, "", cfg.max_tokens, False)
                            w.write(request_record(t, o, ctx.t0_ns, phase="prime", prompt=p.id))
                            prog.step()
                for j, cell in enumerate(phase_cells):
                    await _run_cell(ctx, engines, cell, j, pl, prog, mem, fire, busy, fresh_prefixes, label)
            for server in sorted(busy.unwatched):
                names = ", ".join(t.name for t in real if t.url == server)
                w.write(
                    {
                        "type": "note",
                        "engine": names,
                        "text": f"foreign load not watched: {redact_url(server)} does not say how many requests it is "
                        "running",
                    }
                )
        finally:
            prog.close()
            await busy.aclose()


async def _run_repeat(
    cfg: BenchConfig,
    t: Target,
    cell: CellSpec,
    jobs: Sequence[Job],
    offsets: Sequence[float] | None,
    fire: Fire,
    on_done: Callable[[int, Prompt, str, RequestOutcome], None],
) -> tuple[list[RequestOutcome], int, int]:
    sem = asyncio.Semaphore(cell.concurrency)
    cold = cell.cache == "cold"
    t_a = time.perf_counter_ns()
    deadline = t_a + int(cfg.duration_s * 1e9) if cfg.duration_s else None

    async def job(i: int, p: Prompt, prefix: str) -> RequestOutcome | None:
        if offsets is not None:
            await asyncio.sleep(max(0.0, offsets[i] - (time.perf_counter_ns() - t_a) / 1e9))  # the arrival time
        async with sem:
            if deadline is not None and time.perf_counter_ns() > deadline:
                return None
            o = cast(RequestOutcome, await fire(t, p, prefix, cell.max_tokens, cold))
        on_done(i, p, prefix, o)
        return o

    outs = await asyncio.gather(*(job(i, p, pre) for i, (p, pre) in enumerate(jobs)))
    return [o for o in outs if o is not None], t_a, time.perf_counter_ns()


def _warm_jobs(cell: CellSpec, n: int, pool: Sequence[Prompt], run_id: str) -> list[Job]:
    """One wave of the cell, fresh prefixes (cold) or the bare prompts (warm), to be discarded."""
    k = max(1, min(n, cell.concurrency))
    return [
        (pool[i % len(pool)], f"[{secrets.token_hex(4)} cellwarm {run_id}] " if cell.cache == "cold" else "")
        for i in range(k)
    ]


async def _run_cell(
    ctx: Ctx,
    engines: list[Target],
    cell: CellSpec,
    index: int,
    pl: Plan,
    prog: Progress,
    mem: MemorySource,
    fire: Fire,
    busy: BusyWatch,
    fresh_prefixes: Callable[[Target], bool],
    label: str,
) -> None:
    cfg, w = ctx.cfg, ctx.w
    pool = prompts_for(pl.prompts, cell.prompt_len)
    n = cell.requests(cfg)
    shape = f"{cell.cache} c={cell.concurrency}" + (f" rate={cell.rate:g}/s" if cell.rate else "")
    shape += f" max_tokens={cell.max_tokens} prompt={cell.prompt_len}"
    warmed: set[str] = set()
    for t in engines:  # the cell's warm-up, once per engine server (an A/A twin shares its engine's)
        server = t.url or t.pin or t.name
        if server in warmed:
            continue
        warmed.add(server)
        prog.label = f"{label}{shape} warm-up {t.name}"
        prog.show()

        def warm_done(i: int, p: Prompt, prefix: str, o: RequestOutcome, t: Target = t) -> None:
            w.write(request_record(t, o, ctx.t0_ns, phase="warmup", **cell.key(), prompt=p.id))
            prog.step()

        await _run_repeat(cfg, t, cell, _warm_jobs(cell, n, pool, ctx.run_id), None, fire, warm_done)
    for rep in range(cfg.repeats):
        order = [engines[i] for i in williams(len(engines), index + rep)]
        rp = pl.reps[(cell, rep)]  # the same prompts, prefixes and arrival times on every engine in this repeat
        for t in order:
            prog.label = f"{label}{shape} rep {rep + 1}/{cfg.repeats} {t.name}"
            prog.show()

            def done(i: int, p: Prompt, prefix: str, o: RequestOutcome, t: Target = t, rep: int = rep) -> None:
                key = f"{p.id}#{prefix.strip()}" if prefix else f"{p.id}#{i}"
                w.write(
                    request_record(
                        t, o, ctx.t0_ns, phase="measure", **cell.key(), repeat=rep, index=i, prompt=p.id, key=key
                    )
                )
                prog.step()

            jobs = rp.aa_jobs if fresh_prefixes(t) else rp.jobs
            async with busy.repeat(t.url) as seen, mem.watch(ctx.metrics_client, t.pin or t.name) as box:
                outs, t_a, t_b = await _run_repeat(cfg, t, cell, jobs, rp.offsets, fire, done)
            prog.step(n - len(outs))  # requests the duration cut off
            rec = sample_record(t.name, cell, rep, outs, t_a, t_b, box["peak"], mem, cfg.goodput, t.pin or t.name)
            rec["foreign"] = seen.to_json()
            rec["position"] = order.index(t)
            w.write(rec)
