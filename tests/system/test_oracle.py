"""Issue 45's consistency oracle: every claim the tool prints agrees with its interval, with the other screens and
with the real command line — over generated comparisons (hypothesis) and over the committed GPU runs.

Each test names the defect it catches when reintroduced (/work/notes/progress-answer.md keeps the list)."""

from __future__ import annotations

import argparse
import contextlib
import html as htmlmod
import http.server
import math
import re
import shlex
import threading
from collections.abc import Iterator
from functools import cache
from itertools import permutations
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.bench.report.document import answer_blocks, make_headline, switch_plan
from proxy.bench.report.render import render_html, render_md
from proxy.bench.report.rollback import KEY
from proxy.bench.verdict.comparison import Comparison, log_ratio
from proxy.bench.verdict.data import Data
from proxy.bench.verdict.decide import Verdict, decide_all
from proxy.bench.verdict.headline import Headline, answer_table
from proxy.bench.verdict.inputs import Cell, Traffic
from proxy.bench.verdict.merge import load_runs
from proxy.bench.verdict.regimes import answer
from proxy.bench.verdict.stats import Paired
from proxy.bench.verdict.weighting import parse_spec, weigh
from proxy.cli import COMMANDS, build_parser, main
from proxy.cli.reporting import with_traffic
from proxy.cli.screen import LINES, WIDTH, first_screen
from proxy.config.configfile import parse_file
from proxy.judge import judge
from proxy.notation import count, faster_interval, seconds, unit
from proxy.sequential import STREAMS, Interval, current, sentence
from proxy.server.mirror.pairing import PairTable, Pending

ROOT = Path(__file__).resolve().parents[2]
FAST = settings(max_examples=60, deadline=None)
C1 = Cell("cold", 1, 64, "short")
#: the committed GPU runs with a join (llama.cpp and another)
RUNS = sorted(p.parents[2] for p in ROOT.glob("docs/gpu-results/*/raw/llama/results.jsonl.gz"))
NAMES = ("llama", "sglang-fp8", "vllm-fp8", "sglang", "sglang-gguf")


def _comparison(rel: float, half: float, skew: float, floor: float, higher: bool) -> Comparison:
    """A figure compared: its estimate ``rel`` (relative), an interval around it (``half`` wide on the log scale,
    ``skew`` of it on the upper side), its noise floor."""
    g = math.log1p(rel)
    lo, hi = math.expm1(g - half * (1 - skew)), math.expm1(g + half * (1 + skew))
    stats = Paired(40, 4, 1.0, 1.0 + rel, rel, lo, hi, None, (lo, hi))
    metric, what = ("output_tps", "output tok/s") if higher else ("e2e_s", "whole request")
    return Comparison("decode", what, metric, "x", higher, C1, stats, floor, "A/A", {})


comparisons = st.builds(
    _comparison,
    rel=st.floats(-0.9, 9.0),
    half=st.floats(0.0, 1.5),
    skew=st.floats(-0.5, 0.5),
    floor=st.floats(0.0, 0.5),
    higher=st.booleans(),
)


def _clauses(text: str) -> Iterator[str]:
    """A text's claims: its sentences and clauses, with "between A and B" intervals and a "was …" past left out."""
    text = re.sub(r"between [^()]*? and [^();,]*", "", text)
    for part in re.split(r"[;.—]|\(|\)| now, ", text):
        if " was " not in part:
            yield part


def _both(text: str) -> bool:
    return any("slower" in c and "faster" in c for c in _clauses(text))


@FAST
@given(comparisons)
def test_a_figures_words_follow_its_interval(c: Comparison) -> None:
    """Defects: a direction against the interval; "a tie" outside the band; one interval both slower and faster."""
    _, lo, hi = c.log_gain
    assert c.outcome == judge(lo, hi, log_ratio(c.win_band))
    a = answer("decode", "single request", [c], "base", "cand", None)
    assert ("a tie" in a.line) == (c.outcome == "tie"), a.line
    if c.outcome == "win":
        assert a.line.startswith("cand is ") and "faster" in a.line.split(" — ")[0], a.line
    if c.outcome == "loss":
        assert a.line.startswith("base is "), a.line
    assert not _both(a.line) and not _both(a.text), a.text
    if c.outcome in ("tie", "unresolved"):  # no winner: the interval is the candidate's, named, as the table has it
        _, rlo, rhi = c.speed
        assert f"cand's 95% CI {faster_interval(rlo, rhi, unit(*c.speed))}" in a.line, a.line


@FAST
@given(comparisons)
def test_one_cell_traffic_answers_as_its_cell(c: Comparison) -> None:
    """Defect: the traffic-weighted rule and the regime rule are two functions ("INCONCLUSIVE … crosses the band"
    beside "a tie … inside the band" for the same interval)."""
    t = weigh(Traffic({1.0: 1.0}), [c], "base", "cand", "short")
    assert t.outcome == c.outcome, (t.text, c.log_gain, c.win_band)
    want = {"win": "switch", "loss": "stay", "tie": "stay", "unresolved": "inconclusive"}[c.outcome]
    assert t.decision == want
    assert ("a tie" in t.text) == (c.outcome == "tie") and not _both(t.text), t.text


@FAST
@given(
    decision=st.sampled_from(["faster", "slower", "tie", "not yet"]),
    mid=st.floats(-1.5, 1.5),
    half=st.floats(0.0, 1.0),
    n=st.integers(1, 2000),
)
def test_the_live_sentence_follows_the_current_interval(decision: str, mid: float, half: float, n: int) -> None:
    """Defect: "np4 is slower than np1 beyond the band ±5.0 %, decided after 30 pairs (602 now: ×2.7 faster)"."""
    lo, hi = mid - half, mid + half
    now = current(lo, hi, 0.05)
    st_ = Interval(n, math.expm1(mid), math.expm1(lo), math.expm1(hi), decision, 30 if decision != "not yet" else None)  # type: ignore[arg-type]
    said = sentence("b", "a", STREAMS[1], st_, 0.05)
    for word in ("faster", "slower"):
        if f"b is {word} than a" in said:
            assert now == word, said
    if "a tie between" in said and " was " not in said:
        assert now == "tie", said
    assert not _both(said), said


def test_live_regimes_count_the_clients_requests_not_the_mirrored_copies() -> None:
    """Defect: a pair scored "under load" because a slow shadow copy of the previous request was still in flight."""
    pairs: list[tuple[int, int]] = []
    table = PairTable(60.0, lambda e, p, s, conc: pairs.append(conc), lambda name: None)

    def result(rid: str, role: str, engine: str) -> Any:  # the fields the table reads of a Result
        return SimpleNamespace(request_id=rid, role=role, engine=engine, outcome="ok", n_token_events=3, status=200)

    for rid in ("r1", "r2"):  # one request at a time: r2 starts after r1's primary answered, r1's shadow still out
        table.add(rid, Pending(created=0.0, engines=("p",), expected={"s"}))
        table.on_result(result(rid, "primary", "p"))
    table.on_result(result("r1", "shadow", "s"))
    table.on_result(result("r2", "shadow", "s"))
    assert pairs == [(1, 1), (1, 1)]
    table.add("r3", Pending(created=0.0, engines=("p",), expected={"s"}))
    table.add("r4", Pending(created=0.0, engines=("p",), expected={"s"}))  # two at once at the primary
    for rid in ("r3", "r4"):
        table.on_result(result(rid, "primary", "p"))
        table.on_result(result(rid, "shadow", "s"))
    assert pairs[2:] == [(1, 2), (2, 2)]


@FAST
@given(st.floats(0.0, 1e5), st.integers(0, 10**6))
def test_one_notation_for_durations_and_counts(v: float, n: int) -> None:
    """Defects: "load 1.9385689999999998 s", "1 slots"."""
    said = seconds(v)
    assert re.fullmatch(r"\d+(\.\d{1,2})? (ms|s)", said), said
    assert count(n, "slot") == (f"{n:,} slot" if n == 1 else f"{n:,} slots")
    assert seconds(1.9385689999999998) == "1.94 s" and count(1, "pair") == "1 pair"


# --- the committed GPU runs -----------------------------------------------------------------------------------


@cache
def _run(
    d: Path, order: tuple[str, ...] | None = None, traffic: str | None = None
) -> tuple[Data, list[Verdict], Headline]:
    names = order or tuple(n for n in NAMES if (d / "raw" / n / "results.jsonl.gz").is_file())
    data = load_runs([d / "raw" / n for n in names], baseline="llama", accept_quantization_difference=True)
    if traffic is not None:
        data = with_traffic(data, parse_spec(traffic))
    vs = decide_all(data.results)
    return data, vs, make_headline(data, vs)


def _screen(d: Path, traffic: str | None = None) -> list[str]:
    data, vs, h = _run(d, None, traffic)
    fake = {k: f"out/{k}" for k in ("report_md", "report_html", "verdict_json", "switch_plan")}
    return first_screen({"verdicts": vs, "headline": h, "data": data, **fake})


@pytest.mark.parametrize("d", RUNS, ids=lambda p: p.name)
@pytest.mark.parametrize("traffic", [None, "c1=100", "c64=100", "c256=100"])
def test_the_first_screen_fits_and_says_the_answer_once(d: Path, traffic: str | None) -> None:
    """Defects: the first screen buries the answer (430 words, 561-character lines, each figure three times);
    extrapolation beyond the measured concurrency said only in report.md."""
    lines = _screen(d, traffic)
    assert len(lines) <= LINES and all(len(x) <= WIDTH for x in lines), "\n".join(lines)
    assert lines[0].startswith("workload ") and "figure" in lines[0]
    answers = [x for x in lines if re.match(r"^[A-Z][A-Z ]+( \(discounted\))?: ", x)]
    assert len(answers) == 1, lines
    assert lines.index(answers[0]) > 1  # the table first
    data, _, _ = _run(d, None, traffic)
    measured = max(s.cell.concurrency for s in data.results.samples)
    wanted = float(traffic.split("=")[0][1:]) if traffic else 0.0
    if wanted > measured * 1.5:  # beyond the concurrency measured: said on the first screen
        assert any(x.lstrip().startswith("extrapolated: ") for x in lines), lines
    assert not any(_both(x) for x in lines[lines.index(answers[0]) :]), lines


@pytest.mark.parametrize("d", RUNS, ids=lambda p: p.name)
@pytest.mark.parametrize("traffic", [None, "c64=100"])
def test_the_report_opens_with_the_first_screens_table(d: Path, traffic: str | None) -> None:
    """Defect: report.md and report.html open with another answer than the terminal's (the old list of regime
    lines, each figure again): the report's top is the first screen's table, the same strings, then the answer
    once — no figure of the table said twice before the verdict section."""
    data, vs, h = _run(d, None, traffic)
    t = answer_table(vs, data.results.requests)
    top = render_md(answer_blocks(h, vs, data))
    html = render_html(answer_blocks(h, vs, data), d)
    screen = _screen(d, traffic)
    assert top.startswith("## The answer\n\n| workload | figure |")
    rows = [t.header, *t.rows] + ([t.latency_header, *t.latency_rows] if t.latency_rows else [])
    assert t.latency_rows or not data.results.requests
    for i, row in enumerate(rows):
        assert f"| {' | '.join(x for x in row if x)} |" in top
        assert re.sub(r"\s+", " ", screen[i]) == (re.sub(r"\s+", " ", " ".join(x for x in row if x)))
        assert all(htmlmod.escape(x) in html for x in row)
    for row in t.rows:
        for figure in (x.split(" ", 2)[-1] for x in row[3:] if x != "–"):  # "×10.2 faster (×8.8–×11.7)"
            assert top.count(figure) == 1, figure
    assert h.brief in top and top.index(h.brief) > top.index(t.rows[-1][0])


def test_the_27b_reports_top_says_how_to_switch_on_one_card() -> None:
    """A team with one 72 GB card reads, under the answer, that each FP8 switch is a swap (the two engines do not
    fit at once) and its outage: the switch plan's own figures."""
    d = ROOT / "docs/gpu-results/h100-2026-12-06-27b"
    data, vs, h = _run(d)
    top, plan = render_md(answer_blocks(h, vs, data)), switch_plan(data, vs)
    (line,) = [x for x in top.splitlines() if x.startswith("- *how to switch (switch-plan.md):* ")]
    assert "sglang-fp8 by a swap, about 141 s without service" in line and "vllm-fp8 by a swap, about 151 s" in line
    assert "exceed the budget 72.00 GiB" in line
    assert "**Expected outage: about 141 s**" in plan and "**Expected outage: about 151 s**" in plan


def test_a_four_engine_join_splits_its_table_to_fit() -> None:
    """Defect: the tuned join (np64, np16, sglang-fp8, vllm-fp8) printed its table 161 characters wide: wider than
    ``WIDTH``, the engines go into two tables, each with the workload, its figure and the baseline."""
    raw = ROOT / "docs/gpu-results/h100-2026-12-06-27b/raw"
    runs = [raw / "tune", raw / "sglang-fp8", raw / "vllm-fp8"]
    data = load_runs(runs, baseline="np64", accept_quantization_difference=True)
    vs = decide_all(data.results)
    lines = first_screen({"verdicts": vs, "headline": make_headline(data, vs), "data": data, "report_md": "r.md"})
    assert len(lines) <= LINES and all(len(x) <= WIDTH for x in lines), "\n".join(lines)
    heads = [x.split() for x in lines if x.startswith("workload ")]
    assert len(heads) == 2 and all(h[:3] == ["workload", "figure", "np64"] for h in heads), heads
    assert sorted(e for h in heads for e in h[3:]) == ["np16", "sglang-fp8", "vllm-fp8"]


@pytest.mark.parametrize("d", RUNS, ids=lambda p: p.name)
def test_the_answer_does_not_depend_on_the_order_of_the_results(d: Path) -> None:
    """Defect: the same plan named different winners by chance (order, ties broken by position)."""
    names = tuple(n for n in NAMES if (d / "raw" / n / "results.jsonl.gz").is_file())
    first = _run(d, names)[2].to_json()
    for order in list(permutations(names))[1:4]:
        again = _run(d, order)[2].to_json()
        # the next command repeats the --results as given; everything else is the same
        assert {**again, "next": None} == {**first, "next": None}, order


@pytest.mark.parametrize("d", RUNS, ids=lambda p: p.name)
def test_the_headline_agrees_with_the_regimes_and_the_traffic(d: Path) -> None:
    """Defects: a headline that says something its regimes do not; a traffic answer against its one cell."""
    _, vs, h = _run(d)
    for v in vs:
        for a in v.regimes:
            if a.answer in ("win", "loss", "tie", "unresolved"):
                assert ("a tie" in a.line) == (a.answer == "tie"), a.line
                assert not _both(a.line), a.line
        if v.decision == "switch":
            assert all(a.answer != "loss" for a in v.regimes)
    if h.decision == "switch":
        assert set(h.candidates) <= {v.candidate for v in vs if v.decision == "switch"}
        assert (h.candidate is None) == (len(h.candidates) > 1)
    _, tv, _ = _run(d, None, "c1=100")
    for v in tv:
        c1 = next(c for c in v.cells if c.cell.concurrency == 1 and c.cell.prompt_len == v.cells[0].cell.prompt_len)
        assert v.traffic is not None and v.traffic.outcome == c1.outcome


def test_the_27b_join_names_both_fp8_engines_and_its_traffic_one() -> None:
    """Defect: a coin toss crowned as "the best" (an average of a 16 % gain with a ×10 one)."""
    d = ROOT / "docs/gpu-results/h100-2026-12-06-27b"
    h = _run(d)[2]
    assert h.candidates == ("sglang-fp8", "vllm-fp8") and h.candidate is None
    assert "sglang-fp8 on long prompts" in h.sentence and "vllm-fp8 under load" in h.sentence
    recorded = ROOT / "docs/gpu-results/h100-2026-12-06-27b/raw/live/live/requests.jsonl"
    from proxy.bench.live.trafficsource import traffic_from

    data = with_traffic(_run(d)[0], traffic_from(str(recorded)))
    vs = decide_all(data.results)
    assert make_headline(data, vs).candidates == ("vllm-fp8",)


def _printed_commands(lines: list[str]) -> list[str]:
    """The commands a screen prints (continued with " \\" over lines), without their comments."""
    out, cur = [], ""
    for x in lines:
        s = x.strip()
        if cur or s.startswith("enginemeter "):
            cur += s.removesuffix("\\").strip() + " "
            if not s.endswith("\\"):
                out.append(cur.strip())
                cur = ""
    return out


@pytest.mark.parametrize("d", RUNS, ids=lambda p: p.name)
def test_every_printed_command_parses(d: Path, tmp_path: Path) -> None:
    """Defects: a hint pasted into a command's arguments (`--prompt-lengths short,long '(or' 4k, …`); a switch
    plan whose commands (check-config, serve: rollout or swap) do not parse or whose config the reader refuses;
    "1 slot(s)" in the plan."""
    data, vs, _ = _run(d)
    cmds = _printed_commands(_screen(d))
    for v in vs:
        for a in v.regimes:
            if a.fix and a.fix.startswith("--"):
                cmds.append(f"enginemeter bench --launch x --out y {a.fix}")
        if v.next_step and "enginemeter " in v.next_step:
            cmds.append("enginemeter " + v.next_step.split("enginemeter ", 1)[1].split("  # ")[0])
    plan = switch_plan(data, vs)
    assert not re.search(r"\w\(s\)", plan), "one notation for counts: 1 slot, 16 slots (proxy.notation.count)"
    printed = [x for x in plan.splitlines() if x.startswith("enginemeter ")]
    if any(v.decision == "switch" for v in vs):
        assert any(" serve --config " in x for x in printed), plan
    for cmd in cmds + printed:
        argv = shlex.split(cmd, comments=True)[1:]
        build_parser((argv[0],)).parse_args(argv)  # SystemExit(2) on an unrecognized argument
    configs = re.findall(r"^```yaml\n(.*?)\n```$", plan, re.MULTILINE | re.DOTALL)
    assert len(configs) == sum(" serve --config " in x for x in printed)
    for i, text in enumerate(configs):
        (tmp_path / f"{i}.yaml").write_text(text)
        s = parse_file(tmp_path / f"{i}.yaml", env={KEY: "k"})  # the real reader: ConfigError when it refuses
        assert s.routes and all(r.rollout is not None or r.swap is not None for r in s.routes)


def test_the_printed_report_command_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The quick ones are run: the 27B join's `next:` (the report weighed by a traffic) exits 0."""
    d = ROOT / "docs/gpu-results/h100-2026-12-06-27b"
    (cmd,) = _printed_commands(_screen(d))
    argv = shlex.split(cmd)[1:]
    argv[argv.index("--out") + 1] = str(tmp_path / "out")
    monkeypatch.chdir(d)
    assert main(argv) == 0


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_mistyped_flag_gets_a_did_you_mean(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Defect: no "did you mean" for a mistyped flag (`--lanch`)."""
    p = build_parser((command,))
    sub_action = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    sub = sub_action.choices[command]
    flag = next(
        o for a in sub._actions for o in a.option_strings if o.startswith("--") and len(o) > 6 and o != "--help"
    )
    typo = flag[:3] + flag[4:]  # one letter dropped
    required = [x for a in sub._actions if a.required and a.option_strings for x in (a.option_strings[0], "x")]
    with pytest.raises(SystemExit) as exc:
        main([command, *required, typo, "x"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "did you mean --" in err, err


@contextlib.contextmanager
def _plain_http_server() -> Iterator[str]:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def test_diagnose_refuses_a_server_that_is_no_llm_engine(capsys: pytest.CaptureFixture[str]) -> None:
    """Defect: `diagnose` against `python3 -m http.server` called it kind openai and suggested a bench."""
    with _plain_http_server() as url:
        rc = main(["diagnose", url, "--probes", "0"])
    out, err = capsys.readouterr()
    assert rc == 2 and not out and len(err.strip().splitlines()) == 1 and "is not an LLM engine" in err, err


def test_tune_says_one_answer_on_its_terminal_and_in_its_report(tmp_path: Path) -> None:
    """Defects: tune's terminal said "tuning is flat … compare engines next" and its report's first line "STAY";
    one TTFT 288.2 ms in the tune table and 256 ms in the verdict table, neither naming its statistic."""
    from proxy.bench.report.document import document
    from proxy.bench.report.tunetable import table
    from proxy.bench.report.tuning import summarize

    data = load_runs([ROOT / "docs/gpu-results/h100-2026-12-06-27b/raw/tune"])
    s = summarize(data, tmp_path)
    blocks = document(data, {}, None, decide_all(data.results), lead=s.blocks)
    answer = [b for b in blocks[1:] if b.kind in ("h2", "ul")][:2]
    assert answer[0].text.startswith("Tuning ") and answer[1].items == [x.strip() for x in s.lines]
    header, _ = table(s.flag, s.rows)
    assert all("(median)" in h for h in header if h.startswith("TTFT"))
