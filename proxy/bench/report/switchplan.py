"""The switch plan (``switch-plan.md`` beside the report): the checklist people go through before a long-term switch of
engines, each item checked from the measurements; then the rollback record and the guarded rollout with the one
command that rolls back (``proxy.bench.report.rollback``). Pure: the report's ``Data``, the verdicts and the
greedy-output agreement in, Markdown out. docs/bench.md#the-switch-plan.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from proxy.bench.quality.readout import Quality
from proxy.bench.report.agreement import Agreement
from proxy.bench.report.rollback import launch_command, rollback_record, rollout_section, swap_section
from proxy.bench.verdict.data import Data
from proxy.bench.verdict.decide import Verdict
from proxy.bench.verdict.inputs import FAILS, Sample
from proxy.bench.verdict.switchway import resident
from proxy.config.fields import DEFAULT_LISTEN
from proxy.engines.quant import random_who
from proxy.notation import count, gib

FILE = "switch-plan.md"
OK, NO, UNKNOWN = "✓", "✗", "?"
#: the share of the card EnginemeterGPUMemoryNearFull leaves free (its threshold: 98 % used)
NEAR_FULL = 0.98
#: error texts that mean the engine ran out of memory
_OOM = re.compile(r"out of memory|\bOOM\b|cudaMalloc|CUDA error", re.IGNORECASE)

#: what the proxy exports for the switch, as shipped (tests/bench/report/test_switchplan.py checks each name exists)
LIVENESS_ALERTS = ("EnginemeterEngineDown", "EnginemeterEngineScrapeDown", "EnginemeterProxyDown")
GUARD_ALERTS = ("EnginemeterRequestErrors", "EnginemeterGPUMemoryNearFull", "EnginemeterKVCachePressure",
                "EnginemeterRolloutRolledBack")  # fmt: skip
METRICS = ("enginemeter_engine_up", "enginemeter_time_to_first_token_seconds",
           "enginemeter_time_per_output_token_seconds", "enginemeter_request_duration_seconds",
           "enginemeter_requests_total", "enginemeter_engine_gpu_headroom_bytes", "enginemeter_rollout_share")  # fmt: skip
RULES = ("deploy/prometheus/rules/enginemeter-alerts.yml", "deploy/prometheus/rules/enginemeter-recording.yml")
DASHBOARDS = ("grafana/dashboards/overview.json", "grafana/dashboards/engine-comparison.json")
TTFT_P95 = "engine_model_role:enginemeter_time_to_first_token_seconds:p95_5m"


@dataclass(frozen=True)
class Outputs:
    """Greedy-output agreement of a candidate with the baseline, whatever measured it (bench or mirrored pairs);
    ``quality``: its token agreement and task accuracy where measured (``bench --agreement``, ``--eval``), which
    judge the item — on random weights too, with their caveat."""

    pairs: int
    identical: int
    text: str
    recorded: bool = True
    quality: Quality | None = None


def from_agreement(a: Agreement, base: str, cand: str, quality: Quality | None = None) -> Outputs:
    return Outputs(a.pairs, a.identical, a.text(base, cand), a.recorded, quality)


@dataclass(frozen=True)
class Item:
    name: str
    mark: str
    evidence: str


def markdown(
    d: Data,
    verdicts: Sequence[Verdict],
    outputs: Mapping[str, Outputs],
    *,
    listen: str | None = None,
) -> str:
    """The plan. ``outputs``: candidate -> its agreement with the baseline (the outputs of engines on random weights,
    ``d.results.random_weights``, cannot be judged); ``listen``: where the proxy listens (default: the config's
    default)."""
    at = listen or DEFAULT_LISTEN
    lines = [
        f"# Switch plan: {', '.join(v.candidate for v in verdicts) or 'nothing to switch to'} "
        f"(baseline {d.results.baseline})",
        "",
        "The checklist before a long-term switch, each item checked from this report's measurements (✓ done, "
        "✗ not met, ? not measured), the rollback record, and the enginemeter config that switches the traffic "
        "and goes back by itself: the mirrored rollout, step by step, when both engines fit at once "
        "(docs/routing.md#rollout); the swap, one engine at a time, when they do not (docs/routing.md#swap). The "
        "evidence is in `report.md`.",
        "",
    ]
    if not verdicts:
        lines += [
            "Only one engine was measured: nothing to compare, so no checklist. Join this run with another "
            "one's (`enginemeter report --results A/results.jsonl B/results.jsonl`).",
            "",
        ]
    for v in verdicts:
        items = checklist(d, v, outputs.get(v.candidate))
        marks = {m: [i.name for i in items if i.mark == m] for m in (OK, NO, UNKNOWN)}
        lines += [
            f"## Checklist: {v.candidate} replacing {v.baseline}",
            "",
            f"**{len(marks[OK])} of {len(items)} ✓**"
            + "".join(f"; {m} {', '.join(names)}" for m, names in marks.items() if m != OK and names)
            + ".",
            "",
            "| | item | evidence |",
            "|---|---|---|",
            *(f"| {i.mark} | {i.name} | {_cell(i.evidence)} |" for i in items),
            "",
        ]
    names = [d.results.baseline, *(v.candidate for v in verdicts)]
    lines += rollback_record(d, names)
    for v in verdicts:
        lines += switch_section(d, v, at)
    return "\n".join(lines)


def switch_section(d: Data, v: Verdict, listen: str) -> list[str]:
    """The way from the measurements (``proxy.bench.verdict.switchway``): the swap when both engines cannot be
    resident at once, else the mirrored rollout."""
    if resident(d, v.baseline, v.candidate).way == "swap":
        return swap_section(d, v, listen)
    return rollout_section(d, v, listen)


def checklist(d: Data, v: Verdict, outputs: Outputs | None) -> list[Item]:
    return [
        _parity(v),
        _speed(v),
        _outputs(v, outputs, d.results.random_of(v.baseline, v.candidate)),
        _errors(d, v),
        _queueing(d, v),
        _memory(d, v),
        _monitoring(d, v),
        _rollback_item(d, v),
    ]


def _cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


# ---- the items -------------------------------------------------------------------------------------------


def _parity(v: Verdict) -> Item:
    name = "Compared under the same conditions"
    mine = [x for x in v.reasons if x.step == "parity"]
    bad = [x for x in mine if x.outcome in FAILS]
    if bad:
        return Item(name, NO, "; ".join(f"{x.check or 'parity'}: {x.text}" for x in bad))
    if not mine:
        return Item(name, UNKNOWN, "the verdict made no parity check")
    equal = ", ".join(dict.fromkeys(x.check for x in mine if x.outcome == "ok" and x.check))
    notes = "; ".join(x.text for x in mine if x.outcome == "note")
    return Item(name, OK, f"equal: {equal or 'every check made'}" + (f"; noted: {notes}" if notes else ""))


def _speed(v: Verdict) -> Item:
    mark = {"switch": OK, "stay": NO}.get(v.decision, UNKNOWN)
    regimes = "; ".join(f"{a.title}: {getattr(a, 'head', '') or a.answer}" for a in v.regimes)
    return Item("Speed verdict", mark, f"**{v.decision.upper()}**" + (f" — {regimes}" if regimes else ""))


def _outputs(v: Verdict, o: Outputs | None, random: Mapping[str, str]) -> Item:
    name = "Outputs agree under the same parameters"
    sampling = [x for x in v.reasons if x.step == "parity" and x.check == "sampling"]
    unlike = [x for x in sampling if x.outcome in FAILS]
    text = o.text if o is not None else "greedy-output agreement not measured"
    if o is not None and o.quality is not None and o.quality.measured and not unlike:
        # measured next-token agreement / task accuracy judge it, against stated bounds; on random weights a bound
        # crossed is the network's noise, not the model's (paritygate.discount): shown and said so, judging nothing
        mark = OK if not o.quality.differs else UNKNOWN if random else NO
        return Item(name, mark, o.quality.evidence(random_weights=bool(random)))
    if random:
        # only that: the agreement's own text judges it ("the same weights should agree"), which random weights
        # cannot be held to
        return Item(
            name,
            UNKNOWN,
            f"cannot be judged: {random_who(random)}, whose outputs say nothing of the model's; compare on the "
            "real weights",
        )
    if unlike:
        return Item(name, NO, f"not sampled alike: {unlike[0].text}. {text}")
    alike = f"sampling: {sampling[0].text}. " if sampling else ""
    if o is None or not o.recorded or not o.pairs:
        return Item(name, UNKNOWN, alike + text)
    return Item(name, OK if o.identical == o.pairs else NO, alike + text)


def _judged(d: Data) -> str | None:
    caches = {s.cell.cache for s in d.results.samples}
    return next((c for c in ("cold", "live", "warm") if c in caches), None)


def _errors(d: Data, v: Verdict) -> Item:
    name = "No OOM, no errors as concurrency rises"
    per: dict[str, str] = {}
    oom: list[str] = []
    failed = 0
    for e in (v.baseline, v.candidate):
        mine = [s for s in d.results.samples if s.engine == e]
        by: dict[int, list[int]] = {}
        for s in mine:
            by.setdefault(s.cell.concurrency, [0, 0])[0] += s.n_err
            by[s.cell.concurrency][1] += s.n_ok + s.n_err
            oom += [f"{e}: {x}" for x in s.errors if _OOM.search(x)]
        err, total = sum(x[0] for x in by.values()), sum(x[1] for x in by.values())
        failed += err if e == v.candidate else 0
        per[e] = f"{e} {err} of {total} failed" + (
            " (" + ", ".join(f"c={c}: {x[0]}/{x[1]}" for c, x in sorted(by.items())) + ")" if by else ""
        )
    launch = [f"launch failed: {s['failed']}" for s in d.stints if s.get("failed") and s.get("engine") == v.candidate]
    gate = [x.text for x in v.reasons if x.step == "data" and x.check == "errors"]
    stopped = [f"the run stopped early: {d.stopped}"] if d.stopped and not any(d.stopped in x for x in launch) else []
    evidence = "; ".join([*oom[:2], *launch, *stopped, per[v.candidate], per[v.baseline], *gate])
    if any(x.startswith(f"{v.candidate}: ") for x in oom) or launch or failed:
        return Item(name, NO, evidence)
    return Item(name, OK if any(s.engine == v.candidate for s in d.results.samples) else UNKNOWN, evidence)


def _medians(samples: Sequence[Sample], attr: str) -> dict[int, float]:
    by: dict[int, list[float]] = {}
    for s in samples:
        x = getattr(s, attr)
        if isinstance(x, int | float) and x > 0:
            by.setdefault(s.cell.concurrency, []).append(float(x))
    return {c: statistics.median(x) for c, x in by.items()}


def _queueing(d: Data, v: Verdict) -> Item:
    """Queueing shows as a first token that waits longer than a whole request takes alone: a request waited for
    others to finish, not only shared a batch with them (batched prefill raises TTFT a little, not that much); or as
    fewer slots than requests at once. The mark is the candidate's (the engine switched to), but the evidence judges
    both engines in words: a baseline that queues is a reason to switch and is said so, never hidden behind a ✓."""
    name = "No obvious queueing as concurrency rises"
    r, cache = d.results, _judged(d)
    slots = {e.name: e.slots for e in r.engines}
    ttft: dict[str, dict[int, float]] = {}
    e2e: dict[str, dict[int, float]] = {}
    for e in (v.baseline, v.candidate):
        mine = [s for s in r.samples if s.engine == e and s.cell.cache == cache and s.cell.rate is None]
        base = [s for s in mine if s.cell.prompt_len == r.base_prompt_len and s.cell.max_tokens == r.base_max_tokens]
        use = base if len({s.cell.concurrency for s in base}) > 1 else mine
        ttft[e], e2e[e] = _medians(use, "ttft_s"), _medians(use, "e2e_s")
    cand = ttft[v.candidate]
    if len(cand) < 2 or 1 not in cand:
        return Item(
            name,
            UNKNOWN,
            f"{v.candidate}: TTFT measured at {count(len(cand), 'concurrency level')} without c=1 "
            "beside a higher one (--concurrency 1,N)",
        )
    top = max(cand)

    def judged(e: str) -> tuple[bool | None, str]:
        """(queues: True / False / None unknown, the engine's figures and why)."""
        f, alone, n = ttft[e], e2e[e].get(1), slots.get(e)
        if 1 not in f or top not in f:
            return None, f"{e}: TTFT not measured at c=1 and c={top}"
        why = []
        if alone and f[top] > alone:
            why.append(
                f"at c={top} its first token waits longer than a whole request takes alone: requests wait "
                "for others to finish"
            )
        if n is not None and n < top:
            why.append(f"{count(n, 'slot')} for {top} concurrent requests: the rest wait inside the engine")
        figures = (
            f"{e}: TTFT {f[1] * 1000:.1f} ms at c=1 → {f[top] * 1000:.1f} ms at c={top} (×{f[top] / f[1]:.2f}; "
            "a whole request alone: "
            + (f"{alone * 1000:.1f} ms" if alone else "unknown")
            + f"), {count(n, 'slot') if n else 'slots unknown'}"
        )
        return (True if why else False if alone else None), figures + (f" — {'; '.join(why)}" if why else "")

    cq, ctext = judged(v.candidate)
    bq, btext = judged(v.baseline)
    said = {True: "queues", False: "no obvious queueing", None: "queueing not known"}
    lead = f"{v.candidate} (candidate): {said[cq]}; {v.baseline} (baseline): {said[bq]}"
    if bq and not cq:
        lead += f" — queueing the switch to {v.candidate} removes"
    elif bq and cq:
        lead += " — both queue: the switch does not remove it"
    cell = "medians of the per-repeat medians" + (f", {cache} cache" if cache else "")
    mark = NO if cq else OK if cq is False else UNKNOWN
    return Item(name, mark, f"{lead}. {ctext}; {btext} ({cell}; c={top} is the highest measured)")


def _memory(d: Data, v: Verdict) -> Item:
    """What will be resident at once: both engines for the mirrored rollout (their peaks summed), one at a time for
    the swap (the candidate alone, as the verdict's memory gate judged it); ``proxy.bench.verdict.switchway``."""
    name = "Memory: what is resident at once fits"
    gate = next((x for x in v.reasons if x.step == "memory"), None)
    at = resident(d, v.baseline, v.candidate)
    peak = at.peaks[v.candidate]
    total = max((s.gpu_mem_total_bytes or 0 for s in d.results.samples if s.engine == v.candidate), default=0)
    text = gate.text if gate is not None else "the verdict judged no memory"
    if gate is None or peak is None or gate.outcome == "note":
        return Item(
            name,
            UNKNOWN,
            f"{text} (a GPU memory reading per engine: NVML, or bench --through the proxy; a budget: --memory-budget)"
            + (f"; at once: {at.why}" if at.way else ""),
        )
    if gate.outcome in FAILS:
        return Item(name, NO, text)
    if at.way is None:
        return Item(name, UNKNOWN, f"{v.candidate} alone: {text}; both at once: {at.why}")
    together = at.way == "rollout" and not at.why.startswith(f"{v.baseline} and {v.candidate} run on different")
    held = (at.together() or peak) if together else peak
    ref = at.limit or total or None
    room = f"; headroom {gib(ref - held)} ({(ref - held) / ref:.0%} of the {at.limit_what})" if ref else ""
    lead = (
        f"both at once (the mirrored rollout): {at.why}"
        if together
        else f"each on its own (the mirrored rollout): {at.why}"
        if at.way == "rollout"
        else f"one at a time (the swap): {at.why}, so never both; {v.candidate} alone"
    )
    said = f"{lead}{room}; {v.candidate} alone: {text}" if together else f"{lead}: {text}{room}"
    if total and held > NEAR_FULL * total:
        return Item(
            name, NO, f"{said} — under the {1 - NEAR_FULL:.0%} of the card EnginemeterGPUMemoryNearFull leaves free"
        )
    return Item(name, OK, said)


def _monitoring(d: Data, v: Verdict) -> Item:
    slo = d.goodput.get("ttft")
    alert = (
        f'; add one from the bench\'s goodput SLO: `{TTFT_P95}{{engine="{v.candidate}", role="primary"}} > '
        f"{slo / 1000:g}`"
        if slo
        else f"; add one on the recording rule `{TTFT_P95}` at your SLO"
    )
    return Item(
        "Monitoring covers liveness and latency",
        OK,
        "what the proxy exports once the traffic goes through it — liveness: `GET /health` (each engine's "
        f"state), `{METRICS[0]}`, the alerts {', '.join(LIVENESS_ALERTS)}; latency: the histograms "
        f"{', '.join(f'`{m}`' for m in METRICS[1:4])} (p95 recording rules), the dashboards "
        f"{', '.join(f'`{x}`' for x in DASHBOARDS)}; errors, memory and the rollout: `{METRICS[4]}`, "
        f"`{METRICS[5]}`, `enginemeter_rollout_*`, the alerts {', '.join(GUARD_ALERTS)}; load "
        f"{' and '.join(f'`{x}`' for x in RULES)} into Prometheus. No alert on absolute latency ships "
        f"(enginemeter knows no SLO){alert}",
    )


def _rollback_item(d: Data, v: Verdict) -> Item:
    name = "The rollback record is ready"
    missing = [e for e in (v.baseline, v.candidate) if not launch_command(d, e)]
    if missing:
        return Item(
            name,
            NO,
            f"no launch command recorded for {', '.join(missing)} (resident: enginemeter did not "
            "start it): write the command that starts it into the version-controlled script; what is known "
            "is below (Rollback record)",
        )
    return Item(
        name,
        OK,
        "both launch commands verbatim, the model file, quantization, port and sampling below "
        "(Rollback record): keep them in a version-controlled script, so that going back is one change",
    )
