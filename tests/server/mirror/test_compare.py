"""proxy/server/mirror/compare.py: the pair -> Comparison rules, its metrics, and the rotating JSONL log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from proxy.server.mirror.compare import ComparisonLog, compare, first_diff, observe_comparison, to_record
from proxy.server.record.metrics import Metrics
from proxy.server.record.result import Result
from proxy.timing import EngineTimings, StreamTiming, Usage
from proxy.types import EngineKind, Outcome, Role


def _result(
    role: Role,
    engine: str,
    *,
    prompt: int | None = 10,
    completion: int | None = 8,
    cached: int | None = None,
    cache_n: int | None = None,
    upstream_ttft: float | None = 0.1,
    tpot: float | None = 0.01,
    tps: float | None = 100.0,
    finish: str | None = "length",
    text: str | None = "hello world",
    greedy: bool = True,
    outcome: Outcome = "ok",
) -> Result:
    timing = StreamTiming(
        ttft_s=None if upstream_ttft is None else upstream_ttft + 0.001,
        upstream_ttft_s=upstream_ttft,
        headers_s=0.001,
        overhead_s=0.001,
        tpot_s=tpot,
        decode_tps=tps,
        e2e_s=0.5,
        queue_s=None,
    )
    return Result(
        request_id="req-1",
        engine=engine,
        engine_kind="llamacpp" if engine == "llama" else "sglang",
        role=role,
        model="m",
        endpoint="chat",
        stream=True,
        outcome=outcome,
        status=200,
        timing=timing,
        usage=Usage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached),
        engine_timings=EngineTimings(prompt_ms=12.5, cache_n=cache_n, predicted_per_second=101.0)
        if engine == "llama"
        else None,
        finish_reason=finish,
        n_token_events=8,
        greedy=greedy,
        text=text,
    )


def test_first_diff() -> None:
    assert first_diff("abc", "abc") is None
    assert first_diff("abc", "abd") == 2
    assert first_diff("abc", "abcdef") == 3
    assert first_diff("", "x") == 0


def test_identical_pair_has_no_mismatch_and_unit_ratios() -> None:
    c = compare(_result("primary", "llama"), _result("shadow", "sglang"))
    assert c.comparable
    assert (c.prompt_mismatch, c.completion_mismatch, c.finish_mismatch, c.output_mismatch) == (
        False,
        False,
        False,
        False,
    )
    assert c.first_diff_pos is None
    assert c.ratio_ttft == pytest.approx(1.0)
    assert c.ratio_tpot == pytest.approx(1.0)
    assert c.ratio_decode_tps == pytest.approx(1.0)


def test_mismatches_deltas_and_ratios() -> None:
    p = _result("primary", "llama", prompt=10, completion=8, text="hello world", cache_n=6)
    s = _result(
        "shadow",
        "sglang",
        prompt=13,
        completion=6,
        finish="stop",
        text="hello there",
        upstream_ttft=0.3,
        tpot=0.02,
        tps=50.0,
        cached=4,
    )
    c = compare(p, s)
    assert c.prompt_mismatch and c.completion_mismatch and c.finish_mismatch and c.output_mismatch
    assert (c.prompt_delta, c.completion_delta) == (3, -2)
    assert c.first_diff_pos == 6
    assert c.ratio_ttft == pytest.approx(3.0)
    assert c.ratio_tpot == pytest.approx(2.0)
    assert c.ratio_decode_tps == pytest.approx(0.5)
    # cached tokens: llama.cpp timings.cache_n when usage has none; SGLang usage cached_tokens
    assert c.primary.cached_tokens == 6
    assert c.shadow.cached_tokens == 4


def test_output_is_compared_only_for_greedy_requests() -> None:
    c = compare(
        _result("primary", "llama", greedy=False, text="a"), _result("shadow", "sglang", greedy=False, text="b")
    )
    assert c.output_mismatch is None and c.first_diff_pos is None
    assert c.prompt_mismatch is False  # token counts are still compared


def test_failed_side_is_not_comparable_and_not_counted() -> None:
    registry = CollectorRegistry()
    m = Metrics(registry)
    c = compare(_result("primary", "llama"), _result("shadow", "sglang", outcome="timeout", completion=3))
    assert not c.comparable
    assert c.completion_mismatch is None and c.ratio_ttft is None
    observe_comparison(m, c)
    assert (
        registry.get_sample_value("enginemeter_compared_pairs_total", {"primary": "llama", "shadow": "sglang"}) is None
    )


def test_missing_usage_is_not_a_mismatch() -> None:
    c = compare(_result("primary", "llama"), _result("shadow", "sglang", prompt=None, completion=None))
    assert c.prompt_mismatch is None and c.completion_mismatch is None


def test_metrics_count_mismatches_by_kind() -> None:
    registry = CollectorRegistry()
    m = Metrics(registry)
    p = _result("primary", "llama")
    observe_comparison(m, compare(p, _result("shadow", "sglang", prompt=12, text="hello World")))
    observe_comparison(m, compare(p, _result("shadow", "sglang")))

    def v(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"primary": "llama", "shadow": "sglang", **labels})

    assert v("enginemeter_compared_pairs_total") == 2
    assert v("enginemeter_token_count_mismatches_total", kind="prompt") == 1
    assert v("enginemeter_token_count_mismatches_total", kind="completion") is None
    assert v("enginemeter_output_mismatches_total") == 1
    assert v("enginemeter_finish_reason_mismatches_total") is None
    # negative buckets: the client exposes no _sum; the +2 lands in the (1, 4] bucket
    assert v("enginemeter_token_count_delta_bucket", kind="prompt", le="1.0") == 1
    assert v("enginemeter_token_count_delta_bucket", kind="prompt", le="4.0") == 2
    assert v("enginemeter_token_count_delta_count", kind="completion") == 2
    assert v("enginemeter_shadow_ratio_count", metric="ttft") == 2


def test_record_schema_and_text_only_when_given() -> None:
    c = compare(_result("primary", "llama"), _result("shadow", "sglang"))
    rec = to_record(c, ts=1.0)
    assert set(rec) == {
        "v",
        "type",
        "ts",
        "request_id",
        "model",
        "endpoint",
        "stream",
        "greedy",
        "comparable",
        "primary",
        "shadow",
        "mismatch",
        "delta",
        "first_diff_pos",
        "first_diff_token",
        "ratios",
    }
    assert set(rec["primary"]) == {
        "engine",
        "kind",
        "outcome",
        "status",
        "ttft_s",
        "upstream_ttft_s",
        "tpot_s",
        "decode_tps",
        "e2e_s",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "engine_prompt_ms",
        "engine_decode_tps",
        "finish_reason",
    }
    assert set(rec["mismatch"]) == {"prompt_tokens", "completion_tokens", "finish_reason", "output"}
    assert set(rec["ratios"]) == {"ttft", "tpot", "decode_tps", "e2e"}
    assert "prompt" not in rec and "text" not in rec["primary"]
    json.dumps(rec)  # serializable as is
    with_text = to_record(c, prompt=[{"role": "user", "content": "hi"}], primary_text="a", shadow_text="b")
    assert with_text["prompt"][0]["content"] == "hi"
    assert (with_text["primary"]["text"], with_text["shadow"]["text"]) == ("a", "b")
    assert not {"run", "t_start", "concurrency"} & set(rec) and "sampling" not in rec["primary"]


def test_record_says_its_run_its_start_its_concurrency_and_what_sampling_each_engine_got() -> None:
    from proxy.normalize import normalize_request

    client = {"model": "m", "messages": [], "temperature": 0.7, "min_p": 0.1, "repeat_penalty": 1.1}
    defaults = {"top_p": 0.95}
    kinds: dict[str, EngineKind] = {"primary": "llamacpp", "shadow": "sglang"}
    norms = {role: normalize_request(client, endpoint="chat", kind=kind, served_model="m", defaults=defaults)
             for role, kind in kinds.items()}  # fmt: skip
    c = compare(_result("primary", "llama"), _result("shadow", "sglang"))
    rec = to_record(c, ts=2.0, run="r1", t_start=1.5, concurrency=(2, 5), sampling=norms)
    assert (rec["run"], rec["t_start"], rec["concurrency"]) == ("r1", 1.5, {"at_start": 2, "overlapping": 5})
    p, sh = rec["primary"]["sampling"], rec["shadow"]["sampling"]
    assert p == {"params": {"temperature": 0.7, "min_p": 0.1, "repeat_penalty": 1.1, "top_p": 0.95},
                 "dropped": [], "defaulted": ["top_p"]}  # fmt: skip
    # llama.cpp's window-limited repeat_penalty has no equivalent on SGLang: dropped there, never converted
    assert sh["params"] == {"temperature": 0.7, "min_p": 0.1, "top_p": 0.95} and sh["dropped"] == ["repeat_penalty"]
    json.dumps(rec)


def test_run_and_engine_records() -> None:
    from proxy.server.mirror.compare import engine_record, new_run_id, run_record

    rid = new_run_id(0.0)
    assert rid.startswith("19700101T000000Z-") and len(rid) == 21 and new_run_id() != new_run_id()
    run = run_record(rid, listen="http://127.0.0.1:8080", pairs=[("a", "b"), ("a", "b"), ("c", "b")],
                     engines={"a": {"kind": "llamacpp"}}, version="1", ts=5.0)  # fmt: skip
    assert run == {"v": 1, "type": "run", "run": rid, "ts": 5.0, "listen": "http://127.0.0.1:8080", "version": "1",
                   "pairs": [["a", "b"], ["c", "b"]], "engines": {"a": {"kind": "llamacpp"}}}  # fmt: skip
    eng = engine_record(rid, "a", {"quantization": "F16", "slots": 4}, ts=6.0)
    assert eng == {"v": 1, "type": "engine", "run": rid, "ts": 6.0, "engine": "a", "quantization": "F16", "slots": 4}


def test_first_differing_token_counts_the_whole_token_events_before_the_difference() -> None:
    from dataclasses import replace

    from proxy.server.mirror.compare import first_diff_token

    p = replace(_result("primary", "llama", text="Hello world!"), text_ends=(5, 11, 12))  # "Hello" " world" "!"
    s = replace(_result("shadow", "sglang", text="Hello there"), text_ends=(5, 11))  # "Hello" " there"
    c = compare(p, s)
    assert (c.first_diff_pos, c.first_diff_token) == (6, 1)  # the second token differs
    assert compare(p, replace(s, text="Hello world!", text_ends=(5, 11, 12))).first_diff_token is None
    assert compare(p, replace(s, text="Hello world", text_ends=(5, 11))).first_diff_token == 2  # a prefix
    assert compare(replace(p, text_ends=None), s).first_diff_token is None  # offsets not collected
    assert first_diff_token(0, (3,), (1, 2)) == 0


def test_log_rotates_and_keeps_a_bounded_number_of_files(tmp_path: Path) -> None:
    path = tmp_path / "cmp" / "pairs.jsonl"
    rec = to_record(compare(_result("primary", "llama"), _result("shadow", "sglang")), ts=1.0)
    line_len = len(json.dumps(rec, separators=(",", ":"))) + 1
    log = ComparisonLog(str(path), max_bytes=line_len * 3, backups=2)
    try:
        for i in range(20):
            assert log.write({**rec, "request_id": f"r{i}"})
        assert log.flush()
    finally:
        log.close()
    files = sorted(p.name for p in path.parent.iterdir())
    assert files == ["pairs.jsonl", "pairs.jsonl.1", "pairs.jsonl.2"]
    for p in path.parent.iterdir():
        assert p.stat().st_size <= line_len * 3
    newest = [json.loads(x)["request_id"] for x in path.read_text().splitlines()]
    assert newest[-1] == "r19"
    older = [json.loads(x)["request_id"] for x in (path.parent / "pairs.jsonl.1").read_text().splitlines()]
    assert int(older[-1][1:]) < int(newest[0][1:])
    assert log.written == 20 and log.errors == 0


def test_log_drops_instead_of_blocking_when_the_queue_is_full(tmp_path: Path) -> None:
    log = ComparisonLog(str(tmp_path / "x.jsonl"), max_bytes=1 << 20, backups=1, queue_size=1)
    try:
        accepted = sum(log.write({"i": i}) for i in range(10_000))
        assert accepted + log.dropped == 10_000
        assert log.dropped > 0
    finally:
        log.close()
