"""The report's section on time-shared runs: which engine ran when, that each ran alone, each launch's command
(verbatim), log, time from launch to ready and GPU memory at its four moments. Pure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from proxy.bench.report.blocks import Block
from proxy.notation import gib

_ROLE = {"baseline": "baseline", "candidate": "candidate", "aa": "A/A: the baseline again"}


def _mem(m: Mapping[str, Any] | None, key: str) -> str:
    if not m:
        return "–"
    v = m.get(key)
    if v is None:
        return "unknown"
    return gib(v)


def _device(m: Mapping[str, Any] | None) -> int | None:
    if not m:
        return None
    devs = m.get("devices") or []
    return sum(int(d.get("used_bytes") or 0) for d in devs) if devs else None


def launch_rows(stints: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    rows = []
    for s in stints:
        la = s.get("launch") or {}
        mem = la.get("memory") or {}
        before, idle, peak, after = (mem.get(k) for k in ("before", "idle", "peak", "after"))
        back = {True: "yes", False: "**no**", None: "unknown"}[la.get("memory_returned")] if la else "–"
        ready = (
            f"{la['ready_s']:.1f} s" if la.get("ready_s") is not None else ("**failed**" if s.get("failed") else "–")
        )
        rows.append(
            [
                str(s.get("engine")),
                _ROLE.get(str(s.get("role")), str(s.get("role"))),
                "launched" if la or s.get("failed") else "resident",
                ready,
                gib(_device(before)) if la else "–",
                _mem(idle, "engine_bytes"),
                _mem(peak, "engine_bytes"),
                gib(_device(after)) if la else "–",
                back,
                "unknown" if s.get("gpu_processes_before") is None else str(s["gpu_processes_before"]),
                f"`{la.get('log') or s.get('log')}`" if la.get("log") or s.get("log") else "–",
            ]
        )
    return rows


def timeshared_blocks(stints: Sequence[Mapping[str, Any]], stopped: str | None) -> list[Block]:
    if not stints:
        return []
    out = [Block("h2", "One engine at a time")]
    order = " → ".join(str(s.get("engine")) for s in stints)
    alone = [s for s in stints if s.get("gpu_processes_before") == 0]
    out.append(
        Block(
            "p",
            f"Time-shared run: {order}. Each engine ran the whole suite alone, the same requests in the "
            "same order; a launched engine was stopped and its GPU memory back before the next started, so "
            "the engines never contended for the GPU (no contention flag applies). "
            + (
                f"{len(alone)} of {len(stints)} found no other process on the GPU when they started."
                if any(s.get("gpu_processes_before") is not None for s in stints)
                else ""
            ),
        )
    )
    if stopped:
        out.append(Block("p", f"**Stopped early**: {stopped}"))
    out.append(
        Block(
            "table",
            header=[
                "engine",
                "role",
                "how",
                "launch → ready",
                "GPU used before",
                "engine: loaded, idle",
                "engine: peak generating",
                "GPU used after stop",
                "memory back",
                "other GPU processes",
                "log",
            ],
            rows=launch_rows(stints),
        )
    )
    notes = []
    memory_notes: dict[str, list[str]] = {}
    for s in stints:
        la = s.get("launch") or {}
        cmd = la.get("command") or s.get("command")
        if cmd:
            notes.append(f"{s.get('engine')}: `{cmd}`")
        note = ((la.get("memory") or {}).get("idle") or {}).get("note")
        if note:
            memory_notes.setdefault(str(note), []).append(str(s.get("engine")))
        if s.get("failed"):
            notes.append(f"{s.get('engine')}: launch failed — {s['failed']}")
    if notes:
        out.append(Block("p", "Commands, verbatim (`{port}`: a free port chosen at each launch):"))
        out.append(Block("ul", items=notes))
    for note, names in memory_notes.items():
        out.append(Block("p", f"GPU memory of {', '.join(names)}: {note}."))
    return out


def launches_json(stints: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The stints for verdict.json: engine, role, load time, memory (engine bytes) at each moment."""
    out = []
    for s in stints:
        la = s.get("launch") or {}
        mem = la.get("memory") or {}
        out.append(
            {
                "engine": s.get("engine"),
                "role": s.get("role"),
                "launched": bool(la),
                "command": la.get("command"),
                "log": la.get("log"),
                "ready_s": la.get("ready_s"),
                "memory_bytes": {k: (mem.get(k) or {}).get("engine_bytes") for k in ("idle", "peak")}
                | {"before_device": _device(mem.get("before")), "after_device": _device(mem.get("after"))},
                "memory_returned": la.get("memory_returned"),
                "gpu_processes_before": s.get("gpu_processes_before"),
                "failed": s.get("failed"),
            }
        )
    return out
