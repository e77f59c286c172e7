"""``enginemeter tune``'s table: one row per setting — its memory peak, load time, prompt eval and decode per token,
tok/s and TTFT alone and under load, and its regime answers against the first setting. Pure.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from proxy.bench.verdict.data import Data
from proxy.bench.verdict.inputs import Cell, Sample
from proxy.notation import gib, seconds


@dataclass
class Row:
    name: str
    value: str
    command: str
    memory_peak_bytes: int | None = None
    load_s: float | None = None
    prompt_ms_per_token: float | None = None
    decode_ms_per_token: float | None = None
    single_tps: tuple[float, float, float] | None = None  # median, min, max over repeats
    ttft_single_s: float | None = None
    concurrency: int | None = None
    concurrent_tps: tuple[float, float, float] | None = None
    ttft_load_s: float | None = None
    single: str = "baseline"  # the regime answers against the first setting
    under_load: str = "baseline"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "value": self.value,
            "command": self.command,
            "memory_peak_bytes": self.memory_peak_bytes,
            "load_s": self.load_s,
            "prompt_eval_ms_per_token": self.prompt_ms_per_token,
            "decode_ms_per_token": self.decode_ms_per_token,
            "single_tps": self.single_tps[0] if self.single_tps else None,
            "ttft_single_s": self.ttft_single_s,
            "concurrency": self.concurrency,
            "concurrent_tps": self.concurrent_tps[0] if self.concurrent_tps else None,
            "ttft_under_load_s": self.ttft_load_s,
            "single_request": self.single,
            "under_load": self.under_load,
        }


def _med(vals: Sequence[float | None]) -> float | None:
    v = [float(x) for x in vals if isinstance(x, int | float)]
    return statistics.median(v) if v else None


def _spread(vals: Sequence[float | None]) -> tuple[float, float, float] | None:
    v = [float(x) for x in vals if isinstance(x, int | float)]
    return (statistics.median(v), min(v), max(v)) if v else None


def _ms(x: float | None) -> str:
    """A time in the one notation (``proxy.notation.seconds``)."""
    return "–" if x is None else seconds(x)


def table(flag: str, settings: Sequence[Row]) -> tuple[list[str], list[list[str]]]:
    """The tune's table: a header and one row of figures per setting."""
    conc = next((r.concurrency for r in settings if r.concurrency), None)
    header = [
        flag,
        "memory peak",
        "load",
        "prompt eval",
        "decode",
        "single tok/s",
        f"c={conc or '?'} tok/s",
        "TTFT c=1 (median)",  # a median of the repeats' medians: the verdict's tables show means, and say so
        f"TTFT c={conc or '?'} (median)",
        "single request",
        "under load",
    ]
    rows = []
    for r in settings:
        rows.append(
            [
                r.value,
                gib(r.memory_peak_bytes) if r.memory_peak_bytes is not None else "unknown",
                seconds(r.load_s) if r.load_s is not None else "–",
                f"{r.prompt_ms_per_token:.2f} ms/token" if r.prompt_ms_per_token is not None else "–",
                f"{r.decode_ms_per_token:.2f} ms/token" if r.decode_ms_per_token is not None else "–",
                f"{r.single_tps[0]:.0f}" if r.single_tps else "–",
                f"{r.concurrent_tps[0]:.0f}" if r.concurrent_tps else "–",
                _ms(r.ttft_single_s),
                _ms(r.ttft_load_s),
                r.single,
                r.under_load,
            ]
        )
    return header, rows


def setting_rows(d: Data, names: Sequence[str], values: Sequence[str], commands: Sequence[str]) -> list[Row]:
    """One row per setting: its memory peak, load time, per-token prompt eval and decode at c=1, and its
    tok/s and TTFT alone and at the highest concurrency measured (the base cell of the judged cache)."""
    r = d.results
    judged = "cold" if any(s.cell.cache == "cold" for s in r.samples) else "warm"
    base = Cell(judged, 1, r.base_max_tokens or 0, r.base_prompt_len or "")
    load = [
        s.cell
        for s in r.samples
        if s.cell.cache == judged
        and s.cell.concurrency > 1
        and s.cell.rate is None
        and s.cell.max_tokens == base.max_tokens
        and s.cell.prompt_len == base.prompt_len
    ]
    top = max(load, key=lambda c: c.concurrency, default=None)
    stints = {s.get("engine"): s for s in d.stints if s.get("role") != "aa"}
    out = []
    for name, value, command in zip(names, values, commands, strict=True):
        mine: list[Sample] = [s for s in r.samples if s.engine == name]
        single = [s for s in mine if s.cell == base]
        under = [s for s in mine if s.cell == top]
        la = (stints.get(name) or {}).get("launch") or {}
        peak = ((la.get("memory") or {}).get("peak") or {}).get("engine_bytes")
        if peak is None:
            peaks = [s.gpu_mem_peak_bytes for s in mine if s.gpu_mem_peak_bytes is not None]
            peak = max(peaks) if peaks else None
        prompt = _prompt_ms_per_token(d, name, base)
        tpot = _med([s.tpot_s for s in single])
        out.append(
            Row(
                name,
                value,
                command,
                peak,
                la.get("ready_s"),
                _med(prompt),
                tpot * 1000 if tpot else None,
                _spread([1 / s.tpot_s for s in single if s.tpot_s]),
                _med([s.ttft_s for s in single]),
                top.concurrency if top else None,
                _spread([s.output_tps for s in under]),
                _med([s.ttft_s for s in under]),
            )
        )
    return out


def _prompt_ms_per_token(d: Data, name: str, base: Cell) -> list[float]:
    """The engine's own prompt-eval time per token (llama.cpp's timings) of each measured request at ``base``."""
    out = []
    for q in d.requests:
        if (
            q.get("engine") == name
            and q.get("phase") == "measure"
            and q.get("concurrency") == 1
            and q.get("cache") == base.cache
            and q.get("prompt_len") == base.prompt_len
        ):
            t = q.get("engine_timings") or {}
            if t.get("prompt_ms") is not None and t.get("prompt_n"):
                out.append(float(t["prompt_ms"]) / float(t["prompt_n"]))
    return out
