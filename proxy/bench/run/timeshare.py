"""The time-shared bench: one engine on the GPU at a time, each running the whole suite alone.

With any launched engine (``--launch NAME='COMMAND'``) the run is a sequence of *stints*: the baseline, each
candidate, then the baseline again (launched anew: the A/A pass measures restart-to-restart noise, the noise a
user's two separate runs have; ``--aa off`` leaves it out). A launched engine is started by ``proxy.procs.launch``
(its own process group, its log in ``<out>/engines/NAME.log``, ready by its kind's own signal), probed and sent
the preflight request once ready, measured, stopped, and its GPU memory must come back before the next one
starts; an engine given by URL (resident) is measured in its stint the same way and left running.

Every stint runs the same ``Plan`` (``proxy.bench.run.schedule``), made once on the baseline: the i-th request of a
(cell, repeat) is the same on every engine, so the paired statistics apply unchanged. A relaunched engine starts
with an empty prompt cache and gets the very same requests; a resident baseline measured again gets fresh
cold prefixes. Per stint: warm-ups, cache phases, per-cell warm-ups, repeats and the foreign-load watch, as for
resident engines (``proxy.bench.run.measure``); no contention is possible between the bench's engines.

Each stint writes a ``stint`` record: engine, role (baseline | candidate | aa), when it ran, the GPU processes
that existed before it started and, for a launched engine, the launch (verbatim command, log path, launch to
ready, GPU memory before / loaded idle / peak while generating / after stop, whether it came back).

Failures: a launch that exits or is not ready in time raises ``LaunchError`` with the log's last lines; memory
that does not come back raises ``MemoryNotBack`` (the next engine would not run alone, so the bench stops); a
failed preflight raises ``PreflightError``. Each stops the engine it started first; what finished stays in
``results.jsonl``. Ctrl-C stops whatever was started (``proxy.procs.process``).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from proxy.bench import suite
from proxy.bench.quality.phases import QualityRun
from proxy.bench.run.benchconfig import BenchConfig, CellSpec, Target
from proxy.bench.run.client import Writer
from proxy.bench.run.measure import Ctx, measure
from proxy.bench.run.memprobe import MemoryProbe, MemorySource, ProcessMemory
from proxy.bench.run.prepare import (
    client_for,
    count_tokens,
    engine_record,
    headers_for,
    preflight,
    quality_engine,
    quality_for,
    run_record,
)
from proxy.bench.run.schedule import Plan, make_plan, unfit_cells
from proxy.bench.run.targets import probe
from proxy.bench.suite import Prompt
from proxy.procs.launch import Launched, Launcher, fit_memory_share, parse_launch
from proxy.procs.process import LaunchError
from proxy.redact import redact_command


class MemoryNotBack(LaunchError):
    """A stopped engine's GPU memory did not come back: the next engine would not run alone."""


@dataclass(frozen=True)
class Stint:
    target: Target
    role: str  # baseline | candidate | aa


def stints(cfg: BenchConfig) -> list[Stint]:
    """Baseline, candidates in the order given, then the baseline again (unless ``aa == "off"``)."""
    base = next(t for t in cfg.engines if t.name == cfg.baseline)
    out = [Stint(base, "baseline"), *(Stint(t, "candidate") for t in cfg.engines if t is not base)]
    if cfg.aa != "off":
        twin = replace(base, name=f"{base.name}-aa", aa_of=base.name, pin=None, info={})
        cfg.engines.append(twin)
        out.append(Stint(twin, "aa"))
    return out


@dataclass
class _Run:
    cfg: BenchConfig
    run_id: str
    t_start: float
    suite: list[Prompt]
    say: Callable[[str], None]
    clients: dict[str, httpx.AsyncClient] = field(default_factory=dict)
    headers: dict[str, dict[str, str]] = field(default_factory=dict)
    w: Writer | None = None
    plan: Plan | None = None
    ctx: Ctx | None = None
    metrics_client: httpx.AsyncClient | None = None

    #: what fitting the launched engines' memory shares to the budget did, in words (``_fit_shares``)
    share_notes: list[str] = field(default_factory=list)
    #: the quality phases after each stint's cells (``--agreement``, ``--eval``), made at the first
    quality: QualityRun | None = None

    @property
    def path(self) -> Path:
        return self.cfg.out / "results.jsonl"


async def _fit_shares(cfg: BenchConfig, launcher: Launcher, say: Callable[[str], None]) -> list[str]:
    """With ``--memory-budget``: each launched engine whose memory is a setting gets the share that fits the budget
    on this card, or its own share checked (``proxy.procs.launch.fit_memory_share``), before anything is launched."""
    if not cfg.memory_budget_bytes or not any(t.launch for t in cfg.engines):
        return []
    reading = await asyncio.to_thread(launcher.memory.read)
    if not reading.devices:
        return []
    total = reading.devices[0].total_bytes  # where an engine goes unless CUDA_VISIBLE_DEVICES says otherwise
    out = []
    for t in cfg.engines:
        if t.launch:
            t.launch, note = fit_memory_share(t.name, t.launch, cfg.memory_budget_bytes, total)
            if note:
                say(f"enginemeter bench: {note}")
                out.append(note)
    return out


async def run_time_shared(cfg: BenchConfig, say: Callable[[str], None], launcher: Launcher | None = None) -> Path:
    launcher = launcher or Launcher(cfg.out, ready_timeout_s=cfg.launch_timeout_s)
    run = _Run(cfg, secrets.token_hex(4), time.time(), suite.load(cfg.suite, cfg.prompt_lengths), say)
    if cfg.metrics_url:
        run.metrics_client = httpx.AsyncClient(timeout=10, trust_env=False)
    run.share_notes = await _fit_shares(cfg, launcher, say)
    order = stints(cfg)
    interrupted = False
    stopped: dict[str, Any] | None = None
    try:
        for i, s in enumerate(order):
            await _stint(run, s, i, len(order), launcher)
    except (asyncio.CancelledError, KeyboardInterrupt):
        interrupted = True
        raise
    except LaunchError as exc:
        stopped = {"cause": str(exc).split("\n", 1)[0]}
        raise
    finally:
        for c in run.clients.values():
            await c.aclose()
        if run.metrics_client is not None:
            await run.metrics_client.aclose()
        if run.w is not None:
            run.w.write(
                {"type": "end", "interrupted": interrupted, "duration_s": time.time() - run.t_start, "stopped": stopped}
            )
            run.w.close()
            say(f"enginemeter bench: {'interrupted; ' if interrupted else ''}results in {run.path}")
    return run.path


async def _stint(run: _Run, s: Stint, i: int, n: int, launcher: Launcher) -> None:
    t = s.target
    label = f"[{i + 1}/{n} {t.name}] "
    others = await asyncio.to_thread(_gpu_processes, launcher)
    rec: dict[str, Any] = {
        "type": "stint",
        "engine": t.name,
        "role": s.role,
        "index": i,
        "started": time.time(),
        "gpu_processes_before": others,
        "launch": None,
    }
    if not t.launch:
        await _measure(run, s, MemoryProbe(run.cfg.metrics_url), label, fresh=s.role == "aa")
        rec["ended"] = time.time()
        _write(run, rec)
        return
    spec = parse_launch(t.name, t.launch)  # a fresh {port} for every launch
    run.say(f"enginemeter bench: launching {t.name} ({s.role}): {redact_command(t.launch)}")
    try:
        eng = await launcher.start(spec)
    except LaunchError as exc:
        _write(
            run,
            {
                **rec,
                "ended": time.time(),
                "failed": str(exc).split("\n", 1)[0],
                "log": str(launcher.log_path(spec)),
                "command": redact_command(t.launch),
            },
        )
        raise
    mem = ProcessMemory(launcher.memory, t.name, eng.pid)
    try:
        t.url, t.kind = eng.url, eng.kind
        run.say(f"enginemeter bench: {t.name} ready after {eng.ready_s or 0:.1f} s at {eng.url}")
        await _measure(run, s, mem, label, fresh=False, log=launcher.log_path(spec))
    finally:
        await asyncio.shield(launcher.stop(eng))
        rec["ended"] = time.time()
        rec["launch"] = _launch_record(eng, mem)
        _write(run, rec)
    if eng.memory_returned is False:
        raise MemoryNotBack(
            f"{t.name}: GPU memory did not come back within {launcher.memory_timeout_s:g} s after "
            f"it stopped ({_held(eng)}): the next engine would not run alone, so the bench stops "
            "here — find what holds the GPU (nvidia-smi) and run again"
        )


def _gpu_processes(launcher: Launcher) -> int | None:
    """GPU compute processes now (None: no GPU readings here)."""
    return len(launcher.memory.gpu_pids()) if launcher.memory.available else None


def _held(eng: Launched) -> str:
    before, after = eng.memory.get("before"), eng.memory.get("after")
    gib = 2**30
    if before is None or after is None or before.device_used_bytes is None or after.device_used_bytes is None:
        return "no reading"
    return (
        f"device used {after.device_used_bytes / gib:.2f} GiB after vs {before.device_used_bytes / gib:.2f} GiB before"
    )


def _launch_record(eng: Launched, mem: ProcessMemory) -> dict[str, Any]:
    out = eng.record()
    out["pid"] = eng.pid
    out["memory"]["peak"] = {"engine_bytes": mem.peak_bytes, "device_used_bytes": mem.peak_device_bytes}
    return out


def _write(run: _Run, rec: dict[str, Any]) -> None:
    if run.w is not None:
        run.w.write(rec)


async def _measure(run: _Run, s: Stint, mem: MemorySource, label: str, *, fresh: bool, log: Path | None = None) -> None:
    """Probe (a launched engine's ``log`` too), preflight, count the prompts' tokens, plan (first stint) or fit
    the plan (later ones), measure."""
    cfg, t = run.cfg, s.target
    await probe(t, log=log)
    run.clients[t.name] = client_for(cfg, t)
    run.headers[t.name] = headers_for(cfg, t)
    await preflight(cfg, [t], run.clients, run.headers)
    counted = await count_tokens(cfg, [t], run.suite)
    skip: set[CellSpec] = set()
    notes: list[dict[str, Any]] = []
    if run.plan is None:
        seeded = all(x.launch for x in cfg.engines)  # fresh processes only: nothing cached from an earlier run
        pl = make_plan(
            cfg, run.suite, counted, [t.context_per_slot] if t.context_per_slot else [], run.run_id, seeded=seeded
        )
        run.plan, notes = (
            pl,
            [
                *pl.notes,
                *({"type": "note", "engine": n.split(":", 1)[0], "text": n.split(": ", 1)[1]} for n in run.share_notes),
            ],
        )
        run.w = Writer(run.path)
        mt = sorted({c.max_tokens for c in pl.cells})
        run.w.write(run_record(cfg, run.run_id, run.t_start, pl, [engine_record(cfg, x, mt) for x in cfg.engines]))
        run.ctx = Ctx(cfg, run.w, run.run_id, time.perf_counter_ns(), run.clients, run.headers, run.metrics_client)
    else:
        skip, note = unfit_cells(cfg, run.plan, counted, t.context_per_slot, t.name)
        notes = [note] if note else []
    assert run.w is not None and run.ctx is not None and run.plan is not None
    for r in counted + notes:
        run.w.write(r)
    mt = sorted({c.max_tokens for c in run.plan.cells})
    run.w.write({"type": "engine", **engine_record(cfg, t, mt), "role": s.role})
    try:
        await measure(run.ctx, [t], run.plan, mem, fresh_prefixes=lambda _: fresh, skip=skip, label=label)
        if run.quality is None:
            run.quality = quality_for(cfg, run.plan.prompts, run.w.write, run.say)
        await quality_engine(run.quality, cfg, t, run.clients[t.name], run.headers[t.name])
    finally:
        await run.clients.pop(t.name).aclose()
