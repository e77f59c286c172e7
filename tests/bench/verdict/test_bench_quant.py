"""A declared quantization difference is an answer, not a dead end: ``--accept-quantization-difference`` passes
the parity gate with a caveat and the verdict is *discounted*; the greedy-output agreement is reported beside
it; the same-file arm (SGLang loading the baseline's own GGUF) and the discounted arm are shown side by side,
their combined answer only when they agree. Real llama-servers on a real Q8_0 copy of the tiny model; the SGLang
emulator launched by its command line stands in for SGLang (it says ``quantization: gguf`` for a GGUF path, as
SGLang's ServerArgs do)."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from proxy.bench.report.arms import arms, model_file, notes
from proxy.cli import main
from tests.bench.run.test_bench import SMALL, q8_0_copy, recs, verdict
from tests.bench.run.test_bench_launch import llama

Factory = Callable[..., Any]
PY = shlex.quote(sys.executable)
DISCOUNT = (
    "includes the precision difference F16 vs Q8_0 (answers not compared: bench --agreement); a same-weights "
    "comparison is the clean test"
)


def test_q8_0_vs_f16_with_the_flag_is_a_discounted_verdict_with_the_output_agreement(
    llama_server_factory: Factory, tiny_model_spm: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    q8 = q8_0_copy(tiny_model_spm, tmp_path / "tiny-q8.gguf")
    a = llama_server_factory(model=tiny_model_spm, np=1)
    b = llama_server_factory(model=q8, np=1)
    out = tmp_path / "out"
    rc = main(["bench", "--engine", f"f16={a.url}", "--engine", f"q8={b.url}", *SMALL, "--concurrency", "1,2",
               "--prompt-lengths", "short", "--accept-quantization-difference", "--out", str(out)])  # fmt: skip
    assert rc == 0
    (v,) = verdict(out)["verdicts"]
    assert v["discounted"] == DISCOUNT
    assert v["stopped_at"] is None or v["stopped_at"]["gate"] != "parity", v["summary"]
    (q,) = [x for x in v["reasons"] if x["check"] == "quantization"]
    assert q["outcome"] == "note" and "accepted as a declared difference" in q["text"]
    assert any(c["step"] == "decode" for c in v["comparisons"])  # the speed was judged
    ag = v["output_agreement"]
    assert ag["pairs"] > 0 and 0 <= ag["identical"] <= ag["pairs"]
    stdout = capsys.readouterr().out
    assert f"{v['decision'].upper()} (discounted)" in stdout
    assert f"discounted: it {DISCOUNT}" in " ".join(stdout.split())  # whole, on the lines it wraps to
    md = (out / "report.md").read_text()
    assert "(baseline): **" in md and "(discounted)" in md and f"**Discounted:** this answer {DISCOUNT}." in md
    assert "greedy-output agreement f16 vs q8: cannot be judged: f16 and q8 run random weights" in md
    # the run recorded the flag: a replay judges alike
    assert main(["report", "--results", str(out / "results.jsonl"), "--out", str(tmp_path / "again")]) == 0
    assert verdict(tmp_path / "again")["verdicts"][0]["discounted"] == DISCOUNT


def test_the_same_file_arm_and_the_discounted_arm_side_by_side(
    llama_server_bin: Path, llama_server_factory: Factory, tiny_model_spm: Path, tmp_path: Path
) -> None:
    """The baseline launched on the F16 file; "SGLang" launched twice: on that same file and on a Q8_0 one."""
    q8 = q8_0_copy(tiny_model_spm, tmp_path / "tiny-q8.gguf")
    back_f16 = llama_server_factory(model=tiny_model_spm, np=1)
    back_q8 = llama_server_factory(model=q8, np=1)

    def emulator(backend: str, model: Path) -> str:
        return f"{PY} -m fakes.sglang_emulator --backend {backend} --model-path {model} --port {{port}}"

    out = tmp_path / "out"
    rc = main(["bench", "--launch", f"llama={llama(llama_server_bin, tiny_model_spm, 1, 2048)}",
               "--launch", f"sgl-gguf={emulator(back_f16.url, tiny_model_spm)}",
               "--launch", f"sgl-q8={emulator(back_q8.url, q8)}", *SMALL, "--concurrency", "1",
               "--prompt-lengths", "short", "--max-tokens", "8", "--accept-quantization-difference",
               "--out", str(out)])  # fmt: skip
    assert rc == 0
    eng = {e["name"]: e for e in recs(out / "results.jsonl", "engine")}
    assert eng["sgl-gguf"]["kind"] == "sglang"
    assert (eng["sgl-gguf"]["quantization"], eng["sgl-gguf"]["quantization_source"]) == (
        "F16", "GGUF header (the engine says gguf)")  # fmt: skip
    assert eng["sgl-q8"]["quantization"] == "Q8_0"
    doc = verdict(out)
    by = {v["candidate"]: v for v in doc["verdicts"]}
    assert by["sgl-gguf"]["discounted"] is None and by["sgl-q8"]["discounted"] == DISCOUNT
    (arm,) = doc["arms"]
    assert {a["candidate"]: a["weights"] for a in arm["arms"]} == {"sgl-gguf": "same file",
                                                                   "sgl-q8": "different precision"}  # fmt: skip
    agree = by["sgl-gguf"]["decision"] == by["sgl-q8"]["decision"]
    assert (arm["combined"] is not None) == agree
    md = (out / "report.md").read_text()
    assert "## Arms: the same weights and the engine's own" in md
    assert "sgl-gguf (same file)" in md and "sgl-q8 (different precision, discounted)" in md


@dataclass
class _V:
    candidate: str
    decision: str
    discounted: str | None = None


META = [{"name": "llama", "kind": "llamacpp", "quantization": "Q4_K_M", "launch": "llama-server -m /m/q4.gguf"},
        {"name": "sgl-gguf", "kind": "sglang", "quantization": "Q4_K_M",
         "launch": "python -m sglang.launch_server --model-path /m/q4.gguf --tokenizer-path /m/hf"},
        {"name": "sgl", "kind": "sglang", "quantization": "bf16", "launch": "python -m sglang.launch_server --model-path /m/hf"},
        {"name": "vllm", "kind": "vllm", "quantization": "Q4_K_M", "launch": "CUDA_VISIBLE_DEVICES=0 vllm serve /m/q4.gguf"}]  # fmt: skip


def test_arms_that_disagree_have_no_combined_answer() -> None:
    (a,) = arms(META, "llama", [_V("sgl-gguf", "stay"), _V("sgl", "switch", "includes ...")])
    assert a.combined is None and "the arms disagree" in a.text and "no combined answer" in a.text
    assert "sgl-gguf (same file): STAY" in a.text and "sgl (different precision, discounted): SWITCH" in a.text
    (a,) = arms(META, "llama", [_V("sgl-gguf", "switch"), _V("sgl", "switch", "includes ...")])
    assert a.combined == "switch" and "both arms say SWITCH" in a.text
    assert arms(META, "llama", [_V("sgl", "switch", "x")]) == []  # one arm is no pair of arms
    assert model_file(META[3]) == "/m/q4.gguf"
    assert notes(META) == ["vllm: vLLM loads a GGUF file only with its GGUF plugin (since vLLM 0.24); without it the "
                           "launch fails"]  # fmt: skip
