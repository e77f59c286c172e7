"""Bench results (JSONL) -> verdict + ``report.md`` + self-contained ``report.html`` + PNG charts.

The report is built from whatever the JSONL holds, so an interrupted bench still gets one. Charts need
matplotlib (the ``report`` extra, Agg backend); without it the report says so and has tables only.
The document is built once as a list of blocks and rendered twice (Markdown, HTML), so both say the same.
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import json
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proxy.bench.verdict import Cell, EngineInfo, Results, Sample, Verdict, decide_all

# ---- loading --------------------------------------------------------------------------------------


@dataclass
class Data:
    """Everything a report needs, whatever produced it (bench JSONL or the proxy's comparison log)."""

    title: str
    results: Results
    engines_meta: list[dict[str, Any]]
    requests: list[dict[str, Any]] = field(default_factory=list)
    tokenized: list[dict[str, Any]] = field(default_factory=list)
    protocol: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    interrupted: bool = False
    duration_s: float | None = None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    recs: list[dict[str, Any]] = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by Ctrl-C
            if isinstance(obj, dict):
                recs.append(obj)
    return recs


def load_bench(
    path: Path,
    *,
    baseline: str | None = None,
    quantization: Mapping[str, str] | None = None,
    min_repeats: int = 3,
    max_noise: float = 0.25,
) -> Data:
    recs = read_jsonl(path)
    run = next((r for r in recs if r.get("type") == "run"), None)
    if run is None:
        raise ValueError(f"{path}: no 'run' record — not a bench results file")
    end = next((r for r in recs if r.get("type") == "end"), None)
    cfg = run.get("config", {})
    quant = dict(quantization or {})
    infos = []
    for e in run["engines"]:
        q = quant.get(e["name"]) or e.get("quantization")
        infos.append(
            EngineInfo(
                name=e["name"],
                kind=e.get("kind"),
                model=e.get("model"),
                quantization=q,
                sampling=e.get("sampling") or {},
                max_tokens=tuple(e.get("max_tokens") or ()),
            )
        )
        e["quantization"] = q
    samples = tuple(
        Sample(
            engine=r["engine"],
            cell=Cell(r["cache"], int(r["concurrency"]), int(r["max_tokens"]), r["prompt_len"]),
            repeat=int(r["repeat"]),
            n_ok=int(r["n_ok"]),
            n_err=int(r["n_err"]),
            ttft_s=r.get("ttft_s"),
            tpot_s=r.get("tpot_s"),
            decode_tps=r.get("decode_tps"),
            e2e_s=r.get("e2e_s"),
            completion_tokens=r.get("completion_tokens"),
            prompt_tokens=r.get("prompt_tokens"),
            output_tps=r.get("output_tps"),
            gpu_mem_peak_bytes=r.get("gpu_mem_peak_bytes"),
            errors=tuple(r.get("errors") or ()),
        )
        for r in recs
        if r.get("type") == "sample"
    )
    tokenized = [r for r in recs if r.get("type") == "prompt_tokens"]
    requests = [r for r in recs if r.get("type") == "request"]
    pt: dict[str, dict[str, int]] = {}
    for r in tokenized:
        if isinstance(r.get("tokens"), int):
            pt.setdefault(r["engine"], {})[f"tokenizer:{r['prompt']}"] = r["tokens"]
    for r in requests:
        if r.get("phase") == "measure" and r.get("ok") and isinstance(r.get("prompt_tokens"), int) and r.get("key"):
            pt.setdefault(r["engine"], {})[f"usage:{r['key']}"] = r["prompt_tokens"]
    base = run.get("base", {})
    names = [e.name for e in infos]
    bl = baseline or run.get("baseline") or names[0]
    if bl not in names:
        raise ValueError(f"baseline {bl!r} is not one of the engines: {', '.join(names)}")
    results = Results(
        engines=tuple(infos),
        baseline=bl,
        samples=samples,
        prompt_tokens=pt,
        base_max_tokens=base.get("max_tokens"),
        base_prompt_len=base.get("prompt_len"),
        memory_budget_bytes=run.get("memory_budget_bytes"),
        min_repeats=min_repeats,
        max_noise=max_noise,
    )
    ex = run["engines"][0].get("body_example", {}) if run["engines"] else {}
    protocol = [
        f"started {dt.datetime.fromtimestamp(run.get('started', 0), dt.UTC):%Y-%m-%d %H:%M:%S} UTC"
        + (f", took {end['duration_s']:.0f} s" if end and isinstance(end.get("duration_s"), int | float) else ""),
        (
            "through the proxy at " + str(run["through"]) + " (engine pinned per request with x-enginemeter-engine; "
            "the proxy maps sampling per engine kind)"
        )
        if run.get("through")
        else "directly against each engine (sampling mapped per engine kind by proxy.normalize)",
        f"suite: {cfg.get('suite')}; prompt lengths {', '.join(cfg.get('prompt_lengths') or [])} "
        f"(base {base.get('prompt_len')}); concurrency {', '.join(map(str, cfg.get('concurrency') or []))}; "
        f"output lengths {', '.join(map(str, cfg.get('output_lengths') or []))} (base {base.get('max_tokens')})",
        f"{cfg.get('repeats')} repeats per cell, engines alternating order; {cfg.get('warmup')} warm-up request(s) "
        f"per engine discarded; {cfg.get('waves')} × concurrency requests per cell repeat",
        f"cache: {cfg.get('cache')} (cold = unique prefix per request"
        + (", cache_prompt:false to llama.cpp" if cfg.get("no_prompt_cache") else "")
        + ", SGLang /flush_cache before each phase; warm = bare prompts, primed once)",
        "sampling sent (before per-kind mapping): "
        + ", ".join(f"{k}={v}" for k, v in sorted(ex.items()) if k not in ("model", "stream", "stream_options")),
    ]
    notes = [f"{r.get('engine')}: {r.get('text')}" for r in recs if r.get("type") == "note"]
    return Data(
        title="enginemeter bench report",
        results=results,
        engines_meta=run["engines"],
        requests=requests,
        tokenized=tokenized,
        protocol=protocol,
        notes=notes,
        interrupted=bool(end is None or end.get("interrupted")),
        duration_s=end.get("duration_s") if end else None,
    )


# ---- document model ---------------------------------------------------------------------------------


@dataclass
class Block:
    kind: str  # h1 h2 h3 p ul table img
    text: str = ""
    items: list[str] = field(default_factory=list)
    header: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)
    path: str = ""


def _num(x: float | None, unit: str = "", digits: int = 3) -> str:
    if x is None:
        return "–"
    if unit == "ms":
        return f"{x * 1000:.1f} ms"
    if abs(x) >= 100:
        return f"{x:.0f}{(' ' + unit) if unit else ''}"
    return f"{x:.{digits}g}{(' ' + unit) if unit else ''}"


def _mib(b: float | None) -> str:
    return "unknown" if b is None else f"{b / 2**20:.0f} MiB"


def _agg(vals: Iterable[float | None], unit: str = "") -> str:
    v = [x for x in vals if isinstance(x, int | float)]
    if not v:
        return "–"
    m = statistics.median(v)
    if len(v) == 1:
        return _num(m, unit)
    return f"{_num(m, unit)} ({_num(min(v), unit)}–{_num(max(v), unit)})"


_MARK = {"ok": "✓", "inconclusive": "✗", "win": "▲", "loss": "▼", "tie": "=", "noisy": "~", "stay": "■", "note": "·"}


def document(d: Data, charts: Mapping[str, Path], chart_note: str | None) -> list[Block]:
    r = d.results
    verdicts = decide_all(r)
    out: list[Block] = [Block("h1", d.title)]
    if d.interrupted:
        out.append(Block("p", "**Interrupted run** — the report covers only what finished."))
    out.append(Block("h2", "Verdict"))
    for v in verdicts:
        out += _verdict_blocks(v)
    if not verdicts:
        out.append(Block("p", "Only one engine: nothing to compare."))

    out.append(Block("h2", "Engines"))
    rows = []
    for e in d.engines_meta:
        tag = " (baseline)" if e["name"] == r.baseline else ""
        rows.append(
            [
                e["name"] + tag,
                str(e.get("kind")),
                str(e.get("model")),
                str(e.get("quantization") or "undeclared"),
                str(e.get("slots") or "–"),
                str(e.get("url") or "–"),
            ]
        )
    out.append(Block("table", header=["engine", "kind", "model", "quantization", "slots", "url"], rows=rows))
    if d.protocol:
        out.append(Block("h2", "Protocol"))
        out.append(Block("ul", items=d.protocol))

    out += _parity_blocks(d)

    caches = sorted(
        {s.cell.cache for s in r.samples},
        key=lambda c: ("cold", "live", "warm").index(c) if c in ("cold", "live", "warm") else 9,
    )
    for cache in caches:
        out.append(Block("h2", f"Results: {cache}" + (" cache" if cache != "live" else " mirrored traffic")))
        out += _cell_tables(d, cache)

    out.append(Block("h2", "Charts"))
    if chart_note:
        out.append(Block("p", chart_note))
    for title, p in charts.items():
        out.append(Block("h3", title))
        out.append(Block("img", text=title, path=p.name))
    if d.notes:
        out.append(Block("h2", "Notes"))
        out.append(Block("ul", items=d.notes))
    out.append(Block("h2", "How to read this"))
    out.append(
        Block(
            "p",
            "TTFT = request sent → first token event (non-empty content/reasoning/tool_calls), as the "
            "client feels it. TPOT = (last token − first token) / (completion tokens − 1); decode tok/s "
            "is its inverse (llama.cpp `predicted_per_second` definition). Output tok/s = all completion "
            "tokens of a cell repeat / its wall time. Medians over requests, then median (min–max) over "
            "repeats. A difference counts only when the repeat ranges do not overlap. See docs/bench.md.",
        )
    )
    return out


def _verdict_blocks(v: Verdict) -> list[Block]:
    out = [
        Block("h3", f"{v.candidate} vs {v.baseline} (baseline): **{v.decision.upper()}**"),
        Block("p", v.summary),
    ]
    out.append(Block("ul", items=[f"{_MARK.get(x.outcome, '·')} [{x.step}] {x.outcome}: {x.text}" for x in v.reasons]))
    return out


def _parity_blocks(d: Data) -> list[Block]:
    names = [e.name for e in d.results.engines]
    out = [Block("h2", "Prompt-token parity")]
    by: dict[str, dict[str, Any]] = {}
    methods: dict[str, str] = {}
    for t in d.tokenized:
        by.setdefault(t["prompt"], {})[t["engine"]] = t.get("tokens")
        methods[t["engine"]] = str(t.get("method"))
    rows = []
    for pid, m in by.items():
        vals = [m.get(n) for n in names]
        known = [x for x in vals if isinstance(x, int)]
        eq = "–" if len(known) < 2 else ("equal" if len(set(known)) == 1 else "**DIFFER**")
        rows.append([pid, *[str(x) if x is not None else "?" for x in vals], eq])
    if rows:
        out.append(
            Block(
                "p",
                "Counted with each engine's own tokenizer before the run ("
                + "; ".join(f"{n}: {methods.get(n, '?')}" for n in names)
                + ").",
            )
        )
        out.append(Block("table", header=["prompt", *names, "parity"], rows=rows))
    # per-request usage: the same request (same prompt + prefix) on every engine
    pt = d.results.prompt_tokens
    keys = [k for k in pt.get(names[0], {}) if k.startswith("usage:")] if names else []
    common = [k for k in keys if all(k in pt.get(n, {}) for n in names)]
    if common:
        diff = [k for k in common if len({pt[n][k] for n in names}) > 1]
        out.append(
            Block(
                "p",
                f"Engine-reported `usage.prompt_tokens` of identical requests: {len(common) - len(diff)} "
                f"of {len(common)} equal on all engines.",
            )
        )
    if not rows and not common:
        out.append(Block("p", "No prompt-token counts on both engines."))
    return out


_METRICS = (
    ("TTFT", "ttft_s", "ms"),
    ("TPOT", "tpot_s", "ms"),
    ("decode tok/s", "decode_tps", ""),
    ("e2e", "e2e_s", "ms"),
    ("output tok/s", "output_tps", ""),
)


def _cell_tables(d: Data, cache: str) -> list[Block]:
    r = d.results
    names = [e.name for e in r.engines]
    samples = [s for s in r.samples if s.cell.cache == cache]
    cells = sorted(
        {s.cell for s in samples},
        key=lambda c: (
            c.concurrency,
            c.max_tokens,
            ("short", "medium", "long", "mixed").index(c.prompt_len)
            if c.prompt_len in ("short", "medium", "long", "mixed")
            else 9,
        ),
    )
    rows = []
    for c in cells:
        for n in names:
            mine = [s for s in samples if s.cell == c and s.engine == n]
            if not mine:
                continue
            err = sum(s.n_err for s in mine)
            ok = sum(s.n_ok for s in mine)
            mem = [s.gpu_mem_peak_bytes for s in mine if s.gpu_mem_peak_bytes is not None]
            rows.append(
                [
                    str(c.concurrency),
                    str(c.max_tokens),
                    c.prompt_len,
                    n,
                    str(len(mine)),
                    *[_agg((getattr(s, attr) for s in mine), unit) for _, attr, unit in _METRICS],
                    _agg(s.prompt_tokens for s in mine),
                    _agg(s.completion_tokens for s in mine),
                    f"{err}/{ok + err}" if err else "0",
                    _mib(max(mem)) if mem else "unknown",
                ]
            )
    header = [
        "c",
        "max_tokens",
        "prompt",
        "engine",
        "repeats",
        *[m[0] for m in _METRICS],
        "prompt tokens",
        "out tokens",
        "errors",
        "GPU mem peak",
    ]
    return [
        Block(
            "p",
            "Each figure: median over repeats (min–max) of the per-repeat median over requests; output "
            "tok/s is per repeat (all requests' completion tokens / wall time).",
        ),
        Block("table", header=header, rows=rows),
    ]


# ---- charts -------------------------------------------------------------------------------------------


def make_charts(d: Data, out: Path) -> tuple[dict[str, Path], str | None]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}, "Charts skipped: matplotlib is not installed (pip install 'enginemeter[report]')."
    r = d.results
    names = [e.name for e in r.engines]
    charts: dict[str, Path] = {}
    caches = sorted({s.cell.cache for s in r.samples})
    base_mt, base_pl = r.base_max_tokens, r.base_prompt_len

    def series(cache: str, engine: str, attr: str, key: str) -> tuple[list[Any], list[float], list[float], list[float]]:
        pts: dict[Any, list[float]] = {}
        for s in r.samples:
            if s.engine != engine or s.cell.cache != cache:
                continue
            c = s.cell
            if key == "concurrency" and (c.max_tokens != base_mt or c.prompt_len != base_pl):
                continue
            if key == "prompt_len" and (c.concurrency != 1 or c.max_tokens != base_mt):
                continue
            v = getattr(s, attr)
            if isinstance(v, int | float):
                pts.setdefault(getattr(c, key), []).append(float(v))
        order = ["short", "medium", "long", "mixed"]
        xs = sorted(pts, key=lambda x: order.index(x) if isinstance(x, str) and x in order else x)
        return xs, [statistics.median(pts[x]) for x in xs], [min(pts[x]) for x in xs], [max(pts[x]) for x in xs]

    specs = [
        ("ttft_vs_concurrency", "TTFT vs concurrency", "concurrency", "ttft_s", "TTFT (ms)", 1000.0),
        (
            "decode_vs_concurrency",
            "Per-request decode tok/s vs concurrency",
            "concurrency",
            "decode_tps",
            "decode tok/s",
            1.0,
        ),
        (
            "throughput_vs_concurrency",
            "Aggregate output tok/s vs concurrency",
            "concurrency",
            "output_tps",
            "output tok/s",
            1.0,
        ),
        ("ttft_vs_prompt_length", "TTFT vs prompt length (c=1)", "prompt_len", "ttft_s", "TTFT (ms)", 1000.0),
    ]
    for fname, title, key, attr, ylabel, scale in specs:
        fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=80)
        drew = False
        for cache in caches:
            for ni, n in enumerate(names):
                xs, ys, lo, hi = series(cache, n, attr, key)
                if not xs:
                    continue
                drew = True
                pos = list(range(len(xs))) if key == "prompt_len" else xs
                ax.errorbar(
                    pos,
                    [y * scale for y in ys],
                    yerr=[
                        [(y - a) * scale for y, a in zip(ys, lo, strict=True)],
                        [(b - y) * scale for y, b in zip(ys, hi, strict=True)],
                    ],
                    marker="o",
                    capsize=3,
                    linestyle="-" if cache != "warm" else "--",
                    color=f"C{ni}",  # one colour per engine; warm cache dashed
                    label=f"{n} ({cache})",
                )
                if key == "prompt_len":
                    ax.set_xticks(pos, [str(x) for x in xs])
        if not drew:
            plt.close(fig)
            continue
        if key == "concurrency":
            ax.set_xscale("log", base=2)
            ticks = sorted({s.cell.concurrency for s in r.samples})
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.minorticks_off()
            ax.set_xlabel("concurrent requests")
        else:
            ax.set_xlabel("prompt length class")
        ax.set_ylabel(ylabel)
        ax.set_title(title + " — median, bars = min–max over repeats", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        p = out / f"{fname}.png"
        fig.savefig(p)
        plt.close(fig)
        charts[title] = p
    # memory
    mem: dict[str, int] = {}
    for s in r.samples:
        if s.gpu_mem_peak_bytes is not None:
            mem[s.engine] = max(mem.get(s.engine, 0), s.gpu_mem_peak_bytes)
    note = None
    if mem:
        fig, ax = plt.subplots(figsize=(5, 3), dpi=80)
        ax.bar(list(mem), [v / 2**30 for v in mem.values()])
        ax.set_ylabel("GiB")
        ax.set_title("GPU memory peak during the bench", fontsize=9)
        if r.memory_budget_bytes:
            ax.axhline(r.memory_budget_bytes / 2**30, color="red", linestyle="--", label="budget")
            ax.legend(fontsize=7)
        fig.tight_layout()
        p = out / "memory.png"
        fig.savefig(p)
        plt.close(fig)
        charts["GPU memory peak"] = p
    else:
        note = "No memory chart: GPU memory was unknown (no proxy /metrics given and no NVML device)."
    return charts, note


# ---- rendering -----------------------------------------------------------------------------------------


def _md_cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def render_md(blocks: Sequence[Block]) -> str:
    lines: list[str] = []
    for b in blocks:
        if b.kind in ("h1", "h2", "h3"):
            lines += ["#" * int(b.kind[1]) + " " + b.text, ""]
        elif b.kind == "p":
            lines += [b.text, ""]
        elif b.kind == "ul":
            lines += [f"- {i}" for i in b.items] + [""]
        elif b.kind == "table":
            lines.append("| " + " | ".join(map(_md_cell, b.header)) + " |")
            lines.append("|" + "|".join("---" for _ in b.header) + "|")
            lines += ["| " + " | ".join(map(_md_cell, row)) + " |" for row in b.rows]
            lines.append("")
        elif b.kind == "img":
            lines += [f"![{b.text}]({b.path})", ""]
    return "\n".join(lines)


def _inline(s: str) -> str:
    """HTML-escape, then the two bits of Markdown we use: **bold** and `code`."""
    e = html.escape(s)
    e = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", e)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", e)


_CSS = """body{font:14px/1.45 system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em;font-size:12px}td,th{border:1px solid #ccc;padding:3px 6px;
text-align:left}th{background:#f3f3f3}code{background:#f3f3f3;padding:0 3px}img{max-width:100%}
h3 strong{padding:1px 6px;border-radius:3px;background:#eee}"""


def render_html(blocks: Sequence[Block], out: Path) -> str:
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>enginemeter report</title>",
        f"<style>{_CSS}</style></head><body>",
    ]
    for b in blocks:
        if b.kind in ("h1", "h2", "h3"):
            parts.append(f"<{b.kind}>{_inline(b.text)}</{b.kind}>")
        elif b.kind == "p":
            parts.append(f"<p>{_inline(b.text)}</p>")
        elif b.kind == "ul":
            parts.append("<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in b.items) + "</ul>")
        elif b.kind == "table":
            head = "".join(f"<th>{_inline(h)}</th>" for h in b.header)
            body = "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in row) + "</tr>" for row in b.rows)
            parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        elif b.kind == "img":
            data = base64.b64encode((out / b.path).read_bytes()).decode()
            parts.append(f"<img alt='{html.escape(b.text)}' src='data:image/png;base64,{data}'>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(d: Data, out: Path) -> dict[str, Any]:
    """Write report.md, report.html and the charts into ``out``; returns the verdicts and paths."""
    out.mkdir(parents=True, exist_ok=True)
    charts, note = make_charts(d, out)
    blocks = document(d, charts, note)
    (out / "report.md").write_text(render_md(blocks), encoding="utf-8")
    (out / "report.html").write_text(render_html(blocks, out), encoding="utf-8")
    verdicts = decide_all(d.results)
    return {
        "report_md": out / "report.md",
        "report_html": out / "report.html",
        "charts": list(charts.values()),
        "verdicts": verdicts,
    }
