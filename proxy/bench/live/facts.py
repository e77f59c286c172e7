"""What the live report knows about the engines and the traffic they carried: the facts (quantization, context,
slots) read the bench's way, a running proxy's view, the sampling each engine got per pair, and how often
greedy outputs agreed. Pure but for ``proxy_info`` (two GETs to a running proxy).
"""

from __future__ import annotations

import os
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from proxy.bench.run import targets
from proxy.bench.run.benchconfig import Target, canonical_sampling
from proxy.bench.verdict.inputs import Reason
from proxy.engines.quant import RANDOM_WHY, random_among, random_who
from proxy.gpu.scraped import PER_ENGINE, MemReading, parse_metrics, read_memory
from proxy.normalize import normalize_request
from proxy.types import EngineKind

#: the sampling a client typically sends; what the proxy drops of it per kind is the "effective sampling"
TYPICAL = {"temperature": 0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
           "presence_penalty": 0.0, "frequency_penalty": 0.0, "seed": 0, "max_tokens": 16}  # fmt: skip


def effective_for_kind(kind: str | None) -> tuple[dict[str, Any], list[str] | None]:
    if kind not in ("llamacpp", "sglang", "vllm", "openai"):
        return {}, None
    k: EngineKind = kind  # type: ignore[assignment]
    norm = normalize_request(dict(TYPICAL), endpoint="chat", kind=k, served_model=None, defaults={})
    return canonical_sampling(norm.body), sorted({c.param for c in norm.changes if c.action == "dropped"})


def legacy_sampling(kind: str | None) -> tuple[dict[str, Any], tuple[str, ...] | None]:
    s, d = effective_for_kind(kind)
    return s, tuple(d) if d is not None else None


# ---- a running proxy ---------------------------------------------------------------------------------

#: the key ``proxy_info`` sends to a proxy with ``api_keys`` (an environment variable: a flag shows in ``ps``)
PROXY_KEY_ENV = "ENGINEMETER_PROXY_KEY"


@dataclass
class ProxyInfo:
    url: str
    run: str | None = None
    states: dict[str, dict[str, Any]] = field(default_factory=dict)  # /health engine_state
    memory: dict[str, MemReading] = field(default_factory=dict)
    mirror: dict[str, Any] = field(default_factory=dict)  # /health mirror (the answering worker's)
    #: enginemeter_mirror_requests_total by result, summed over engines (every worker's: /metrics merges them)
    copies: dict[str, int] = field(default_factory=dict)
    error: str | None = None


def proxy_info(url: str, timeout: float = 5.0) -> ProxyInfo:
    """Engine facts, GPU memory peaks since the proxy started and its mirror state, from a running proxy; a
    proxy that does not answer gives an ``error``, not an exception (the log alone still makes the report)."""
    base = url.rstrip("/")
    # a proxy with api_keys shows /health's detail (and /metrics, with metrics.access: key) only to a key
    key = os.environ.get(PROXY_KEY_ENV)
    headers = {"authorization": f"Bearer {key}"} if key else {}
    try:
        health = httpx.get(f"{base}/health", headers=headers, timeout=timeout, trust_env=False).json()
        scrape = httpx.get(f"{base}/metrics", headers=headers, timeout=timeout, trust_env=False)
        scrape.raise_for_status()
        text = scrape.text
    except (httpx.HTTPError, ValueError) as exc:
        hint = f" (a proxy with api_keys: set {PROXY_KEY_ENV} to one of its keys)" if "401" in str(exc) else ""
        return ProxyInfo(base, error=f"{type(exc).__name__}: {exc}{hint}")
    health = health if isinstance(health, dict) else {}
    if "engines" not in health:
        return ProxyInfo(
            base, error=f"its /health answers only liveness without a key: set {PROXY_KEY_ENV} to one of its api_keys"
        )
    states = (health.get("engine_state") or {}).get("engines") or {}
    mirror = health.get("mirror") or {}
    peaks: dict[str, float] = {}
    copies: dict[str, int] = {}
    for name, labels, v in parse_metrics(text):
        if name == "enginemeter_engine_gpu_memory_peak_bytes":
            peaks[labels.get("engine", "")] = peaks.get(labels.get("engine", ""), 0) + v
        elif name == "enginemeter_mirror_requests_total":
            copies[labels.get("result", "")] = copies.get(labels.get("result", ""), 0) + int(v)
    mem: dict[str, MemReading] = {}
    for engine in set(states) | set(peaks):
        now = read_memory(text, engine)
        if now.source in PER_ENGINE:
            peak = int(peaks.get(engine, now.used_bytes or 0))
            mem[engine] = MemReading(max(peak, now.used_bytes or 0), "proxy engine peak", now.gpus, now.total_bytes)
    return ProxyInfo(base, mirror.get("run"), states, mem, mirror, copies)


# ---- sampling and greedy agreement -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SamplingGroup:
    """One engine's pairs of one kind (greedy / sampled / not recorded) and what they carried."""

    engine: str
    group: str
    pairs: int
    params: tuple[tuple[str, int], ...]  # "temperature=0.8, top_k=40, ..." -> pairs, most common first
    max_tokens: tuple[int, ...]  # the distinct max_tokens
    dropped: Mapping[str, int]  # param -> pairs
    defaulted: Mapping[str, int]


def side_sampling(side: Mapping[str, Any]) -> Mapping[str, Any] | None:
    s = side.get("sampling")
    return s if isinstance(s, dict) and isinstance(s.get("params"), dict) else None


def _canon_text(params: Mapping[str, Any]) -> str:
    c = canonical_sampling(params)
    return ", ".join(f"{k}={c[k]}" for k in sorted(c)) or "nothing explicit"


def sampling_groups(recs: Sequence[Mapping[str, Any]], role: str) -> list[SamplingGroup]:
    groups: dict[str, list[Mapping[str, Any]]] = {}
    engine = str(recs[0][role].get("engine")) if recs else "?"
    for r in recs:
        s = side_sampling(r[role])
        if s is None:
            groups.setdefault("not recorded (a proxy before per-side sampling)", []).append({})
            continue
        t = s["params"].get("temperature")
        g = "temperature 0 (greedy)" if t == 0 else "temperature > 0 (sampled)" if t is not None else "no temperature"
        groups.setdefault(g, []).append(s)
    out = []
    for g, ss in groups.items():
        params = Counter(_canon_text(s["params"]) for s in ss if s)
        mt = sorted(
            {int(s["params"]["max_tokens"]) for s in ss if s and isinstance(s["params"].get("max_tokens"), int)}
        )
        out.append(
            SamplingGroup(
                engine,
                g,
                len(ss),
                tuple(params.most_common()),
                tuple(mt),
                Counter(p for s in ss if s for p in s.get("dropped") or ()),
                Counter(p for s in ss if s for p in s.get("defaulted") or ()),
            )
        )
    return sorted(out, key=lambda x: x.group)


def sampling_parity(recs: Sequence[Mapping[str, Any]]) -> tuple[int, int, Mapping[str, Any] | None]:
    """(pairs with both sides recorded, pairs whose two engines got different canonical sampling, the first
    such pair)."""
    both = differ = 0
    first = None
    for r in recs:
        p, s = side_sampling(r["primary"]), side_sampling(r["shadow"])
        if p is None or s is None:
            continue
        both += 1
        if canonical_sampling(p["params"]) != canonical_sampling(s["params"]):
            differ += 1
            first = first or r
    return both, differ, first


@dataclass(frozen=True, slots=True)
class Greedy:
    pairs: int  # comparable greedy pairs with both texts compared
    differ: int
    first_tokens: tuple[int, ...]  # first differing token position of each differing pair (where known)


def greedy_agreement(recs: Sequence[Mapping[str, Any]]) -> Greedy:
    g = [
        r
        for r in recs
        if r.get("greedy") and r.get("comparable") and (r.get("mismatch") or {}).get("output") is not None
    ]
    d = [r for r in g if r["mismatch"]["output"]]
    toks = tuple(sorted(int(r["first_diff_token"]) for r in d if isinstance(r.get("first_diff_token"), int)))
    return Greedy(len(g), len(d), toks)


def greedy_text(base: str, cand: str, g: Greedy, random: Mapping[str, str] | None = None) -> str:
    mine = random_among(random or {}, base, cand)
    if mine:
        return f"greedy outputs cannot be judged: {random_who(mine)} — {RANDOM_WHY}"
    if not g.pairs:
        return "greedy outputs: no greedy pair (temperature 0 on both sides) was compared"
    if not g.differ:
        return f"greedy outputs identical in all {g.pairs} greedy pairs"
    at = ""
    if g.first_tokens:
        t = g.first_tokens
        at = (
            f"; first differing token: median {statistics.median(t):g}, range {t[0]}–{t[-1]} "
            f"({sum(1 for x in t if x == 0)} at token 0)"
        )
    why = (
        "at token 0 the engines did not see the same input (chat template, BOS, tokenizer) or sample differently"
        if g.first_tokens and statistics.median(g.first_tokens) == 0
        else "later tokens usually mean floating-point differences (batched vs single-request kernels, another "
        "build or number format) that flip a near-tie argmax, after which the texts part; speed is still "
        "comparable when the output lengths agree"
    )
    return (
        f"greedy outputs differ in {g.differ} of {g.pairs} greedy pairs ({g.differ / g.pairs:.0%}) between "
        f"{base} and {cand}{at} — {why}"
    )


# ---- engine facts -----------------------------------------------------------------------------------


def engine_facts(
    name: str, kind: str | None, facts: Mapping[str, Any], declared: str | None, state: Mapping[str, Any]
) -> Target:
    """A bench ``Target`` filled the bench's way: declared, the engine's own words, the GGUF header, the name."""
    src = facts or state
    t = Target(
        name=name,
        url=None,
        kind=kind if kind in ("llamacpp", "sglang", "vllm", "openai") else None,  # type: ignore[arg-type]
        model=src.get("model"),
        quantization=declared,
        quantization_source="declared" if declared else None,
    )
    if src.get("model_path"):
        t.info["model_path"] = src["model_path"]
    t.slots = src.get("slots")
    t.context_per_slot = src.get("context_length")
    if src.get("kv_pool_tokens"):
        t.info["kv_pool_tokens"] = src["kv_pool_tokens"]
    targets.quantization(t, {"quantization": src.get("quantization"), "weights_format": src.get("weights_format")})
    if not declared and not facts and state and t.quantization_source:
        t.quantization_source = f"{t.quantization_source}, via the running proxy"
    return t


def sampling_reasons(
    bl: str,
    other: str,
    recs: Sequence[Mapping[str, Any]],
    canon_of: dict[str, Mapping[str, Any]],
    dropped_of: dict[str, set[str]],
) -> list[Reason]:
    both, differ, first = sampling_parity(recs)
    if not both:
        return [
            Reason(
                "parity",
                "note",
                f"{bl} / {other}: the records do not say what sampling each engine got (a "
                "proxy before per-side sampling): effective sampling derived from the engine kinds",
                "sampling",
            )
        ]
    for role, name in (("primary", bl), ("shadow", other)):
        ss = [s for r in recs if (s := side_sampling(r[role])) is not None]
        dropped_of.setdefault(name, set()).update(p for s in ss for p in s.get("dropped") or ())
        if first is not None:  # the gate compares one set per engine: show it one pair that differed
            canon_of[name] = canonical_sampling(first[role]["sampling"]["params"])
        else:  # equal in every pair: the most common set
            common = Counter(_canon_text(s["params"]) for s in ss).most_common(1)[0][0]
            canon_of[name] = canonical_sampling(next(s["params"] for s in ss if _canon_text(s["params"]) == common))
    if differ and first is not None:
        a, b = (_canon_text(first[x]["sampling"]["params"]) for x in ("primary", "shadow"))
        return [
            Reason(
                "parity",
                "inconclusive",
                f"sampling differed in {differ} of {both} pairs: {bl} got {a} vs "
                f"{other} {b} (e.g. request {first.get('request_id')})",
                "sampling as carried",
            )
        ]
    greedy = sum(1 for r in recs if (side_sampling(r["primary"]) or {}).get("params", {}).get("temperature") == 0)
    return [
        Reason(
            "parity",
            "ok",
            f"every one of {both} pairs gave {bl} and {other} the same sampling "
            f"({greedy} at temperature 0, {both - greedy} above; see Sampling as carried)",
            "sampling as carried",
        )
    ]
