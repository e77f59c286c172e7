"""``report --results A B ...``: separate runs joined (``proxy.bench.verdict.merge``). Real runs of launched CPU
llama-servers; split files of one run must give that run's verdict; a non-comparable pair is refused naming the
difference; the A/A floor comes from the baseline's run repeated, and the report says when there is none."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from proxy.bench.outdir import read_jsonl
from proxy.bench.quality.divergence import Figure
from proxy.bench.quality.readout import Accuracy, Quality, TokenAgreement
from proxy.bench.verdict.data import Data, load_bench
from proxy.bench.verdict.decide import decide_all
from proxy.bench.verdict.merge import difference, join, load_runs
from proxy.cli import main
from tests.bench.run.test_bench import SMALL, verdict
from tests.bench.run.test_bench_launch import llama
from tests.helpers import REPO

WORK = [*SMALL, "--concurrency", "1,2", "--prompt-lengths", "short"]
#: the record types that belong to one engine (``engine`` records name it ``name``, the others ``engine``)
ENGINE_RECORDS = ("request", "sample", "prompt_tokens", "stint", "engine")


def split(results: Path, groups: list[list[str]], out: Path) -> list[Path]:
    """One run's records cut into one file per group of engines, as separate runs of those engines would be."""
    recs = read_jsonl(results)
    paths = []
    for i, names in enumerate(groups):
        mine: list[dict[str, Any]] = []
        for r in recs:
            if r["type"] == "run":
                r = copy.deepcopy(r)
                r["engines"] = [e for e in r["engines"] if e["name"] in names]
                r["baseline"] = names[0]
            elif r.get("engine", r.get("name")) not in names and r["type"] in ENGINE_RECORDS:
                continue
            mine.append(r)
        p = out / f"part{i}" / "results.jsonl"
        p.parent.mkdir(parents=True)
        p.write_text("".join(json.dumps(r) + "\n" for r in mine))
        paths.append(p)
    return paths


def test_two_result_files_merged_give_the_verdict_of_one_run(
    llama_server_bin: Path, tiny_model: Path, tmp_path: Path
) -> None:
    one = tmp_path / "one"
    assert main(["bench", "--launch", f"a={llama(llama_server_bin, tiny_model, 1, 1024)}", "--launch",
                 f"b={llama(llama_server_bin, tiny_model, 2, 2048)}", *WORK, "--out", str(one)]) == 0  # fmt: skip
    fa, fb = split(one / "results.jsonl", [["a", "a-aa"], ["b"]], tmp_path)
    (whole,) = decide_all(load_bench(one / "results.jsonl").results)
    (joined,) = decide_all(load_runs([fa, fb]).results)
    w, j = whole.to_json(), joined.to_json()
    w.pop("next_step"), j.pop("next_step")  # the rerun advice names the command of one run; joined runs have none
    assert j == w
    assert main(["report", "--results", str(fa), str(fb), "--out", str(tmp_path / "rep")]) == 0
    (vd,) = verdict(tmp_path / "rep")["verdicts"]
    assert vd["decision"] == whole.decision and vd["comparisons"] == verdict(one)["verdicts"][0]["comparisons"]
    assert verdict(tmp_path / "rep")["sources"] == [str(fa), str(fb)]
    assert (
        "A/A noise floor: a-aa = the baseline launched again in its own run (restart-to-restart noise) — the drift "
        "between separate runs is not in it"
    ) in (tmp_path / "rep" / "report.md").read_text()
    # a run cut short before its A/A pass (the lease ended) declares that pass and never measured it: no floor is
    # claimed from it, and the engines table shows it as the baseline's engine, not measured
    cut = tmp_path / "cut" / "results.jsonl"
    cut.parent.mkdir()
    cut.write_text("".join(json.dumps(r) + "\n" for r in read_jsonl(fa)
                           if r.get("engine", r.get("name")) != "a-aa" or r["type"] not in ENGINE_RECORDS))  # fmt: skip
    assert main(["report", "--results", str(cut), str(fb), "--out", str(tmp_path / "rep-cut")]) == 0
    text = (tmp_path / "rep-cut" / "report.md").read_text()
    assert "**no A/A noise floor**: a was measured in one run only" in text and "A/A noise floor: a-aa" not in text
    (row,) = [line for line in text.splitlines() if line.startswith("| a-aa (A/A pass of a)")]
    assert "not measured" in row and "| llamacpp |" in row and "None" not in row, row


def test_separate_runs_joined_with_the_baseline_repeated_as_the_floor_or_refused(
    llama_server_bin: Path, tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = llama(llama_server_bin, tiny_model, 1, 1024), llama(llama_server_bin, tiny_model, 2, 2048)
    runs = {}
    for name, (engine, cmd, extra) in {"r1": ("a", a, []), "r2": ("b", b, []), "r3": ("a", a, []),
                                       "r4": ("b", b, ["--max-tokens", "8"])}.items():  # fmt: skip
        out = tmp_path / name
        assert main(["bench", "--launch", f"{engine}={cmd}", *WORK, "--aa", "off", *extra, "--out", str(out)]) == 0
        runs[name] = str(out / "results.jsonl")
    assert "one engine measured: nothing to compare here" in capsys.readouterr().out
    assert "Only one engine: nothing to compare here" in (tmp_path / "r1" / "report.md").read_text()

    # the baseline's run repeated: its second run is the A/A pass, the floor of separate runs
    rep = tmp_path / "joined3"
    assert main(["report", "--results", runs["r1"], runs["r2"], runs["r3"], "--out", str(rep)]) == 0
    (vd,) = verdict(rep)["verdicts"]
    assert (vd["baseline"], vd["candidate"]) == ("a", "b")
    assert vd["comparisons"][0]["noise_floor_source"].startswith("A/A: a-aa against a")
    md = (rep / "report.md").read_text()
    assert "3 separate runs joined" in md and "A/A noise floor: a-aa = the baseline a's run repeated" in md
    assert "a-aa (A/A pass of a)" in md
    # every engine launched fresh: the cold prefixes come from --seed, so separate runs sent the same requests and
    # their greedy outputs pair up (the same weights: identical)
    ag = vd["output_agreement"]
    assert ag["pairs"] > 0 and ag["identical"] == ag["pairs"], ag

    # no repeat of the baseline: the report says there is no A/A floor
    rep2 = tmp_path / "joined2"
    assert main(["report", "--results", runs["r1"], runs["r2"], "--out", str(rep2)]) == 0
    assert "**no A/A noise floor**: a was measured in one run only" in (rep2 / "report.md").read_text()
    (vd,) = verdict(rep2)["verdicts"]
    assert vd["comparisons"][0]["noise_floor_source"] == "no A/A pass: run-to-run variation"

    # another max tokens: refused, naming the difference
    capsys.readouterr()
    assert main(["report", "--results", runs["r1"], runs["r4"], "--out", str(tmp_path / "no")]) == 2
    err = capsys.readouterr().err
    assert "are not comparable runs: max tokens differ: 16 vs 8" in err
    assert not (tmp_path / "no" / "verdict.json").exists()


def _run(**over: Any) -> dict[str, Any]:
    run: dict[str, Any] = {
        "prompts": [{"id": "en-short", "length": "short"}, {"id": "zh-short", "length": "short"}],
        "comparable": {"suite": "builtin", "prompts": {"en-short": "aa", "zh-short": "bb"},
                       "sampling": {"temperature": 0, "seed": 1234, "ignore_eos": True}, "max_tokens": 16,
                       "prompt_len": "short", "gpu": {"model": "NVIDIA H200", "count": 1, "driver": "570.86.15"}},
    }  # fmt: skip
    for k, v in over.items():
        if k == "prompts":
            run["prompts"] = v
        else:
            run["comparable"][k] = v
    return run


@pytest.mark.parametrize(
    ("over", "why"),
    [
        ({"suite": "mine.jsonl"}, "suite differs: 'builtin' vs 'mine.jsonl'"),
        ({"prompts": [{"id": "en-short", "length": "short"}]}, "the short prompts differ: en-short, zh-short vs en-short"),
        ({"prompts": [{"id": "en-long", "length": "long"}]}, "no prompt length class measured in both runs"),
        ({"sampling": {"temperature": 0, "seed": 7, "ignore_eos": True}}, "sampling differs: seed 1234 vs 7"),
        ({"max_tokens": 128}, "max tokens differ: 16 vs 128"),
        ({"gpu": {"model": "NVIDIA H100", "count": 1, "driver": "570.86.15"}}, "GPU model differs: NVIDIA H200 vs NVIDIA H100"),
        ({"gpu": {"model": "NVIDIA H200", "count": 1, "driver": "575.51.03"}}, "GPU driver differs: 570.86.15 vs 575.51.03"),
    ],
)  # fmt: skip
def test_the_first_difference_is_named(over: dict[str, Any], why: str) -> None:
    assert difference(_run(), _run()) is None
    got = difference(_run(), _run(**over))
    assert got is not None and got.startswith(why), got


def test_a_prompt_with_other_text_or_an_unrecorded_gpu() -> None:
    changed = _run()
    changed["comparable"]["prompts"] = {"en-short": "aa", "zh-short": "cc"}
    assert difference(_run(), changed) == "prompt zh-short has different text in the two runs (digest bb vs cc)"
    assert difference(_run(), _run(gpu=None)) is None  # where only one run recorded its GPU, nothing is compared


def test_each_runs_quality_figures_are_kept_whatever_the_order() -> None:
    """``report --results A B`` keeps every run's token agreement / accuracy against the joined baseline (or its
    A/A pass, the baseline measured again in that run), renamed as joined; a figure against another engine is left
    out; the files' order changes nothing."""
    raw = REPO / "docs/gpu-results/h100-2026-12-06-27b/raw"
    agree = TokenAgreement("llama", "llama-aa", 32, 2048, 20, "teacher-forced", {"same_top": Figure(1, 1, 1)})
    acc = Accuracy("vllm-fp8", "x", 10, 9, 9, Figure(0, 0, 0), 1.0, (0, 0))

    def with_quality(d: Data, q: dict[str, Quality]) -> Data:
        return dataclasses.replace(d, results=dataclasses.replace(d.results, quality=q))

    a = with_quality(load_bench(raw / "llama"), {"llama-aa": Quality(agree)})
    again = with_quality(load_bench(raw / "llama"), {"llama-aa": Quality(dataclasses.replace(agree, prompts=16))})
    v = with_quality(load_bench(raw / "vllm-fp8"), {"x": Quality(None, acc)})  # against vllm-fp8: no baseline here
    got = [join(order, baseline="llama").results.quality for order in ([a, v, again], [again, v, a], [v, again, a])]
    # the run given first keeps its names; the others' repeats of llama are its A/A passes, renamed
    first, second = got[0], got[1]
    assert set(first) == {"llama-aa", "llama-aa3"} and first["llama-aa"].agreement is not None
    assert first["llama-aa3"].agreement == dataclasses.replace(agree, prompts=16, cand="llama-aa3")
    assert {q.agreement.prompts for q in second.values() if q.agreement} == {32, 16}
    assert all(q.agreement and q.agreement.base == "llama" for g in got for q in g.values())
    assert [sorted(q.agreement.prompts for q in g.values() if q.agreement) for g in got] == [[16, 32]] * 3
