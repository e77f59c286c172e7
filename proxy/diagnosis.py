"""The diagnosis of one running engine, shared by ``enginemeter diagnose`` and ``serve``'s live section: how it was
launched, what its start-up log and its own endpoints say, the model file's header, the KV-cache formula, and
GPU memory -> whether the weights are resident and whether memory is the constraint. docs/diagnose.md.

Sources, each optional, each saying why when it cannot be read (``notes``):
- the engine's process: the one listening on the URL's port when the host is this machine
  (``proxy.gpu.attribution``), or a given pid: its command line (``/proc/PID/cmdline``) and its log (``--log``,
  else llama.cpp's ``--log-file``, else the file its stdout/stderr point to);
- the log, read from its last start by the kind's dialect (``proxy.engines``: ``parse_log``), and the engine's
  own endpoints (``startup``: llama.cpp ``/props``, SGLang ``/server_info``, vLLM ``/metrics``); the log wins;
- the model file: a GGUF header (``proxy.embedded.gguf_meta``; exact weights size and the attention shape), or
  an HF directory's ``config.json`` for the shape;
- GPU memory (``proxy.gpu.memory``): the devices and the engine's processes.

The KV-cache formula and the model's shape are ``proxy.engines.kvcache``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from proxy import engines
from proxy.embedded.gguf_meta import model_shape as gguf_shape
from proxy.embedded.gguf_meta import read_gguf
from proxy.engines.kvcache import KvEstimate, Shape, hf_shape, kv_estimate
from proxy.engines.llamacpp import ftype_name, launch_flags
from proxy.engines.startup import LogFacts, flag_value, last_launch, read_log
from proxy.gpu.attribution import is_local_host, listening_inodes, parent_pid, pids_holding
from proxy.gpu.memory import GpuMemory, MemoryReading
from proxy.types import EngineKind

PROC = Path("/proc")
#: below this share of the weights in GPU memory, the weights are not resident
RESIDENT_RATIO = 0.9
#: free GPU memory below max(this, 5 % of the device) makes memory the constraint
TIGHT_BYTES = 2**30


@dataclass(frozen=True)
class Judgement:
    """A yes/no the diagnosis reached (None: it cannot tell) and the reasoning, with its numbers."""

    value: bool | None
    why: str


@dataclass(frozen=True)
class ProcessFacts:
    pid: int | None = None
    argv: tuple[str, ...] = ()
    #: how it was found: "given", "listening on port N"
    how: str = ""
    note: str | None = None


@dataclass
class Diagnosis:
    url: str
    name: str = "engine"
    kind: EngineKind | None = None
    model: str | None = None
    build: str | None = None
    model_path: str | None = None
    process: ProcessFacts = field(default_factory=ProcessFacts)
    #: launch parameters read from the command line (llama.cpp: -c -b -ub -np -ngl -t -fa -ctk -ctv -kvu ...)
    flags: dict[str, Any] = field(default_factory=dict)
    log_path: str | None = None
    #: the start-up facts: the log's, filled in from the engine's own endpoints
    started: LogFacts = field(default_factory=LogFacts)
    shape: Shape | None = None
    kv: KvEstimate | None = None
    gpu: MemoryReading | None = None
    resident: Judgement | None = None
    memory: Judgement | None = None
    #: the probe requests' timing split (``enginemeter diagnose``; not in the live section)
    timing: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    #: GPU memory the engine may use (``--memory-budget``): memory is judged against it where it is tighter
    memory_budget_bytes: int | None = None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["started"] = {k: v for k, v in out["started"].items() if v not in (None, (), {})}
        out["gpu"] = self.gpu.to_json() if self.gpu is not None else None
        return out


# ---- gathering -------------------------------------------------------------------------------------------


async def gather(
    url: str,
    *,
    name: str = "engine",
    kind: EngineKind | None = None,
    log: Path | None = None,
    pid: int | None = None,
    memory: GpuMemory | None = None,
    timeout_s: float = 5.0,
    client: httpx.AsyncClient | None = None,
    budget_bytes: int | None = None,
) -> Diagnosis:
    """Everything the diagnosis can learn about the engine at ``url`` without generating a token. Blocking
    reads (``/proc``, the log, the model file, NVML) run in a thread. Never raises for an unreadable source:
    ``notes`` say what could not be read. ``client``: the engine's own (its auth), else one made here."""
    d = Diagnosis(url=url.rstrip("/"), name=name, kind=kind, memory_budget_bytes=budget_bytes)
    async with contextlib.AsyncExitStack() as stack:
        if client is None:
            client = await stack.enter_async_context(
                httpx.AsyncClient(base_url=d.url, timeout=timeout_s, trust_env=False)
            )
        c = client
        p = await engines.probe(c, timeout_s, kind=kind, full=True)
        d.kind = p.kind
        if p.error:
            d.notes.append(f"engine: {p.error}")
        if p.facts is not None:
            d.model, d.build, d.model_path = p.facts.model, p.facts.build, p.facts.model_path
        http = await engines.dialect(d.kind).startup(c, timeout_s) if d.kind is not None else LogFacts()
    await asyncio.to_thread(_local, d, http, log, pid, memory)
    return d


def _local(d: Diagnosis, http: LogFacts, log: Path | None, pid: int | None, memory: GpuMemory | None) -> None:
    d.process = find_process(d.url, pid)
    if d.process.note:
        d.notes.append(d.process.note)
    argv = d.process.argv
    if d.kind == "llamacpp" and argv:
        d.flags = launch_flags(argv)
    logged = LogFacts()
    path, why = (log, None) if log is not None else process_log(d.process.pid, argv)
    if path is not None:
        try:
            logged = engines.dialect(d.kind).parse_log(last_launch(read_log(path)))
            d.log_path = str(path)
            d.notes += logged.notes
        except OSError as exc:
            d.notes.append(f"cannot read the log {path}: {exc.strerror or exc}")
    elif why:
        d.notes.append(why)
    d.started = merge(logged, http)
    d.shape, shape_note = model_shape(d, argv)
    if shape_note:
        d.notes.append(shape_note)
    d.kv = kv_from(d)
    if memory is not None:
        d.gpu = memory.read(d.name, pid=d.process.pid, url=d.url if d.process.pid is None else None)
        if d.gpu.note:
            d.notes.append(f"GPU: {d.gpu.note}")
    d.resident = judge_resident(d, d.gpu)
    d.memory = judge_memory(d, d.gpu)


def merge(first: LogFacts, then: LogFacts) -> LogFacts:
    """``first``'s facts, with what it leaves None taken from ``then`` (evidence and notes joined)."""
    values = {f.name: getattr(first, f.name) for f in fields(LogFacts)}
    for f in fields(LogFacts):
        if f.name not in ("evidence", "notes") and values[f.name] in (None, ()):
            values[f.name] = getattr(then, f.name)
    values["evidence"] = {**then.evidence, **first.evidence}
    values["notes"] = tuple(dict.fromkeys((*first.notes, *then.notes)))
    return LogFacts(**values)


def find_process(url: str, pid: int | None = None, proc: Path = PROC) -> ProcessFacts:
    """The engine's process: ``pid``, else the one listening on the URL's port on this machine."""
    how = "given"
    if pid is None:
        parts = urlsplit(url)
        host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
        if not is_local_host(host):
            return ProcessFacts(note=f"{host} is not this machine: the process (command line, log) cannot be read")
        holders = pids_holding(listening_inodes(port, proc), proc)
        if not holders:
            return ProcessFacts(
                note=f"no process of ours listens on port {port} (another user's, or in a container?): "
                "its command line and log cannot be read; pass --log FILE"
            )
        pid = min(p for p in holders if parent_pid(p, proc) not in holders)
        how = f"listening on port {port}"
    try:
        raw = (proc / str(pid) / "cmdline").read_bytes()
    except OSError as exc:
        return ProcessFacts(pid, how=how, note=f"cannot read /proc/{pid}/cmdline: {exc.strerror or exc}")
    return ProcessFacts(pid, tuple(a.decode(errors="replace") for a in raw.split(b"\0") if a), how)


def process_log(pid: int | None, argv: tuple[str, ...], proc: Path = PROC) -> tuple[Path | None, str | None]:
    """The engine's log file: llama.cpp's ``--log-file``, else the regular file its stderr or stdout is."""
    if pid is None:
        return None, "no engine process found: no log to read (pass --log FILE)"
    named = flag_value(argv, "--log-file")
    if named:
        return _resolve(named, pid, proc), None
    seen = []
    for fd in (2, 1):
        try:
            target = os.readlink(proc / str(pid) / "fd" / str(fd))
        except OSError as exc:
            return None, f"cannot see where process {pid} writes its log ({exc.strerror or exc}): pass --log FILE"
        if target.startswith("/") and not target.startswith(("/dev/", "/proc/")) and Path(target).is_file():
            return Path(target.removesuffix(" (deleted)")), None
        seen.append(target)
    return None, (
        f"process {pid} writes its log to {seen[0]} (a terminal, pipe or journal), not a file: pass --log FILE "
        "(e.g. journalctl -u llama-server > FILE)"
    )


def _resolve(path: str, pid: int, proc: Path) -> Path:
    p = Path(path)
    if p.is_absolute():
        return p
    try:
        return Path(os.readlink(proc / str(pid) / "cwd")) / p
    except OSError:
        return p


# ---- the model and the KV cache ------------------------------------------------------------------------


def model_shape(d: Diagnosis, argv: tuple[str, ...]) -> tuple[Shape | None, str | None]:
    """The attention shape from the model file: the command line's ``-m`` / ``--model-path``, else the path
    the engine reports (a GGUF header, or an HF directory's config.json)."""
    named = flag_value(argv, "-m", "--model", "--model-path") if argv else None
    if d.kind == "vllm" and argv and len(argv) > 2 and argv[1] == "serve":
        named = named or argv[2]
    where = _resolve(named, d.process.pid, PROC) if named and d.process.pid else Path(named or d.model_path or "")
    if not str(where) or str(where) == ".":
        return None, "the model file is not known: no KV formula, no weights size"
    if where.is_file():
        try:
            h = read_gguf(where)
            s = gguf_shape(h)
        except Exception as exc:  # not a GGUF, truncated, a field missing: no shape, said so
            return None, f"cannot read the GGUF header of {where}: {exc}"
        shape = Shape(
            s.n_layer,
            s.n_head,
            s.kv_heads,
            s.head_dim_k,
            s.head_dim_v,
            f"GGUF header of {where}",
            s.sliding_window,
            h.n_params,
            h.weights_bytes,
            ftype_name(s.file_type),
        )
        return shape, None
    config = where / "config.json"
    if config.is_file():
        try:
            return hf_shape(json.loads(config.read_text()), str(config)), None
        except (ValueError, KeyError, TypeError) as exc:
            return None, f"cannot read the model shape from {config}: {exc}"
    return None, f"the model file {where} is not readable here: no KV formula, no weights size"


def kv_from(d: Diagnosis) -> KvEstimate | None:
    """The formula at the context the engine allocated: llama.cpp's whole ``-c`` (the log's ``n_ctx``, its KV
    cells, the command line, else slots x context per slot); SGLang/vLLM: their KV pool's tokens."""
    s, f = d.started, d.flags
    if d.shape is None:
        return None
    if d.kind == "llamacpp":
        per_slot = (s.slots or 0) * (s.context_per_slot or 0) if s.kv_unified is not True else s.context_per_slot
        candidates = [
            (s.context, "the log (llama_context: n_ctx)"),
            (s.kv_cache_tokens, "the log (KV cells x streams)"),
            (f.get("ctx_size") or None, "-c on the command line"),
            (per_slot, "slots x context per slot (/props)"),
        ]
    else:
        candidates = [(s.kv_cache_tokens, "the engine's KV pool (tokens)")]
    context, source = next(((int(c), w) for c, w in candidates if c), (0, ""))
    if not context:
        return None
    tk = str(f.get("cache_type_k") or _logged_type(s.kv_cache_type, 0) or ("f16" if d.kind == "llamacpp" else "auto"))
    tv = str(f.get("cache_type_v") or _logged_type(s.kv_cache_type, 1) or tk)
    unified = f.get("kv_unified") if "kv_unified" in f else s.kv_unified
    return kv_estimate(d.shape, context, source, tk, tv, slots=s.slots, unified=unified, reported=s.kv_cache_bytes)


def _logged_type(logged: str | None, i: int) -> str | None:
    if not logged:
        return None
    if logged.startswith("K "):  # "K q8_0, V f16"
        parts = [p.split()[-1] for p in logged.split(",")]
        return parts[i] if i < len(parts) else None
    return logged


# ---- judgements ------------------------------------------------------------------------------------------


def size(n: int | float | None) -> str:
    if n is None:
        return "?"
    if abs(n) < 2**20:
        return f"{n / 2**10:.1f} KiB" if abs(n) >= 2**10 else f"{n:.0f} B"
    return (
        f"{n / 2**30:.2f} GiB"
        if abs(n) >= 2**30
        else f"{n / 2**20:.1f} MiB"
        if abs(n) >= 10 * 2**20
        else f"{n / 2**20:.2f} MiB"
    )


def judge_resident(d: Diagnosis, gpu: MemoryReading | None) -> Judgement:
    """Are the weights in GPU memory? Layers offloaded (the log) and the process's GPU memory against the
    weights' size (the GGUF header, else what the engine reports)."""
    s = d.started
    weights = d.shape.weights_bytes if d.shape and d.shape.weights_bytes else s.weights_bytes
    reasons, verdict = [], None
    no_gpu = gpu is not None and not gpu.devices
    if s.layers_offloaded is not None and s.layers_total and not (no_gpu and s.layers_offloaded == 0):
        if s.layers_offloaded < s.layers_total:
            ngl = d.flags.get("gpu_layers", "default")
            reasons.append(f"only {s.layers_offloaded}/{s.layers_total} layers are on the GPU (-ngl {ngl})")
            verdict = False
        else:
            reasons.append(f"all {s.layers_total} layers are on the GPU")
            verdict = True
    engine = gpu.engine_bytes if gpu is not None and gpu.devices else None
    if engine is not None and weights:
        if engine < RESIDENT_RATIO * weights:
            reasons.append(
                f"the process holds {size(engine)} of GPU memory, less than the {size(weights)} of weights: layers "
                "are off the GPU (-ngl too low) or read through mmap"
            )
            verdict = False
        else:
            reasons.append(f"the process holds {size(engine)} of GPU memory, the weights are {size(weights)}")
            verdict = True if verdict is None else verdict
    if verdict is None:
        if no_gpu and s.layers_offloaded == 0:
            return Judgement(
                None, "no GPU here and no GPU backend in this llama-server: the weights are in host memory"
            )
        why = "cannot tell: " + ("no GPU reading" if engine is None else "the weights' size is not known")
        return Judgement(
            None, why + ("" if s.layers_total else ", and the log does not say how many layers are offloaded")
        )
    return Judgement(verdict, "; ".join(reasons))


def judge_memory(d: Diagnosis, gpu: MemoryReading | None) -> Judgement:
    """Is GPU memory the constraint? Free memory on the engine's GPU(s) against what another slot's KV would need."""
    if gpu is None or not gpu.devices:
        return Judgement(
            None, "cannot tell: no GPU reading" + (f" ({gpu.note})" if gpu is not None and gpu.note else "")
        )
    devs = gpu.on_engine_gpus()
    total, free = sum(x.total_bytes for x in devs), sum(x.free_bytes for x in devs)
    used = total - free
    where = ", ".join(f"GPU {x.index} {x.name}" for x in devs)
    budget = d.memory_budget_bytes
    if budget is not None and budget < total:  # the engine's share: the budget less what it holds already
        held_now = gpu.engine_bytes if gpu.engine_bytes is not None else used
        free, total = max(0, min(free, budget - held_now)), budget
        used = total - free
        where += f" (the --memory-budget {size(budget)})"
    tight = max(TIGHT_BYTES, 0.05 * total)
    held = f"; the engine holds {size(gpu.engine_bytes)}" if gpu.engine_bytes is not None else ""
    frac = d.started.memory_fraction
    if d.kind in ("sglang", "vllm") and frac:
        pool = d.started.kv_cache_tokens
        per_req = d.started.context_per_slot
        room = (
            f" (KV pool {pool:,} tokens = {pool // per_req} requests at full context {per_req:,})"
            if pool and per_req
            else ""
        )
        return Judgement(
            free < tight,
            f"{d.kind} took {frac:g} of the GPU up front{room}; {size(free)} of {size(total)} free on {where}{held}: "
            "its free memory does not measure its need — memory is the constraint only when the KV pool fills "
            "under load",
        )
    if free < tight:
        return Judgement(True, f"memory is the constraint: {size(free)} free of {size(total)} on {where}{held}")
    more = ""
    if d.kv and d.kv.per_slot_bytes:
        n = int(free // d.kv.per_slot_bytes)
        room = f"about {n:,}" if n < 1000 else "over 1,000"  # a tiny model's slot is KiB: the count says nothing
        more = f"; room for {room} more slots at {size(d.kv.per_slot_bytes)} of KV each"
    return Judgement(
        False,
        f"memory is not the constraint: {size(free)} free of {size(total)} ({size(used)} used) on {where}{held}{more}",
    )


def with_gpu(d: Diagnosis, gpu: MemoryReading | None) -> Diagnosis:
    """``d`` judged again with another GPU reading (the live section: the proxy's own sampler's)."""
    return replace(d, gpu=gpu, resident=judge_resident(d, gpu), memory=judge_memory(d, gpu))
