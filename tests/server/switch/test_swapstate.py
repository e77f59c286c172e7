"""The swap's phase machine, restart reconciliation and watch, pure (no processes)."""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from proxy.config.configfile import load
from proxy.config.settings import SettingsError
from proxy.config.switching import SwapSettings
from proxy.server.switch.swapstate import enter, fresh, merge, on_open, outage, plan_, serving
from proxy.server.switch.swapwatch import Running, Window, figures_of, interval, judge, regime_of, rows

PLAN = plan_(0, "base", "cand")


def test_who_serves_follows_the_phase() -> None:
    doc = fresh(PLAN, "r1", "ready", 0.0)
    assert serving(doc) == "base"
    for phase in ("draining", "stopping", "launching", "warming", "reverting"):
        enter(doc, phase, 1.0)
        assert doc["serving"] is None and serving(doc) is None
    enter(doc, "watching", 2.0)
    assert doc["serving"] == "cand"
    enter(doc, "rolled_back", 3.0, cause="slower")
    assert doc["serving"] == "base" and doc["rollbacks"]["slower"] == 1
    assert [e["event"] for e in doc["events"]][-2:] == ["watching", "rolled_back"]
    assert doc["transitions"] == {
        p: 1 for p in ("draining", "stopping", "launching", "warming", "reverting", "watching", "rolled_back")
    }


def test_the_outage_runs_from_the_last_answer_to_the_first() -> None:
    doc = fresh(PLAN, "r1", "ready", 0.0)
    enter(doc, "draining", 10.0)
    doc.update(last_answer=10.5, first_answer=14.25)
    assert outage(doc) == pytest.approx(3.75)


@pytest.mark.parametrize(
    ("phase", "side", "after", "cause"),
    [
        ("baseline", "baseline", "baseline", "none"),
        ("draining", "baseline", "rolled_back", "restarted"),
        ("launching", "baseline", "rolled_back", "restarted"),
        ("warming", "baseline", "rolled_back", "restarted"),
        ("reverting", "baseline", "rolled_back", "restarted"),
        ("watching", "candidate", "watching", "restarted"),
        ("complete", "candidate", "complete", "none"),
        ("rolled_back", "baseline", "rolled_back", "slower"),
    ],
)
def test_a_restart_resumes_or_returns_to_the_baseline_never_without_an_engine(
    phase: str, side: str, after: str, cause: str
) -> None:
    doc = fresh(PLAN, "r1", "ready", 0.0)
    if phase != "baseline":
        enter(doc, phase, 1.0, cause="slower" if phase == "rolled_back" else "none")  # type: ignore[arg-type]
    doc2, launch = on_open(doc, False, PLAN, "r2", "ready", 5.0)
    assert (launch, doc2["phase"], doc2["cause"]) == (side, after, cause)
    assert serving(doc2) is not None and doc2["command"] is None


def test_a_damaged_state_starts_safe_and_never_swaps() -> None:
    doc, launch = on_open(None, True, PLAN, "r2", "running", 5.0)
    assert (launch, doc["phase"], doc["cause"], doc["command"]) == ("baseline", "rolled_back", "damaged", None)


def test_the_config_state_applies_only_when_it_changed() -> None:
    doc, _ = on_open(None, False, PLAN, "r1", "running", 0.0)
    assert doc["command"] == {"action": "start", "who": "config"}
    enter(doc, "watching", 1.0)
    enter(doc, "rolled_back", 2.0, cause="slower")
    doc2, launch = on_open(doc, False, PLAN, "r2", "running", 3.0)  # the same config again: no new swap
    assert (launch, doc2["phase"], doc2["command"]) == ("baseline", "rolled_back", None)
    enter(doc2, "watching", 4.0)
    doc3, launch = on_open(doc2, False, PLAN, "r3", "aborted", 5.0)  # aborted in the config: back to the baseline
    assert (launch, doc3["phase"], doc3["cause"]) == ("baseline", "rolled_back", "aborted")


def test_sums_merge_like_one_sample() -> None:
    rng = random.Random(1)
    xs = [rng.gauss(0, 1) for _ in range(300)]
    a, b, whole = Running(), Running(), Running()
    for i, x in enumerate(xs):
        (a if i % 3 else b).add("2", {"e2e": x})
        whole.add("2", {"e2e": x})
    m = merge([a.sums, b.sums])["2/e2e"]
    assert m[0] == 300 and m[1] == pytest.approx(whole.sums["2/e2e"][1])
    assert m[2] == pytest.approx(whole.sums["2/e2e"][2])


def _watch(base_ms: float, cand_ms: float, n_base: int, n_cand: int) -> tuple[dict, dict]:  # type: ignore[type-arg]
    rng = random.Random(7)
    w, r = Window(200), Running()
    for _ in range(n_base):
        w.add("2", {"e2e": math.log(base_ms * math.exp(rng.gauss(0, 0.1)))})
    for _ in range(n_cand):
        r.add("2", {"e2e": math.log(cand_ms * math.exp(rng.gauss(0, 0.1)))})
    return w.sums(), r.sums


def test_the_watch_finds_a_slower_candidate_and_passes_an_equal_one_after_its_dwell() -> None:
    s = SwapSettings(candidate="cand", min_dwell_s=10, min_requests=30)
    base, cand = _watch(100, 150, 200, 40)
    assert judge(s, 0.05, base, cand, {"attempts": 40}, 1.0)[0] == "slower"
    base, cand = _watch(100, 100, 200, 40)
    assert judge(s, 0.05, base, cand, {"attempts": 40}, 1.0) == (None, "the watch lasts 10 s at least")
    assert judge(s, 0.05, base, cand, {"attempts": 40}, 11.0) == (
        "pass",
        "40 requests watched, none slower beyond +5%, 0 failed",
    )
    # the baseline also served bursts the watch never saw: the pass says which (H100, 2026-12-07: 32 and 64)
    w = Window(200)
    for i in range(40):
        w.add("33-64", {"e2e": math.log(900 + i)})
    passed = judge(s, 0.05, {**base, **w.sums()}, cand, {"attempts": 40}, 11.0)
    assert passed[0] == "pass" and passed[1].endswith(
        "; not watched: 33-64 in flight (the baseline served them before)"
    )
    base, cand = _watch(100, 100, 200, 20)
    assert judge(s, 0.05, base, cand, {"attempts": 20}, 11.0)[0] is None  # 20 of 30 requests


def test_the_watch_states_the_requests_timed_while_the_proxy_stalled() -> None:
    """A request timed across a stall of the proxy's own event loop (``Result.loop_stalled``) is counted beside the
    decision, on each side, merged over workers like the figures, and never set aside: the decision is the same."""
    s = SwapSettings(candidate="cand", min_dwell_s=10, min_requests=30)
    rng = random.Random(3)

    def timing(ms: float) -> SimpleNamespace:
        return SimpleNamespace(ttft_s=None, tpot_s=None, e2e_s=ms * math.exp(rng.gauss(0, 0.1)) / 1e3)

    def watch(cand_ms: float, stalled: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
        w, workers = Window(200), [Running(), Running()]
        for i in range(100):
            w.add("2", figures_of(timing(100), stalled=i < 2))
        for i in range(40):
            workers[i % 2].add("2", figures_of(timing(cand_ms), stalled=i < stalled))
        return w.sums(), merge([r.sums for r in workers])

    said = (
        "; the proxy's event loop stalled (≥ 20 ms) while {k} of the candidate's 40 requests (2 of the baseline's "
        "100) were timed: their figures hold the proxy's wait too"
    )
    base, cand = watch(150, 6)
    decision, detail = judge(s, 0.05, base, cand, {"attempts": 40}, 1.0)
    assert decision == "slower" and detail.endswith(said.format(k=6)), detail
    assert [(r["metric"], r["candidate_stalled"], r["baseline_stalled"]) for r in rows(base, cand)] == [("e2e", 6, 2)]
    base, cand = watch(100, 3)
    assert judge(s, 0.05, base, cand, {"attempts": 40}, 11.0) == (
        "pass",
        "40 requests watched, none slower beyond +5%, 0 failed" + said.format(k=3),
    )
    base, cand = watch(100, 0)  # none of the candidate's: nothing said, whatever the baseline's
    assert (
        judge(s, 0.05, base, cand, {"attempts": 40}, 11.0)[1] == "40 requests watched, none slower beyond +5%, 0 failed"
    )


def test_the_watch_swaps_back_on_errors_beyond_the_budget() -> None:
    s = SwapSettings(candidate="cand", error_budget=0.1, min_errors=3)
    assert judge(s, 0.05, {}, {}, {"attempts": 20, "errors": 3}, 0.0)[0] == "errors"
    assert judge(s, 0.05, {}, {}, {"attempts": 40, "errors": 3}, 0.0)[0] is None


def test_an_interval_needs_thirty_on_each_side_and_regimes_follow_the_levels() -> None:
    assert interval([29, 0.0, 1.0], [100, 0.0, 1.0]) is None
    assert interval([30, 0.0, 1.0], [30, 0.0, 1.0]) is not None
    assert [regime_of(n) for n in (0, 1, 2, 3, 4, 5, 200)] == ["1", "1", "2", "3-4", "3-4", "5-8", "129+"]


@pytest.mark.parametrize(
    ("routes", "engines", "says"),
    [
        ([{"models": ["*"], "primary": "a", "swap": {"candidate": "b"}}], ["a", "b"], None),
        ([{"models": ["*"], "primary": "a", "swap": {"candidate": "a"}}], ["a", "b"], "is the route's primary"),
        ([{"models": ["*"], "primary": "a", "swap": {"candidate": "b"}}], ["a"], "a swap launches both engines"),
        (
            [{"models": ["x"], "primary": "a", "swap": {"candidate": "b"}}, {"models": ["y"], "primary": "b"}],
            ["a", "b"],
            "also serves route 1",
        ),
        (
            [{"models": ["*"], "primary": "a", "shadows": ["b"], "swap": {"candidate": "b"}}],
            ["a", "b"],
            "no split and no shadows",
        ),
    ],
)
def test_check_config_refuses_a_swap_it_cannot_run(
    tmp_path: Path, routes: list[dict[str, Any]], engines: list[str], says: str | None
) -> None:
    doc = {
        "engines": [
            {"name": "a", "launch": "llama-server -m a.gguf --port {port}"},
            {
                "name": "b",
                **(
                    {"launch": "llama-server -m b.gguf --port {port}"}
                    if "b" in engines
                    else {"url": "http://127.0.0.1:9"}
                ),
            },
        ],
        "routes": routes,
    }
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps(doc))
    if says is None:
        assert load(path, env={}).routes[0].swap is not None
        return
    with pytest.raises(SettingsError, match=re.escape(says)):
        load(path, env={})


def test_failed_serves_nothing_counts_no_rollback_and_a_restart_launches_the_baseline() -> None:
    plan = plan_(0, "a", "b")
    doc = fresh(plan, "r1", "ready", 0.0)
    enter(doc, "reverting", 1.0, cause="died", detail="b exited with -9")
    enter(doc, "failed", 2.0, cause="died", detail="a did not start again")
    assert serving(doc) is None and doc["rollbacks"]["died"] == 0 and doc["transitions"]["failed"] == 1
    again, side = on_open(doc, False, plan, "r2", "ready", 3.0)
    assert side == "baseline" and (again["phase"], again["cause"]) == ("rolled_back", "restarted")
