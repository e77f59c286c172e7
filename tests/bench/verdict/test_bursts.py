"""Bursts are data problems, not speed: a stream whose token events arrive in one read (the fault engine's
``burst`` knob: made at their cadence, written in one go) yields no decode rate from chunk timing — the engine's
own timings stand in, the data gate says so, and the decode figures and chart axes stay those of the engine.

On a loaded box the bench's client is descheduled now and then: a steady stream's events then pile up and are read
together. Such a burst is the client's (``burst_cause``, the data gate's "client" reason), never flagged as the
engine's, and a reading the client disturbed is not held against the engine's speed."""

from __future__ import annotations

import contextlib
import json
import re
import statistics
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.bench.verdict.gates.datagate import data_gate
from proxy.bench.verdict.inputs import Cell, Results, Sample
from proxy.cli import main
from proxy.timing import BURST_GAP_S, StreamTimer, StreamTiming, Usage, is_burst
from tests.helpers import ProcessServer

CADENCE_MS = 4.0  # 250 tok/s: what the engine makes, burst or not


#: the client's stall above which a request's chunk timing is the client's, not the engine's speed
DISTURBED_S = 0.05


@pytest.fixture
def steady_and_bursty() -> Iterator[tuple[str, str]]:
    """Each engine its own process (as engines are): a descheduled bench does not stop them. They run above the
    priority of any load beside the tests (``nice -n -10``, where allowed): a fake engine that is descheduled catches
    up on its schedule in a burst of its own, really the engine's; the claim here is about the client."""
    with contextlib.ExitStack() as stack:
        steady = stack.enter_context(_engine())
        bursty = stack.enter_context(_engine("--fault", "burst=1"))
        yield steady.url, bursty.url


def _engine(*args: str) -> ProcessServer:
    cadence = ("--cadence-ms", str(CADENCE_MS))
    return ProcessServer("fakes.fault_engine", *cadence, *args, ready_path="/health", wrapper=("nice", "-n", "-10"))


def test_a_burst_stream_is_flagged_and_its_decode_rate_is_the_engines(
    steady_and_bursty: tuple[str, str], tmp_path: Path
) -> None:
    steady, bursty = steady_and_bursty
    out = tmp_path / "out"
    rc = main(["bench", "--engine", f"a={steady}", "--engine", f"b={bursty}", "--quick", "--no-progress",
               "--warmup", "0", "--aa", "off", "--out", str(out)])  # fmt: skip
    assert rc == 0
    recs = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    reqs = [r for r in recs if r.get("type") == "request" and r.get("phase") == "measure" and r["ok"]]
    a = [r for r in reqs if r["engine"] == "a"]
    b = [r for r in reqs if r["engine"] == "b"]
    assert a and b
    assert not any(r["burst_cause"] == "engine" for r in a)  # a steady engine: a burst there is the client's
    assert all(r["burst"] and r["burst_cause"] == "engine" for r in b)
    assert all(statistics.median(r["itl_s"]) < BURST_GAP_S for r in b)  # the chunks did come in one read
    assert all(r["client_lag_s"] is not None for r in reqs)  # every request knows the client's own delay
    undisturbed = [r for r in reqs if r["client_lag_s"] < DISTURBED_S]
    assert len(undisturbed) >= len(reqs) / 2, [r["client_lag_s"] for r in reqs]
    for r in undisturbed:  # both near the 250 tok/s the engine made; a burst's chunk timing would be ~10^5
        assert 100 < r["decode_tps"] < 400, r
    samples = [r for r in recs if r.get("type") == "sample"]
    assert all(s["bursts"] == s["n_ok"] and s["bursts_unrated"] == 0 for s in samples if s["engine"] == "b")
    assert all(s["itl_p99_s"] is None for s in samples if s["engine"] == "b")  # a burst's gaps time the reader

    (v,) = json.loads((out / "verdict.json").read_text())["verdicts"]
    (flag,) = [x for x in v["reasons"] if x["check"] == "bursts"]
    assert flag["text"].startswith("b: ")  # the steady engine is never flagged for the client's bursts
    assert all(x["text"].startswith("a: ") and "bench's own client" in x["text"] for x in v["reasons"]
               if x["check"] == "client")  # fmt: skip
    assert flag["outcome"] == "ok" and "arrived in one read" in flag["text"] and "engine's own timings" in flag["text"]
    md = (out / "report.md").read_text()
    assert "arrived in one read" in md

    svg = (out / "decode_vs_load.svg").read_text()
    assert "10^{" not in svg and "×10" not in svg and "\\times" not in svg
    ticks = [float(t.replace(",", "")) for t in re.findall(r"<!-- ([0-9][0-9,.]*) -->", svg)]
    assert ticks and max(ticks) < 1000  # the axis is the engine's rate, not a burst's


def _sample(name: str, rep: int, bursts: int, unrated: int) -> Sample:
    return Sample(engine=name, cell=Cell("cold", 1, 16, "short"), repeat=rep, n_ok=4, n_err=0, bursts=bursts,
                  bursts_unrated=unrated)  # fmt: skip


def test_a_repeat_resting_on_unrated_bursts_fails_the_data_gate() -> None:
    samples = [_sample("a", r, 0, 0) for r in range(3)] + [_sample("b", 0, 4, 4), _sample("b", 1, 0, 0),
                                                            _sample("b", 2, 1, 1)]  # fmt: skip
    cells = {samples[0].cell}
    by = {(s.engine, s.cell): [x for x in samples if x.engine == s.engine] for s in samples}
    reasons = [
        x
        for x in data_gate(
            Results(engines=(), baseline="a", samples=tuple(samples)), samples, "a", "b", "cold", cells, by
        )
        if x.check == "bursts"
    ]
    assert [(x.outcome, x.text.split(":")[0]) for x in reasons] == [("inconclusive", "b")]
    assert "5 of 12 requests arrived in one read" in reasons[0].text and "1 repeat(s) rest on them" in reasons[0].text


def test_burst_detection_from_the_gaps() -> None:
    us = 1000
    assert is_burst([14 * us] * 15)
    assert is_burst([4_000_000] + [14 * us] * 14)  # the first event alone, the rest in one read
    assert not is_burst([400 * us] * 15)  # 2,500 tok/s: a tiny model on a CPU
    assert not is_burst([])
    t = StreamTimer()
    t.t_first_token_ns, t.t_last_token_ns = 1_000_000, 1_210_000
    t.gaps_ns.extend([14 * us] * 15)
    tm = StreamTiming.derive(t, Usage(prompt_tokens=8, completion_tokens=16), None)
    assert tm.burst and tm.decode_tps is None and tm.tpot_s is None
