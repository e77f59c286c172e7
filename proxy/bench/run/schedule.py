"""What every engine is sent, planned once per run: the prompts that fit, the cells, and for every cell repeat the
requests in order (prompt, cold-cache prefix) and their arrival times. Pure apart from the random prefixes.

Planned once, so the i-th request of a (cell, repeat) is the same on every engine — whether the engines run side
by side (resident: one repeat of each engine after the other) or one at a time (launched: each engine runs the
whole suite alone): the paired statistics need nothing else. A second pass of an engine whose prompt cache may
still hold the first pass's prefixes (the A/A twin of a resident engine) gets ``aa_jobs``: the same prompts with
fresh prefixes of the same length. A relaunched engine starts with an empty cache and gets ``jobs`` themselves.
"""

from __future__ import annotations

import hashlib
import json
import random
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.bench.run.benchconfig import BenchConfig, CellSpec, plan
from proxy.bench.suite import TARGET_TOKENS, Prompt, length_rank
from proxy.bench.verdict.workload import arrivals

Job = tuple[Prompt, str]


def prompts_for(prompts: Sequence[Prompt], length: str) -> list[Prompt]:
    """The pool a cell draws from: its length class (every prompt when the class has none)."""
    return [p for p in prompts if p.length == length] or list(prompts)


def new_prefix(run_id: str, what: str = "bench", rng: random.Random | None = None) -> str:
    """A unique cold-cache prefix, the same length every time (the same token count on every engine); drawn from
    ``rng`` when given (a run of launched engines: the same prefixes in every run with the same seed)."""
    tag = f"{rng.getrandbits(32):08x}" if rng is not None else secrets.token_hex(4)
    return f"[{tag} {what} {run_id}] "


@dataclass(frozen=True)
class RepPlan:
    jobs: tuple[Job, ...]
    #: the same prompts with fresh prefixes (cold cells): for a second pass on an engine that keeps its cache
    aa_jobs: tuple[Job, ...]
    #: open loop: each request's arrival time from the start of the repeat; None: closed loop
    offsets: tuple[float, ...] | None


@dataclass
class Plan:
    prompts: list[Prompt]
    cells: list[CellSpec]
    reps: dict[tuple[CellSpec, int], RepPlan] = field(default_factory=dict)
    notes: list[dict[str, Any]] = field(default_factory=list)
    #: the cold prefixes come from the seed (every engine launched), not from this run's random id
    seeded: bool = False


def prompt_digests(prompts: Iterable[Prompt]) -> dict[str, str]:
    """Prompt id -> a short hash of its class and messages: two runs sent the same prompt when they match."""
    out = {}
    for p in prompts:
        doc = json.dumps([p.length, list(p.messages)], ensure_ascii=False, sort_keys=True)
        out[p.id] = hashlib.sha256(doc.encode()).hexdigest()[:16]
    return out


def too_long(
    cfg: BenchConfig, prompts: Sequence[Prompt], counted: Sequence[Mapping[str, Any]], contexts: Sequence[int]
) -> tuple[list[Prompt], int | None, dict[str, int]]:
    """(prompts longer than the smallest context per slot less the longest output, the room, worst counts)."""
    if not contexts:
        return [], None, {}
    room = min(contexts) - max((*cfg.output_lengths, cfg.max_tokens))
    # the largest count any engine gave; uncounted (no tokenizer endpoint): the class's size, with margin
    worst = {
        p.id: max(
            [r["tokens"] for r in counted if r["prompt"] == p.id and r["tokens"]]
            or [int(TARGET_TOKENS.get(p.length, 0) * 1.2)]
        )
        for p in prompts
    }
    return [p for p in prompts if worst[p.id] > room], room, worst


def make_plan(
    cfg: BenchConfig,
    prompts: Sequence[Prompt],
    counted: Sequence[Mapping[str, Any]],
    contexts: Sequence[int],
    run_id: str,
    *,
    seeded: bool = False,
) -> Plan:
    """Leave out what does not fit (a note), then plan the cells and every repeat's requests. ``seeded``: the cold
    prefixes come from ``cfg.seed`` — only where every engine is a fresh process (launched), which holds nothing
    of an earlier run in its prompt cache; then two runs with the same seed send the very same requests."""
    rng = random.Random(f"enginemeter cold prefixes {cfg.seed}") if seeded else None
    tag = f"{cfg.seed & 0xFFFFFFFF:08x}" if seeded else run_id
    notes: list[dict[str, Any]] = []
    out, room, worst = too_long(cfg, prompts, counted, contexts)
    kept = [p for p in prompts if p not in out]
    if out:
        notes.append(
            {
                "type": "note",
                "engine": None,
                "text": f"left out {len(out)} prompt(s) longer than {room} "
                f"tokens (context per slot {min(contexts)} − max_tokens): "
                + ", ".join(f"{p.id} ({worst[p.id]})" for p in out),
            }
        )
    if not kept:
        raise ValueError("no prompt fits the engines' context per slot")
    cfg.prompt_lengths = tuple(pl for pl in cfg.prompt_lengths if any(p.length == pl for p in kept)) or tuple(
        sorted({p.length for p in kept}, key=length_rank)
    )
    pl = Plan(kept, plan(cfg), notes=notes, seeded=seeded)
    for cell in pl.cells:
        pool = prompts_for(kept, cell.prompt_len)
        n = cell.requests(cfg)
        for rep in range(cfg.repeats):
            cold = cell.cache == "cold"
            jobs = tuple((pool[i % len(pool)], new_prefix(tag, rng=rng) if cold else "") for i in range(n))
            aa = tuple((p, new_prefix(tag, rng=rng) if pre else "") for p, pre in jobs)
            offsets = arrivals(n, cell.rate, cfg.burstiness, seed=cfg.seed + rep) if cell.rate else None
            pl.reps[(cell, rep)] = RepPlan(jobs, aa, tuple(offsets) if offsets is not None else None)
    return pl


def unfit_cells(
    cfg: BenchConfig, pl: Plan, counted: Sequence[Mapping[str, Any]], context: int | None, engine: str
) -> tuple[set[CellSpec], dict[str, Any] | None]:
    """Cells of a plan made on another engine whose prompts do not fit this engine's context per slot (an engine
    launched later with a smaller context): left out for it, with a note."""
    out, room, worst = too_long(cfg, pl.prompts, counted, [context] if context else [])
    if not out:
        return set(), None
    ids = {p.id for p in out}
    cells = {c for c in pl.cells if any(p.id in ids for p in prompts_for(pl.prompts, c.prompt_len))}
    note = {
        "type": "note",
        "engine": engine,
        "text": f"{len(cells)} cell(s) left out on {engine}: {len(out)} "
        f"prompt(s) longer than its {room} tokens (context per slot {context} − max_tokens): "
        + ", ".join(f"{p.id} ({worst[p.id]})" for p in out),
    }
    return cells, note
