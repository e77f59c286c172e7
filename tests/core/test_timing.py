from __future__ import annotations

import pytest

from proxy.timing import NS, EngineTimings, StreamTimer, StreamTiming, Usage, usage_from_json


def _timer() -> StreamTimer:
    t = StreamTimer(t_received_ns=1 * NS)
    t.t_sent_ns = 1 * NS + 2_000_000  # 2 ms overhead
    t.t_headers_ns = 1 * NS + 5_000_000
    for ms in (100, 120, 150, 200):  # four token events
        t.token(1 * NS + ms * 1_000_000)
    t.t_done_ns = 1 * NS + 210_000_000
    return t


def test_derived_figures_follow_the_documented_definitions() -> None:
    t = _timer()
    timing = StreamTiming.derive(t, Usage(prompt_tokens=10, completion_tokens=11, cached_tokens=3), None)
    assert timing.ttft_s == pytest.approx(0.100)
    assert timing.upstream_ttft_s == pytest.approx(0.098)
    assert timing.overhead_s == pytest.approx(0.002)
    assert timing.headers_s == pytest.approx(0.003)
    assert timing.gaps_s == pytest.approx((0.020, 0.030, 0.050))
    # 11 tokens, 10 after the first, over 100 ms
    assert timing.tpot_s == pytest.approx(0.010)
    assert timing.decode_tps == pytest.approx(100.0)
    assert timing.e2e_s == pytest.approx(0.210)
    assert t.n_token_events == 4


def test_queue_time_is_upstream_ttft_minus_prompt_ms() -> None:
    timing = StreamTiming.derive(_timer(), Usage(completion_tokens=2), EngineTimings(prompt_ms=58.0))
    assert timing.queue_s == pytest.approx(0.040)


def test_single_token_has_no_tpot() -> None:
    t = StreamTimer(t_received_ns=NS)
    t.token(2 * NS)
    timing = StreamTiming.derive(t, Usage(completion_tokens=1), None)
    assert timing.tpot_s is None
    assert timing.decode_tps is None
    assert timing.ttft_s == pytest.approx(1.0)


def test_usage_parsing_handles_engine_variants() -> None:
    assert usage_from_json(
        {"prompt_tokens": 5, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 4}}
    ) == Usage(5, 2, 4)
    assert usage_from_json({"prompt_tokens": 5, "completion_tokens": 2, "prompt_tokens_details": None}) == Usage(
        5, 2, None
    )
    assert usage_from_json(None) is None
    et = EngineTimings.from_json({"prompt_ms": 3.5, "predicted_per_second": 530.0, "cache_n": 14, "predicted_n": 32})
    assert et is not None
    assert et.cache_n == 14
    assert et.predicted_per_second == 530.0


def test_the_proxys_own_share_counts_queueing_and_the_relay_of_the_first_event() -> None:
    ms = 1_000_000
    t = StreamTimer(t_received_ns=NS, t_handler_ns=NS + 1 * ms)  # waited 1 ms for the event loop
    t.t_sent_ns = NS + 3 * ms
    t.t_first_read_ns = NS + 50 * ms
    t.token(NS + 50 * ms)
    t.first_byte()  # now: far later than the read in this test's clock
    t.t_first_byte_ns = NS + 50 * ms + 400_000  # 0.4 ms from the engine's first event to the client's first byte
    timing = StreamTiming.derive(t, None, None)
    assert timing.handler_wait_s == pytest.approx(0.001)
    assert timing.overhead_s == pytest.approx(0.003)
    assert timing.proxy_delay_s == pytest.approx(0.0034)
    whole = StreamTimer(t_received_ns=NS)  # non-stream: no first byte of a stream, the delay is the overhead
    whole.t_sent_ns = NS + 2 * ms
    assert StreamTiming.derive(whole, None, None).proxy_delay_s == pytest.approx(0.002)
    assert StreamTiming.derive(whole, None, None).handler_wait_s is None
    retry = t.retry()
    assert (retry.t_received_ns, retry.t_handler_ns, retry.t_sent_ns) == (NS, NS + 1 * ms, 0)
