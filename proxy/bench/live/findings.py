"""What the comparison log finds besides the speeds, as the verdict's reasons and findings: pairs lost for causes
that are not an engine's speed, engine-side failures against the error budget, pairs contended on a shared GPU,
and each regime as the anytime-valid live verdict decided it. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from proxy.bench.live.log import CAUSE_TEXT, Outcomes
from proxy.bench.verdict.inputs import LiveFinding, Reason
from proxy.sequential import REGIME_LABEL, LiveVerdict, sentence

#: regime step -> the live stream that decides it (the others are shown beside it): single request: TPOT; under
#: load: e2e per output token (the time a loaded request takes per token); long context: TTFT
DECIDING = {
    "decode": ("decode", "tpot_s"),
    "throughput": ("load", "e2e_per_token_s"),
    "long-context": ("long", "ttft_s"),
}


def findings(v: LiveVerdict) -> dict[str, LiveFinding]:
    """Each regime as the anytime-valid live verdict has it: its deciding stream's decision, in words."""
    out: dict[str, LiveFinding] = {}
    states = v.states()
    for step, (regime, metric) in DECIDING.items():
        stream = next((s for s in states if s.regime == regime and s.metric == metric), None)
        if stream is None:
            continue
        st = states[stream]
        out[step] = LiveFinding(
            st.decision,
            sentence(v.shadow, v.primary, stream, st, v.min_effect),
            st.n,
            f"{REGIME_LABEL[regime]} {stream.label}",
        )
    return out


def outcome_reasons(bl: str, other: str, o: Outcomes, max_rate: float) -> list[Reason]:
    """The data gate's view of an engine pair's outcomes: pairs lost for other causes (left out), and each
    engine's own failures (left out within ``max_rate``, stopping the gate above it)."""
    out = []
    lost = {c: n for c, n in o.by_cause.items() if c not in ("ok", "engine")}
    if lost:
        what = "; ".join(f"{n} {CAUSE_TEXT[c]}" for c, n in sorted(lost.items()))
        down = ", ".join(f"{e}: {n}" for e, n in sorted(o.unreachable.items()))
        text = (
            f"{sum(lost.values())} of {o.total} pairs of {bl} and {other} lost for causes "
            f"that are not an engine's speed, left out: {what}" + (f" (unreachable — {down})" if down else "")
        )
        out.append(Reason("data", "ok", text, "causes"))
    for name in (bl, other):
        f = o.failures.get(name)
        if not f:
            continue
        n, rate = sum(f.values()), o.failure_rate(name)
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(f.items()))
        judged = o.by_cause.get("ok", 0) + o.by_cause.get("engine", 0)
        if rate > max_rate:
            text = (
                f"{name}: engine-side failures in {n} of {judged} pairs "
                f"({rate:.1%} > {max_rate * 100:g}%: {kinds}) — the engine itself fails under this traffic"
            )
            out.append(Reason("data", "inconclusive", text, "errors"))
        else:
            text = (
                f"{name}: engine-side failures in {n} of {judged} pairs ({rate:.1%}, "
                f"within the {max_rate * 100:g}% the live report tolerates: {kinds}); those pairs are left out"
            )
            out.append(Reason("data", "ok", text, "errors"))
    return out


def contention(r: Mapping[str, Any], gpus: Mapping[str, set[int]]) -> str | None:
    """Why a pair was contended (its record says so, or the proxy's GPU attribution puts both on one GPU)."""
    if r.get("contended") is True:
        g = r.get("gpus") or {}
        shared = sorted(set(g.get("primary") or ()) & set(g.get("shadow") or ()))
        return f"GPU {', '.join(map(str, shared))}" if shared else "the proxy marked the pair contended"
    if gpus:
        p, s = str(r["primary"].get("engine")), str(r["shadow"].get("engine"))
        shared = sorted(gpus.get(p, set()) & gpus.get(s, set()))
        if shared:
            return f"GPU {', '.join(map(str, shared))}, per the proxy's GPU attribution"
    return None


def contention_reason(bl: str, other: str, contended: Sequence[str]) -> Reason:
    text = (
        f"contended: {len(contended)} mirrored pair(s) of {bl} and "
        f"{other} ran on a shared GPU ({contended[0]}) — each slows the other, so the speeds "
        "are not the engines' own; mirror to a shadow on its own GPU"
    )
    return Reason("parity", "inconclusive", text, "contention")
