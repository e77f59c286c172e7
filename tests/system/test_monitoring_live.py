"""Every dashboard query and every rule, run against a real Prometheus scraping a real proxy with real traffic.

The stack: two real llama-server engines; the primary serves the qwen2-vocab tiny model, the shadow backend the
llama-SPM-vocab one behind the SGLang emulator (so every pair disagrees on token counts and greedy text);
``proxy.server.compose.build_app`` under real uvicorn (``tests.helpers.start_proxy``) with a mirror route; a vLLM-shaped ``/metrics``
(``fakes/vllm_metrics.py``) for the vLLM queries; Debian's ``prometheus`` scraping the proxy and the three
engines' own ``/metrics`` with ``deploy/prometheus/prometheus.yml`` (target files and intervals swapped) and the
repository's rule files. Two identical waves of traffic, each waited for in Prometheus, so every counter
and histogram has an increase inside the query window.

Then each panel target and each variable of each dashboard, each recording rule and each alert's signal must
come back ``success`` with at least one finite sample. The only exception is an explicit allow-list of GPU
queries, and only while the proxy's ``/health`` says NVML is unavailable (no GPU in CI).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from fakes import vllm_metrics as vllm_metrics_fake
from proxy.config.configfile import load
from proxy.gpu.nvml import DeviceReading, ProcReading
from proxy.procs.process import free_port
from proxy.sequential import LONG_PROMPT_TOKENS
from tests.helpers import start_proxy, uncommented, wait_until

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "grafana" / "dashboards").glob("*.json"))
RULE_FILES = sorted((ROOT / "deploy" / "prometheus" / "rules").glob("*.yml"))
ALIAS = "tiny-chat"
SHADOW_MODEL = "Qwen/Tiny-Instruct"
#: at least LONG_PROMPT_TOKENS on the primary's tokenizer (one token a word at least), well inside its slot
LONG_PROMPT = " ".join(["colour"] * (LONG_PROMPT_TOKENS + 200))

#: queries allowed to be empty on a host without NVML, and only there: (dashboard uid or "rules", title)
GPU_ALLOW = {
    ("enginemeter-compare", "GPU memory per GPU"),
    ("enginemeter-compare", "GPU memory per engine (with peak)"),
    ("enginemeter-compare", "GPU utilization"),
    ("enginemeter-compare", "GPU headroom per engine"),
    ("enginemeter-overview", "GPU memory used share"),
    ("rules", "EnginemeterGPUMemoryNearFull"),
}
#: Grafana's $__rate_interval for a 1 s scrape is 4 s; a little more keeps both waves' increases in view
RATE_INTERVAL = "10s"
ALERT_EXPR = re.compile(r"^(?P<signal>.+?)\s*(?:>|<|>=|<=|==|!=)\s*[0-9.e+-]+\s*$", re.S)

pytestmark = pytest.mark.timeout(420)


class Prom:
    def __init__(self, url: str) -> None:
        self.url = url
        self.client = httpx.Client(base_url=url, timeout=10)

    def get(self, path: str, **params: Any) -> Any:
        r = self.client.get(path, params=params)
        body = r.json()
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def value(self, expr: str) -> float:
        res = self.get("/api/v1/query", query=expr)["result"]
        return float(res[0]["value"][1]) if res else 0.0


def finite(result: list[dict[str, Any]]) -> bool:
    for series in result:
        values = series.get("values") or [series["value"]]
        if any(math.isfinite(float(v)) for _, v in values):
            return True
    return False


def substitute(expr: str) -> str:
    out = expr.replace("$__rate_interval", RATE_INTERVAL).replace("$__range", "10m").replace("$__interval", "1s")
    out = out.replace("$engine", ".*").replace("$model", ".*")
    assert "$" not in out, f"unknown Grafana variable left in {expr}"
    return out


@pytest.fixture
def prometheus_bin() -> str:
    path = shutil.which("prometheus")
    if path is None:
        pytest.skip("Debian's prometheus is not installed (run scripts/install-monitoring-tools.sh)")
    return path


@pytest.fixture
def sglang_shadow(llama_server_factory: Any, tiny_model_spm: Path) -> Iterator[str]:
    """The SGLang emulator with --enable-metrics in front of a llama-server on a different-tokenizer model."""
    # 8192: the long prompt of ``drive`` (2,000 words) in a slot of this tokenizer, whatever it makes of them
    backend = llama_server_factory(model=tiny_model_spm, np=2, alias="tiny-spm", ctx_size=8192)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fakes.sglang_emulator", "--port", str(port), "--backend", backend.url,
         "--served-model-name", SHADOW_MODEL, "--enable-metrics", "--enable-cache-report"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: proc.poll() is None and httpx.get(f"{url}/v1/models", timeout=1).status_code == 200, 60)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_prometheus(
    binary: str, tmp: Path, targets: dict[str, str], *, text: str | None = None
) -> tuple[subprocess.Popen[bytes], Prom]:
    """deploy/prometheus/prometheus.yml (or ``text``, a variant of it) with 1 s scrapes and 1 s rule evaluation;
    each job's target file is the repository's loopback one (targets/host: its labels) with the address swapped.
    A job missing from ``targets`` gets no file, as in a deployment that does not run that engine kind."""
    cfg = yaml.safe_load(text if text is not None else (ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    cfg["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    jobs = {j["job_name"] for j in cfg["scrape_configs"]}
    assert set(targets) <= jobs and {"enginemeter", "llamacpp", "sglang", "vllm"} <= jobs
    (tmp / "targets").mkdir()
    for job in cfg["scrape_configs"]:
        [sd] = job["file_sd_configs"]
        assert sd["files"] == [f"targets/{job['job_name']}.yml"], job
        if job["job_name"] not in targets:
            continue
        groups = yaml.safe_load((ROOT / "deploy" / "prometheus" / "targets" / "host" / sd["files"][0][8:]).read_text())
        for g in groups:
            g["targets"] = [targets[job["job_name"]]]
        (tmp / sd["files"][0]).write_text(yaml.safe_dump(groups))
    rules = []
    for f in RULE_FILES:
        doc = yaml.safe_load(f.read_text())
        for g in doc["groups"]:
            g["interval"] = "1s"
        (tmp / f.name).write_text(yaml.safe_dump(doc))
        rules.append(str(tmp / f.name))
    cfg["rule_files"] = rules
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    port = free_port()
    with (tmp / "prometheus.log").open("wb") as log:
        proc = subprocess.Popen(
            [binary, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    prom = Prom(f"http://127.0.0.1:{port}")
    try:
        wait_until(lambda: proc.poll() is None and prom.client.get("/-/ready").status_code == 200, 30)
    except BaseException:
        prom.client.close()
        proc.kill()
        proc.wait()
        raise
    return proc, prom


def post(c: httpx.Client, path: str, body: dict[str, Any]) -> None:
    r = c.post(path, json=body)
    assert r.status_code == 200, r.text


def drive(proxy: str) -> None:
    """One wave: the same mix every time, so every series seen in wave 1 increases in wave 2."""
    with httpx.Client(base_url=proxy, timeout=120) as c:
        # 64 tokens: a stream whose tokens all come in one read has no TPOT, and with 12 a loaded run once had
        # none in its second wave (the TPOT and decode-rate panels empty: no increase)
        for stream in (True, False, True):
            post(c, "/v1/chat/completions", {"model": ALIAS, "stream": stream, "temperature": 0, "max_tokens": 64,
                 "messages": [{"role": "user", "content": "Name three colours of the rainbow."}]})  # fmt: skip
        post(c, "/v1/completions", {"model": ALIAS, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0})
        # a long prompt, streamed: the live verdict's TTFT stream of the "long" regime, which needs only the first
        # token's time — on a loaded box the emulator may relay a short answer's tokens in one read (no TPOT), and
        # then this is the live-delta panel's only data
        post(c, "/v1/chat/completions", {"model": ALIAS, "stream": True, "temperature": 0, "max_tokens": 4,
             "messages": [{"role": "user", "content": LONG_PROMPT}]})  # fmt: skip
        # a rejected request (outcome="rejected") is part of normal life too
        r = c.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["enginemeter"] is True


def wait_scraped(prom: Prom, pairs: float, ok: float) -> None:
    """Poll Prometheus (not the proxy) until a scrape holds the wave's comparisons and requests, then until every
    target has been scraped after that. A pair is counted once its shadow's answer is in, so the engines' own
    counters for the wave are final by then; an engine's labelled series appear with its first request (as in
    SGLang), and without the later scrape a loaded run once ended with one sample of them (no rate)."""

    def seen() -> bool:
        return (
            prom.value('sum(enginemeter_compared_pairs_total{job="enginemeter"})') >= pairs
            and prom.value('sum(enginemeter_requests_total{job="enginemeter", role="primary", outcome="ok"})') >= ok
        )

    wait_until(seen, timeout=120, interval=0.2)
    t = time.time()
    after = f'count(timestamp(up{{job=~"enginemeter|llamacpp|sglang|vllm"}} == 1) > {t:.3f})'
    wait_until(lambda: prom.value(after) == 4, timeout=30, interval=0.2)


def queries() -> Iterator[tuple[str, str, str, str]]:
    """(source, title, kind, expr): every panel target, variable, recording rule and alert signal."""
    for path in DASHBOARDS:
        dash = json.loads(path.read_text())
        for v in dash["templating"]["list"]:
            if v["type"] == "query":
                yield dash["uid"], f"variable {v['name']}", "variable", v["definition"]
        for p in dash["panels"]:
            for t in p.get("targets", []):
                yield dash["uid"], p["title"], "instant" if t.get("instant") else "range", t["expr"]
    for f in RULE_FILES:
        for g in yaml.safe_load(f.read_text())["groups"]:
            for r in g["rules"]:
                if "record" in r:
                    yield "rules", r["record"], "range", r["record"]
                    yield "rules", r["record"], "range", r["expr"]
                else:
                    m = ALERT_EXPR.match(r["expr"].strip())
                    assert m, f"alert {r['alert']}: expr is not `<signal> <op> <number>`"
                    yield "rules", r["alert"], "range", m["signal"]


#: series that are NaN by design until the live verdict has MIN_PAIRS pairs (the test drives 8): they must exist
NAN_UNTIL_BOUNDED = ("enginemeter_live_interval_low_ratio", "enginemeter_live_interval_high_ratio")


def run_query(prom: Prom, kind: str, expr: str, start: float, end: float) -> bool:
    if kind == "range" and any(m in expr for m in NAN_UNTIL_BOUNDED):
        got = prom.get("/api/v1/query_range", query=substitute(expr), start=start, end=end, step=1)["result"]
        return bool(got)
    if kind == "variable":
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", expr)
        assert m, expr
        series = prom.get("/api/v1/series", **{"match[]": substitute(m[1]), "start": start, "end": end})
        return any(m[2] in s for s in series)
    if kind == "instant":
        return finite(prom.get("/api/v1/query", query=substitute(expr), time=end)["result"])
    return finite(prom.get("/api/v1/query_range", query=substitute(expr), start=start, end=end, step=1)["result"])


def check_queries(
    prom: Prom, start: float, end: float, *, allow_gpu_empty: bool, only: set[tuple[str, str]] | None = None
) -> tuple[int, list[str], list[str]]:
    """Run the queries (all, or those whose (source, title) is in ``only``): (checked, allowed empty, failures)."""
    checked, allowed_empty, failures = 0, [], []
    for source, title, kind, expr in queries():
        if only is not None and (source, title) not in only:
            continue
        checked += 1
        try:
            ok = run_query(prom, kind, expr, start, end)
        except AssertionError as exc:
            failures.append(f"{source} | {title} | {expr} | {exc}")
            continue
        if ok:
            continue
        if (source, title) in GPU_ALLOW and allow_gpu_empty:
            allowed_empty.append(title)
            continue
        failures.append(f"{source} | {title} | {expr} | empty")
    return checked, allowed_empty, failures


@pytest.fixture
def vllm_metrics() -> Iterator[str]:
    """A vLLM-shaped /metrics (fakes/vllm_metrics.py): scraped by the vllm job only, no traffic through the proxy."""
    with vllm_metrics_fake.run_in_thread(model="Qwen/Tiny-Instruct") as url:
        yield url


def test_every_dashboard_and_rule_query_returns_data(
    prometheus_bin: str, llama_server_factory: Any, sglang_shadow: str, vllm_metrics: str, tmp_path: Path
) -> None:
    # -lv 4: the log carries llama.cpp's loader lines, which the live diagnosis (layers on the GPU) reads
    primary = llama_server_factory(np=2, alias="tiny", extra_args=("-lv", "4"), ctx_size=8192)
    config = {
        "engines": [
            {"name": "llama", "url": primary.url, "kind": "llamacpp", "model": "tiny"},
            {"name": "sglang", "url": sglang_shadow, "kind": "sglang", "model": SHADOW_MODEL},
        ],
        "models": [{"alias": ALIAS, "engines": {"llama": "tiny", "sglang": SHADOW_MODEL}}],
        # a rollout to the shadow that stays at its first step (share 0: the traffic is what the mirror alone makes)
        # so the rollout row and its alert have series; 10 pairs decide nothing
        "routes": [{"models": [ALIAS], "primary": "llama", "shadows": ["sglang"],
                    "rollout": {"candidate": "sglang", "state_file": str(tmp_path / "rollout.json")}}],
    }  # fmt: skip
    (tmp_path / "enginemeter.yaml").write_text(yaml.safe_dump(config))
    settings = load(config=str(tmp_path / "enginemeter.yaml"), env={})
    start = time.time() - 5
    with ExitStack() as stack:
        proxy = start_proxy(stack, settings).url
        health = httpx.get(f"{proxy}/health", timeout=10).json()
        no_nvml = health.get("gpu", {}).get("enabled") is False
        targets = {"enginemeter": proxy[len("http://") :], "llamacpp": primary.url[len("http://") :],
                   "sglang": sglang_shadow[len("http://") :], "vllm": vllm_metrics[len("http://") :]}  # fmt: skip
        proc, prom = start_prometheus(prometheus_bin, tmp_path, targets)
        try:
            # every target scraped once before any traffic, so each counter's first sample precedes its increase
            wait_until(lambda: prom.value('count(up{job=~"enginemeter|llamacpp|sglang|vllm"} == 1)') == 4, 30, 0.2)
            drive(proxy)
            wait_scraped(prom, pairs=5, ok=5)
            drive(proxy)
            wait_scraped(prom, pairs=10, ok=10)
            t_data = time.time()
            # every rule group evaluated at least once after the second wave was scraped, all healthy
            wait_until(
                lambda: all(
                    g["lastEvaluation"] and _ts(g["lastEvaluation"]) > t_data
                    for g in prom.get("/api/v1/rules")["groups"]
                ),
                timeout=30,
                interval=0.2,
            )
            # at least two scrapes of every target
            assert prom.value("min(count_over_time(up[5m]))") >= 2
            for g in prom.get("/api/v1/rules")["groups"]:
                for r in g["rules"]:
                    assert r["health"] == "ok", f"{r['name']}: {r.get('lastError')}"
            # range queries step back from `end`, so the last recorded-rule sample (<= end) is always in view
            end = time.time()
            start = end - math.ceil(end - start)
            checked, allowed_empty, failures = check_queries(prom, start, end, allow_gpu_empty=no_nvml)
            print(f"\nmonitoring: {checked} queries checked against a live Prometheus, "
                  f"{checked - len(failures) - len(allowed_empty)} returned data, "
                  f"{len(allowed_empty)} GPU queries empty (no NVML), {len(failures)} failed")  # fmt: skip
            assert not failures, "\n".join(failures)
            # proof the allow-list is not hiding something: without NVML the GPU metrics are absent, with it present
            gpu_series = prom.get("/api/v1/series", **{"match[]": "enginemeter_gpu_memory_total_bytes", "start": start})
            assert bool(gpu_series) is not no_nvml
            # the exposition itself passes Prometheus' lint (names, units, _total), with every family populated
            promtool = shutil.which("promtool")
            assert promtool is not None, "Debian's prometheus package ships promtool"
            exposition = httpx.get(f"{proxy}/metrics", timeout=10).text
            lint = subprocess.run([promtool, "check", "metrics"], input=exposition, capture_output=True, text=True, check=False)  # fmt: skip
            assert lint.returncode == 0, lint.stdout + lint.stderr
            # the comparison really saw a token-count mismatch (different tokenizers)
            assert prom.value('sum(enginemeter_token_count_mismatches_total{kind="prompt"})') >= 8
            # the pair's counters were primed: every kind has a series from the first scrape on
            assert prom.value('count(enginemeter_output_mismatches_total{primary="llama", shadow="sglang"})') == 1
            # vLLM's own `engine` label (the engine-core index) gave way to the target's
            vllm_series = prom.get("/api/v1/series", **{"match[]": "vllm:num_requests_running", "start": start})
            assert [(s["engine"], s["exported_engine"]) for s in vllm_series] == [("vllm", "0")]
        finally:
            prom.client.close()
            proc.terminate()
            proc.wait(15)


def _ts(rfc3339: str) -> float:
    """Prometheus' RFC 3339 with nanoseconds -> epoch seconds (fromisoformat takes at most microseconds)."""
    m = re.fullmatch(r"(.+?)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)", rfc3339)
    assert m, rfc3339
    frac = (m[2] or "0")[:6].ljust(6, "0")
    tz = "+00:00" if m[3] == "Z" else m[3]
    return datetime.fromisoformat(f"{m[1]}.{frac}{tz}").timestamp()


class ReplayedNvml:
    """NVML readings replayed from the H200 run in shared/reference/gpu.md (7B F16 llama-server, one GPU)."""

    TOTAL = 150_754_820_096

    def __init__(self, engine_pid: int) -> None:
        self.engine_pid = engine_pid

    def devices(self) -> list[DeviceReading]:
        used, reserved = 16_030_000_000, 600 * 2**20
        return [DeviceReading(0, "NVIDIA H200", "GPU-0000", self.TOTAL, used, self.TOTAL - used - reserved, reserved, 0.37)]  # fmt: skip

    def processes(self, index: int) -> list[ProcReading]:
        return [ProcReading(self.engine_pid, 15_370_000_000)]

    def close(self) -> None:
        pass


def test_gpu_queries_return_data_from_replayed_nvml(prometheus_bin: str, tmp_path: Path) -> None:
    """The GPU allow-list above only excuses *absence*: here NVML readings exist and those queries must answer.

    NVML is replaced at the reader seam (``start_proxy(nvml=)``); exposition, scrape and PromQL are real.
    """
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        config = {
            "engines": [{"name": "llama", "url": "http://127.0.0.1:9", "kind": "llamacpp", "model": "m", "pid": engine.pid}],
            "routes": [{"primary": "llama"}],
            "collectors": {"gpu": True, "gpu_interval": 0.2},
        }  # fmt: skip
        (tmp_path / "enginemeter.yaml").write_text(yaml.safe_dump(config))
        settings = load(config=str(tmp_path / "enginemeter.yaml"), env={})
        reader = ReplayedNvml(engine.pid)
        start = time.time() - 5
        with ExitStack() as stack:
            proxy = start_proxy(stack, settings, nvml=lambda: reader).url
            assert httpx.get(f"{proxy}/health", timeout=10).json()["gpu"]["enabled"] is True
            addr = proxy[len("http://") :]
            # no engine jobs: GPU queries need only the proxy
            proc, prom = start_prometheus(prometheus_bin, tmp_path, {"enginemeter": addr})
            try:
                wait_until(lambda: prom.value("count_over_time(enginemeter_gpu_memory_total_bytes[1m])") >= 2, 30, 0.2)
                end = time.time()
                start = end - math.ceil(end - start)
                checked, _, failures = check_queries(prom, start, end, allow_gpu_empty=False, only=GPU_ALLOW)
                print(
                    f"\nmonitoring: {checked} GPU queries checked against replayed NVML readings, {len(failures)} failed"
                )
                assert checked == 8 and not failures, "\n".join(failures)
                used_share = prom.value("max(enginemeter_gpu_memory_used_bytes / enginemeter_gpu_memory_total_bytes)")
                assert used_share == pytest.approx(16_030_000_000 / ReplayedNvml.TOTAL)
                assert prom.value('max(enginemeter_engine_gpu_memory_used_bytes{engine="llama"})') == 15_370_000_000
            finally:
                prom.client.close()
                proc.terminate()
                proc.wait(15)
    finally:
        engine.kill()
        engine.wait()


def test_the_shipped_key_recipe_scrapes_a_proxy_whose_metrics_need_a_key(prometheus_bin: str, tmp_path: Path) -> None:
    """``metrics: {access: key}``: the commented ``authorization`` block of deploy/prometheus/prometheus.yml,
    uncommented as its comment says, scrapes the proxy; the same Prometheus without it gets a 401 (target down)."""
    from fakes.fault_engine import FaultEngineConfig, run_in_thread

    shipped = (ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text()
    key_file = tmp_path / "enginemeter-key"
    key_file.write_text("sk-scrape\n")
    variant = uncommented(shipped, "authorization:").replace("/etc/prometheus/enginemeter-key", str(key_file))
    assert yaml.safe_load(variant)["scrape_configs"][0]["authorization"]["credentials_file"] == str(key_file)
    with ExitStack() as stack:
        engine = stack.enter_context(run_in_thread(FaultEngineConfig()))
        cfg = tmp_path / "enginemeter.yaml"
        cfg.write_text(yaml.safe_dump({
            "api_keys": ["sk-scrape"], "metrics": {"access": "key"},
            "engines": [{"name": "llama", "url": engine, "kind": "llamacpp"}], "collectors": {"gpu": False},
        }))  # fmt: skip
        proxy = start_proxy(stack, load(config=str(cfg), env={})).url
        assert httpx.get(f"{proxy}/metrics", timeout=10).status_code == 401
        addr = proxy[len("http://") :]
        assert scraped(prometheus_bin, tmp_path / "with-key", addr, variant) == 1.0
        assert scraped(prometheus_bin, tmp_path / "shipped", addr, shipped) == 0.0


def scraped(binary: str, run_dir: Path, addr: str, text: str) -> float:
    """``up`` of the enginemeter job once a Prometheus configured by ``text`` has scraped ``addr``; when 1, also
    waits for a series of the proxy's own."""
    run_dir.mkdir()
    proc, prom = start_prometheus(binary, run_dir, {"enginemeter": addr}, text=text)
    try:
        wait_until(lambda: prom.get("/api/v1/query", query='up{job="enginemeter"}')["result"], 30, 0.2)
        up = prom.value('up{job="enginemeter"}')
        if up:
            wait_until(lambda: prom.value('enginemeter_build_info{job="enginemeter"}') == 1, 30, 0.2)
        return up
    finally:
        prom.client.close()
        proc.terminate()
        proc.wait(15)
