"""Primary vs shadow: one mirrored pair of Results -> one ``PairComparison``, its metrics and its log record.

``compare()`` is pure. A pair is *comparable* when both sides finished ``ok``; only comparable pairs count in
the pair/mismatch/delta/ratio metrics (a failed side says nothing about token counts or speed — its outcome is
already in ``enginemeter_requests_total{role=...}``). Every pair, comparable or not, gets one log record.

What is compared:

- token counts: ``usage.prompt_tokens`` and ``usage.completion_tokens`` as each engine reports them (a side
  that reports none makes that check ``None``, not a mismatch);
- the finish reason of choice 0;
- for greedy requests (temperature 0 on both sides) the output text of choice 0, and where it differs, the
  first differing position (index into the text, in Unicode code points; the shorter length when one is a
  prefix of the other);
- ratios shadow/primary of upstream TTFT (sent upstream -> first token, so the proxy's own work before the
  send does not enter either side), TPOT and decode tok/s;
- cached prompt tokens each side (``usage.prompt_tokens_details.cached_tokens`` / SGLang's top-level
  ``cached_tokens``, else llama.cpp ``timings.cache_n``), so a cache hit can be told from engine speed.

- for greedy requests whose texts differ, also the first differing *token* position: the number of token
  events both sides sent whole before the first differing character (each event is one token on llama.cpp,
  SGLang and vLLM at their default stream interval).

The log record (``to_record``) says which proxy run (``run``) and which primary/shadow pair it belongs to, when
the pair started and how many mirrored requests overlapped it (``concurrency``), and per side the sampling the
engine actually got after normalization and which params were dropped or filled in (``run_record`` is the line a
run starts with). ``ComparisonLog`` (``proxy.jsonlog``) writes them from its own thread.
"""

from __future__ import annotations

import bisect
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.jsonlog import ComparisonLog as ComparisonLog  # the writer (re-exported: its old home)
from proxy.normalize import Normalized
from proxy.server.record.metrics import Metrics
from proxy.server.record.result import Result

#: bump when a field changes meaning or disappears (adding fields does not bump it)
RECORD_VERSION = 1


@dataclass(frozen=True, slots=True)
class Side:
    """One engine's half of a pair, in the units of the log record."""

    engine: str
    kind: str
    outcome: str
    #: the engine's HTTP status (0: no answer)
    status: int
    ttft_s: float | None
    upstream_ttft_s: float | None
    tpot_s: float | None
    decode_tps: float | None
    e2e_s: float | None
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    engine_prompt_ms: float | None
    engine_decode_tps: float | None
    finish_reason: str | None

    @classmethod
    def of(cls, r: Result) -> Side:
        u, et, t = r.usage, r.engine_timings, r.timing
        cached = u.cached_tokens if u is not None else None
        if cached is None and et is not None:
            cached = et.cache_n
        return cls(
            engine=r.engine,
            kind=r.engine_kind,
            outcome=r.outcome,
            status=r.status,
            ttft_s=t.ttft_s,
            upstream_ttft_s=t.upstream_ttft_s,
            tpot_s=t.tpot_s,
            decode_tps=t.decode_tps,
            e2e_s=t.e2e_s,
            prompt_tokens=u.prompt_tokens if u is not None else None,
            completion_tokens=u.completion_tokens if u is not None else None,
            cached_tokens=cached,
            engine_prompt_ms=et.prompt_ms if et is not None else None,
            engine_decode_tps=et.predicted_per_second if et is not None else None,
            finish_reason=r.finish_reason,
        )


@dataclass(frozen=True, slots=True)
class PairComparison:
    request_id: str
    model: str
    endpoint: str
    stream: bool
    greedy: bool
    comparable: bool
    primary: Side
    shadow: Side
    #: None = could not be checked (a side failed or did not report the figure)
    prompt_mismatch: bool | None
    completion_mismatch: bool | None
    finish_mismatch: bool | None
    output_mismatch: bool | None
    prompt_delta: int | None  # shadow - primary
    completion_delta: int | None
    first_diff_pos: int | None
    #: token events both sides sent whole before the first difference (None: equal, or not streamed)
    first_diff_token: int | None
    ratio_ttft: float | None  # shadow / primary
    ratio_tpot: float | None
    ratio_decode_tps: float | None
    ratio_e2e: float | None  # log record only (non-stream pairs have no TTFT/TPOT)


def first_diff(a: str, b: str) -> int | None:
    """Index of the first differing code point; None when equal."""
    if a == b:
        return None
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def first_diff_token(pos: int, *ends: Sequence[int] | None) -> int | None:
    """How many whole token events end at or before code point ``pos`` on every side (``ends``: each side's
    cumulative end offsets of its token events' text)."""
    counts = [bisect.bisect_right(e, pos) for e in ends if e is not None]
    return min(counts) if len(counts) == len(ends) and counts else None


def _ratio(shadow: float | None, primary: float | None) -> float | None:
    if shadow is None or primary is None or primary <= 0:
        return None
    return shadow / primary


def _delta(shadow: int | None, primary: int | None) -> int | None:
    return None if shadow is None or primary is None else shadow - primary


def compare(primary: Result, shadow: Result) -> PairComparison:
    p, s = Side.of(primary), Side.of(shadow)
    ok = p.outcome == "ok" and s.outcome == "ok"
    greedy = primary.greedy and shadow.greedy
    prompt_d = _delta(s.prompt_tokens, p.prompt_tokens) if ok else None
    compl_d = _delta(s.completion_tokens, p.completion_tokens) if ok else None
    finish_mm = (p.finish_reason != s.finish_reason) if ok and p.finish_reason and s.finish_reason else None
    output_mm = diff_pos = diff_tok = None
    if ok and greedy and primary.text is not None and shadow.text is not None:
        diff_pos = first_diff(primary.text, shadow.text)
        output_mm = diff_pos is not None
        if diff_pos is not None and primary.stream:
            diff_tok = first_diff_token(diff_pos, primary.text_ends, shadow.text_ends)
    return PairComparison(
        request_id=primary.request_id,
        model=primary.model,
        endpoint=primary.endpoint,
        stream=primary.stream,
        greedy=greedy,
        comparable=ok,
        primary=p,
        shadow=s,
        prompt_mismatch=None if prompt_d is None else prompt_d != 0,
        completion_mismatch=None if compl_d is None else compl_d != 0,
        finish_mismatch=finish_mm,
        output_mismatch=output_mm,
        prompt_delta=prompt_d,
        completion_delta=compl_d,
        first_diff_pos=diff_pos,
        first_diff_token=diff_tok,
        ratio_ttft=_ratio(s.upstream_ttft_s, p.upstream_ttft_s) if ok else None,
        ratio_tpot=_ratio(s.tpot_s, p.tpot_s) if ok else None,
        ratio_decode_tps=_ratio(s.decode_tps, p.decode_tps) if ok else None,
        ratio_e2e=_ratio(s.e2e_s, p.e2e_s) if ok else None,
    )


def observe_comparison(m: Metrics, c: PairComparison) -> None:
    """Count one pair. Only comparable pairs (both sides ``ok``) are counted."""
    if not c.comparable:
        return
    pe, se = c.primary.engine, c.shadow.engine
    m.pairs.labels(pe, se).inc()
    for kind, mismatch, delta in (
        ("prompt", c.prompt_mismatch, c.prompt_delta),
        ("completion", c.completion_mismatch, c.completion_delta),
    ):
        if mismatch:
            m.token_mismatch.labels(pe, se, kind).inc()
        if delta is not None:
            m.token_delta.labels(pe, se, kind).observe(delta)
    if c.output_mismatch:
        m.output_mismatch.labels(pe, se).inc()
    if c.finish_mismatch:
        m.finish_mismatch.labels(pe, se).inc()
    for metric, ratio in (("ttft", c.ratio_ttft), ("tpot", c.ratio_tpot), ("decode_tps", c.ratio_decode_tps)):
        if ratio is not None:
            m.ratio.labels(pe, se, metric).observe(ratio)


def _side_record(s: Side) -> dict[str, Any]:
    return {
        "engine": s.engine,
        "kind": s.kind,
        "outcome": s.outcome,
        "status": s.status,
        "ttft_s": s.ttft_s,
        "upstream_ttft_s": s.upstream_ttft_s,
        "tpot_s": s.tpot_s,
        "decode_tps": s.decode_tps,
        "e2e_s": s.e2e_s,
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.completion_tokens,
        "cached_tokens": s.cached_tokens,
        "engine_prompt_ms": s.engine_prompt_ms,
        "engine_decode_tps": s.engine_decode_tps,
        "finish_reason": s.finish_reason,
    }


#: the sampling params a pair record carries per side, as the engine got them (after normalization)
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "repeat_penalty", "ignore_eos", "max_tokens")  # fmt: skip


def sampling_of(norm: Normalized) -> dict[str, Any]:
    """What one engine got of a request's sampling: the values after normalization, and which params the
    proxy dropped for the engine's kind or filled in from ``sampling_defaults``."""
    body = norm.body
    return {
        "params": {k: body[k] for k in SAMPLING_KEYS if k in body},
        "dropped": sorted({c.param for c in norm.changes if c.action == "dropped"}),
        "defaulted": sorted({c.param for c in norm.changes if c.action == "defaulted"}),
    }


def to_record(
    c: PairComparison,
    *,
    ts: float | None = None,
    prompt: Any = None,
    primary_text: str | None = None,
    shadow_text: str | None = None,
    gpus: Mapping[str, Sequence[int]] | None = None,
    run: str | None = None,
    t_start: float | None = None,
    concurrency: tuple[int, int] | None = None,
    sampling: Mapping[str, Normalized] | None = None,
) -> dict[str, Any]:
    """The JSONL record (schema in docs/routing.md). Text fields appear only when given.

    ``gpus``: role (``primary``/``shadow``) -> the GPU indices that side's engine holds memory on (the GPU
    monitor's attribution); when given, the record says which and whether the two share one (``contended``:
    mirrored requests then slow each other, and ``enginemeter report --log`` stops at its parity gate).
    ``run``: the proxy run's id; ``t_start``: Unix time the request arrived (both sides start then);
    ``concurrency``: (mirrored requests in flight at its start, mirrored requests that overlapped it at any
    time), itself included; ``sampling``: role -> that side's normalized request."""
    rec: dict[str, Any] = {
        "v": RECORD_VERSION,
        "type": "pair",
        "ts": time.time() if ts is None else ts,
        "request_id": c.request_id,
        "model": c.model,
        "endpoint": c.endpoint,
        "stream": c.stream,
        "greedy": c.greedy,
        "comparable": c.comparable,
        "primary": _side_record(c.primary),
        "shadow": _side_record(c.shadow),
        "mismatch": {
            "prompt_tokens": c.prompt_mismatch,
            "completion_tokens": c.completion_mismatch,
            "finish_reason": c.finish_mismatch,
            "output": c.output_mismatch,
        },
        "delta": {"prompt_tokens": c.prompt_delta, "completion_tokens": c.completion_delta},
        "first_diff_pos": c.first_diff_pos,
        "first_diff_token": c.first_diff_token,
        "ratios": {
            "ttft": c.ratio_ttft,
            "tpot": c.ratio_tpot,
            "decode_tps": c.ratio_decode_tps,
            "e2e": c.ratio_e2e,
        },
    }
    if run is not None:
        rec["run"] = run
    if t_start is not None:
        rec["t_start"] = t_start
    if concurrency is not None:
        rec["concurrency"] = {"at_start": concurrency[0], "overlapping": concurrency[1]}
    for role, norm in (sampling or {}).items():
        rec[role]["sampling"] = sampling_of(norm)
    if gpus is not None:
        p, sh = sorted(gpus.get("primary", ())), sorted(gpus.get("shadow", ()))
        rec["gpus"] = {"primary": p, "shadow": sh}
        rec["contended"] = bool(set(p) & set(sh))
    if prompt is not None:
        rec["prompt"] = prompt
    if primary_text is not None:
        rec["primary"]["text"] = primary_text
    if shadow_text is not None:
        rec["shadow"]["text"] = shadow_text
    return rec


def new_run_id(now: float | None = None) -> str:
    """A proxy run's id: its start time (UTC, sortable) and 4 random hex digits, e.g. ``20261203T101500Z-3fa2``."""
    t = time.gmtime(time.time() if now is None else now)
    return time.strftime("%Y%m%dT%H%M%SZ", t) + "-" + os.urandom(2).hex()


def run_record(
    run: str,
    *,
    listen: str,
    pairs: Iterable[tuple[str, str]],
    engines: Mapping[str, Mapping[str, Any]],
    version: str,
    ts: float | None = None,
) -> dict[str, Any]:
    """The line a proxy run writes to the comparison log when it starts: its id, where it listened, the
    primary/shadow pairs its routes mirror, and each engine's kind and served model as probed at start."""
    return {
        "v": RECORD_VERSION,
        "type": "run",
        "run": run,
        "ts": time.time() if ts is None else ts,
        "listen": listen,
        "version": version,
        "pairs": [list(p) for p in dict.fromkeys(pairs)],
        "engines": {k: dict(v) for k, v in engines.items()},
    }


def engine_record(run: str, engine: str, facts: Mapping[str, Any], *, ts: float | None = None) -> dict[str, Any]:
    """What the engine-state poller learned about an engine (model path, context, slots, quantization), written
    once per run and again when it changes, so the report judges parity from the log alone."""
    return {
        "v": RECORD_VERSION,
        "type": "engine",
        "run": run,
        "ts": time.time() if ts is None else ts,
        "engine": engine,
        **facts,
    }


def end_record(run: str, counts: Mapping[str, int], compared: int, *, ts: float | None = None) -> dict[str, Any]:
    """The line a proxy run writes when it stops: how many pairs ended for each cause, and how many were compared."""
    return {
        "v": RECORD_VERSION,
        "type": "end",
        "run": run,
        "ts": time.time() if ts is None else ts,
        "counts": dict(counts),
        "compared": compared,
    }
