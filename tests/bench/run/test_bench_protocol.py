"""The bench's protocol on real llama-server engines: a warm-up for every cell, a balanced order from the first
repeat (the A/A twin included), foreign load noticed, and a concurrency-1 run that never says STAY; plus the
pure pieces (the Williams order, the first-repeat check, the busy reading of each dialect)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.bench.run.measure import williams
from proxy.bench.verdict import checks
from proxy.bench.verdict.inputs import Cell, Sample
from proxy.cli import main
from proxy.engines.base import metric_sum
from tests.bench.run.test_bench import SMALL, recs, verdict

Factory = Callable[..., Any]
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "engines"


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_williams_rows_balance_first_places_and_successors(n: int) -> None:
    period = n if n % 2 == 0 else 2 * n
    rows = [williams(n, r) for r in range(period)]
    assert all(sorted(r) == list(range(n)) for r in rows)
    for pos in range(n):  # every engine takes every place equally often
        assert sorted(r[pos] for r in rows) == sorted(list(range(n)) * (period // n))
    follows = [(r[i], r[i + 1]) for r in rows for i in range(n - 1)]
    counts = {p: follows.count(p) for p in itertools.permutations(range(n), 2)}
    assert len(set(counts.values())) == 1  # every engine follows every other one equally often


C1 = Cell("cold", 1, 16, "short")


def _sample(engine: str, rep: int, tpot: float) -> Sample:
    return Sample(engine, C1, rep, 4, 0, ttft_s=0.02, tpot_s=tpot)


def test_the_first_repeat_check_finds_a_cell_measured_cold() -> None:
    cold_start = [_sample("a", 0, 0.010 * 1.6), *(_sample("a", r, 0.010 * (1 + 0.01 * r)) for r in range(1, 5))]
    steady = [_sample("b", r, 0.010 * (1 + 0.01 * ((r * 7) % 5))) for r in range(5)]
    found = {(x.engine, x.metric): x for x in checks.first_repeat(cold_start + steady)}
    assert found[("a", "tpot_s")].outlier and found[("a", "tpot_s")].deviation == pytest.approx(0.56, abs=0.02)
    assert not found[("b", "tpot_s")].outlier
    lines = checks.summary(cold_start + steady, [], {}, [])
    assert "first repeat differs" in lines[0] and "(a)" in lines[0]


@pytest.mark.parametrize(
    ("fixture", "names", "busy"),
    [("llama.cpp-11434.0.0/metrics_after.txt", ("llamacpp:requests_processing", "llamacpp:requests_deferred"), 0),
     ("vllm-0.26.0/metrics.txt", ("vllm:num_requests_running", "vllm:num_requests_waiting"), 0),
     ("sglang-0.5.17/metrics_after.txt", ("sglang:num_running_reqs", "sglang:num_queue_reqs"), 0),
     ("sglang-0.5.17/metrics_after.txt", ("sglang:no_such_gauge",), None)],
)  # fmt: skip
def test_busy_readings_from_captured_metrics(fixture: str, names: tuple[str, ...], busy: int | None) -> None:
    text = (FIXTURES / fixture).read_text()
    assert metric_sum(text, names) == busy
    if busy is not None:  # every label set counts, a sample without labels too
        more = text.replace(f"{names[0]}{{", f'{names[0]}{{x="1",') + f"\n{names[0]} 3\n"
        assert metric_sum(more, names) == busy + 3


def test_every_cell_is_warmed_and_the_order_is_balanced_from_the_first_repeat(
    llama_server_factory: Factory, tmp_path: Path
) -> None:
    a = llama_server_factory(np=1)
    b = llama_server_factory(np=2, ctx_size=4096)
    out = tmp_path / "b"
    assert main(["bench", "--engine", f"a={a.url}", "--engine", f"b={b.url}", *SMALL, "--repeats", "3",
                 "--out", str(out)]) == 0  # fmt: skip
    res = out / "results.jsonl"
    reqs = recs(res, "request")
    samples = recs(res, "sample")
    cells = {(s["cache"], s["concurrency"], s["max_tokens"], s["prompt_len"]) for s in samples}
    for cell in cells:
        key = dict(zip(("cache", "concurrency", "max_tokens", "prompt_len"), cell, strict=True))
        mine = [i for i, r in enumerate(reqs) if all(r.get(k) == v for k, v in key.items())]
        warm = [i for i in mine if reqs[i]["phase"] == "warmup"]
        measured = [i for i in mine if reqs[i]["phase"] == "measure"]
        # one wave per engine server (a and b; the A/A twin a-aa shares a's server), before any measurement
        assert {reqs[i]["engine"] for i in warm} == {"a", "b"}, cell
        assert len(warm) == 2 * key["concurrency"] and max(warm) < min(measured), cell
    # the first place rotates from the first repeat: three engines (a, b, a-aa), three repeats per cell
    for cell in cells:
        firsts = [s["engine"] for s in samples if s["position"] == 0
                  and (s["cache"], s["concurrency"], s["max_tokens"], s["prompt_len"]) == cell]  # fmt: skip
        assert len(firsts) == 3 and len(set(firsts)) >= 2, (cell, firsts)
    by_pos = {s["engine"] for s in samples if s["position"] == 0 and s["repeat"] == 0}
    assert {"a-aa"} & by_pos or {"b"} & by_pos  # repeat 0 does not always start with the baseline
    assert all(s["foreign"]["flagged"] is False for s in samples)
    md = (out / "report.md").read_text()
    assert "## Protocol checks" in md and "order: times each engine ran first" in md


def test_a_run_at_concurrency_1_only_is_partial_and_names_the_missing_regime(
    llama_server_factory: Factory, tmp_path: Path
) -> None:
    a = llama_server_factory(np=1)
    b = llama_server_factory(np=2, ctx_size=4096)
    out = tmp_path / "c1"
    rc = main(["bench", "--engine", f"np1={a.url}", "--engine", f"np2={b.url}", *SMALL, "--concurrency", "1",
               "--prompt-lengths", "short", "--out", str(out), "--fail-on", "stay"])  # fmt: skip
    v = verdict(out)["verdicts"][0]
    assert rc == 0 and v["decision"] in ("partial", "inconclusive"), v["summary"]
    assert v["decision"] != "stay"
    load = next(a for a in v["regimes"] if a["step"] == "throughput")
    assert load["answer"] == "not measured" and load["fix"].startswith("--concurrency 1,")
    if v["decision"] == "partial":
        assert "under load not measured" in v["summary"] and "--concurrency" in v["next_step"]
        assert v["next_step"].startswith("enginemeter bench") and f"np1={a.url}" in v["next_step"]
    assert "decode-bound" not in v["summary"]


def test_a_second_client_loading_one_engine_flags_its_cells(llama_server_factory: Factory, tmp_path: Path) -> None:
    # four slots each: the bench's two at c=2 plus the other clients' two, so the foreign requests run (and show
    # as busy slots beyond the bench's own) instead of queueing unseen behind the bench's
    a = llama_server_factory(np=4, ctx_size=4096)
    b = llama_server_factory(np=4, ctx_size=4096)
    stop = threading.Event()
    sent: list[int] = []

    def other_client() -> None:  # someone else's traffic on b: one long request after another
        with httpx.Client(base_url=b.url, timeout=60) as c:
            while not stop.is_set():
                body = {"model": "tiny", "max_tokens": 400, "messages": [{"role": "user", "content": "go on"}],
                        "ignore_eos": True}  # fmt: skip
                c.post("/v1/chat/completions", json=body)
                sent.append(1)

    # two of them, so that b is never idle between one's requests (a probe there once read 0 busy: unflagged)
    others = [threading.Thread(target=other_client, daemon=True) for _ in range(2)]
    for t in others:
        t.start()
    try:
        out = tmp_path / "busy"
        assert main(["bench", "--engine", f"a={a.url}", "--engine", f"b={b.url}", *SMALL, "--concurrency", "1,2",
                     "--prompt-lengths", "short", "--aa", "off", "--out", str(out)]) == 0  # fmt: skip
    finally:
        stop.set()
        for t in others:
            t.join(timeout=60)
    assert sent
    samples = recs(out / "results.jsonl", "sample")
    on_b = [s for s in samples if s["engine"] == "b"]
    assert on_b and all(s["foreign"]["flagged"] for s in on_b), [s["foreign"] for s in on_b]
    assert not any(s["foreign"]["flagged"] for s in samples if s["engine"] == "a")
    v = verdict(out)["verdicts"][0]
    assert v["decision"] == "inconclusive", v["summary"]
    assert "engine busy with other clients" in v["summary"]
    assert {a["answer"] for a in v["regimes"] if a["step"] in ("decode", "throughput")} == {"flagged"}
    assert "the cell cannot decide" in (out / "report.md").read_text()
