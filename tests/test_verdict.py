"""The verdict on crafted results: every inconclusive path, and wins only beyond the run-to-run spread."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest

from proxy.bench.verdict import Cell, Comparison, EngineInfo, Results, Sample, Verdict, decide, decide_all

SAMPLING = {"temperature": 0, "top_p": 1, "top_k": "off", "seed": 1, "ignore_eos": True}
C1 = Cell("cold", 1, 64, "medium")
C8 = Cell("cold", 8, 64, "medium")
LONG = Cell("cold", 1, 64, "long")


def engines(**over: object) -> tuple[EngineInfo, EngineInfo]:
    a = EngineInfo("llama", "llamacpp", "m", "Q4_K_M", dict(SAMPLING), (64,))
    b = EngineInfo("sglang", "sglang", "m", "Q4_K_M", dict(SAMPLING), (64,))
    return a, dataclasses.replace(b, **over)  # type: ignore[arg-type]


def samples(
    engine: str,
    cell: Cell,
    *,
    decode: Sequence[float] = (100, 101, 102),
    tps: Sequence[float] | None = None,
    ttft: Sequence[float] | None = None,
    n_err: int = 0,
    tokens: float = 64,
    mem: int | None = None,
) -> list[Sample]:
    out = []
    for i, d in enumerate(decode):
        out.append(
            Sample(
                engine=engine,
                cell=cell,
                repeat=i,
                n_ok=cell.concurrency,
                n_err=n_err,
                ttft_s=ttft[i] if ttft else 0.1,
                tpot_s=1 / d,
                decode_tps=d,
                e2e_s=1.0,
                completion_tokens=tokens,
                output_tps=tps[i] if tps else d * cell.concurrency * 0.9,
                gpu_mem_peak_bytes=mem,
                errors=("HTTP 500: boom",) if n_err else (),
            )
        )
    return out


def prompt_tokens(a: int = 100, b: int = 100) -> dict[str, dict[str, int]]:
    return {"llama": {"tokenizer:en": 100, "tokenizer:zh": a}, "sglang": {"tokenizer:en": 100, "tokenizer:zh": b}}


def results(ss: Sequence[Sample], **over: object) -> Results:
    r = Results(
        engines=engines(),
        baseline="llama",
        samples=tuple(ss),
        prompt_tokens=prompt_tokens(),
        base_max_tokens=64,
        base_prompt_len="medium",
    )
    return dataclasses.replace(r, **over)  # type: ignore[arg-type]


def equal_runs() -> list[Sample]:
    return [*samples("llama", C1), *samples("sglang", C1)]


def reasons(v: Verdict, outcome: str) -> list[str]:
    return [x.text for x in v.reasons if x.outcome == outcome]


# ---- decisive paths ----------------------------------------------------------------------------------


def test_equal_engines_stay_decode_bound() -> None:
    v = decide(results(equal_runs()), "sglang")
    assert v.decision == "stay"
    assert "decode-bound, switching engines won't fix it" in v.summary
    (tie,) = reasons(v, "tie")
    assert "100" in tie and "102" in tie  # the numbers are in the reason
    assert not reasons(v, "inconclusive")


def test_faster_beyond_spread_is_switch() -> None:
    ss = [*samples("llama", C1), *samples("sglang", C1, decode=(120, 121, 123))]
    v = decide(results(ss), "sglang")
    assert v.decision == "switch", v
    (win,) = reasons(v, "win")
    assert "sglang is faster" in win and "Δ +19.8%" in win


def test_slower_beyond_spread_is_stay() -> None:
    ss = [*samples("llama", C1), *samples("sglang", C1, decode=(80, 81, 82))]
    v = decide(results(ss), "sglang")
    assert v.decision == "stay"
    assert reasons(v, "loss")


def test_a_difference_inside_the_spread_is_never_a_win() -> None:
    # medians differ by 10%, but the ranges overlap: 95..110 vs 104..115
    ss = [*samples("llama", C1, decode=(95, 100, 110)), *samples("sglang", C1, decode=(104, 110, 115))]
    v = decide(results(ss), "sglang")
    assert v.decision == "stay"
    assert not reasons(v, "win")
    assert reasons(v, "tie")


def test_ttft_lower_is_better() -> None:
    c = Comparison("ttft_s", "s", False, (0.5, 0.51, 0.52), (0.3, 0.31, 0.32))
    assert c.outcome == "win"
    assert dataclasses.replace(c, cand=(0.7, 0.71, 0.72)).outcome == "loss"


def test_throughput_and_long_context_are_judged() -> None:
    ss = [
        *samples("llama", C1),
        *samples("sglang", C1),
        *samples("llama", C8, tps=(400, 410, 405)),
        *samples("sglang", C8, tps=(900, 910, 905)),
        *samples("llama", LONG, ttft=(1.0, 1.01, 1.02)),
        *samples("sglang", LONG, ttft=(1.0, 1.01, 1.02)),
    ]
    v = decide(results(ss), "sglang")
    steps = {x.step: x.outcome for x in v.reasons if x.outcome in ("win", "tie", "loss")}
    assert steps == {"decode": "tie", "throughput": "win", "long-context": "tie"}
    assert v.decision == "switch"
    assert "c=8" in reasons(v, "win")[0]


def test_memory_that_does_not_fit_is_stay() -> None:
    ss = [*samples("llama", C1, mem=20 * 2**30), *samples("sglang", C1, decode=(150, 151, 152), mem=90 * 2**30)]
    v = decide(results(ss, memory_budget_bytes=80 * 2**30), "sglang")
    assert v.decision == "stay"
    assert "does not fit" in v.summary and "90.00 GiB" in v.summary


def test_memory_unknown_is_a_note_not_a_blocker() -> None:
    v = decide(results(equal_runs()), "sglang")
    (mem,) = [x for x in v.reasons if x.step == "memory"]
    assert mem.outcome == "note" and "unknown" in mem.text


def test_quantization_differs_is_a_note() -> None:
    r = results(equal_runs(), engines=engines(quantization="FP8"))
    v = decide(r, "sglang")
    assert v.decision == "stay"
    assert any("quantization differs" in t for t in reasons(v, "note"))


def test_warm_cache_alone_is_judged_and_cold_preferred() -> None:
    warm = Cell("warm", 1, 64, "medium")
    ss = [*samples("llama", warm), *samples("sglang", warm, decode=(150, 151, 152))]
    assert decide(results(ss), "sglang").decision == "switch"
    # with both phases the cold phase decides: here a tie
    v = decide(results([*ss, *equal_runs()]), "sglang")
    assert v.decision == "stay"


def test_decide_all_one_verdict_per_candidate() -> None:
    third = EngineInfo("vllm", "vllm", "m", "Q4_K_M", dict(SAMPLING), (64,))
    r = results([*equal_runs(), *samples("vllm", C1)], engines=(*engines(), third))
    r = dataclasses.replace(r, prompt_tokens={**r.prompt_tokens, "vllm": {"tokenizer:en": 100}})
    vs = decide_all(r)
    assert [(v.baseline, v.candidate) for v in vs] == [("llama", "sglang"), ("llama", "vllm")]


# ---- every inconclusive path ---------------------------------------------------------------------------


def assert_inconclusive(v: Verdict, needle: str) -> None:
    assert v.decision == "inconclusive", v
    assert any(needle in t for t in reasons(v, "inconclusive")), reasons(v, "inconclusive")


def test_prompt_token_mismatch() -> None:
    v = decide(results(equal_runs(), prompt_tokens=prompt_tokens(100, 103)), "sglang")
    assert_inconclusive(v, "prompt tokens differ")
    assert "100 vs 103" in v.summary


def test_prompt_tokens_unknown() -> None:
    assert_inconclusive(decide(results(equal_runs(), prompt_tokens={}), "sglang"), "parity unknown")


def test_sampling_differs() -> None:
    r = results(equal_runs(), engines=engines(sampling={**SAMPLING, "top_p": 0.95}))
    v = decide(r, "sglang")
    assert_inconclusive(v, "sampling differs")
    assert "top_p: 1 vs 0.95" in v.summary


def test_sampling_not_recorded() -> None:
    assert_inconclusive(decide(results(equal_runs(), engines=engines(sampling={})), "sglang"), "not recorded")


def test_max_tokens_differ() -> None:
    v = decide(results(equal_runs(), engines=engines(max_tokens=(128,))), "sglang")
    assert_inconclusive(v, "max tokens differ")


def test_output_lengths_differ() -> None:
    ss = [*samples("llama", C1), *samples("sglang", C1, tokens=20)]
    assert_inconclusive(decide(results(ss), "sglang"), "output lengths differ")


def test_quantization_undeclared() -> None:
    v = decide(results(equal_runs(), engines=engines(quantization=None)), "sglang")
    assert_inconclusive(v, "quantization not declared for sglang")


def test_difference_within_wide_noise_is_inconclusive() -> None:
    # spread 60% of the median on the candidate: too noisy to call anything, even "no difference"
    ss = [*samples("llama", C1), *samples("sglang", C1, decode=(80, 100, 140))]
    v = decide(results(ss), "sglang")
    assert v.decision == "inconclusive"
    assert "too noisy" in v.summary
    assert reasons(v, "noisy")


def test_too_few_repeats() -> None:
    ss = [*samples("llama", C1, decode=(100, 101)), *samples("sglang", C1, decode=(150, 151))]
    v = decide(results(ss), "sglang")
    assert_inconclusive(v, "too few repeats")
    assert not reasons(v, "win")  # 2 repeats never make a win, however far apart


def test_errors() -> None:
    ss = [*samples("llama", C1), *samples("sglang", C1, n_err=1)]
    v = decide(results(ss), "sglang")
    assert_inconclusive(v, "3 of 6 requests failed")
    assert "HTTP 500: boom" in v.summary


def test_no_successful_requests() -> None:
    bad = [dataclasses.replace(s, n_ok=0, n_err=1, decode_tps=None) for s in samples("sglang", C1)]
    assert_inconclusive(decide(results([*samples("llama", C1), *bad]), "sglang"), "no successful requests")


def test_no_common_cell() -> None:
    ss = [*samples("llama", C1), *samples("sglang", C8)]
    assert_inconclusive(decide(results(ss), "sglang"), "share no measured cell")


def test_engine_without_results() -> None:
    v = decide(results(equal_runs()), "vllm")
    assert v.decision == "inconclusive"
    assert "vllm" in v.summary


def test_mixed_wins_and_losses() -> None:
    ss = [
        *samples("llama", C1),
        *samples("sglang", C1, decode=(80, 81, 82)),
        *samples("llama", C8, tps=(400, 410, 405)),
        *samples("sglang", C8, tps=(900, 910, 905)),
    ]
    v = decide(results(ss), "sglang")
    assert v.decision == "inconclusive"
    assert "mixed" in v.summary and "throughput" in v.summary and "decode" in v.summary


def test_nothing_comparable() -> None:
    # cells in common but no figures: nothing judged
    empty = [dataclasses.replace(s, decode_tps=None, output_tps=None, ttft_s=None) for s in equal_runs()]
    v = decide(results(empty), "sglang")
    assert v.decision == "inconclusive"
    assert "nothing comparable" in v.summary


@pytest.mark.parametrize(
    ("base", "cand", "outcome"),
    [
        ((1, 2, 3), (4, 5, 6), "win"),
        ((1, 2, 3), (3, 5, 6), "tie"),  # touching ranges overlap
        ((4, 5, 6), (1, 2, 3), "loss"),
    ],
)
def test_comparison_ranges(base: tuple[float, ...], cand: tuple[float, ...], outcome: str) -> None:
    assert Comparison("decode_tps", "tok/s", True, base, cand, max_noise=10).outcome == outcome
