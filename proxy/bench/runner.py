"""Send the suite to every engine, one variable at a time, and write every result to JSONL as it finishes.

Protocol (docs/bench.md):

- **preflight**: every engine is probed and sent one tiny request before anything else; an engine that is
  unreachable or fails stops the run at once (``PreflightError``: engine, URL, cause);
- **A/A pass**: the baseline runs a second time in every cell repeat (or an engine listed twice under two
  names — same URL — is used as that second pass), so the noise floor is measured in the same run;
- every engine gets the same request body, mapped per kind by ``proxy.normalize`` (``config.build_body``);
- warm-up requests first, discarded; cache-cold: a unique prefix per request (the *same* prefix on every
  engine), optionally ``cache_prompt: false`` to llama.cpp, SGLang ``/flush_cache`` before the phase;
  cache-warm: the bare prompts, primed once per engine;
- **every cell is warmed up** on every engine server before its first repeat: one wave at the cell's
  concurrency, discarded (a new concurrency, prompt length or output length is a new shape for the engine:
  CUDA graphs, buffers, batch sizes; measured without it, the first repeat differs from all the others);
- every cell is repeated ``repeats`` times in a **balanced order from the first repeat** (Williams rows of a
  Latin square, the A/A twin an engine like the others, each cell starting on another row): every engine runs
  first, last and after each other engine equally often, so drift and order effects hit all alike;
  closed loop (``concurrency`` in flight) or open loop (``rate`` requests/s, gamma arrivals, the same schedule
  for every engine);
- **foreign load**: before and during each repeat what each engine says it is running is read against what
  the bench has in flight (``proxy.bench.busy``); a repeat run beside another client is flagged;
- prompts longer than the smallest context per slot (measured tokens + max_tokens) are left out, with a note.

JSONL record types: ``run`` (version 2: config, engines, cells), ``prompt_tokens``, ``note``, ``request`` (one
per request), ``sample`` (one per cell repeat per engine), ``end``.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, cast

import httpx

from proxy.bench import suite as suite_mod
from proxy.bench.busy import BusyWatch, InFlight
from proxy.bench.client import RequestOutcome, Writer, send_one
from proxy.bench.config import (
    PIN_HEADER,
    BenchConfig,
    CellSpec,
    Target,
    build_body,
    canonical_sampling,
    effective_sampling,
    plan,
)
from proxy.bench.engines import count_prompt_tokens, flush_cache, probe
from proxy.bench.memory import MemoryProbe
from proxy.bench.progress import Progress
from proxy.bench.records import request_record, sample_record
from proxy.bench.suite import Prompt
from proxy.bench.workload import arrivals

#: 3: per-cell warm-ups, balanced order, foreign-load readings (``foreign`` in each sample), the command line
RESULTS_VERSION = 3


class PreflightError(RuntimeError):
    """An engine did not answer the probe or the one tiny request: the bench stops before it starts."""

    def __init__(self, engine: str, url: str | None, cause: str) -> None:
        super().__init__(f"engine {engine} ({url or 'via proxy'}): {cause}")
        self.engine, self.url, self.cause = engine, url, cause


def _prompts_for(prompts: Sequence[Prompt], length: str) -> list[Prompt]:
    return [p for p in prompts if p.length == length] or list(prompts)


def _with_prefix(p: Prompt, prefix: str) -> tuple[dict[str, str], ...]:
    if not prefix:
        return p.messages
    msgs = [dict(m) for m in p.messages]
    for m in msgs:
        if m["role"] == "user":
            m["content"] = prefix + m["content"]
            break
    return tuple(msgs)


def _new_prefix(old: str, run_id: str) -> str:
    """A unique cold-cache prefix (the same length every time), or "" where there was none."""
    return f"[{secrets.token_hex(4)} bench {run_id}] " if old else ""


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


def setup_aa(cfg: BenchConfig) -> Target | None:
    """The A/A pass of the baseline: an engine listed again under another name (same URL) beside a candidate,
    else — unless ``aa == "off"`` — a second pass of the baseline itself. Two names for one engine and nothing
    else is an A/A run: the second name is the candidate, judged against the second pass."""
    base = next(t for t in cfg.engines if t.name == cfg.baseline)
    others = [t for t in cfg.engines if t is not base]
    for t in others if len(others) > 1 else ():  # with one other engine, that one is the candidate: A vs A
        if t.url and t.url == base.url and not cfg.through:
            t.aa_of = base.name
            return t
    if cfg.aa == "off":
        return None
    twin = replace(base, name=f"{base.name}-aa", aa_of=base.name, pin=base.pin or base.name, info=dict(base.info))
    cfg.engines.append(twin)
    return twin


async def _engine_info_via_proxy(cfg: BenchConfig) -> None:
    """Through the proxy: what it knows about each pinned engine (``/health`` ``engine_state``: kind,
    quantization, context per slot, slots) fills what probing the engine directly did not."""
    try:
        async with httpx.AsyncClient(timeout=5, trust_env=False) as c:
            doc = (await c.get(f"{cfg.through}/health")).json()
    except (httpx.HTTPError, ValueError) as exc:
        raise PreflightError("proxy", cfg.through, f"{type(exc).__name__}: {exc}"[:200]) from None
    states = ((doc.get("engine_state") or {}).get("engines") or {}) if isinstance(doc, dict) else {}
    for t in cfg.engines:
        st = states.get(t.pin or t.name)
        if not isinstance(st, dict):
            continue
        if t.kind is None and st.get("kind") in ("llamacpp", "sglang", "vllm", "openai"):
            t.kind = st["kind"]
        if not t.quantization and isinstance(st.get("quantization"), str):
            t.quantization, t.quantization_source = st["quantization"], "proxy engine info"
        t.context_per_slot = t.context_per_slot or st.get("context_length")
        t.slots = t.slots or st.get("slots")
        t.model = t.model or st.get("model")


async def preflight(
    cfg: BenchConfig, clients: Mapping[str, httpx.AsyncClient], headers: Mapping[str, dict[str, str]]
) -> None:
    """Probe results checked, then one tiny request per engine (concurrently): the first failure raises."""
    for t in cfg.engines:
        if t.info.get("probe_error"):
            raise PreflightError(t.name, t.url, f"probe failed: {t.info['probe_error']}")
    real = [t for t in cfg.engines if not (t.aa_of and t.pin)]

    async def one(t: Target) -> None:
        body = build_body(cfg, t, ({"role": "user", "content": "Say hi."},), 2, cold=False)
        o = await send_one(clients[t.name], json.dumps(body).encode(), headers[t.name])
        if not o.ok:
            raise PreflightError(t.name, t.url or cfg.through, f"test request failed: {o.error}")

    await asyncio.gather(*(one(t) for t in real))


def _engine_record(cfg: BenchConfig, t: Target, max_tokens_all: list[int]) -> dict[str, Any]:
    body = build_body(cfg, t, ({"role": "user", "content": "x"},), cfg.max_tokens, cold=False)
    eff, known = effective_sampling(cfg, t)
    dropped: list[str] | None = known
    if cfg.through and t.kind is None:  # the proxy maps it for a kind we do not know here
        eff, dropped = canonical_sampling(body), None
    return {
        "name": t.name,
        "url": t.url,
        "kind": t.kind,
        "model": t.model,
        "quantization": t.quantization,
        "quantization_source": t.quantization_source,
        "slots": t.slots,
        "context_per_slot": t.context_per_slot,
        "aa_of": t.aa_of,
        "info": t.info,
        "sampling": eff,
        "dropped": dropped,
        "body_example": {k: v for k, v in body.items() if k != "messages"},
        "max_tokens": max_tokens_all,
    }


@dataclass
class _Cell:
    """One repeat of one cell on one engine: which requests, when."""

    spec: CellSpec
    rep: int
    jobs: list[tuple[Prompt, str]]
    offsets: list[float] | None


async def _run_repeat(
    cfg: BenchConfig,
    t: Target,
    c: _Cell,
    fire: Callable[[Target, Prompt, str, int, bool], Any],
    on_done: Callable[[int, Prompt, str, RequestOutcome], None],
) -> tuple[list[RequestOutcome], int, int]:
    sem = asyncio.Semaphore(c.spec.concurrency)
    cold = c.spec.cache == "cold"
    t_a = time.perf_counter_ns()
    deadline = t_a + int(cfg.duration_s * 1e9) if cfg.duration_s else None

    async def job(i: int, p: Prompt, prefix: str) -> RequestOutcome | None:
        if c.offsets is not None:
            await asyncio.sleep(max(0.0, c.offsets[i] - (time.perf_counter_ns() - t_a) / 1e9))  # the arrival time
        async with sem:
            if deadline is not None and time.perf_counter_ns() > deadline:
                return None
            o = cast(RequestOutcome, await fire(t, p, prefix, c.spec.max_tokens, cold))
        on_done(i, p, prefix, o)
        return o

    outs = await asyncio.gather(*(job(i, p, pre) for i, (p, pre) in enumerate(c.jobs)))
    return [o for o in outs if o is not None], t_a, time.perf_counter_ns()


def shared_llamacpp_servers(cfg: BenchConfig) -> list[str]:
    """Names of llama.cpp targets that share their URL with another target (an A/A twin listed by name)."""
    by_url: dict[str, list[str]] = {}
    for t in cfg.engines:
        if t.url and t.kind == "llamacpp":
            by_url.setdefault(t.url.rstrip("/"), []).append(t.name)
    return [n for names in by_url.values() if len(names) > 1 for n in names]


async def run_bench(cfg: BenchConfig, log: Callable[[str], None] | None = None) -> Path:
    """Run the whole bench; returns the JSONL path. Cancellation (Ctrl-C) keeps what was written.
    Raises ``PreflightError`` before anything is measured when an engine is unreachable or failing."""
    say = log or (lambda m: print(m, file=sys.stderr, flush=True))
    out = cfg.out
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.jsonl"
    cfg.baseline = cfg.baseline or cfg.engines[0].name
    # a new id per run: engines keep prompt caches across runs, so a prefix repeated from one run to the next
    # would turn the next run's "cold" requests into cache hits
    run_id = secrets.token_hex(4)
    await asyncio.gather(*(probe(t) for t in cfg.engines))
    if cfg.through:
        await _engine_info_via_proxy(cfg)
    shared = shared_llamacpp_servers(cfg)
    if shared and not cfg.no_prompt_cache:
        # two names on one llama.cpp server share one prompt cache: in a cold cell the second name would be served
        # the first one's prompt from cache (the cold prefix is the same on every engine, for token parity)
        cfg.no_prompt_cache = True
        say(f"enginemeter bench: {', '.join(shared)} share one llama.cpp server: cold cells send cache_prompt:false")
    setup_aa(cfg)
    max_conc = max(cfg.concurrency)
    clients: dict[str, httpx.AsyncClient] = {}
    for t in cfg.engines:
        base_url = cfg.through or t.url
        if not base_url:
            raise ValueError(f"engine {t.name}: no URL and no --through")
        clients[t.name] = httpx.AsyncClient(
            base_url=base_url,
            timeout=httpx.Timeout(cfg.timeout_s, connect=5),
            limits=httpx.Limits(max_connections=max_conc + 2, max_keepalive_connections=max_conc + 2),
            trust_env=False,
        )
    headers = {
        t.name: {"content-type": "application/json", **({PIN_HEADER: t.pin or t.name} if cfg.through else {})}
        for t in cfg.engines
    }
    metrics_client = httpx.AsyncClient(timeout=10, trust_env=False) if cfg.metrics_url else None
    w: Writer | None = None
    interrupted = False
    t_start = time.time()
    try:
        await preflight(cfg, clients, headers)
        w = Writer(path)
        await _measure(cfg, w, run_id, clients, headers, metrics_client, t_start)
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


async def _measure(
    cfg: BenchConfig,
    w: Writer,
    run_id: str,
    clients: Mapping[str, httpx.AsyncClient],
    headers: Mapping[str, dict[str, str]],
    metrics_client: httpx.AsyncClient | None,
    t_start: float,
) -> None:
    real = [t for t in cfg.engines if not (t.aa_of and t.pin)]
    prompts = suite_mod.load(cfg.suite, cfg.prompt_lengths)
    notes: list[dict[str, Any]] = []
    # prompt tokens with each engine's tokenizer, before anything is generated
    counted: list[dict[str, Any]] = []
    for p in prompts:
        counts = await asyncio.gather(*(count_prompt_tokens(t, cfg.model or t.model, p.messages) for t in real))
        for t, (n, method) in zip(real, counts, strict=True):
            counted.append({"type": "prompt_tokens", "engine": t.name, "prompt": p.id, "length": p.length,
                            "lang": p.lang, "tokens": n, "method": method})  # fmt: skip
    # leave out what does not fit the smallest context per slot (prompt + the longest output)
    ctxs = [t.context_per_slot for t in real if t.context_per_slot]
    if ctxs:
        room = min(ctxs) - max((*cfg.output_lengths, cfg.max_tokens))
        # the largest count any engine gave; uncounted (no tokenizer endpoint): the class's size, with margin
        worst = {
            p.id: max([r["tokens"] for r in counted if r["prompt"] == p.id and r["tokens"]]
                      or [int(suite_mod.TARGET_TOKENS.get(p.length, 0) * 1.2)])
            for p in prompts
        }  # fmt: skip
        too_long = [p for p in prompts if worst[p.id] > room]
        if too_long:
            prompts = [p for p in prompts if p not in too_long]
            notes.append({"type": "note", "engine": None, "text": f"left out {len(too_long)} prompt(s) longer than "
                          f"{room} tokens (context per slot {min(ctxs)} − max_tokens): "
                          + ", ".join(f"{p.id} ({worst[p.id]})" for p in too_long)})  # fmt: skip
    if not prompts:
        raise ValueError("no prompt fits the engines' context per slot")
    cfg.prompt_lengths = tuple(pl for pl in cfg.prompt_lengths if any(p.length == pl for p in prompts)) or tuple(
        sorted({p.length for p in prompts}, key=suite_mod.length_rank)
    )
    cells = plan(cfg)
    max_tokens_all = sorted({c.max_tokens for c in cells})
    cfg_rec = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items() if k != "engines"}
    w.write({
        "type": "run", "version": RESULTS_VERSION, "run_id": run_id, "started": t_start, "config": cfg_rec,
        "engines": [_engine_record(cfg, t, max_tokens_all) for t in cfg.engines], "baseline": cfg.baseline,
        "through": cfg.through,
        "base": {"concurrency": 1, "max_tokens": cfg.max_tokens, "prompt_len": cfg.base_prompt_len},
        "cells": [asdict(c) for c in cells], "prompts": [{"id": p.id, "lang": p.lang, "length": p.length} for p in prompts],
        "memory_budget_bytes": cfg.memory_budget_bytes, "goodput": cfg.goodput, "python": sys.version.split()[0],
        "argv": cfg.argv or None, "min_effect": cfg.min_effect,
        "protocol": {"cell_warmup": "one wave per cell and engine server", "order": "williams"},
    })  # fmt: skip
    for rec in counted + notes:
        w.write(rec)

    n_prime = len(prompts) if cfg.cache in ("warm", "both") else 0
    servers = {t.url: t.kind for t in real if t.url}
    n_warm = sum(min(c.requests(cfg), c.concurrency) for c in cells) * len(servers)
    total = len(real) * (cfg.warmup + n_prime) + n_warm + len(cfg.engines) * sum(c.requests(cfg) * cfg.repeats
                                                                                for c in cells)  # fmt: skip
    prog = Progress(total, cfg.progress)
    mem = MemoryProbe(cfg.metrics_url)
    inflight = InFlight()
    busy = BusyWatch(servers, inflight)
    t0_ns = time.perf_counter_ns()

    async def fire(t: Target, prompt: Prompt, prefix: str, max_tokens: int, cold: bool) -> RequestOutcome:
        body = json.dumps(build_body(cfg, t, _with_prefix(prompt, prefix), max_tokens, cold=cold)).encode()
        server = t.url or ""
        inflight.up(server)
        try:
            return await send_one(clients[t.name], body, headers[t.name])
        finally:
            inflight.down(server)

    try:
        for t in real:  # warm-up: discarded from every figure (a second pass shares its engine's)
            prog.label = f"warm-up {t.name}"
            for i in range(cfg.warmup):
                p = prompts[i % len(prompts)]
                o = await fire(t, p, f"[{secrets.token_hex(4)} warmup {run_id}] ", cfg.max_tokens, True)
                w.write(request_record(t, o, t0_ns, phase="warmup", prompt=p.id))
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
                    prog.label = f"priming {t.name}"
                    for p in prompts:
                        o = await fire(t, p, "", cfg.max_tokens, False)
                        w.write(request_record(t, o, t0_ns, phase="prime", prompt=p.id))
                        prog.step()
            for j, cell in enumerate(phase_cells):
                await _run_cell(cfg, cell, j, prompts, run_id, w, prog, mem, metrics_client, fire, t0_ns, busy)
        for server in sorted(busy.unwatched):
            names = ", ".join(t.name for t in real if t.url == server)
            w.write({"type": "note", "engine": names, "text": f"foreign load not watched: {server} does not say "
                     "how many requests it is running"})  # fmt: skip
    finally:
        prog.close()
        await busy.aclose()


def _warm_jobs(cell: CellSpec, n: int, pool: Sequence[Prompt], run_id: str) -> list[tuple[Prompt, str]]:
    """One wave of the cell, fresh prefixes (cold) or the bare prompts (warm), to be discarded."""
    k = max(1, min(n, cell.concurrency))
    return [(pool[i % len(pool)], f"[{secrets.token_hex(4)} cellwarm {run_id}] " if cell.cache == "cold" else "")
            for i in range(k)]  # fmt: skip


async def _run_cell(
    cfg: BenchConfig,
    cell: CellSpec,
    index: int,
    prompts: Sequence[Prompt],
    run_id: str,
    w: Writer,
    prog: Progress,
    mem: MemoryProbe,
    metrics_client: httpx.AsyncClient | None,
    fire: Callable[[Target, Prompt, str, int, bool], Any],
    t0_ns: int,
    busy: BusyWatch,
) -> None:
    pool = _prompts_for(prompts, cell.prompt_len)
    n = cell.requests(cfg)
    warmed: set[str] = set()
    for t in cfg.engines:  # the cell's warm-up, once per engine server (an A/A twin shares its engine's)
        server = t.url or t.pin or t.name
        if server in warmed:
            continue
        warmed.add(server)
        prog.label = (
            f"{cell.cache} c={cell.concurrency} max_tokens={cell.max_tokens} prompt={cell.prompt_len} warm-up {t.name}"
        )
        prog.show()
        jobs = _warm_jobs(cell, n, pool, run_id)

        def warm_done(i: int, p: Prompt, prefix: str, o: RequestOutcome, t: Target = t) -> None:
            w.write(request_record(t, o, t0_ns, phase="warmup", **cell.key(), prompt=p.id))
            prog.step()

        await _run_repeat(cfg, t, _Cell(cell, -1, jobs, None), fire, warm_done)
    for rep in range(cfg.repeats):
        order = [cfg.engines[i] for i in williams(len(cfg.engines), index + rep)]
        # the same prompts, prefixes and arrival times on every engine in this repeat
        jobs = [(pool[i % len(pool)], _new_prefix("x" if cell.cache == "cold" else "", run_id)) for i in range(n)]
        offsets = arrivals(n, cell.rate, cfg.burstiness, seed=cfg.seed + rep) if cell.rate else None
        c = _Cell(cell, rep, jobs, offsets)
        # a second pass of an engine gets fresh prefixes: the same ones would be served from its prompt cache
        c_aa = _Cell(cell, rep, [(p, _new_prefix(pre, run_id)) for p, pre in jobs], offsets)
        for t in order:
            prog.label = (f"{cell.cache} c={cell.concurrency}" + (f" rate={cell.rate:g}/s" if cell.rate else "")
                          + f" max_tokens={cell.max_tokens} prompt={cell.prompt_len} rep {rep + 1}/{cfg.repeats} {t.name}")  # fmt: skip
            prog.show()

            def done(i: int, p: Prompt, prefix: str, o: RequestOutcome, t: Target = t, rep: int = rep) -> None:
                key = f"{p.id}#{prefix.strip()}" if prefix else f"{p.id}#{i}"
                w.write(request_record(t, o, t0_ns, phase="measure", **cell.key(), repeat=rep, index=i,
                                       prompt=p.id, key=key))  # fmt: skip
                prog.step()

            async with busy.repeat(t.url) as seen, mem.watch(metrics_client, t.pin or t.name) as box:
                outs, t_a, t_b = await _run_repeat(cfg, t, c_aa if t.aa_of else c, fire, done)
            prog.step(n - len(outs))  # requests the duration cut off
            rec = sample_record(t.name, cell, rep, outs, t_a, t_b, box["peak"], mem, cfg.goodput, t.pin or t.name)
            rec["foreign"] = seen.to_json()
            rec["position"] = order.index(t)
            w.write(rec)
