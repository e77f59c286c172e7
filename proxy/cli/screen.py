"""The first screen ``bench``, ``report`` and ``tune`` print: a table first, then the answer once, then caveats.

The table is ``proxy.bench.verdict.headline.Table`` — the one report.md and report.html open with, the same strings:
one row per workload (regime) with its deciding figure for each engine and each candidate's speed ratio over the
baseline with its 95 % interval; then, per workload, each engine's TTFT and TPOT at p50 and p99 (its requests in
that cell). Then the headline's decision and its sentence without the table's figures (``Headline.brief``: said
once), the traffic, what the answer extrapolates (a traffic beyond the concurrency or prompt length measured), the
trade-offs and caveats, the next command (split over lines with ``\\`` so it still pastes) and the files. At most
``LINES`` lines of at most ``WIDTH`` characters: what does not fit is in report.md, and the screen says so.
"""

from __future__ import annotations

import shlex
import textwrap
from collections.abc import Sequence
from typing import Any

from proxy.bench.verdict.decide import Verdict
from proxy.bench.verdict.headline import Headline, answer_table, extrapolated
from proxy.bench.verdict.inputs import Results

WIDTH = 120
LINES = 25


def _columns(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def table(verdicts: Sequence[Verdict], results: Results | None) -> list[str]:
    """The answer's table (``proxy.bench.verdict.headline.answer_table``, the one report.md opens with) as columns:
    the deciding figures and ratios, then TTFT / TPOT p50 and p99 per engine in the same cells."""
    t = answer_table(verdicts, results.requests if results is not None else ())
    out = _fit([t.header, *t.rows], 3)
    return out + (_fit([t.latency_header, *t.latency_rows], 2) if t.latency_rows else [])


def _fit(rows: Sequence[Sequence[str]], keep: int) -> list[str]:
    """The columns, split into tables of fewer engines when wider than ``WIDTH`` (four engines and more): each
    repeats the first ``keep`` columns (the workload, its figure, the baseline), the same strings."""
    lines = _columns(rows)
    if max(map(len, lines)) <= WIDTH or len(rows[0]) <= keep + 1:
        return lines
    out, cols = [], list(range(keep, len(rows[0])))
    while cols:
        n = len(cols)
        while n > 1 and max(map(len, _columns([[*r[:keep], *(r[i] for i in cols[:n])] for r in rows]))) > WIDTH:
            n -= 1
        out += _columns([[*r[:keep], *(r[i] for i in cols[:n])] for r in rows])
        cols = cols[n:]
    return out


def _wrap(text: str, first: str = "", rest: str = "    ", most: int = 2) -> list[str]:
    lines = textwrap.wrap(text, WIDTH, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False)
    if len(lines) > most:
        lead = first if most == 1 else rest
        body = textwrap.shorten(lines[most - 1][len(lead) :], WIDTH - len(lead) - 16, placeholder="")
        lines = [*lines[: most - 1], f"{lead}{body} … (report.md)"]
    return lines


def wrapped(line: str) -> list[str]:
    """A line of prose at most ``WIDTH`` wide, its continuation indented under it (nothing cut)."""
    indent = " " * (len(line) - len(line.lstrip()))
    if len(line) <= WIDTH:
        return [line]
    if line.lstrip().startswith("enginemeter "):  # a command: split so it still pastes
        return command_lines(line.lstrip(), indent)
    return _wrap(line, "", indent + "  ", 99)


def command_lines(cmd: str, prefix: str) -> list[str]:
    """A printed command split with `` \\`` between its arguments so each line fits ``WIDTH`` and it still pastes
    (a shell comment after it goes on the line before)."""
    command, _, comment = cmd.partition("  # ")
    out = _wrap(comment, "  # ", "  # ", 1) if comment else []
    try:
        words = [shlex.quote(w) for w in shlex.split(command)]
    except ValueError:
        return [*out, f"{prefix}{command}"]
    line = prefix.rstrip() + " " if prefix.strip() else prefix
    for w in words:
        if len(line) + len(w) + 2 > WIDTH and line.strip():
            out.append(line.rstrip() + " \\")
            line = "      "
        line += w + " "
    out.append(line.rstrip())
    return out


def answer(h: Headline, verdicts: Sequence[Verdict]) -> tuple[list[str], list[str], list[str]]:
    """(the answer's lines; the lines that must show after it: the traffic, what it extrapolates, next; the lines
    that may give way: the discount, trade-offs, caveats, the other candidates)."""
    head = _wrap(f"{h.decision.upper()}{h.tag}: {h.brief}", "", "  ", 3)
    must: list[str] = []
    if h.traffic:
        must += _wrap(f"traffic: {h.traffic}", "  ", "    ", 1)
    must += [x for n in extrapolated(verdicts) for x in _wrap(n, "  ", "    ", 2)]
    may = [x for n in h.notes for x in _wrap(n.replace("this answer is ", ""), "  ", "    ", 2)]
    may += [x for t in h.tradeoffs for x in _wrap(f"trade-off: {t}", "  ", "    ", 1)]
    may += [x for c in h.caveats for x in _wrap(f"caveat: {c}", "  ", "    ", 2)]
    may += [x for o in h.others for x in _wrap(o, "  ", "    ", 2)]
    nxt = []
    if h.next_step:
        before, sep, cmd = h.next_step.partition(": enginemeter ")
        if h.next_step.startswith("enginemeter "):
            nxt = ["  next:", *command_lines(h.next_step, "  ")]
        elif sep:
            nxt = [*_wrap(f"next: {before}:", "  ", "    ", 1), *command_lines("enginemeter " + cmd, "  ")]
        else:
            nxt = _wrap(f"next: {h.next_step}", "  ", "    ", 2)
    return head, must + nxt, may


def first_screen(out: dict[str, Any]) -> list[str]:
    """Everything the command prints after the run: the table, the answer once, caveats, the files."""
    verdicts: Sequence[Verdict] = out["verdicts"]
    files = [str(out[k]) for k in ("report_md", "report_html", "verdict_json", "switch_plan") if out.get(k)]
    tail = _wrap(f"report: {', '.join(files[:-1])} and {files[-1]}", "", "  ", 4) if files else []
    if not verdicts:
        return [
            "one engine measured: nothing to compare here (join runs with: enginemeter report --results A B)",
            *tail,
        ]
    data = out.get("data")
    lines = table(verdicts, data.results if data is not None else None)
    lines += [x for a in out.get("arms_lines", ()) for x in _wrap(a, "", "  ", 2)]
    h: Headline | None = out.get("headline")
    if h is None:
        return lines + tail
    head, must, may = answer(h, verdicts)
    room = LINES - len(lines) - len(head) - len(must) - len(tail)
    if len(may) > room:
        may = [*may[: max(room - 1, 0)], "  (more in report.md)"] if room > 0 else []
    return lines + head + may + must + tail
