"""``enginemeter bench`` / ``report`` end to end against real llama-server engines (``-np 1`` vs ``-np 2``), the
SGLang emulator on a real llama-server, and the real proxy; plus the pure pieces (suite files, plan, sampling
mapping, metrics parsing). Every bench here is ``--quick`` on the tiny model: seconds, not minutes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.bench import runner, suite
from proxy.bench.logreport import load_log
from proxy.bench.report import load_bench, read_jsonl, write_report
from proxy.cli import main
from proxy.settings import load
from tests.helpers import ProxyFactory, free_port, run_uvicorn_app, wait_until

Factory = Callable[..., Any]
ROOT = Path(__file__).resolve().parent.parent
QUANT = ["--quantization", "a=F16", "--quantization", "b=F16"]


def recs(path: Path, kind: str) -> list[dict[str, Any]]:
    return [r for r in read_jsonl(path) if r.get("type") == kind]


@pytest.fixture
def np1_np2(llama_server_factory: Factory) -> tuple[str, str]:
    """Two real engines on the same model, one variable changed: 1 slot vs 2 slots."""
    a = llama_server_factory(np=1, alias="tiny")
    b = llama_server_factory(np=2, alias="tiny")
    return a.url, b.url


# ---- end to end -----------------------------------------------------------------------------------------


def test_quick_bench_np1_vs_np2(np1_np2: tuple[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "bench"
    a, b = np1_np2
    rc = main(
        ["bench", "--engine", f"a={a}", "--engine", f"b={b}", "--quick", "--out", str(out), "--no-progress", *QUANT]
    )
    assert rc == 0
    results = out / "results.jsonl"
    (run,) = recs(results, "run")
    assert [e["kind"] for e in run["engines"]] == ["llamacpp", "llamacpp"]
    assert [e["slots"] for e in run["engines"]] == [1, 2]
    assert run["engines"][0]["sampling"] == run["engines"][1]["sampling"]
    assert run["engines"][0]["sampling"]["top_k"] == "off"
    assert run["engines"][0]["body_example"]["top_k"] == 0  # llama.cpp's spelling of "off"

    # prompt tokens measured with each engine's tokenizer, equal (same GGUF)
    pt = recs(results, "prompt_tokens")
    assert {r["engine"] for r in pt} == {"a", "b"}
    by = {(r["engine"], r["prompt"]): r["tokens"] for r in pt}
    assert all(isinstance(v, int) and v > 0 for v in by.values())
    assert all(by[("a", p)] == by[("b", p)] for _, p in by)
    assert by[("a", "en-medium")] > 3 * by[("a", "en-short")]

    # quick: c=1,2 at medium + short at c=1 -> 3 cells x 3 repeats x 2 engines
    samples = recs(results, "sample")
    assert len(samples) == 18
    cells = {(s["concurrency"], s["max_tokens"], s["prompt_len"]) for s in samples}
    assert cells == {(1, 16, "medium"), (2, 16, "medium"), (1, 16, "short")}
    reqs = [r for r in recs(results, "request") if r["phase"] == "measure"]
    assert reqs and all(r["ok"] for r in reqs), [r["error"] for r in reqs if not r["ok"]]
    for r in reqs:
        assert r["completion_tokens"] == 16  # ignore_eos: every engine does the same work
        assert 0 < r["ttft_s"] < r["e2e_s"]
        assert r["decode_tps"] == pytest.approx(15 / (r["tpot_s"] * 15))
        assert r["engine_timings"]["predicted_n"] == 16
    # cold: the unique prefix keeps the prompt cache from serving the prompt
    assert all((r["cached_tokens"] or 0) < r["prompt_tokens"] / 2 for r in reqs)
    assert len(recs(results, "end")) == 1 and not recs(results, "end")[0]["interrupted"]

    md = (out / "report.md").read_text()
    assert "## Verdict" in md and "b vs a (baseline)" in md
    assert "prompt tokens equal" in md and "sampling equal" in md and "quantization declared: F16" in md
    assert "GPU memory peak unknown" in md
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 4
    for png in ("ttft_vs_concurrency", "throughput_vs_concurrency", "decode_vs_concurrency", "ttft_vs_prompt_length"):
        assert (out / f"{png}.png").stat().st_size > 1000

    # the verdict: parity holds, every judged step carries its numbers
    data = load_bench(results)
    (v,) = write_report(data, tmp_path / "again")["verdicts"]
    assert v.decision in ("stay", "switch", "inconclusive")
    assert not [x for x in v.reasons if x.step == "parity" and x.outcome == "inconclusive"]
    decode = [x for x in v.reasons if x.step == "decode"]
    assert decode and "tok/s (range" in decode[0].text
    # undeclared quantization is an inconclusive verdict, whatever the speed
    data.results = dataclasses.replace(
        data.results, engines=tuple(dataclasses.replace(e, quantization=None) for e in data.results.engines)
    )
    (v,) = write_report(data, tmp_path / "noquant")["verdicts"]
    assert v.decision == "inconclusive" and "quantization not declared" in v.summary

    # without matplotlib: tables, no charts, and the report says why
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    bare = tmp_path / "bare"
    rep = write_report(load_bench(results), bare)
    assert rep["charts"] == []
    assert "Charts skipped: matplotlib is not installed" in (bare / "report.md").read_text()
    assert "data:image/png" not in (bare / "report.html").read_text()
    assert not list(bare.glob("*.png"))
    monkeypatch.undo()

    # a second run on the same (now warm) engines is still cold: the prefixes are new every run
    again = tmp_path / "second"
    argv = ["bench", "--engine", f"a={a}", "--engine", f"b={b}", "--quick", "--concurrency", "1",
            "--prompt-lengths", "medium", "--repeats", "1", "--out", str(again), "--no-progress", *QUANT]  # fmt: skip
    assert main(argv) == 0
    second = [r for r in recs(again / "results.jsonl", "request") if r["phase"] == "measure"]
    assert second and all((r["cached_tokens"] or 0) < r["prompt_tokens"] / 2 for r in second)
    assert recs(again / "results.jsonl", "run")[0]["run_id"] != run["run_id"]


def test_bench_against_sglang_emulator(llama_server_factory: Factory, tmp_path: Path) -> None:
    llama = llama_server_factory(np=1, alias="tiny")
    backend = llama_server_factory(np=2, alias="tiny")
    port = free_port()
    with (tmp_path / "emulator.log").open("wb") as emu_log:
        emu = subprocess.Popen(
            [sys.executable, "-m", "fakes.sglang_emulator", "--port", str(port), "--backend", backend.url,
             "--served-model-name", "tiny"],
            cwd=ROOT, stdout=emu_log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        sgl = f"http://127.0.0.1:{port}"
        wait_until(lambda: httpx.get(f"{sgl}/ready", timeout=1).status_code == 200, timeout=60)
        rc = main(["bench", "--engine", f"a={llama.url}", "--engine", f"b={sgl}", "--quick", "--cache", "both",
                   "--prompt-lengths", "medium", "--concurrency", "1", "--out", str(tmp_path), "--no-progress", *QUANT])  # fmt: skip
        assert rc == 0
    finally:
        emu.send_signal(signal.SIGTERM)
        emu.wait(timeout=20)
    results = tmp_path / "results.jsonl"
    (run,) = recs(results, "run")
    assert [e["kind"] for e in run["engines"]] == ["llamacpp", "sglang"]
    assert run["engines"][1]["body_example"]["top_k"] == -1  # SGLang's spelling of "off"
    assert run["engines"][1]["body_example"]["repetition_penalty"] == 1
    assert run["engines"][0]["body_example"]["repeat_penalty"] == 1
    methods = {r["engine"]: r["method"] for r in recs(results, "prompt_tokens")}
    assert methods["b"] == "v1/tokenize"
    pt = {(r["engine"], r["prompt"]): r["tokens"] for r in recs(results, "prompt_tokens")}
    assert pt[("a", "en-medium")] == pt[("b", "en-medium")]
    notes = [n for n in recs(results, "note") if n["engine"] == "b"]
    assert [n["phase"] for n in notes] == ["cold", "warm"] and all("HTTP 200" in n["text"] for n in notes)
    reqs = [r for r in recs(results, "request") if r["phase"] == "measure"]
    assert all(r["ok"] for r in reqs), [r["error"] for r in reqs if not r["ok"]]
    assert {r["cache"] for r in reqs} == {"cold", "warm"}
    # llama.cpp reports its prompt-cache hits: the warm phase hits, the cold phase does not
    warm = [r for r in reqs if r["engine"] == "a" and r["cache"] == "warm"]
    cold = [r for r in reqs if r["engine"] == "a" and r["cache"] == "cold"]
    assert all(r["cached_tokens"] > r["prompt_tokens"] / 2 for r in warm)
    assert all((r["cached_tokens"] or 0) < r["prompt_tokens"] / 2 for r in cold)
    md = (tmp_path / "report.md").read_text()
    assert "## Results: cold cache" in md and "## Results: warm cache" in md
    assert "| a | b | parity |" in md


@pytest.fixture
def proxy_url(np1_np2: tuple[str, str], tmp_path: Path, proxy_factory: ProxyFactory) -> tuple[str, Path]:
    a, b = np1_np2
    s = load(None, primary=f"primary={a}", shadow=f"shadow={b}", shadow_rate=1.0)
    log = tmp_path / "comparisons.jsonl"
    s = dataclasses.replace(s, mirror=dataclasses.replace(s.mirror, log_path=str(log)))
    return proxy_factory(s).url, log


def test_bench_through_proxy_pins_each_engine(proxy_url: tuple[str, Path], tmp_path: Path) -> None:
    url, _ = proxy_url
    out = tmp_path / "out"
    rc = main(["bench", "--engine", "primary=", "--engine", "shadow=", "--through", url, "--model", "tiny", "--quick",
               "--concurrency", "1", "--prompt-lengths", "short", "--out", str(out), "--no-progress"])  # fmt: skip
    assert rc == 0
    reqs = [r for r in recs(out / "results.jsonl", "request") if r["phase"] == "measure"]
    assert len(reqs) == 6 and all(r["ok"] for r in reqs)
    metrics = httpx.get(f"{url}/metrics").text
    served = {
        e: sum(v for n, lab, v in runner.parse_metrics(metrics)
               if n == "enginemeter_requests_total" and lab.get("engine") == e and lab.get("role") == "primary")
        for e in ("primary", "shadow")
    }  # fmt: skip
    assert served["primary"] >= 4 and served["shadow"] >= 4  # warm-up + 3 repeats each, pinned
    # no engine URLs: tokenizer counts are unknown, parity comes from per-request usage
    md = (out / "report.md").read_text()
    assert "through the proxy" in md
    assert "Engine-reported `usage.prompt_tokens` of identical requests: 3 of 3 equal" in md


def test_report_from_the_proxy_comparison_log(proxy_url: tuple[str, Path], tmp_path: Path) -> None:
    url, log = proxy_url
    body = {"model": "tiny", "stream": True, "max_tokens": 12, "temperature": 0, "seed": 1}
    sent = 0
    with httpx.Client(base_url=url, timeout=60) as c:
        for i in range(12):
            msgs = [{"role": "user", "content": f"request {i}: tell me about harbours"}]
            for _ in range(2):  # once more when llama-server closed a kept-alive connection (see runner.send_one)
                with c.stream("POST", "/v1/chat/completions", json={**body, "messages": msgs}) as r:
                    r.read()
                sent += 1
                if r.status_code != 502 or "Server disconnected" not in r.text:
                    break
            assert r.status_code == 200, (i, r.text)
    # one pair per request sent, failed or not
    wait_until(lambda: log.exists() and len(log.read_text().splitlines()) >= sent, timeout=30)
    out = tmp_path / "rep"
    rc = main(["report", "--log", str(log), "--out", str(out), "--quantization", "primary=F16",
               "--quantization", "shadow=F16", "--blocks", "3"])  # fmt: skip
    assert rc == 0
    data = load_log(log, quantization={"primary": "F16", "shadow": "F16"}, blocks=3)
    assert data.results.baseline == "primary"
    assert len([s for s in data.results.samples if s.engine == "shadow"]) == 3
    md = (out / "report.md").read_text()
    assert "shadow vs primary (baseline)" in md
    n = len(log.read_text().splitlines())
    assert f"{n} mirrored pairs" in md
    assert "sampling normalized by the proxy" in md
    assert "prompt tokens equal on all" in md
    assert "## Results: live mirrored traffic" in md


def test_ctrl_c_keeps_what_finished(np1_np2: tuple[str, str], tmp_path: Path) -> None:
    a, b = np1_np2
    argv = [sys.executable, "-m", "proxy.cli", "bench", "--engine", f"a={a}", "--engine", f"b={b}", "--quick",
            "--repeats", "200", "--out", str(tmp_path), "--no-progress", *QUANT]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        results = tmp_path / "results.jsonl"
        wait_until(lambda: results.exists() and results.read_text().count('"type":"sample"') >= 4, timeout=60)
        p.send_signal(signal.SIGINT)
        stdout, stderr = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130, stderr.decode()
    assert b"interrupted" in stderr
    (end,) = recs(results, "end")
    assert end["interrupted"] is True
    assert len(recs(results, "sample")) >= 4
    md = (tmp_path / "report.md").read_text()
    assert "**Interrupted run**" in md
    assert b"verdict b vs a" in stdout


# ---- pure pieces ----------------------------------------------------------------------------------------


def test_builtin_suite_is_bilingual_and_sized() -> None:
    ps = suite.builtin()
    assert {(p.lang, p.length) for p in ps} == {(lang, n) for lang in ("en", "zh") for n in suite.LENGTHS}
    size = {p.id: len(p.messages[0]["content"]) for p in ps}
    assert size["en-short"] < size["en-medium"] < size["en-long"]
    assert size["zh-short"] < size["zh-medium"] < size["zh-long"]
    assert any("\u4e00" <= ch <= "\u9fff" for ch in next(p for p in ps if p.id == "zh-long").messages[0]["content"])
    with pytest.raises(ValueError, match="unknown prompt length"):
        suite.builtin(["huge"])


def test_user_suites(tmp_path: Path) -> None:
    jl = tmp_path / "s.jsonl"
    jl.write_text(
        json.dumps({"id": "x", "prompt": "hi", "length": "short"}) + "\n\n"
        + json.dumps({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q" * 500}]}) + "\n"
    )  # fmt: skip
    ps = suite.load(str(jl))
    assert [p.id for p in ps] == ["ux", "u3"]
    assert ps[0].length == "short" and ps[0].messages == ({"role": "user", "content": "hi"},)
    assert ps[1].messages[0]["role"] == "system"
    sg = tmp_path / "sharegpt.json"
    sg.write_text(json.dumps([
        {"id": "c1", "conversations": [{"from": "human", "value": "你好，介绍一下长城"}, {"from": "gpt", "value": "..."}]},
        {"id": "c2", "conversations": [{"from": "gpt", "value": "only an answer"}]},
    ]))  # fmt: skip
    (p,) = suite.load(str(sg))
    assert p.id == "uc1" and p.lang == "zh" and p.messages == ({"role": "user", "content": "你好，介绍一下长城"},)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"nothing": 1}\n')
    with pytest.raises(ValueError, match="needs 'messages' or 'prompt'"):
        suite.load(str(bad))


def test_plan_is_single_variable_sweeps_without_duplicates() -> None:
    cfg = runner.BenchConfig(engines=[], concurrency=(1, 2, 4), output_lengths=(32, 128), prompt_lengths=("short", "medium", "long"), max_tokens=128, cache="both")  # fmt: skip
    cells = runner.plan(cfg)
    cold = [(c.concurrency, c.max_tokens, c.prompt_len) for c in cells if c.cache == "cold"]
    assert cold == [(1, 128, "medium"), (2, 128, "medium"), (4, 128, "medium"), (1, 32, "medium"),
                    (1, 128, "short"), (1, 128, "long")]  # fmt: skip
    base = next(c for c in cells if (c.cache, c.concurrency, c.max_tokens, c.prompt_len) == ("cold", 1, 128, "medium"))
    assert base.sweeps == ("concurrency", "output", "prompt")
    for cell in cells:  # exactly one variable differs from the base point
        diff = (cell.concurrency != 1) + (cell.max_tokens != 128) + (cell.prompt_len != "medium")
        assert diff <= 1
    assert len(cells) == 2 * len(cold)


def test_bodies_are_explicit_and_mapped_per_kind() -> None:
    cfg = runner.BenchConfig(engines=[], seed=7, no_prompt_cache=True)
    msgs = ({"role": "user", "content": "x"},)
    llama = runner.build_body(cfg, runner.Target("l", "http://l", kind="llamacpp", model="m"), msgs, 64, cold=True)
    sgl = runner.build_body(cfg, runner.Target("s", "http://s", kind="sglang", model="m"), msgs, 64, cold=True)
    assert llama["top_k"] == 0 and sgl["top_k"] == -1
    assert llama["repeat_penalty"] == 1.0 and "repetition_penalty" not in llama
    assert sgl["repetition_penalty"] == 1.0 and "cache_prompt" not in sgl
    assert llama["cache_prompt"] is False
    for b in (llama, sgl):
        assert (b["temperature"], b["top_p"], b["seed"], b["max_tokens"], b["ignore_eos"]) == (0, 1.0, 7, 64, True)
        assert b["stream_options"] == {"include_usage": True}
    assert runner.canonical_sampling(llama) == runner.canonical_sampling(sgl)
    warm = runner.build_body(cfg, runner.Target("l", "http://l", kind="llamacpp", model="m"), msgs, 64, cold=False)
    assert "cache_prompt" not in warm


def test_memory_from_proxy_metrics() -> None:
    text = "\n".join([
        "# HELP enginemeter_engine_gpu_memory_used_bytes x",
        'enginemeter_engine_gpu_memory_used_bytes{engine="a",gpu="0"} 1.5e+09',
        'enginemeter_engine_gpu_memory_used_bytes{engine="a",gpu="1"} 5e+08',
        'enginemeter_engine_gpu_memory_peak_bytes{engine="b",gpu="0"} 3e+09',
        'enginemeter_gpu_memory_used_bytes{gpu="0",name="H200"} 7e+09',
    ])  # fmt: skip
    assert runner.memory_from_metrics(text, "a") == (2_000_000_000, "proxy engine gauge")
    assert runner.memory_from_metrics(text, "b") == (3_000_000_000, "proxy engine peak")
    assert runner.memory_from_metrics(text, "c") == (7_000_000_000, "proxy device gauge")
    assert runner.memory_from_metrics("", "a") == (None, "unknown")


def test_bench_cli_rejects_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--engine", "a=http://127.0.0.1:9", "--out", str(tmp_path)]) == 2
    assert "at least two" in capsys.readouterr().err
    assert main(["bench", "--engine", "a=", "--engine", "b=", "--through", "http://x", "--out", str(tmp_path)]) == 2
    assert "--model" in capsys.readouterr().err
    assert main(["report", "--log", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path)]) == 2


def test_memory_probe_keeps_the_peak_while_a_cell_runs() -> None:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    readings = iter([1_000, 5_000, 3_000] + [2_000] * 1000)
    scrapes = 0

    async def metrics(_: Request) -> PlainTextResponse:
        nonlocal scrapes
        scrapes += 1
        return PlainTextResponse(f'enginemeter_engine_gpu_memory_used_bytes{{engine="a",gpu="0"}} {next(readings)}\n')

    async def scenario(url: str) -> tuple[int | None, str]:
        probe = runner.MemoryProbe(f"{url}/metrics")
        async with httpx.AsyncClient() as c, probe.watch(c, "a", period_s=0.01) as box:
            deadline = asyncio.get_running_loop().time() + 10
            while scrapes < 4:  # the "cell": poll until the probe has read several times
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.01)
        return box["peak"], probe.source

    with run_uvicorn_app(Starlette(routes=[Route("/metrics", metrics)])) as url:
        peak, source = asyncio.run(scenario(url))
    assert peak == 5_000
    assert source == "proxy engine gauge"
