"""The decision a person can act on: regimes judged as they are felt, the answer per workload, a traffic profile's
answer, a small memory excess as a caveat, the candidates read together, one notation. Pure: crafted results and
the committed 27B H200 run's raw results."""

from __future__ import annotations

import asyncio
import dataclasses
import gzip
import json
import math
import shlex
from pathlib import Path

import pytest

from proxy.bench.live.trafficsource import from_records
from proxy.bench.report.document import make_headline
from proxy.bench.run.benchconfig import Target
from proxy.bench.run.targets import probe
from proxy.bench.verdict.comparison import Comparison
from proxy.bench.verdict.decide import decide, decide_all
from proxy.bench.verdict.headline import headline
from proxy.bench.verdict.inputs import Cell, LiveFinding, Traffic
from proxy.bench.verdict.merge import load_runs
from proxy.bench.verdict.regimes import RegimeAnswer, answer, even_split, weigh_next
from proxy.bench.verdict.stats import Paired
from proxy.bench.verdict.weighting import crossing, parse_spec, prompt_class, weigh
from proxy.cli import main
from proxy.cli.reporting import with_traffic
from proxy.notation import band, faster, faster_interval
from tests.bench.verdict.test_verdict import C1, C8, LONG, loaded, results, run, trio

ROOT = Path(__file__).resolve().parents[3]
RAW27 = ROOT / "docs/gpu-results/h200-2026-12-03-27b/raw"


def unzip(tmp: Path, name: str) -> Path:
    out = tmp / f"{name}.jsonl"
    out.write_bytes(gzip.decompress((RAW27 / name / "results.jsonl.gz").read_bytes()))
    return out


@pytest.fixture(scope="module")
def run27(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("r27")
    return unzip(tmp, "llama"), unzip(tmp, "sglang")


def test_the_27b_run_is_an_answer_per_workload_with_its_crossing_points(run27: tuple[Path, Path]) -> None:
    """llama.cpp Q4_K_M vs SGLang bf16 on the H200 under a 72 GiB budget: llama.cpp is faster one request at a
    time, SGLang under load and on long prompts — the answer depends on the traffic, and says where it turns."""
    d = load_runs(list(run27), baseline="llama", accept_quantization_difference=True)
    # each run called its own first engine the baseline; joined, sglang is the candidate
    assert {s["engine"]: s["role"] for s in d.stints} == {"llama": "baseline", "llama-aa": "aa", "sglang": "candidate"}
    (v,) = decide_all(d.results)
    assert v.decision == "depends", v.summary
    by = {a.step: a for a in v.regimes}
    assert (by["decode"].answer, by["throughput"].answer, by["long-context"].answer) == ("loss", "win", "win")
    # each regime decided by the figure its person feels, the rest trade-offs in words
    assert by["decode"].decided_by == "whole request, 64-token answer"
    assert by["throughput"].decided_by == "output tok/s at c=64"
    assert by["long-context"].decided_by == "whole 16k-prompt request"
    assert "stay with llama for one request at a time (llama 20 % faster" in v.summary
    assert "switch to sglang for concurrent traffic (sglang ×7.6 faster" in v.summary
    # where SGLang overtakes as concurrency rises (c=1: llama faster, c=4: sglang), and the output length at which
    # the whole single request costs the same (sglang's first token sooner, each next one later)
    assert "sglang overtakes llama between c=1 and c=4" in v.summary
    be = by["decode"].break_even
    assert be is not None and (be.shorter, be.longer) == ("sglang", "llama") and 5 < be.tokens < 15
    assert "sglang is faster for answers under 9 tokens, llama beyond" in v.summary
    assert any("decode after a 16k prompt" in t for t in by["long-context"].tradeoffs)  # a trade-off, not a veto
    # 0.19 GiB over the 72 GiB budget through a share setting: a caveat with the share that fits, not a stop
    assert v.stopped_at is None and len(v.caveats) == 1
    assert "0.19 GiB (0.3 %) over budget 72.00 GiB" in v.caveats[0] and "--mem-fraction-static 0.48" in v.caveats[0]
    assert "token" not in v.caveats[0]  # the results alone (no engine log beside them) do not hold the KV pool
    assert v.next_step is not None and "--traffic" in v.next_step
    x = crossing(v.cells, "short")
    assert x is not None and x[:2] == (1, 4) and 1 < x[2] < 4


def test_the_27b_headline_says_discounted_and_its_next_is_a_command_that_runs(
    run27: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first screen says the answer includes the precision difference (first line and a note, before the
    regimes), and "next" is the report command on these results with the concurrency levels measured — pasted as
    printed (the even split standing in for the user's shares), it runs and weighs the answer by that traffic."""
    d = load_runs(list(run27), baseline="llama", accept_quantization_difference=True)
    vs = decide_all(d.results)
    h = headline(vs)
    assert h.lines()[0].startswith("DEPENDS (discounted): depends on your traffic"), h.lines()[0]
    assert h.discounted is not None and h.to_json()["discounted"] == h.discounted
    (note,) = h.notes
    assert "precision difference Q4_K - Medium vs bf16" in note and "same-weights comparison is the clean test" in note
    assert "vs bf16 (answers not compared: bench --agreement); a same-weights" in note  # how to measure it, said
    assert h.lines()[1] == f"  note: {note}"  # right under the decision, before the regimes
    cmd, _, comment = (h.next_step or "").partition("  # ")
    assert cmd == shlex.join(["enginemeter", "report", "--results", *map(str, run27), "--baseline", "llama",
                              "--accept-quantization-difference", "--traffic", "c1=25,c4=25,c16=25,c64=25",
                              "--out", "traffic-report"]), h.next_step  # fmt: skip
    assert "share of busy time" in comment and "placeholder" in comment
    argv = shlex.split(cmd)[1:]
    argv[argv.index("--out") + 1] = str(tmp_path / "traffic-report")
    capsys.readouterr()
    assert main(argv) == 0
    vj = json.loads((tmp_path / "traffic-report" / "verdict.json").read_text())
    assert vj["traffic"]["concurrency"] == {"1": 0.25, "4": 0.25, "16": 0.25, "64": 0.25}, vj["traffic"]
    assert vj["headline"]["decision"] in ("switch", "stay") and vj["headline"]["discounted"]
    assert vj["headline"]["next"] is None  # the traffic decided: nothing left to weigh
    md = (tmp_path / "traffic-report" / "report.md").read_text()
    assert f"**{vj['headline']['decision'].upper()}** (discounted) — " in md.split("## Verdict")[0]
    # a live report's next takes the profile from its own comparison log; without a known command, words
    (v,) = vs
    live = dataclasses.replace(
        d.results, live=True, report_command="enginemeter report --log 'c 1.jsonl' --primary llama"
    )
    assert weigh_next(live, v.cells).startswith(
        "enginemeter report --log 'c 1.jsonl' --primary llama --traffic 'c 1.jsonl' --out traffic-report  # "
    )
    bare = weigh_next(dataclasses.replace(d.results, report_command=None), v.cells)
    assert bare.startswith("weigh it by your traffic: the report again with --traffic c1=25,c4=25,c16=25,c64=25")
    assert even_split([1, 4, 64]) == "c1=34,c4=33,c64=33"


def test_the_27b_memory_caveat_states_its_kv_cost_in_tokens() -> None:
    """The runs as collected, each launched engine's log in its engines/: SGLang's says its KV pool (77,941 tokens
    in 2 x 8.62 GiB), so the 0.56 GiB a smaller share gives back is stated in tokens of that pool too."""
    d = load_runs([RAW27 / "llama", RAW27 / "sglang"], baseline="llama", accept_quantization_difference=True)
    sg = next(e for e in d.results.engines if e.name == "sglang")
    assert (sg.kv_pool_tokens, sg.kv_cache_bytes) == (77941, round(8.62 * 2**30) * 2)
    (v,) = decide_all(d.results)
    (caveat,) = v.caveats
    assert "~0.56 GiB less, from its KV cache (≈2,539 tokens of its 77,941-token KV pool): launch it so" in caveat
    # 0.004 of the GPU's 140.40 GiB is 0.56 GiB: 3.3 % of the pool's 17.24 GiB, so 3.3 % of its 77,941 tokens


def test_a_run_cut_by_the_end_of_its_lease_says_it_ended_before_a_regime() -> None:
    """The 2026-12-05 H100 run had long prompts in its suite; the lease ended before llama.cpp reached them. The
    first screen says so, not "add --prompt-lengths" (the flag it already had)."""
    raw = ROOT / "docs/gpu-results/h100-2026-12-05-27b/raw"
    d = load_runs([raw / "llama", raw / "sglang-fp8"], baseline="llama", accept_quantization_difference=True)
    assert d.interrupted
    h = make_headline(d, decide_all(d.results))
    assert h.decision == "switch" and "long prompts: not measured (the run ended before it)" in h.regimes, h.regimes
    d.interrupted = False  # the same data from a run that ended on its own: the flags it lacked
    (line,) = [r for r in make_headline(d, decide_all(d.results)).regimes if r.startswith("long prompts")]
    assert "--prompt-lengths" in line, line


def test_a_launched_engines_log_gives_the_bench_its_kv_pool() -> None:
    """The bench records the pool a launched engine logged (SGLang's /server_info has the tokens, not the bytes),
    so a new run's results carry it without the log beside them."""
    t = Target("sglang", "http://127.0.0.1:9", kind="sglang")  # nothing answers: the log alone speaks
    asyncio.run(probe(t, timeout=1.0, log=RAW27 / "sglang" / "engines" / "sglang.log"))
    assert (t.info["kv_pool_tokens"], t.info["kv_cache_bytes"]) == (77941, round(8.62 * 2**30) * 2)
    bare = Target("sglang", "http://127.0.0.1:9", kind="sglang")
    asyncio.run(probe(bare, timeout=1.0))
    assert "kv_cache_bytes" not in bare.info


@pytest.mark.parametrize(("spec", "decision", "words"), [
    ("c1=100", "stay", "stay with llama for this traffic: llama is 20 % faster than sglang"),
    ("c64=100", "switch", "switch to sglang for this traffic: sglang is ×7.6 faster than llama"),
    ("c1=30,c16=70", "switch", "switch to sglang for this traffic: sglang is ×2.2 faster than llama"),
])  # fmt: skip
def test_the_27b_run_for_a_traffic_profile(
    run27: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], spec: str, decision: str, words: str
) -> None:
    out = tmp_path / "rep"
    # the runs as collected: a directory each, its results gzipped (the unzipped files give the same answer)
    rc = main(["report", "--results", str(RAW27 / "llama"), str(RAW27 / "sglang"), "--baseline", "llama",
               "--accept-quantization-difference", "--traffic", spec, "--out", str(out)])  # fmt: skip
    assert rc == 0
    vj = json.loads((out / "verdict.json").read_text())
    assert vj["sources"] == [str(RAW27 / n / "results.jsonl.gz") for n in ("llama", "sglang")]
    assert vj["version"] == 4 and vj["decision"] == decision and vj["headline"]["decision"] == decision
    assert words in vj["headline"]["sentence"]
    assert vj["traffic"]["source"] == f"inline: {spec}" and vj["verdicts"][0]["traffic"]["decision"] == decision
    # one headline everywhere: the console's last lines, the report's first screen
    printed = " ".join(capsys.readouterr().out.split())  # the first screen wraps at 120 characters
    assert f"{decision.upper()} (discounted): {vj['headline']['sentence']}" in printed  # Q4_K_M vs bf16
    md = (out / "report.md").read_text()
    assert md.index("## The answer") < md.index("## Verdict") and f"**{decision.upper()}** (discounted) — " in md


def test_a_directory_without_results_is_refused_plainly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["report", "--results", str(tmp_path), "--out", str(tmp_path / "rep")])
    assert rc != 0 and "no results.jsonl (or results.jsonl.gz) in this directory" in capsys.readouterr().err
    assert not (tmp_path / "rep").exists()


def test_traffic_specs_are_read_and_refused_plainly() -> None:
    t = parse_spec("c1=30,c16=70,short=90,16k=10")
    assert t.concurrency == {1.0: pytest.approx(0.3), 16.0: pytest.approx(0.7)}
    assert t.prompts == {"short": pytest.approx(0.9), "16k": pytest.approx(0.1)}
    assert parse_spec("c2=1,c8=3").concurrency == {2.0: 0.25, 8.0: 0.75}  # shares are normalized
    for bad, why in (("c1=30,x=70", "no prompt-length class"), ("short=100", "give the concurrency shares"),
                     ("c0=50,c2=50", "1 or more"), ("c1=thirty", "is not cN=PERCENT")):  # fmt: skip
        with pytest.raises(ValueError, match=why):
            parse_spec(bad)
    assert (prompt_class(30), prompt_class(1200), prompt_class(20_000)) == ("short", "long", "16k")


def test_a_profile_is_weighed_by_the_nearest_cells_and_says_where_it_reaches_beyond() -> None:
    # the candidate is 20 % slower alone, ×2.25 faster at c=8 (900 tok/s against 400)
    r = results(*trio(tpot=0.0125), *loaded(tps=900))
    cells = decide(r, "sglang").cells
    alone = weigh(parse_spec("c1=100"), cells, "llama", "sglang", "medium")
    busy = weigh(parse_spec("c32=100"), cells, "llama", "sglang", "medium")
    assert (alone.decision, busy.decision) == ("stay", "switch")
    assert busy.parts[0].cell.cell == C8 and any("beyond the largest measured (8)" in n for n in busy.notes)
    # a mix is the time-weighted geometric mean of its cells' speed ratios
    mix = weigh(parse_spec("c1=50,c8=50"), cells, "llama", "sglang", "medium")
    expected = math.exp(0.5 * math.log(alone.ratio) + 0.5 * math.log(busy.ratio))
    assert mix.ratio == pytest.approx(expected)
    # long prompts not measured: the nearest class stands for them, and the answer says so
    longer = weigh(parse_spec("c1=100,16k=100"), cells, "llama", "sglang", "medium")
    assert any("16k prompts were not measured" in n for n in longer.notes)
    # through the verdict: the decision is the profile's
    assert decide(dataclasses.replace(r, traffic=parse_spec("c8=100")), "sglang").decision == "switch"
    assert decide(dataclasses.replace(r, traffic=parse_spec("c1=100")), "sglang").decision == "stay"


def test_a_candidate_that_wins_ttft_and_loses_decode_gets_the_output_length_break_even() -> None:
    # first token 60 ms sooner, each next one 2 ms later: the same whole request at 1 + 60/2 = 31 tokens
    r = results(run("llama", C1, ttft=0.100, tpot=0.010, noise=0.005), run("llama-aa", C1, seed=1, noise=0.005),
                run("sglang", C1, ttft=0.040, tpot=0.012, noise=0.005), *loaded(tps=400))  # fmt: skip
    single = next(a for a in decide(r, "sglang").regimes if a.step == "decode")
    assert single.break_even is not None and single.break_even.tokens == pytest.approx(31, rel=0.05)
    assert single.break_even.text() == "sglang is faster for answers under 31 tokens, llama beyond"


def test_a_throughput_tie_is_decided_by_the_first_token_under_load() -> None:
    r = results(*trio(), run("llama", C8, tps=400, ttft=1.0), run("llama-aa", C8, tps=400, ttft=1.0, seed=1),
                run("sglang", C8, tps=400, ttft=0.2))  # fmt: skip
    load = next(a for a in decide(r, "sglang").regimes if a.step == "throughput")
    assert load.answer == "win" and load.decided_by == "TTFT at c=8"
    assert "the deciding figure (output tok/s at c=8) tied" in load.text


C4 = Cell("cold", 4, 32, "short")


def under_load(
    tps: tuple[float, float, float], ttft: tuple[float, float, float], floor: float = 0.074
) -> list[Comparison]:
    """The two figures of the under-load regime, np4 against np1: output tok/s (deciding) and TTFT at c=4, each
    as (relative change, 95 % interval) over a relaunch's noise floor of ``floor``."""

    def comp(
        metric: str, what: str, higher: bool, base: float, rel: tuple[float, float, float], primary: bool
    ) -> Comparison:
        stats = Paired(8, 8, base, base * (1 + rel[0]), *rel, None)
        return Comparison("throughput", what, metric, "tok/s" if higher else "s", higher, C4, stats, floor, "A/A", {},
                          primary=primary)  # fmt: skip

    return [comp("output_tps", "output tok/s at c=4", True, 886.0, tps, True),
            comp("ttft_s", "TTFT at c=4", False, 0.110, ttft, False)]  # fmt: skip


def load_answer(comps: list[Comparison]) -> RegimeAnswer:
    return answer("throughput", "under load", comps, "np1", "np4", 4)


# CI's 2-core tune run: -np 4 serves four requests together, the same tokens (compute-bound), none queued
SAME_TOKENS = (-0.077, -0.10, -0.055)  # beyond the ±7.4 % floor in its estimate, its interval reaching inside it
SOONER = (-0.79, -0.83, -0.74)  # TTFT 110 ms -> 23 ms
TTFT_TIE = (-0.02, -0.05, 0.01)


def test_a_throughput_that_does_not_separate_them_leaves_it_to_the_first_token_under_load() -> None:
    load = load_answer(under_load(SAME_TOKENS, SOONER))
    assert [c.outcome for c in load.comparisons] == ["unresolved", "win"]
    assert (load.answer, load.decided_by) == ("win", "TTFT at c=4")
    assert load.head.startswith("np4 ×4.8 faster (TTFT at c=4: np1 110 ms, np4 23.1 ms)"), load.head
    # the throughput's lean goes with the answer, in the short form and the long one
    assert load.head.endswith("; output tok/s at c=4 unresolved"), load.head
    assert "output tok/s at c=4 unresolved: np1 8.3 % faster (5.8–11 % faster), reaching inside the band ±7.4 %" in (
        load.line)  # fmt: skip
    assert "the deciding figure (output tok/s at c=4) did not separate them" in load.text
    # both ways: the same tokens, later
    later = load_answer(under_load(SAME_TOKENS, (3.0, 2.5, 3.5)))
    assert (later.answer, later.decided_by) == ("loss", "TTFT at c=4")


def test_an_unresolved_throughput_with_no_clear_first_token_stays_unresolved() -> None:
    load = load_answer(under_load(SAME_TOKENS, TTFT_TIE))
    assert [c.outcome for c in load.comparisons] == ["unresolved", "tie"]
    assert (load.answer, load.decided_by) == ("unresolved", "output tok/s at c=4")
    # nor does an unresolved TTFT decide
    load = load_answer(under_load(SAME_TOKENS, (-0.10, -0.20, 0.02)))
    assert [c.outcome for c in load.comparisons] == ["unresolved", "unresolved"] and load.answer == "unresolved"


def test_a_throughput_resolved_either_way_is_never_overruled_by_the_first_token() -> None:
    """Clearly fewer tokens beyond the floor: TTFT ×4.8 sooner is a trade-off beside the loss, never the answer
    (and a clear gain is not undone by a slower first token)."""
    slower = load_answer(under_load((-0.20, -0.25, -0.15), SOONER))
    assert [c.outcome for c in slower.comparisons] == ["loss", "win"]
    assert (slower.answer, slower.decided_by) == ("loss", "output tok/s at c=4")
    assert slower.tradeoffs == ("np4 is ×4.8 faster (TTFT at c=4; 95% CI ×3.8–×5.9 faster)",)
    assert "did not separate" not in slower.text and "unresolved" not in slower.head
    faster_ = load_answer(under_load((0.20, 0.15, 0.25), (3.0, 2.5, 3.5)))
    assert (faster_.answer, faster_.decided_by) == ("win", "output tok/s at c=4")


def test_candidates_are_read_together_and_the_same_file_arm_is_attribution() -> None:
    """Three SGLang candidates against llama.cpp: FP8 switches (the best), bf16 depends, the same GGUF file is
    slower — attribution ('its gains come from its formats'), not a second answer."""
    fp8 = results(*trio(tpot=0.007), *loaded(tps=3000))
    bf16 = results(*trio(tpot=0.0125), *loaded(tps=2000))
    gguf = results(*trio(tpot=0.011), *loaded(tps=350))
    vs = [dataclasses.replace(decide(r, "sglang"), candidate=n) for r, n in ((fp8, "sg-fp8"), (bf16, "sg-bf16"),
                                                                             (gguf, "sg-gguf"))]  # fmt: skip
    assert [v.decision for v in vs] == ["switch", "depends", "stay"]
    weights = {"sg-fp8": "different precision", "sg-bf16": "different precision", "sg-gguf": "same file"}
    h = headline(vs, weights, dict.fromkeys(weights, "sglang"))
    assert h.decision == "switch" and h.candidate == "sg-fp8" and h.sentence.startswith("switch to sg-fp8")
    attribution = next(x for x in h.others if x.startswith("sg-gguf"))
    assert "your own weights file" in attribution and "switch formats with it" in attribution
    assert any(x.startswith("sg-bf16: DEPENDS") for x in h.others)
    assert h.lines()[0].startswith("SWITCH: switch to sg-fp8")


def test_live_traffic_says_not_yet_until_the_sequence_decides() -> None:
    r = dataclasses.replace(results(*trio(tpot=0.008), *loaded(tps=400)), live=True)
    few = {"sglang": {"decode": LiveFinding("not yet", "...", 3, "TPOT")}}
    v = decide(dataclasses.replace(r, live_findings=few), "sglang")
    assert v.decision == "not yet" and "nothing is decided before 30" in v.summary
    done = {
        "sglang": {"decode": LiveFinding("faster", "sglang is faster than llama beyond the band ±5.0 %", 41, "TPOT")}
    }
    assert decide(dataclasses.replace(r, live_findings=done), "sglang").decision == "switch"


def test_the_profile_of_logged_requests_is_the_time_at_each_number_in_flight() -> None:
    # request log lines (end time, duration): 0-10 s one request; 10-20 s four; then 10 s idle; one at 30-40 s
    recs = [{"request_id": "a", "role": "primary", "ts": 10.0, "e2e_s": 10.0, "prompt_tokens": 30,
             "completion_tokens": 64}]  # fmt: skip
    recs += [{"request_id": f"b{i}", "role": "primary", "ts": 20.0, "e2e_s": 10.0, "prompt_tokens": 1000,
              "completion_tokens": 128} for i in range(4)]  # fmt: skip
    recs += [{"request_id": "c", "role": "primary", "ts": 40.0, "e2e_s": 10.0, "prompt_tokens": 30,
              "completion_tokens": 64}, {"request_id": "s", "role": "shadow", "ts": 40.0, "e2e_s": 39.0}]  # fmt: skip
    t = from_records(recs, "request log")
    assert t.concurrency == {1.0: pytest.approx(2 / 3), 4.0: pytest.approx(1 / 3)}
    assert t.idle == pytest.approx(0.25) and t.requests == 6 and t.output_tokens == 128
    assert t.prompts == {"short": pytest.approx(2 / 6), "long": pytest.approx(4 / 6)}


def test_one_notation() -> None:
    assert (faster(1.44), faster(14.2), faster(1 / 1.16), faster(0.4), faster(1.0)) == (
        "44 % faster", "×14.2 faster", "16 % slower", "×2.5 slower", "as fast")  # fmt: skip
    assert faster_interval(1.12, 1.18) == "12–18 % faster"
    assert faster_interval(1.6, 3.2) == "×1.6–×3.2 faster"  # one unit: the one its farther end needs
    assert faster_interval(1 / 1.18, 1 / 1.12) == "12–18 % slower"
    assert faster_interval(0.97, 1.05) == "between 3.1 % slower and 5.0 % faster"
    # ends that would read the same get a decimal more: an interval never reads as a point (27B, vllm-fp8 16k)
    assert faster_interval(2.47, 2.53) == "×2.47–×2.53 faster"
    assert faster_interval(1 / 1.194, 1 / 1.186) == "18.6–19.4 % slower"
    assert faster_interval(1.0412, 1.0414) == "4.12–4.14 % faster"
    assert (band(0.05), band(0.206), band(1.4)) == ("±5.0 %", "±21 %", "×2.4 either way")
    # no signed numbers anywhere a person reads a difference
    r = results(*trio(tpot=0.0125), *loaded(tps=900), *trio(LONG))
    text = json.dumps([x.text for x in decide(r, "sglang").reasons])
    assert "+-" not in text and "faster by -" not in text and "Δ" not in text


def test_cells_compare_each_regimes_own_figure() -> None:
    v = decide(results(*trio(), *loaded(tps=900)), "sglang")
    assert [(c.cell, c.metric) for c in v.cells] == [(C1, "e2e_s"), (C8, "output_tps")]
    assert Cell("cold", 1, 64, "medium") == C1 and isinstance(Traffic({1.0: 1.0}).text(), str)


def test_the_forest_chart_keeps_its_row_labels(run27: tuple[Path, Path]) -> None:
    """Each row of the forest chart is named by its comparison (matplotlib 3.11's ``set_yticks(ticks, labels)``
    installs a FuncFormatter, which the plain-number formatting had replaced with the row indices)."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from proxy.bench.report.charts import forest
    from proxy.bench.report.drawing import plain

    d = load_runs(list(run27), baseline="llama", accept_quantization_difference=True)
    fig, ax = plt.subplots()
    try:
        assert forest(decide_all(d.results), ax)
        plain(ax)
        fig.canvas.draw()
        labels = [t.get_text() for t in ax.get_yticklabels()]
        xs = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
    finally:
        plt.close(fig)
    assert "sglang: whole request, 64-token answer" in labels and "0" not in labels, labels
    assert xs and all("10^" not in x and "$" not in x for x in xs), xs  # the log axis in plain numbers


def test_the_h100_27b_run_names_both_fp8_switches_and_weighs_the_traffic_sent_through_the_proxy() -> None:
    """The 2026-12-06 H100 run: SGLang FP8 and vLLM FP8 both switch, within 2 % of each other on average — the
    headline names the best, says where the other leads, and the traffic decides between them. The
    traffic live.py sent through the proxy (bursts to 64) is weighed from the request log and written in the
    proxy's levels; vLLM's memory caveat says its context must come down with its share."""
    raw = ROOT / "docs/gpu-results/h100-2026-12-06-27b/raw"
    d = load_runs([raw / n for n in ("llama", "sglang-fp8", "vllm-fp8")], baseline="llama",
                  accept_quantization_difference=True)  # fmt: skip
    vs = decide_all(d.results)
    assert [(v.candidate, v.decision) for v in vs] == [("sglang-fp8", "switch"), ("vllm-fp8", "switch")]
    h = make_headline(d, vs)
    # issue 45: neither is crowned by an average of a 16 % gain and a ×10 one: both are named, with where each leads
    assert h.candidate is None and h.candidates == ("sglang-fp8", "vllm-fp8"), h
    assert h.sentence == (
        "switch to sglang-fp8 or vllm-fp8 — neither leads everywhere: sglang-fp8 on long prompts, vllm-fp8 under "
        "load; a tie one request at a time; your traffic picks: long prompts → sglang-fp8, under load → vllm-fp8"
    ), h.sentence
    assert h.next_step and "--traffic c1=25,c4=25,c16=25,c64=25" in h.next_step and not h.others
    (caveat,) = next(v for v in vs if v.candidate == "vllm-fp8").caveats
    assert "with --max-model-len at most 195,712" in caveat and "vLLM refuses to start" in caveat
    t = from_records(
        [json.loads(x) for x in (raw / "live/live/requests.jsonl").read_text().splitlines()], "request log"
    )
    assert max(t.concurrency) == 64 and t.requests == 380
    said = t.text()
    assert said.startswith("c=1 23%, c=2 19%, ") and "c=33-64 22%" in said and "c=3 " not in said, said
    dt = with_traffic(d, t)
    weighed = make_headline(dt, decide_all(dt.results))
    assert weighed.decision == "switch" and weighed.traffic and "c=33-64" in weighed.traffic
    # with the traffic recorded, one engine: better beyond the noise for it
    assert weighed.candidates == ("vllm-fp8",) and weighed.candidate == "vllm-fp8", weighed
