"""proxy/server/record/metrics.py: finish reasons, prefill rate, configurable buckets, zero series for configured pairs."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from proxy.config.configfile import load
from proxy.config.settings import BUCKET_KEYS, SettingsError
from proxy.server.record.buckets import DEFAULT_BUCKETS
from proxy.server.record.metrics import Metrics, configured_pairs, finish_label, observe, observe_many
from proxy.server.record.result import Result
from proxy.timing import EngineTimings, StreamTiming, Usage
from proxy.types import Outcome

LAB = {"engine": "llama", "model": "m", "role": "primary", "stream": "true"}


def result(
    *,
    outcome: Outcome = "ok",
    finish: str | None = "stop",
    prompt: int | None = 1000,
    cached: int | None = 200,
    upstream_ttft: float | None = 0.4,
    cache_n: int | None = None,
) -> Result:
    timing = StreamTiming(
        ttft_s=0.41, upstream_ttft_s=upstream_ttft, headers_s=0.01, overhead_s=0.001, tpot_s=0.005,
        decode_tps=200.0, e2e_s=1.0, queue_s=None,
    )  # fmt: skip
    return Result(
        request_id="r", engine="llama", engine_kind="llamacpp", role="primary", model="m", endpoint="chat",
        stream=True, outcome=outcome, status=200, timing=timing,
        usage=Usage(prompt_tokens=prompt, completion_tokens=50, cached_tokens=cached),
        engine_timings=EngineTimings(cache_n=cache_n) if cache_n is not None else None,
        finish_reason=finish, n_token_events=50, greedy=False,
    )  # fmt: skip


def sample(m: Metrics, name: str, labels: dict[str, str]) -> float | None:
    return m.registry.get_sample_value(name, labels)


@pytest.mark.parametrize(
    ("reason", "label"),
    [("stop", "stop"), ("length", "length"), ("tool_calls", "tool_calls"), ("function_call", "tool_calls"),
     ("abort", "other"), ("content_filter", "other"), (None, "other"), ("", "other")],
)  # fmt: skip
def test_finish_reason_is_a_closed_set(reason: str | None, label: str) -> None:
    assert finish_label(reason) == label
    m = Metrics(CollectorRegistry())
    observe(m, result(finish=reason))
    labels = {"engine": "llama", "model": "m", "role": "primary", "reason": label}
    assert sample(m, "enginemeter_finish_reasons_total", labels) == 1


def test_finish_reason_counts_only_ok_requests() -> None:
    m = Metrics(CollectorRegistry())
    observe(m, result(outcome="engine_error", finish="stop"))
    assert sample(m, "enginemeter_finish_reasons_total", {"engine": "llama", "model": "m", "role": "primary", "reason": "stop"}) is None  # fmt: skip


def test_prefill_rate_is_uncached_prompt_over_upstream_ttft() -> None:
    m = Metrics(CollectorRegistry())
    observe(m, result(prompt=1000, cached=200, upstream_ttft=0.4))
    assert sample(m, "enginemeter_prefill_tokens_per_second_sum", LAB) == pytest.approx(800 / 0.4)
    assert sample(m, "enginemeter_prefill_tokens_per_second_count", LAB) == 1
    # llama.cpp reports the cache hit in timings.cache_n, not in usage
    m = Metrics(CollectorRegistry())
    observe(m, result(prompt=1000, cached=None, cache_n=900, upstream_ttft=0.1))
    assert sample(m, "enginemeter_prefill_tokens_per_second_sum", LAB) == pytest.approx(100 / 0.1)


@pytest.mark.parametrize(
    "kw",
    [{"outcome": "timeout"}, {"prompt": None}, {"upstream_ttft": None}, {"upstream_ttft": 0.0},
     {"prompt": 100, "cached": 100}, {"prompt": 100, "cached": 150}],
)  # fmt: skip
def test_no_prefill_rate_without_the_inputs(kw: dict[str, object]) -> None:
    m = Metrics(CollectorRegistry())
    observe(m, result(**kw))  # type: ignore[arg-type]
    assert sample(m, "enginemeter_prefill_tokens_per_second_count", LAB) is None


def test_default_buckets_fill_the_typical_ranges() -> None:
    ttft, gap = DEFAULT_BUCKETS["ttft"], DEFAULT_BUCKETS["inter_chunk"]
    assert any(0.1 < b < 0.25 for b in ttft) and any(1.0 < b < 2.5 for b in ttft)
    assert sum(0.002 < b < 0.005 for b in gap) >= 2
    assert set(DEFAULT_BUCKETS) == set(BUCKET_KEYS)


def test_buckets_come_from_the_settings(tmp_path: Path) -> None:
    cfg = {
        "engines": [{"name": "llama", "url": "http://127.0.0.1:9"}],
        "metrics": {"buckets": {"ttft": [0.1, 0.3, 1], "inter_chunk": [0.004, 0.005]}},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    s = load(config=str(tmp_path / "c.yaml"), env={})
    assert s.metrics.buckets == {"ttft": (0.1, 0.3, 1.0), "inter_chunk": (0.004, 0.005)}
    m = Metrics(CollectorRegistry(), s.metrics)
    observe(m, result())
    for name in ("enginemeter_time_to_first_token_seconds", "enginemeter_upstream_time_to_first_token_seconds"):
        bounds = {
            sm.labels["le"]
            for fam in m.registry.collect()
            if fam.name == name
            for sm in fam.samples
            if sm.name.endswith("_bucket")
        }
        assert bounds == {"0.1", "0.3", "1.0", "+Inf"}, name
    assert sample(m, "enginemeter_time_to_first_token_seconds_bucket", {**LAB, "le": "0.3"}) == 0
    assert sample(m, "enginemeter_time_to_first_token_seconds_bucket", {**LAB, "le": "1.0"}) == 1
    # families not named keep their defaults
    assert sample(m, "enginemeter_request_duration_seconds_bucket", {**LAB, "le": "0.05"}) == 0


@pytest.mark.parametrize(
    ("buckets", "error"),
    [({"ttfb": [1]}, "ttfb: expected one of 'ttft'"), ({"ttft": []}, "non-empty"), ({"ttft": "0.1"}, "expected a list"),
     ({"ttft": [0.2, 0.1]}, "strictly increasing"), ({"ttft": [0.1, 0.1]}, "strictly increasing"),
     ({"ttft": [0.1, float("inf")]}, "finite"), ({"ttft": ["x"]}, r"ttft\[0\]: expected a number")],
)  # fmt: skip
def test_bad_buckets_are_rejected_at_startup(tmp_path: Path, buckets: dict[str, object], error: str) -> None:
    cfg = {"engines": [{"name": "llama", "url": "http://127.0.0.1:9"}], "metrics": {"buckets": buckets}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(SettingsError, match=error):
        load(config=str(tmp_path / "c.yaml"), env={})


def test_configured_pairs_start_at_zero(tmp_path: Path) -> None:
    cfg = {
        "engines": [{"name": n, "url": f"http://127.0.0.1:{9 + i}"} for i, n in enumerate(("a", "b", "c", "d"))],
        "routes": [
            {"models": ["x"], "primary": "a", "shadows": ["b", "c"]},
            {"models": ["y"], "primary": "a", "split": {"a": 1, "c": 1, "d": 0}, "shadows": ["c"]},
            {"models": ["z"], "primary": "d"},
        ],
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    s = load(config=str(tmp_path / "c.yaml"), env={})
    # the split engine c is its own shadow's engine: no (c, c); d has weight 0 and no shadow
    assert configured_pairs(s.routes) == [("a", "b"), ("a", "c")]
    m = Metrics(CollectorRegistry())
    m.prime(["a", "b", "c", "d"], ["x"], configured_pairs(s.routes))
    for p, sh in (("a", "b"), ("a", "c")):
        pair = {"primary": p, "shadow": sh}
        assert sample(m, "enginemeter_compared_pairs_total", pair) == 0
        assert sample(m, "enginemeter_output_mismatches_total", pair) == 0
        assert sample(m, "enginemeter_finish_reason_mismatches_total", pair) == 0
        for kind in ("prompt", "completion"):
            assert sample(m, "enginemeter_token_count_mismatches_total", {**pair, "kind": kind}) == 0
    assert sample(m, "enginemeter_compared_pairs_total", {"primary": "a", "shadow": "d"}) is None
    assert sample(m, "enginemeter_finish_reasons_total", {"engine": "d", "model": "x", "role": "primary", "reason": "length"}) == 0  # fmt: skip


def test_series_per_engine_and_alias_are_as_documented() -> None:
    """docs/metrics.md#series-how-many-per-engine-and-alias: 88 + 4E + 18E(E+M) at start; up to 1,481 per
    (engine, model label) pair with traffic. Counted by perf/series.py on the proxy's own Metrics."""
    import importlib.util

    path = Path(__file__).resolve().parents[3] / "perf" / "series.py"
    spec = importlib.util.spec_from_file_location("perf_series", path)
    assert spec is not None and spec.loader is not None
    series = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(series)
    for e, m in [(1, 1), (1, 2), (2, 1), (2, 3)]:
        pairs = e * (e + m)
        primed, full, _ = series.count(e, m)
        assert primed == 88 + 4 * e + 18 * pairs, (e, m, primed)
        assert full == primed + 1463 * pairs, (e, m, full)
    doc = (path.parent.parent / "docs" / "metrics.md").read_text()
    assert "**88 + 4·E + 18·E·(E + M)**" in doc and "**1,481 series per pair**" in doc and "1,463 more" in doc


@pytest.mark.parametrize("multiprocess", [False, True], ids=["one-process", "multiprocess"])
def test_observing_many_values_at_once_is_observing_each(
    multiprocess: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``observe_many`` (a stream's gaps at its end) writes what one ``observe`` per value writes, on the installed
    prometheus-client, in one process and in ``serve --workers``' multiprocess mode (its mmap'd values)."""
    from prometheus_client import Histogram, values

    if multiprocess:
        monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
        monkeypatch.setattr(values, "ValueClass", values.get_value_class())  # type: ignore[no-untyped-call]
    gaps = [0.0004, 0.0005, 0.001, 0.0099, 0.01, 0.0101, 0.04, 7.0, 11.0, 0.0]  # on, under and over bounds
    buckets = DEFAULT_BUCKETS["inter_chunk"]
    one, many = CollectorRegistry(), CollectorRegistry()
    each = Histogram("g_one", "gaps", ["engine"], buckets=buckets, registry=one).labels("e")
    at_once = Histogram("g_many", "gaps", ["engine"], buckets=buckets, registry=many).labels("e")
    if multiprocess:  # the values live in memory-mapped files, as in every --workers worker
        assert "Mmaped" in type(at_once._sum).__name__
    for g in gaps:
        each.observe(g)
    observe_many(at_once, gaps)

    def samples(r: CollectorRegistry) -> list[tuple[str, dict[str, str], float]]:
        return [(s.name.split("_", 2)[-1], s.labels, s.value) for m in r.collect() for s in m.samples]

    assert samples(one) == samples(many)
    assert many.get_sample_value("g_many_count", {"engine": "e"}) == len(gaps)
    assert many.get_sample_value("g_many_bucket", {"engine": "e", "le": "0.01"}) == 6
