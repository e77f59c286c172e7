"""The switch plan chooses the way from the measurements (``proxy.bench.verdict.switchway``): the 27B runs on one
H100 with a 72 GiB budget (docs/gpu-results/h100-2026-12-06-27b/: llama.cpp Q4_K_M, SGLang FP8, vLLM FP8, each
launched alone) must swap — 131 GiB together — with the candidate's measured load time as the expected outage and
a config the real reader loads; steps and the watch timed at the traffic's recorded rate; every ``enginemeter``
line the plan prints parsed by the real CLI parser."""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

import pytest

from proxy.bench.report import rollback, switchplan
from proxy.bench.report.agreement import agreement
from proxy.bench.verdict import switchway
from proxy.bench.verdict.data import Data
from proxy.bench.verdict.decide import decide_all
from proxy.bench.verdict.gates import memorygate
from proxy.bench.verdict.inputs import Traffic
from proxy.bench.verdict.merge import load_runs
from proxy.cli import build_parser
from proxy.config.configfile import parse_file
from proxy.config.settings import Settings
from proxy.config.switching import RolloutSettings, SwapSettings
from proxy.engines.startup import flag_value, set_flags, without_flags
from tests.helpers import REPO

RUN = REPO / "docs/gpu-results/h100-2026-12-06-27b/raw"
ENV = {rollback.KEY: "k"}


@pytest.fixture(scope="module")
def h100() -> Data:
    return load_runs(
        [RUN / "llama", RUN / "sglang-fp8", RUN / "vllm-fp8"], baseline="llama", accept_quantization_difference=True
    )


def plan(d: Data) -> str:
    verdicts = decide_all(d.results)
    outputs = {
        v.candidate: switchplan.from_agreement(agreement(d.requests, v.baseline, v.candidate), v.baseline, v.candidate)
        for v in verdicts
    }
    return switchplan.markdown(d, verdicts, outputs)


def blocks(md: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)\n```$", md, re.MULTILINE | re.DOTALL)


def section(md: str, title: str) -> str:
    return md.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def commands_parse(md: str) -> int:
    """Every ``enginemeter`` line of the plan's shell blocks, parsed by the real parser; how many."""
    n = 0
    for line in (x for b in blocks(md, "sh") for x in b.splitlines()):
        if line.startswith("enginemeter "):
            build_parser().parse_args(shlex.split(line.split("    #")[0])[1:])
            n += 1
    return n


def configs(md: str, tmp: Path, **env: str) -> list[Settings]:
    out = []
    for i, text in enumerate(blocks(md, "yaml")):
        (tmp / f"{i}.yaml").write_text(text)
        out.append(parse_file(tmp / f"{i}.yaml", env={**ENV, **env}))
    return out


def test_the_27b_plans_swap_with_the_measured_outage_and_a_config_the_reader_loads(h100: Data, tmp_path: Path) -> None:
    md = plan(h100)
    assert "## Rollout" not in md and md.count("## Swap: llama → ") == 2
    sg = section(md, "Swap: llama → sglang-fp8")
    assert "llama 59.42 GiB + sglang-fp8 71.31 GiB = 130.73 GiB exceed the budget 72.00 GiB" in sg
    assert "**Expected outage: about 141 s** — sglang-fp8's launch → ready 139.3 s in this bench run + its first 2 " \
        "warm-up requests 1.5 s" in sg  # fmt: skip
    assert "Random weights: llama (" in sg and "sglang-fp8 (" in sg  # real weights load slower: said
    vl = section(md, "Swap: llama → vllm-fp8")
    assert "llama 59.42 GiB + vllm-fp8 72.48 GiB = 131.90 GiB exceed" in vl and "about 151 s" in vl
    assert "6 requests a minute (assumed: no traffic recorded" in vl
    # the memory row judges what is resident at once
    row = next(x for x in md.splitlines() if x.startswith("| ✓ | Memory: what is resident at once fits | "))
    assert "one at a time (the swap): llama 59.42 GiB + sglang-fp8 71.31 GiB" in row, row
    # the configs: the real reader loads them; the swap's bounds from the measurements
    got = configs(md, tmp_path)
    assert len(got) == 2
    for s, cand, wait in zip(got, ("sglang-fp8", "vllm-fp8"), (320, 340), strict=True):
        (route,) = s.routes
        assert route.primary == "llama" and route.rollout is None and route.swap is not None
        assert route.swap.candidate == cand and route.swap.state == "ready"
        assert route.swap.queue_max_wait_s == wait  # ⌈2 × (load + warm-up) + 30⌉ to 10 s
        assert route.swap.ready_timeout_s == 900 and route.swap.error_budget == 0.02
        engines = {e.name: e for e in s.engines}
        assert engines["llama"].launch == rollback.launch_command(h100, "llama")
        launch = engines[cand].launch
        assert launch is not None and "{port}" in launch
        if cand == "sglang-fp8":
            assert launch == rollback.launch_command(h100, cand)  # fits as launched: verbatim
    assert commands_parse(md) == 4  # check-config and serve, twice


def test_a_candidate_over_the_card_as_launched_gets_the_setting_that_fits_in_its_config(
    h100: Data, tmp_path: Path
) -> None:
    """vLLM FP8 peaked 72.48 GiB at --gpu-memory-utilization 0.898, over the 72 GiB budget: the memory row says at
    0.888 it fits, with --max-model-len down to what its smaller pool holds. The swap's config launches it so, says
    so beside the command and above the config, and changes nothing else of the command."""
    md = plan(h100)
    z = memorygate.resize(h100.results, "llama", "vllm-fp8")
    assert z is not None and (z.flag, z.now, z.fits, z.max_model_len) == (
        "--gpu-memory-utilization", 0.898, 0.888, 195712)  # fmt: skip
    assert memorygate.resize(h100.results, "llama", "sglang-fp8") is None  # fits as launched
    vl = section(md, "Swap: llama → vllm-fp8")
    assert "the config below launches it with --gpu-memory-utilization 0.888, --max-model-len 195712 (the " \
        "checklist's memory row), a setting not measured as such" in vl  # fmt: skip
    assert "as measured but --gpu-memory-utilization 0.888, --max-model-len 195712 (the memory row's" in vl
    measured = rollback.launch_command(h100, "vllm-fp8")
    assert measured is not None
    (launch,) = [e.launch for e in configs(md, tmp_path)[1].engines if e.name == "vllm-fp8"]
    assert launch is not None
    got, was = shlex.split(launch), shlex.split(measured)
    assert flag_value(got, "--gpu-memory-utilization") == "0.888" and flag_value(got, "--max-model-len") == "195712"
    assert flag_value(was, "--gpu-memory-utilization") == "0.898" and flag_value(was, "--max-model-len") == "196608"
    assert without_flags(got, "--gpu-memory-utilization", "--max-model-len") == without_flags(
        was, "--gpu-memory-utilization", "--max-model-len"
    )
    # the flag given as --flag=V is changed in place, and an absent one added
    assert set_flags("vllm serve M --gpu-memory-utilization=0.9 --port {port}", z.flags()) == (
        "vllm serve M --gpu-memory-utilization=0.888 --port {port} --max-model-len 195712"
    )


def test_a_recorded_rate_times_the_watch_and_sizes_the_queue(h100: Data, tmp_path: Path) -> None:
    """3 requests a minute over a day: the watch's 30 requests take 10 min; at 10 a second the queue holds what
    arrives in its wait, twice."""
    slow = dataclasses.replace(
        h100,
        results=dataclasses.replace(
            h100.results, traffic=Traffic({1.0: 1.0}, source="x.jsonl: 4,320 requests", requests=4320, span_s=86400)
        ),
    )
    sg = section(plan(slow), "Swap: llama → sglang-fp8")
    assert "**The watch** at 3 requests a minute (x.jsonl: 4,320 requests)" in sg and "about 10 min" in sg, sg
    fast = dataclasses.replace(
        h100, results=dataclasses.replace(h100.results, traffic=Traffic({1.0: 1.0}, requests=36000, span_s=3600))
    )
    md = plan(fast)
    (route,) = configs(md, tmp_path)[0].routes
    assert route.swap is not None and route.swap.queue_max_requests == 2 * 10 * 320  # twice 10/s over the 320 s wait
    assert "queue_max_requests: 6400    # twice what arrives during the wait at the recorded rate" in md


def test_rollout_steps_finish_at_the_rate() -> None:
    """The 1 % step needs 2,000 requests (20 served by the candidate at 1 %): at 6 a minute, 5.6 h — left out."""
    ro = RolloutSettings(candidate="b")
    assert switchway.step_time(0.01, 0.1, ro) == switchway.Step(0.01, 2000, 20000.0)
    assert [x.share for x in switchway.steps(0.1, ro)] == [0.0, 0.1, 0.5, 1.0]
    assert [x.share for x in switchway.skipped(0.1, ro)] == [0.01]
    assert [x.share for x in switchway.steps(1 / 60, ro)] == [0.0, 0.5, 1.0]  # one a minute: 10 % takes 3.3 h
    busy = switchway.steps(10.0, ro)  # ten a second: every default step, the 1 % one 2,000 requests long
    assert [x.share for x in busy] == list(ro.steps) and [x.seconds for x in busy] == [60, 200, 60, 60, 60]
    assert switchway.watch_s(0.05, SwapSettings(candidate="b")) == 600.0


def test_engines_that_fit_together_get_the_rollout_timed_at_the_rate(h100: Data, tmp_path: Path) -> None:
    """The same runs with a budget both fit in (a 192 GiB card): the mirrored rollout, its memory row judging both
    at once, its steps those that finish at the assumed rate."""
    d = dataclasses.replace(h100, results=dataclasses.replace(h100.results, memory_budget_bytes=192 * 2**30))
    md = plan(d)
    assert "## Swap" not in md and md.count("## Rollout: llama → ") == 2
    ro = section(md, "Rollout: llama → sglang-fp8")
    assert "**The mirrored rollout, both engines resident**: llama 59.42 GiB + sglang-fp8 71.31 GiB = 130.73 GiB " \
        "fit the budget 192.00 GiB together." in ro  # fmt: skip
    assert "Left out, each longer than the 60 min a step may take at this rate: 1% (2,000 requests: 5.6 h)." in ro
    row = next(x for x in md.splitlines() if "| Memory: what is resident at once fits | both at once" in x)
    assert "headroom 61.27 GiB (32% of the budget)" in row, row  # 192 − 130.73
    s = configs(md, tmp_path, URL_LLAMA="http://h:1")[0]
    (route,) = s.routes
    assert route.rollout is not None and route.rollout.steps == (0.0, 0.1, 0.5, 1.0) and route.swap is None
    assert commands_parse(md) == 6  # check-config, serve and report, twice
