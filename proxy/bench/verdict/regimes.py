"""Comparisons -> one answer per regime, and what to run next. Pure.

Each regime is judged as the person of that regime feels it, on one **deciding figure**:

- **single request** (c=1): the whole request — first token plus the rest of the answer, at the output length
  measured; TTFT and decode TPOT beside it. When they point different ways the answer says where they cross: the
  **break-even output length** ("sglang is faster for answers under 9 tokens, llama beyond");
- **under load**: output tok/s at the highest concurrency measured; TTFT under load beside it. When the throughput
  does not separate the two — a tie, or unresolved (its interval reaches inside the band) — a TTFT under load
  resolved beyond its own band decides: the same tokens as far as the run can tell, sooner. A throughput resolved
  either way is never overruled by TTFT (it is a trade-off beside it);
- **long prompts**: the whole long request (prefill plus the answer); TTFT and TPOT beside it.

A figure beside the deciding one that points the other way is a **trade-off**, stated with its numbers, never a
veto. A regime not measured names the flags that measure it; an unresolved one the rerun that resolves it
(``rerun``: the run's own command, into a fresh ``--out``). ``proxy.bench.verdict.conclusion`` reads the regimes'
answers into the decision.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from proxy.bench.outdir import next_name
from proxy.bench.verdict.comparison import Comparison
from proxy.bench.verdict.inputs import LiveFinding, Results
from proxy.engines.startup import without_flags
from proxy.notation import band, faster, faster_interval, unit

#: (step, the regime as a person names it), in reading order
REGIMES: tuple[tuple[str, str], ...] = (
    ("decode", "single request"),
    ("throughput", "under load"),
    ("long-context", "long prompts"),
)
#: the gate steps, before any regime (``inputs.STEPS``)
GATES = ("parity", "data", "memory")


@dataclass(frozen=True, slots=True)
class BreakEven:
    """Where the whole request's time is the same on both engines: the output length in tokens."""

    tokens: float
    #: the engine faster for shorter answers (its first token comes sooner), and the one faster beyond
    shorter: str
    longer: str

    def text(self) -> str:
        return f"{self.shorter} is faster for answers under {self.tokens:.0f} tokens, {self.longer} beyond"

    def to_json(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "faster_shorter": self.shorter, "faster_longer": self.longer}


@dataclass(frozen=True, slots=True)
class RegimeAnswer:
    step: str
    title: str
    #: win | loss | tie | unresolved | flagged | not yet | not measured
    answer: str
    text: str
    cell: str | None = None
    comparisons: tuple[Comparison, ...] = ()
    #: flags that measure it (not measured), or the rerun that resolves it (unresolved)
    fix: str | None = None
    #: the answer in a few words ("sglang is ×7.6 faster (output tok/s at c=64)"), for the summary line
    head: str = ""
    #: the figure that decided (``Comparison.what``)
    decided_by: str | None = None
    #: figures beside it that point the other way, in words
    tradeoffs: tuple[str, ...] = ()
    break_even: BreakEven | None = None
    #: the answer with its interval and band, for the headline's regime lines
    line: str = ""

    def to_json(self) -> dict[str, Any]:
        prim = next((c for c in self.comparisons if c.what == self.decided_by), None)
        return {
            "regime": self.title,
            "step": self.step,
            "answer": self.answer,
            "text": self.text,
            "head": self.head,
            "cell": self.cell,
            "fix": self.fix,
            "decided_by": self.decided_by,
            "tradeoffs": list(self.tradeoffs),
            "break_even": self.break_even.to_json() if self.break_even else None,
            "primary": None
            if prim is None
            else {
                "metric": prim.metric,
                "speed_ratio": prim.speed[0],
                "ci95": list(prim.speed[1:]),
                "band": prim.band,
                "detectable_effect": prim.detectable,
            },
        }


def _missing_flags(step: str, slots: int | None, live: bool = False) -> str:
    if live:
        return {"decode": "pairs that ran alone (observed c=1)", "throughput": "pairs at observed concurrency ≥ 2"}.get(
            step, "pairs that ran alone with a prompt of 1,024 tokens or more"
        )
    if step == "decode":
        return "--concurrency 1 (the single-request cell)"
    if step == "throughput":
        levels = [1]
        while levels[-1] < min(max(4, slots or 4), 64):
            levels.append(levels[-1] * 4)
        return f"--concurrency {','.join(map(str, levels))}"
    return "--prompt-lengths short,long"


#: what the flags cannot say, in the sentence beside them (never inside a command: a printed command must run)
_FLAGS_HINT = {"long-context": " (or 4k, 16k: the longest the context holds)"}


def break_even(comps: Sequence[Comparison], base: str, cand: str) -> BreakEven | None:
    """The output length at which the whole request takes as long on both engines, when TTFT and TPOT point
    different ways (each resolved)."""
    ttft = next((c for c in comps if c.metric == "ttft_s"), None)
    tpot = next((c for c in comps if c.metric == "tpot_s"), None)
    if ttft is None or tpot is None or {ttft.outcome, tpot.outcome} != {"win", "loss"}:
        return None
    t_b, t_c, p_b, p_c = ttft.stats.base_mean, ttft.stats.cand_mean, tpot.stats.base_mean, tpot.stats.cand_mean
    if p_b == p_c:
        return None
    n = 1 + (t_c - t_b) / (p_b - p_c)
    if not math.isfinite(n) or n <= 1:
        return None
    # the engine whose first token comes sooner wins the short answers
    return BreakEven(n, cand, base) if ttft.outcome == "win" else BreakEven(n, base, cand)


def answer(
    step: str, title: str, comps: Sequence[Comparison], base: str, cand: str, slots: int | None, live: bool = False
) -> RegimeAnswer:
    mine = [c for c in comps if c.step == step]
    prim = next((c for c in mine if c.primary), None)
    if prim is None:
        flags = _missing_flags(step, slots, live)
        text = f"{title}: not measured — " + (f"needs {flags}" if live else f"add {flags}{_FLAGS_HINT.get(step, '')}")
        return RegimeAnswer(step, title, "not measured", text, fix=None if live else flags, head="not measured")
    decider, a = prim, prim.outcome
    if step == "throughput" and a in ("tie", "unresolved"):
        # the throughput does not separate them (an unresolved interval reaches inside the band as a tie's does):
        # whichever serves the first token sooner, when that is resolved; a throughput win or loss stays the answer
        side = next((c for c in mine if not c.primary and c.outcome in ("win", "loss")), None)
        if side is not None:
            decider, a = side, side.outcome
    sides = [c for c in mine if c is not decider]
    against = {"win": "loss", "loss": "win"}.get(a)
    tradeoffs = tuple(
        c.says(base, cand) for c in sides if c.outcome == against or (a == "tie" and c.outcome in ("win", "loss"))
    )
    be = break_even(mine, base, cand) if step in ("decode", "long-context") else None
    head, line, fix = _words(decider, a, base, cand)
    if decider is not prim and prim.outcome == "unresolved":
        # an unresolved throughput may lean against the answer: its estimate goes with the answer, in every form
        head += f"; {prim.what} unresolved"
        line += (
            f"; {prim.what} unresolved: {prim.difference(base, cand)}, reaching inside the band {band(prim.win_band)}"
        )
    text = f"{title} ({decider.cell.label()}): {line}"
    if decider is not prim:
        held = "tied" if prim.outcome == "tie" else "did not separate them"
        text += f" — decided by {decider.what}: the deciding figure ({prim.what}) {held}"
    if tradeoffs:
        text += "; trade-off: " + "; ".join(tradeoffs)
    if be is not None:
        text += f"; {be.text()}"
    figs = "; ".join(f"{c.what}: {base} {c.figures()[0]} vs {cand} {c.figures()[1]} ({c.outcome})" for c in mine)
    return RegimeAnswer(
        step,
        title,
        a,
        f"{text} — {figs}",
        decider.cell.label(),
        tuple(mine),
        fix,
        head,
        decider.what,
        tradeoffs,
        be,
        line,
    )


def _words(decider: Comparison, a: str, base: str, cand: str) -> tuple[str, str, str | None]:
    """The answer ``a`` on the deciding figure in a few words (``head``), with its interval and band (``line``),
    and the rerun or flags that would resolve it (``fix``; None: none)."""
    who, r, lo, hi = decider.side(base, cand)
    fb, fc = decider.figures()
    figs_ = f"{decider.what}: {base} {fb}, {cand} {fc}"
    u = unit(r, lo, hi)
    ci = f"95% CI {faster_interval(lo, hi, u)}"
    if a in ("win", "loss"):
        return (
            f"{who} {faster(r, u)} ({figs_})",
            f"{who} is {faster(r, u)} — {figs_} ({ci}; band {band(decider.win_band)})",
            None,
        )
    # no winner to speak for: the interval from the candidate's side, named, as the first screen's table shows it
    _, clo, chi = decider.speed
    ci = f"{cand}'s 95% CI {faster_interval(clo, chi, unit(*decider.speed))}"
    if a == "tie":
        wide = decider.win_band > decider.min_effect
        line = f"a tie — {figs_} ({ci}, inside the band {band(decider.win_band)}" + (
            ": the run's noise floor, no smaller difference can be seen in this run)" if wide else ")"
        )
        return f"a tie ({figs_})", line, None
    if a == "flagged":
        said = f"cannot decide: {decider.flagged}"
        return said, said, f"rerun when nothing else uses the engines ({decider.flagged})"
    n = decider.repeats_to_resolve()
    line = f"unresolved — {figs_} ({ci} crosses the band {band(decider.win_band)}; " + (
        f"about {n} repeats would resolve it)" if n else "no feasible number of repeats resolves it)"
    )
    return f"unresolved ({figs_})", line, f"--repeats {n}" if n else None


def from_live(a: RegimeAnswer, f: LiveFinding, min_pairs: int) -> RegimeAnswer:
    """The regime answered by the anytime-valid live verdict (mirrored traffic): faster = win, slower = loss."""
    ans = {"faster": "win", "slower": "loss", "tie": "tie"}.get(f.finding, "not yet")
    head = f.text if f.pairs else "no pairs yet"
    if ans == "not yet" and f.pairs < min_pairs:
        head = f"not yet — {f.pairs} pairs; nothing is decided before {min_pairs}"
    return replace(
        a,
        answer=ans if f.pairs else "not measured",
        head=head,
        line=head,
        text=f"{a.title} (live, anytime-valid): {head}",
        decided_by=f"{f.metric} (live)",
    )


def rerun(command: str | None, flags: str) -> str:
    """The bench command with ``flags`` set (replacing the same flags where the command has them), into a fresh
    ``--out`` (the next name after the run's own: a rerun never writes over the run it improves on)."""
    if not command:
        return f"rerun the bench with {flags} and a fresh --out"
    try:
        argv = shlex.split(command)
        new = shlex.split(flags)
    except ValueError:
        return f"{command} {flags}"
    if "--out" not in {a.split("=", 1)[0] for a in new}:
        old = next(
            (
                a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else "")
                for i, a in enumerate(argv)
                if a.split("=", 1)[0] == "--out"
            ),
            None,
        )
        default = "tune-out" if "tune" in argv[1:2] else "bench-out"
        new += ["--out", next_name(old or default)]
    names = {a for a in new if a.startswith("--")}
    return shlex.join(without_flags(argv, *names) + new)


#: where the report weighed by the traffic goes: beside the per-workload one, never over it
TRAFFIC_OUT = "traffic-report"
_TRAFFIC_HOW = (
    "put your traffic's share of busy time at each number of requests in flight (percent; the even split "
    "is a placeholder), or --traffic URL/PATH to take it from the proxy's own record (its /metrics, its "
    "comparison or request log)"
)


def even_split(levels: Sequence[float]) -> str:
    """``c1=34,c4=33,c64=33``: the measured concurrency levels, equal whole-percent shares summing to 100."""
    n = len(levels)
    shares = [100 // n + (1 if i < 100 % n else 0) for i in range(n)]
    return ",".join(f"c{c:g}={x}" for c, x in zip(levels, shares, strict=True))


def weigh_next(r: Results, cells: Sequence[Comparison]) -> str:
    """What to run when the answer depends on the traffic: the report on these same results, weighed by a traffic
    profile over the concurrency levels measured (an even split to replace with the user's shares; a live report:
    the profile its own log records), into a fresh ``--out``. A shell comment after the command says what to put."""
    levels = sorted(
        {c.cell.concurrency for c in cells if c.cell.prompt_len == r.base_prompt_len and c.cell.rate is None}
        or {c.cell.concurrency for c in cells}
    )
    spec = even_split(levels) if levels else "c1=50,c16=50"
    if not r.report_command:
        return f"weigh it by your traffic: the report again with --traffic {spec} — {_TRAFFIC_HOW}"
    argv = shlex.split(r.report_command)
    if r.live and "--log" in argv:  # the comparison log records the traffic it mirrored: its own profile
        log = argv[argv.index("--log") + 1]
        return shlex.join([*argv, "--traffic", log, "--out", TRAFFIC_OUT]) + (
            "  # the traffic profile this log recorded (the time at each number of requests in flight); or "
            "--traffic c1=PCT,c4=PCT,… with your own shares"
        )
    return shlex.join([*argv, "--traffic", spec, "--out", TRAFFIC_OUT]) + f"  # {_TRAFFIC_HOW}"
