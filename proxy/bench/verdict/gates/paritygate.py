"""The parity gate: both engines saw the same input and did the same work — prompt tokens, effective sampling
(what the per-kind mapping dropped included), max tokens, output lengths, context per slot, quantization
(normalized: F16 = FP16 = float16; bf16 ≠ f16); slots below the offered concurrency are stated. Pure."""

from __future__ import annotations

import statistics

from proxy.bench.verdict.inputs import EngineInfo, Reason, Results
from proxy.engines.quant import quant_key
from proxy.notation import count


def parity_gate(r: Results, b: EngineInfo, c: EngineInfo, offered: int | None) -> list[Reason]:
    out: list[Reason] = []
    out += _prompt_parity(r, b, c)
    out += _sampling_parity(r, b, c)
    # same max_tokens is not enough if one engine stops early (EOS): then tok/s compares different work
    lens_b = [s.completion_tokens for s in r.samples if s.engine == b.name and s.completion_tokens]
    lens_c = [s.completion_tokens for s in r.samples if s.engine == c.name and s.completion_tokens]
    if lens_b and lens_c:
        mb, mc = statistics.mean(lens_b), statistics.mean(lens_c)
        if abs(mb - mc) > 0.1 * max(mb, mc):
            out.append(
                Reason(
                    "parity",
                    "inconclusive",
                    f"output lengths differ: {b.name} {mb:.1f} vs {c.name} "
                    f"{mc:.1f} tokens per request on average — set ignore_eos or compare per-token "
                    "figures only",
                    "output length",
                )
            )
    out += _context_parity(b, c, offered, "context" in r.expected)
    out += _quant_parity(r, b, c)
    return out


def _prompt_parity(r: Results, b: EngineInfo, c: EngineInfo) -> list[Reason]:
    pb, pc = r.prompt_tokens.get(b.name, {}), r.prompt_tokens.get(c.name, {})
    keys = sorted(set(pb) & set(pc))
    if not keys:
        return [
            Reason(
                "parity",
                "inconclusive",
                "prompt-token parity unknown: no prompt was counted on both engines",
                "prompt tokens",
            )
        ]
    diff = [k for k in keys if pb[k] != pc[k]]
    if diff:
        ex = "; ".join(f"{k}: {pb[k]} vs {pc[k]}" for k in diff[:3])
        return [
            Reason(
                "parity",
                "inconclusive",
                f"prompt tokens differ on {len(diff)} of {len(keys)} prompts "
                f"({b.name} vs {c.name}: {ex}) — chat template, BOS or tokenizer conversion differ; the "
                "engines did not see the same input",
                "prompt tokens",
            )
        ]
    return [
        Reason(
            "parity",
            "ok",
            f"prompt tokens equal on all {len(keys)} counts taken on both engines (tokenizer and per-request usage)",
            "prompt tokens",
        )
    ]


def _sampling_parity(r: Results, b: EngineInfo, c: EngineInfo) -> list[Reason]:
    out: list[Reason] = []
    sb, sc = dict(b.sampling), dict(c.sampling)
    if not sb or not sc:
        out.append(Reason("parity", "inconclusive", "sampling parameters not recorded for both engines", "sampling"))
    else:
        bad = sorted(k for k in set(sb) | set(sc) if k != "max_tokens" and sb.get(k) != sc.get(k))
        if bad:
            ex = "; ".join(f"{k}: {sb.get(k, 'dropped')!r} vs {sc.get(k, 'dropped')!r}" for k in bad[:4])
            out.append(
                Reason("parity", "inconclusive", f"effective sampling differs ({b.name} vs {c.name}: {ex})", "sampling")
            )
        else:
            out.append(
                Reason(
                    "parity",
                    "ok",
                    "effective sampling equal: " + ", ".join(f"{k}={sb[k]}" for k in sorted(sb)),
                    "sampling",
                )
            )
    for e, other in ((b, c), (c, b)):
        if e.dropped is None:
            out.append(
                Reason("parity", "note", f"{e.name}: which params the proxy dropped is not recorded", "sampling")
            )
            continue
        only = sorted(set(e.dropped) - set(other.dropped or ()))
        if only:
            out.append(
                Reason(
                    "parity",
                    "inconclusive",
                    f"{e.name} ({e.kind}) had {', '.join(only)} dropped by the "
                    f"per-kind mapping; {other.name} got {'it' if len(only) == 1 else 'them'}",
                    "sampling",
                )
            )
    if sorted(b.max_tokens) != sorted(c.max_tokens) or not b.max_tokens:
        if r.live:
            out.append(
                Reason(
                    "parity", "ok", "max tokens equal by construction (one client request, both sides)", "max tokens"
                )
            )
        else:
            out.append(
                Reason(
                    "parity",
                    "inconclusive",
                    f"max tokens differ: {b.name} {list(b.max_tokens) or 'unknown'}"
                    f" vs {c.name} {list(c.max_tokens) or 'unknown'}",
                    "max tokens",
                )
            )
    else:
        out.append(Reason("parity", "ok", f"same max tokens: {list(b.max_tokens)}", "max tokens"))
    return out


def _context_parity(b: EngineInfo, c: EngineInfo, offered: int | None, expected: bool = False) -> list[Reason]:
    out: list[Reason] = []
    if b.context_per_slot and c.context_per_slot:
        if b.context_per_slot != c.context_per_slot and expected:
            out.append(
                Reason(
                    "parity",
                    "note",
                    f"context per slot differs: {b.name} {b.context_per_slot} vs {c.name} "
                    f"{c.context_per_slot} tokens — the swept flag changes it (llama.cpp: -c divided by "
                    "-np); that is part of what is compared",
                    "context",
                )
            )
        elif b.context_per_slot != c.context_per_slot:
            out.append(
                Reason(
                    "parity",
                    "inconclusive",
                    f"context per slot differs: {b.name} {b.context_per_slot} vs "
                    f"{c.name} {c.context_per_slot} tokens — KV-cache size and batch room differ, so the "
                    "engines are not configured alike (llama.cpp: -c divided by -np)",
                    "context",
                )
            )
        else:
            out.append(Reason("parity", "ok", f"context per slot equal: {b.context_per_slot} tokens", "context"))
    else:
        unknown = [e.name for e in (b, c) if not e.context_per_slot]
        out.append(Reason("parity", "note", f"context per slot unknown for {', '.join(unknown)}", "context"))
    for e, other in ((b, c), (c, b)):
        if e.kv_pool_tokens and e.context_per_slot and e.kv_pool_tokens < e.context_per_slot:
            longest = f"{other.context_per_slot:,} tokens" if other.context_per_slot else "context unknown"
            out.append(
                Reason(
                    "parity",
                    "note",
                    f"{e.name}'s KV pool holds {e.kv_pool_tokens:,} tokens, fewer than "
                    f"its {e.context_per_slot:,}-token context: no request longer than the pool can run "
                    f"on it ({other.name}: {longest}); a service with such requests would see that "
                    "difference, the cells measured here do not",
                    "kv pool",
                )
            )
    if offered:
        for e in (b, c):
            if e.slots is not None and e.slots < offered:
                out.append(
                    Reason(
                        "parity",
                        "note",
                        f"{e.name} has {count(e.slots, 'slot')} for an offered concurrency of "
                        f"{offered}: requests beyond {e.slots} wait inside the engine — that queueing is "
                        "part of what is measured",
                        "slots",
                    )
                )
    return out


def quant_differs(b: EngineInfo, c: EngineInfo) -> bool:
    """Both quantizations known and different after normalization (F16 = FP16 = float16; bf16 ≠ f16)."""
    return bool(b.quantization and c.quantization and quant_key(b.quantization) != quant_key(c.quantization))


#: what an unmeasured discount says of its cost in answers, and how to measure it (short: the first screen's line)
NOT_MEASURED = "answers not compared: bench --agreement"


def discount(b: EngineInfo, c: EngineInfo, measured: str | None = None, random: bool = False) -> str:
    """What a verdict across a declared precision difference includes besides the engines; ``measured``: what was
    measured of it (``proxy.bench.quality``: "same top token 97.1 % [96.4–97.7], mean KL 0.012"). ``random``: either
    engine runs random weights, where that figure is no discount: a random network turns any format's error into
    another function (llama.cpp's own Q4_K_M of a random 3 B checkpoint kept 7.6 % of its F16's top tokens, while
    F16 and vLLM bf16 of it agreed on 14 of 16 first tokens: docs/gpu-results/h100-2026-12-07-agree-vllm)."""
    if measured and random:
        return (
            f"includes the precision difference {b.quantization} vs {c.quantization}, not measurable on random "
            f"weights (on these: {measured}); measure it on the real weights"
        )
    if measured:
        return f"includes the precision difference {b.quantization} vs {c.quantization}, measured: {measured}"
    return (
        f"includes the precision difference {b.quantization} vs {c.quantization} ({NOT_MEASURED}); a same-weights "
        "comparison is the clean test"
    )


def discount_for(r: Results, b: EngineInfo, c: EngineInfo) -> str:
    """The discount of ``c`` against ``b`` with what the run measured of it: one text for the verdict and its
    parity reason."""
    q = r.quality.get(c.name)
    return discount(b, c, q.short() if q else None, bool(r.random_of(b.name, c.name)))


def _quant_parity(r: Results, b: EngineInfo, c: EngineInfo) -> list[Reason]:
    undeclared = [e.name for e in (b, c) if not e.quantization]
    if undeclared:
        return [
            Reason(
                "parity",
                "inconclusive",
                f"quantization unknown for {', '.join(undeclared)} (--quantization NAME=Q4_K_M|FP16|...)",
                "quantization",
            )
        ]
    kb, kc = quant_key(b.quantization), quant_key(c.quantization)
    src = (
        f"{b.name} {b.quantization} ({b.quantization_source or 'declared'}) vs {c.name} {c.quantization} "
        f"({c.quantization_source or 'declared'})"
    )
    if kb != kc:
        extra = " — bf16 ≠ f16: same size, different number format" if {kb, kc} == {"bf16", "f16"} else ""
        if r.accept_quantization_difference:
            return [
                Reason(
                    "parity",
                    "note",
                    f"quantization differs: {src}{extra} — accepted as a declared "
                    f"difference (--accept-quantization-difference): the verdict is discounted, it "
                    f"{discount_for(r, b, c)}",
                    "quantization",
                )
            ]
        return [
            Reason(
                "parity",
                "inconclusive",
                f"quantization differs: {src}{extra} — speed and quality both change; compare like with like",
                "quantization",
            )
        ]
    return [Reason("parity", "ok", f"quantization equal: {src}", "quantization")]
