"""``switch-plan.md`` (proxy/bench/report/switchplan.py): the checklist before a switch, each item checked from the
measurements, the rollback record, the rollout config and the command that rolls back — from a bench of two
llama-servers enginemeter launched (verbatim commands; GPU memory from the driver stand-in that follows the real
processes), from a bench of resident engines (whose rollout config then runs a real proxy), and from the proxy's
comparison log."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import json
import re
import shlex
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from proxy.bench.report import rollback, switchplan
from proxy.bench.report.agreement import agreement
from proxy.bench.run.benchconfig import BenchConfig, Target
from proxy.bench.run.runner import run_bench
from proxy.bench.verdict.data import Data, load_bench
from proxy.bench.verdict.decide import decide_all
from proxy.bench.verdict.merge import load_runs
from proxy.cli import main
from proxy.config.configfile import parse_file
from proxy.config.settings import RouteSettings
from proxy.gpu.memory import GpuMemory
from proxy.procs.launch import Launcher
from tests.bench.live.test_logreport import chat, eng, paired, proxy, settings
from tests.bench.run.test_bench import SMALL
from tests.bench.run.test_bench_launch import PY, LaunchedReader, llama
from tests.helpers import REPO, LlamaServerFactory, ProxyFactory
from tests.system.test_cli import cli

ITEMS = ["Compared under the same conditions", "Speed verdict", "Outputs agree under the same parameters",
         "No OOM, no errors as concurrency rises", "No obvious queueing as concurrency rises",
         "Memory: what is resident at once fits", "Monitoring covers liveness and latency", "The rollback record is ready"]  # fmt: skip


def items(md: str) -> dict[str, tuple[str, str]]:
    """The checklist's rows: item -> (mark, evidence)."""
    rows = re.findall(r"^\| (✓|✗|\?) \| ([^|]+) \| (.+) \|$", md, re.MULTILINE)
    return {name: (mark, evidence) for mark, name, evidence in rows}


def block(md: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)\n```$", md, re.MULTILINE | re.DOTALL)


@dataclasses.dataclass
class Bench:
    out: Path
    results: Path
    commands: dict[str, str]
    printed: str
    model: Path


@pytest.fixture(scope="module")
def launched(llama_server_bin: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Bench:
    """np1 (-np 1) then np2 (-np 2, the same context per slot), launched one at a time at c=1 and c=2; then
    ``enginemeter report`` on the results, as a person reruns it."""
    tmp = tmp_path_factory.mktemp("switchplan")
    commands = {
        "np1": llama(llama_server_bin, tiny_model, 1, 1024),
        "np2": llama(llama_server_bin, tiny_model, 2, 2048),
    }
    reader = LaunchedReader(tmp / "engines")
    launcher = Launcher(tmp, memory=GpuMemory(opener=lambda: reader), settle_s=0.2, settle_timeout_s=2.0, grace_s=5.0,
                        memory_timeout_s=10.0, cwd=REPO)  # fmt: skip
    cfg = BenchConfig(engines=[Target(n, None, launch=c) for n, c in commands.items()], out=tmp, concurrency=(1, 2),
                      output_lengths=(8,), prompt_lengths=("short",), repeats=3, warmup=0, cache="cold", max_tokens=8,
                      aa="off", progress=False, launch_timeout_s=60)  # fmt: skip
    asyncio.run(run_bench(cfg, launcher=launcher))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = main(["report", "--results", str(tmp / "results.jsonl"), "--out", str(tmp / "report")])
    assert rc == 0
    return Bench(tmp / "report", tmp / "results.jsonl", commands, printed.getvalue(), tiny_model)


def test_a_bench_of_two_launched_engines_plans_the_switch_with_every_item_and_both_commands(launched: Bench) -> None:
    plan = launched.out / "switch-plan.md"
    assert f"and {plan}" in " ".join(launched.printed.split())  # the "report: ..." line names it (wrapped or not)
    assert json.loads((launched.out / "verdict.json").read_text())["switch_plan"] == "switch-plan.md"
    md = plan.read_text()
    got = items(md)
    assert list(got) == ITEMS and all(evidence.strip() for _, evidence in got.values())
    # each item's evidence, with its numbers
    assert got["Compared under the same conditions"][0] == "✓"
    assert "quantization" in got["Compared under the same conditions"][1]
    mark, ev = got["Outputs agree under the same parameters"]
    # the same weights, greedy: identical, and said — but generated weights say nothing of a model's outputs
    assert mark == "?" and ev.startswith("cannot be judged: np1 and np2 run random weights"), ev
    assert "should agree" not in ev and "outputs identical" not in ev  # nothing the agreement judges besides
    mark, ev = got["No OOM, no errors as concurrency rises"]
    assert mark == "✓" and re.search(r"np2 0 of \d+ failed \(c=1: 0/\d+, c=2: 0/\d+\)", ev), ev
    mark, ev = got["No obvious queueing as concurrency rises"]
    m = re.search(r"np2: TTFT [\d.]+ ms at c=1 → ([\d.]+) ms at c=2 \(×[\d.]+; a whole request alone: ([\d.]+) ms\), "
                  r"2 slots", ev)  # fmt: skip
    assert m and "np1: TTFT" in ev and "), 1 slot — " in ev, ev
    # both engines judged in words: np1 (the baseline) has one slot for two requests at once — it queues
    assert ev.startswith("np2 (candidate): ") and "; np1 (baseline): queues" in ev, ev
    assert "np1: TTFT" in ev and "1 slot for 2 concurrent requests: the rest wait inside the engine" in ev, ev
    ttft, alone = float(m.group(1)), float(m.group(2))
    if abs(ttft - alone) > 0.1:  # waited longer for its first token than a whole request takes alone: queueing
        assert mark == ("✗" if ttft > alone else "✓"), ev
    # 15 GiB each on the stand-in's 140 GiB card: both fit at once, the mirrored rollout's memory judged together
    mark, ev = got["Memory: what is resident at once fits"]
    assert mark == "✓" and ev.startswith("both at once (the mirrored rollout): np1 15.00 GiB + np2 15.00 GiB = "
                                         "30.00 GiB fit the card 140.40 GiB together"), ev  # fmt: skip
    assert "headroom 110.40 GiB (79% of the card)" in ev, ev
    assert "## Rollout: np1 → np2" in md and "## Swap" not in md
    assert got["Monitoring covers liveness and latency"][0] == "✓"
    assert got["The rollback record is ready"][0] == "✓"
    # the rollback record: both commands verbatim ({port} and all), the model file, its quantization, the port
    assert block(md, "sh")[:2] == [launched.commands["np1"], launched.commands["np2"]]
    assert md.count(f"- model file: `{launched.model}`") == 2 and md.count("- quantization: F16 (engine info)") == 2
    ports = [urlsplit(e["url"]).port for e in map(json.loads, launched.results.read_text().splitlines())
             if e.get("type") == "engine"]  # fmt: skip
    for port in ports:
        assert f"- port: `{{port}}` in the command, a free one at each launch ({port} in this run)" in md
    assert "temperature=0" in md.split("## Rollback record")[1]  # the sampling the bench used
    # the one command that rolls back
    assert ('curl -s -H "authorization: Bearer $ENGINEMETER_ADMIN_KEY" http://127.0.0.1:8080/admin/rollout '
            "-d '{\"action\": \"abort\"}'") in md  # fmt: skip


def test_the_rollout_config_in_the_plan_passes_check_config(launched: Bench, tmp_path: Path) -> None:
    (yaml_text,) = block((launched.out / "switch-plan.md").read_text(), "yaml")
    cfg = tmp_path / rollback.CONFIG
    cfg.write_text(yaml_text)
    ok = cli(tmp_path, "check-config", str(cfg), ENGINEMETER_ADMIN_KEY="k")
    assert ok.returncode == 0, ok.stderr
    assert "ok: 2 engine(s) (np1, np2), 1 route(s)" in ok.stdout
    unset = cli(tmp_path, "check-config", str(cfg))  # the admin key the curl lines need is required
    assert unset.returncode == 2 and "ENGINEMETER_ADMIN_KEY is not set" in unset.stderr
    s = parse_file(cfg, env={"ENGINEMETER_ADMIN_KEY": "k"})
    (route,) = s.routes
    assert route.primary == "np1" and route.rollout is not None and route.rollout.candidate == "np2"
    assert route.rollout.error_budget == 0.02 and s.mirror.min_effect == 0.05  # the bench's own
    assert [e.kind for e in s.engines] == ["llamacpp", "llamacpp"]


def _plan(d: Data, **kw: Any) -> dict[str, tuple[str, str]]:
    verdicts = decide_all(d.results)
    outputs = {v.candidate: switchplan.from_agreement(agreement(d.requests, v.baseline, v.candidate), v.baseline,
                                                      v.candidate) for v in verdicts}  # fmt: skip
    return items(switchplan.markdown(d, verdicts, outputs, **kw))


def test_the_marks_follow_the_measurements(launched: Bench) -> None:
    """The same results read the other way round (np1, one slot, as the candidate), against a budget it does not
    fit, and with random weights declared."""
    d = load_bench(launched.results, baseline="np2")
    declared = {"np1": "declared: --weights random"}
    d = dataclasses.replace(
        d, results=dataclasses.replace(d.results, memory_budget_bytes=10 * 2**30, random_weights=declared)
    )
    got = _plan(d)
    mark, ev = got["No obvious queueing as concurrency rises"]
    assert mark == "✗" and ev.startswith("np1 (candidate): queues"), ev
    assert "1 slot for 2 concurrent requests: the rest wait inside the engine" in ev, ev
    mark, ev = got["Memory: what is resident at once fits"]
    assert mark == "✗" and "np1 does not fit" in ev and "budget 10.00 GiB" in ev, ev
    mark, ev = got["Outputs agree under the same parameters"]
    assert mark == "?" and ev.startswith("cannot be judged: np1 runs random weights (declared: --weights random)"), ev
    assert got["Speed verdict"][0] == "✗"  # the memory gate says stay
    # the bench's own reading knows both GGUFs are generated: "?" as the first test; with no engine known to run
    # random weights, the identical greedy outputs are the item's ✓
    both = load_bench(launched.results)
    assert _plan(both)["Outputs agree under the same parameters"][0] == "?"
    real = dataclasses.replace(both, results=dataclasses.replace(both.results, random_weights={}))
    assert _plan(real)["Outputs agree under the same parameters"][0] == "✓"


def test_the_27b_plan_states_both_engines_queueing_and_random_weights_alone() -> None:
    """llama.cpp Q4_K_M (-np 16) vs SGLang bf16 on the H200 (docs/gpu-results/h200-2026-12-03-27b/): at c=64
    llama's first token waits 7.1 s against 0.84 s for a whole request alone — the item is SGLang's ✓, but it says
    the baseline queues (the reason to switch), never a clean ✓ that hides it. SGLang's weights are random: its
    outputs cannot be judged, and nothing else is said of them (no "the same weights should agree")."""
    raw = REPO / "docs/gpu-results/h200-2026-12-03-27b/raw"
    d = load_runs([raw / "llama", raw / "sglang"], baseline="llama", accept_quantization_difference=True)
    got = _plan(d)
    mark, ev = got["No obvious queueing as concurrency rises"]
    assert mark == "✓" and ev.startswith("sglang (candidate): no obvious queueing; llama (baseline): queues — "
                                         "queueing the switch to sglang removes."), ev  # fmt: skip
    assert "llama: TTFT 57.6 ms at c=1 → 7117.7 ms at c=64 (×123.52; a whole request alone: 843.4 ms)" in ev, ev
    assert "at c=64 its first token waits longer than a whole request takes alone" in ev
    assert "16 slots for 64 concurrent requests" in ev and "sglang: TTFT 34.2 ms at c=1 → 561.1 ms" in ev
    mark, ev = got["Outputs agree under the same parameters"]
    assert mark == "?" and ev.startswith("cannot be judged: sglang runs random weights (--load-format dummy)"), ev
    assert "should agree" not in ev and "identical" not in ev, ev


def test_the_monitoring_the_plan_names_is_shipped() -> None:
    alerts = (REPO / switchplan.RULES[0]).read_text()
    for name in (*switchplan.LIVENESS_ALERTS, *switchplan.GUARD_ALERTS):
        assert f"- alert: {name}\n" in alerts, name
    assert f"- record: {switchplan.TTFT_P95}\n" in (REPO / switchplan.RULES[1]).read_text()
    documented = (REPO / "docs" / "metrics.md").read_text()  # tests/system/test_metrics_doc.py: exported = listed
    for metric in switchplan.METRICS:
        assert f"`{metric}`" in documented, metric
    for path in switchplan.DASHBOARDS:
        assert json.loads((REPO / path).read_text())["panels"]


def test_a_candidate_whose_launch_failed_fails_the_errors_item(
    llama_server_bin: Path, tiny_model: Path, tmp_path: Path
) -> None:
    broken = f'{PY} -c "import sys; sys.exit(3)" --port {{port}}'
    assert main(["bench", "--launch", f"a={llama(llama_server_bin, tiny_model, 1, 1024)}", "--launch", f"b={broken}",
                 *SMALL, "--concurrency", "1", "--prompt-lengths", "short", "--repeats", "1", "--aa", "off",
                 "--out", str(tmp_path)]) == 2  # fmt: skip
    assert main(["report", "--results", str(tmp_path / "results.jsonl"), "--out", str(tmp_path / "rep")]) == 0
    md = (tmp_path / "rep" / "switch-plan.md").read_text()
    mark, ev = items(md)["No OOM, no errors as concurrency rises"]
    assert mark == "✗" and ev.startswith("launch failed: b: exited with 3 before it was ready"), ev
    assert block(md, "sh")[:2] == [llama(llama_server_bin, tiny_model, 1, 1024), broken]  # both, the failed one too


@pytest.fixture
def state_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    return tmp_path / "state"


def _replay(p_url: str, line: str, key: str) -> httpx.Response:
    """A curl line of the plan, sent to the proxy under test (its port, not the default listen address)."""
    words = shlex.split(line.split("    #")[0])
    header = words[words.index("-H") + 1].replace("$ENGINEMETER_ADMIN_KEY", key)
    url = next(w for w in words if w.startswith("http"))
    name, _, value = header.partition(": ")
    body = words[words.index("-d") + 1] if "-d" in words else None
    target = p_url + urlsplit(url).path
    if body is None:
        return httpx.get(target, headers={name: value}, timeout=10)
    return httpx.post(target, headers={name: value}, content=body, timeout=10)


def test_resident_engines_get_the_known_facts_and_the_plans_rollout_runs_and_rolls_back(
    tmp_path: Path, llama_server_factory: LlamaServerFactory, proxy_factory: ProxyFactory, state_home: Path
) -> None:
    a, b = llama_server_factory(np=1, ctx_size=1024), llama_server_factory(np=2, ctx_size=2048)
    out = tmp_path / "out"
    assert main(["bench", "--engine", f"a={a.url}", "--engine", f"b={b.url}", *SMALL, "--concurrency", "1",
                 "--prompt-lengths", "short", "--repeats", "3", "--out", str(out)]) in (0, 3)  # fmt: skip
    md = (out / "switch-plan.md").read_text()
    got = items(md)
    assert list(got) == ITEMS
    mark, ev = got["The rollback record is ready"]
    assert mark == "✗" and ev.startswith("no launch command recorded for a, b (resident")
    assert md.count("Launch command: **not recorded**") == 2 and not block(md, "sh")[0].startswith("/")
    assert f"— `{a.url}`" in md and f"— `{b.url}`" in md and "- slots: 2; context per slot: 1024 tokens" in md
    assert "TTFT measured at 1 concurrency level without" in got["No obvious queueing as concurrency rises"][1]
    # the config as written: a real proxy serves it, the plan's watch and abort lines drive its rollout
    (yaml_text,) = block(md, "yaml")
    (tmp_path / "r.yaml").write_text(yaml_text)
    p = proxy_factory(parse_file(tmp_path / "r.yaml", env={"ENGINEMETER_ADMIN_KEY": "k"}))
    watch = next(x for x in block(md, "sh")[0].splitlines() if x.startswith("curl") and "/admin/rollout" in x)
    (ro,) = _replay(p.url, watch, "k").json()["rollouts"]
    assert (ro["baseline"], ro["candidate"], ro["state"], ro["share"]) == ("a", "b", "running", 0.0)
    assert str(state_home) in ro["state_file"]
    abort = block(md, "sh")[1]
    assert _replay(p.url, abort, "k").status_code == 200
    assert _replay(p.url, watch, "k").json()["rollouts"][0]["state"] == "aborted"
    assert _replay(p.url, abort, "wrong").status_code == 401
    r = p.client.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 4,
                                                   "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    assert r.status_code == 200 and r.headers["x-enginemeter-engine"] == "a"  # back on the baseline


def test_a_live_report_writes_a_switch_plan_too(tmp_path: Path, llama_server_factory: LlamaServerFactory) -> None:
    a, b = llama_server_factory(np=1), llama_server_factory(np=1)
    log = tmp_path / "c.jsonl"
    with proxy(settings(log, (eng("a", a.url), eng("b", b.url)), (RouteSettings(primary="a", shadows=("b",)),))) as p:
        for _ in range(6):
            assert chat(p, temperature=0).status_code == 200
        paired(p, 6, "a", "b")
    out = tmp_path / "out"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["report", "--log", str(log), "--out", str(out)]) in (0, 3)
    assert f"and {out / 'switch-plan.md'}" in " ".join(printed.getvalue().split())
    assert json.loads((out / "verdict.json").read_text())["switch_plan"] == "switch-plan.md"
    md = (out / "switch-plan.md").read_text()
    got = items(md)
    assert list(got) == ITEMS
    mark, ev = got["Outputs agree under the same parameters"]
    assert mark == "✓" and "greedy outputs identical in all 6 greedy pairs" in ev, ev
    assert got["The rollback record is ready"][0] == "✗"
    (yaml_text,) = block(md, "yaml")
    assert '"${URL_A}"' in yaml_text and '"${URL_B}"' in yaml_text  # the log has no URL: the proxy config's
    (tmp_path / "r.yaml").write_text(yaml_text)
    env = {"ENGINEMETER_ADMIN_KEY": "k", "URL_A": a.url, "URL_B": b.url}
    ok = cli(tmp_path, "check-config", str(tmp_path / "r.yaml"), **env)
    assert ok.returncode == 0 and "ok: 2 engine(s) (a, b), 1 route(s)" in ok.stdout, ok.stderr


def test_engines_that_do_not_fit_together_get_the_swap_config_check_config_passes(
    launched: Bench, tmp_path: Path
) -> None:
    """The same two launched llama-servers (15 GiB each) against a 20 GiB budget: one fits, both do not — the plan
    swaps, its config (both launch commands verbatim) passes ``enginemeter check-config``."""
    d = load_bench(launched.results)
    d = dataclasses.replace(d, results=dataclasses.replace(d.results, memory_budget_bytes=20 * 2**30))
    verdicts = decide_all(d.results)
    md = switchplan.markdown(d, verdicts, {})
    assert "## Rollout" not in md and "## Swap: np1 → np2" in md
    assert "np1 15.00 GiB + np2 15.00 GiB = 30.00 GiB exceed the budget 20.00 GiB" in md
    assert re.search(r"\*\*Expected outage: about \d+ s\*\* — np2's launch → ready [\d.]+ s in this bench run", md)
    mark, ev = items(md)["Memory: what is resident at once fits"]
    assert mark == "✓" and ev.startswith("one at a time (the swap): "), ev
    (yaml_text,) = block(md, "yaml")
    cfg = tmp_path / rollback.SWAP_CONFIG
    cfg.write_text(yaml_text)
    ok = cli(tmp_path, "check-config", str(cfg), ENGINEMETER_ADMIN_KEY="k")
    assert ok.returncode == 0, ok.stderr
    s = parse_file(cfg, env={"ENGINEMETER_ADMIN_KEY": "k"})
    assert [e.launch for e in s.engines] == [launched.commands["np1"], launched.commands["np2"]]
    assert s.routes[0].swap is not None and s.routes[0].swap.candidate == "np2"
