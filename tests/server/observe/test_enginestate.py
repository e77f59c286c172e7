"""Engine-state polling against real llama-server processes and the SGLang emulator (a real subprocess in
front of a real llama-server); drift between engines of one route; vLLM shapes and failures through
``httpx.MockTransport`` (fault injection and an engine we cannot run here)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from proxy import engines
from proxy.config.settings import CollectorSettings, EngineSettings, ModelAlias, RouteSettings, Settings, Timeouts
from proxy.embedded import LlamaServer
from proxy.procs.process import free_port
from proxy.server.observe import enginestate
from proxy.server.observe.enginestate import EngineStatePoller
from proxy.server.request.upstream import Engine
from tests.helpers import LlamaServerFactory, ProxyFactory, wait_until


def settings(
    engines: dict[str, str],
    *,
    shadows: tuple[str, ...] = (),
    models: tuple[ModelAlias, ...] = (),
    route_models: tuple[str, ...] = ("*",),
) -> Settings:
    names = list(engines)
    return Settings(
        engines=tuple(EngineSettings(name=n, url=u, timeouts=Timeouts(connect=2, read=10)) for n, u in engines.items()),
        routes=(RouteSettings(models=route_models, primary=names[0], shadows=shadows),),
        models=models,
        collectors=CollectorSettings(gpu=False, engine_interval=0.1),
    )


class Running:
    def __init__(self, registry: CollectorRegistry, poller: EngineStatePoller, url: str) -> None:
        self.registry = registry
        self.poller = poller
        self.url = url

    def value(self, metric: str, /, **labels: str) -> float | None:
        return self.registry.get_sample_value(metric, labels)

    def wait_polls(self, n: int = 1) -> None:
        start = self.poller.polls
        wait_until(lambda: self.poller.polls >= start + n, timeout=20)


@pytest.fixture
def proxy_with_state(proxy_factory: ProxyFactory) -> Callable[[Settings], Running]:
    def start(s: Settings) -> Running:
        p = proxy_factory(s)
        assert p.gateway.engine_state is not None
        r = Running(p.registry, p.gateway.engine_state, p.url)
        r.wait_polls(1)
        return r

    return start


@pytest.fixture
def sglang_emulator() -> Iterator[Callable[..., str]]:
    """Start ``python -m fakes.sglang_emulator`` subprocesses in front of a backend; yields a starter."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(backend: str, served: str, *extra: str) -> str:
        port = free_port()
        root = Path(__file__).resolve().parents[3]
        p = subprocess.Popen(
            [sys.executable, "-m", "fakes.sglang_emulator", "--port", str(port), "--backend", backend,
             "--served-model-name", served, *extra],
            cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        procs.append(p)
        url = f"http://127.0.0.1:{port}"
        # /v1/models: served by every emulated version (0.5.17, the default, has no /ready)
        wait_until(lambda: p.poll() is None and httpx.get(f"{url}/v1/models", timeout=5).status_code == 200, timeout=60)
        return url

    yield start
    for p in procs:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# --------------------------------------------------------------------------------------------- llama.cpp


def test_llamacpp_props_and_slots(
    llama_server_factory: LlamaServerFactory, proxy_with_state: Callable[[Settings], Running]
) -> None:
    srv = llama_server_factory(np=2, alias="tiny", extra_args=["-c", "2048"])
    p = proxy_with_state(settings({"llama": srv.url}))
    assert p.value("enginemeter_engine_up", engine="llama") == 1
    # -c 2048 over 2 slots: one request can use 1024 tokens
    assert p.value("enginemeter_engine_context_length", engine="llama") == 1024
    assert p.value("enginemeter_engine_slots", engine="llama") == 2
    assert p.value("enginemeter_engine_busy_slots", engine="llama") == 0
    info = [
        s.labels
        for m in p.registry.collect()
        for s in m.samples
        if s.name == "enginemeter_engine_info" and s.labels["engine"] == "llama"
    ]
    assert len(info) == 1
    assert info[0]["kind"] == "llamacpp"
    assert info[0]["model"] == "tiny"
    assert info[0]["quantization"] == "F16"
    assert info[0]["build"]  # build_info, e.g. "b0-unknown" for an sdist build
    # a single-engine route has nothing to drift from
    assert p.value("enginemeter_route_drift", route="*", field="context_length") is None
    h = httpx.get(f"{p.url}/health", timeout=10).json()
    st = h["engine_state"]["engines"]["llama"]
    assert st["up"] is True
    assert st["context_length"] == 1024
    assert st["model_path"].endswith(".gguf")
    assert h["drift"] == []


def test_busy_slots_follow_a_running_generation(
    llama_server_factory: LlamaServerFactory, proxy_with_state: Callable[[Settings], Running]
) -> None:
    srv = llama_server_factory(np=2, alias="tiny", extra_args=["-c", "8192"])
    p = proxy_with_state(settings({"llama": srv.url}))
    busy = "enginemeter_engine_busy_slots"
    assert p.value(busy, engine="llama") == 0
    body = {"prompt": "Once upon a time", "n_predict": 4000, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.Client(base_url=srv.url, timeout=60) as c, c.stream("POST", "/completion", json=body) as r:
        lines = r.iter_lines()
        next(lines)  # generating
        wait_until(lambda: p.value(busy, engine="llama") == 1, timeout=20)
    # the client went away: llama-server stops the task and frees the slot
    wait_until(lambda: p.value(busy, engine="llama") == 0, timeout=20)


def test_llamacpp_dialect_counts_tokens_as_generation_does_and_erases_slots(
    llama_server_factory: LlamaServerFactory, tmp_path: Path
) -> None:
    """Prompt tokens counted without generating equal a generation's ``usage.prompt_tokens``; a slot erase
    (``--slot-save-path``) empties the prompt cache, so the same prompt is processed again in full."""
    srv = llama_server_factory(np=1, alias="tiny", extra_args=["--slot-save-path", str(tmp_path)])
    plain = llama_server_factory(np=1, alias="tiny")
    d = engines.dialect("llamacpp")
    msgs = [{"role": "user", "content": "Tell me a story about a lighthouse keeper and a storm. " * 4}]

    async def with_client(url: str, fn: Callable[[httpx.AsyncClient], Any]) -> Any:
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            return await fn(c)

    def chat() -> dict[str, Any]:
        body = {"messages": msgs, "max_tokens": 1, "temperature": 0}
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200
        return dict(r.json())

    n = asyncio.run(with_client(srv.url, lambda c: d.count_prompt_tokens(c, "tiny", msgs)))
    first = chat()
    assert n.tokens == first["usage"]["prompt_tokens"] and n.tokens > 40
    assert chat()["timings"]["cache_n"] > 0  # the same prompt again: served from the slot's cache
    note = asyncio.run(with_client(srv.url, d.flush_cache))
    assert note == "slot erase HTTP 200 (1 slots)"
    assert chat()["timings"]["cache_n"] == 0
    # without --slot-save-path the engine says it cannot, and the note says so
    note = asyncio.run(with_client(plain.url, d.flush_cache))
    assert note is not None and note.startswith("slot erase HTTP 501") and "--slot-save-path" in note


# --------------------------------------------------------------------------------------------- SGLang


def test_sglang_server_info_model_info_models(
    llama_server: LlamaServer,
    sglang_emulator: Callable[..., str],
    proxy_with_state: Callable[[Settings], Running],
) -> None:
    # busy slots: SGLang 0.5.17 reports no running count in /server_info, only sglang:num_running_reqs
    url = sglang_emulator(llama_server.url, "Qwen/Tiny-Instruct", "--enable-metrics")
    p = proxy_with_state(settings({"sglang": url}))
    assert p.value("enginemeter_engine_up", engine="sglang") == 1
    backend = httpx.get(f"{llama_server.url}/props", timeout=10).json()
    assert (
        p.value("enginemeter_engine_context_length", engine="sglang") == backend["default_generation_settings"]["n_ctx"]
    )
    assert p.value("enginemeter_engine_slots", engine="sglang") == backend["total_slots"]
    assert p.value("enginemeter_engine_busy_slots", engine="sglang") == 0
    st = p.poller.states["sglang"]
    assert st.kind == "sglang"
    assert st.model == "Qwen/Tiny-Instruct"
    assert st.build  # SGLang version from /server_info


def test_sglang_without_ready_is_up_by_its_health(
    llama_server: LlamaServer,
    sglang_emulator: Callable[..., str],
    proxy_with_state: Callable[[Settings], Running],
) -> None:
    """SGLang 0.5.17 has no /ready (404): the proxy's /health asks its /health instead, and says up."""
    url = sglang_emulator(llama_server.url, "Qwen/Tiny-Instruct", "--no-ready", "--max-running-requests", "7")
    assert httpx.get(f"{url}/ready", timeout=10).status_code == 404
    p = proxy_with_state(settings({"sglang": url}))
    h = httpx.get(f"{p.url}/health", timeout=30).json()
    (e,) = h["engines"]
    assert (e["kind"], e["up"], e.get("error")) == ("sglang", True, None)
    assert h["status"] == "ok"
    assert p.value("enginemeter_engine_slots", engine="sglang") == 7


def test_sglang_falls_back_to_deprecated_paths() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        if request.url.path == "/get_server_info":
            return httpx.Response(200, json={"context_length": 32768, "max_running_requests": 48, "version": "0.4.9"})
        if request.url.path == "/get_model_info":
            return httpx.Response(200, json={"model_path": "/m/qwen", "served_model_name": "qwen"})
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "qwen", "max_model_len": 32768}]})
        return httpx.Response(404, json={"detail": "Not Found"})

    st = poll_once("sglang", handler)
    assert (st.up, st.model, st.context_length, st.slots, st.build) == (True, "qwen", 32768, 48, "0.4.9")
    assert seen[:2] == ["/server_info", "/get_server_info"]


# --------------------------------------------------------------------------------------------- drift


def drift_values(p: Running) -> dict[str, float | None]:
    return {f: p.value("enginemeter_route_drift", route="*", field=f) for f in enginestate.DRIFT_FIELDS}


def test_drift_between_engines_with_different_context(
    llama_server_factory: LlamaServerFactory, proxy_with_state: Callable[[Settings], Running]
) -> None:
    a = llama_server_factory(np=2, alias="tiny", extra_args=["-c", "2048"])
    b = llama_server_factory(np=2, alias="tiny", extra_args=["-c", "4096"])
    p = proxy_with_state(settings({"a": a.url, "b": b.url}, shadows=("b",)))
    assert drift_values(p) == {"context_length": 1, "model": 0, "slots": 0, "quantization": 0}
    drift = httpx.get(f"{p.url}/health", timeout=10).json()["drift"]
    assert drift == [{"route": "*", "field": "context_length", "drift": True, "values": {"a": 1024, "b": 2048}}]


def test_no_drift_with_the_same_config_and_model_drift_by_name(
    llama_server_factory: LlamaServerFactory, proxy_with_state: Callable[[Settings], Running]
) -> None:
    a = llama_server_factory(np=2, alias="tiny", extra_args=["-c", "2048"])
    b = llama_server_factory(np=2, alias="tiny", extra_args=["-c", "2048"])
    c = llama_server_factory(np=2, alias="other", extra_args=["-c", "2048"])
    same = proxy_with_state(settings({"a": a.url, "b": b.url}, shadows=("b",)))
    assert drift_values(same) == {"context_length": 0, "model": 0, "slots": 0, "quantization": 0}
    differ = proxy_with_state(settings({"a": a.url, "c": c.url}, shadows=("c",)))
    assert drift_values(differ)["model"] == 1


def test_llamacpp_and_sglang_declared_equal_by_an_alias(
    llama_server: LlamaServer,
    sglang_emulator: Callable[..., str],
    proxy_with_state: Callable[[Settings], Running],
) -> None:
    """The SGLang emulator serves the llama-server's own model under another name: same context and slots;
    the model counts as the same only where the config's model alias says these names are one model."""
    sg = sglang_emulator(llama_server.url, "Qwen/Tiny-Instruct")
    served = httpx.get(f"{llama_server.url}/v1/models", timeout=10).json()["data"][0]["id"]
    alias = ModelAlias(alias="team", engines={"llama": served, "sglang": "Qwen/Tiny-Instruct"})
    declared = proxy_with_state(
        settings(
            {"llama": llama_server.url, "sglang": sg}, shadows=("sglang",), models=(alias,), route_models=("team",)
        )
    )
    vals = {f: declared.value("enginemeter_route_drift", route="team", field=f) for f in enginestate.DRIFT_FIELDS}
    # quantization: the llama.cpp ftype is known, the emulator reports none -> not comparable, absent
    assert vals == {"context_length": 0, "model": 0, "slots": 0, "quantization": None}
    undeclared = proxy_with_state(settings({"llama": llama_server.url, "sglang": sg}, shadows=("sglang",)))
    assert drift_values(undeclared)["model"] == 1


def test_drift_is_pure() -> None:
    s = settings({"a": "http://h:1", "b": "http://h:2", "c": "http://h:3"}, shadows=("b", "c"))
    states = {
        "a": enginestate.EngineState(
            name="a", up=True, model="/models/Qwen2.5-7B.gguf", quantization="F16", context_length=8192
        ),
        "b": enginestate.EngineState(
            name="b", up=True, model="qwen2.5-7b", quantization="float16", context_length=8192
        ),
        "c": enginestate.EngineState(name="c", up=False),
    }
    d = {x["field"]: x["drift"] for x in enginestate.drift(s, states)}
    assert d == {"context_length": False, "model": False, "quantization": False}
    # a catch-all route: any configured alias can declare two served names one model
    named = {
        "a": enginestate.EngineState(name="a", up=True, model="qwen-7b-q8"),
        "b": enginestate.EngineState(name="b", up=True, model="Qwen/Qwen2.5-7B-Instruct"),
    }
    assert [x["drift"] for x in enginestate.drift(s, named)] == [True]
    team = ModelAlias(alias="team", engines={"a": "qwen-7b-q8", "b": "Qwen/Qwen2.5-7B-Instruct"})
    assert [x["drift"] for x in enginestate.drift(replace(s, models=(team,)), named)] == [False]


# --------------------------------------------------------------------------------------------- vLLM, failures


def poll_once(
    kind: str, handler: Callable[[httpx.Request], httpx.Response], poller: EngineStatePoller | None = None
) -> Any:
    es = EngineSettings(name="e", url="http://engine.test", kind=kind)  # type: ignore[arg-type]
    client = httpx.AsyncClient(base_url=es.url, transport=httpx.MockTransport(handler))
    engine = Engine(settings=es, client=client, kind=es.kind)
    poller = poller or EngineStatePoller(settings({"e": es.url}), {"e": engine}, interval=1)
    poller.engines = {"e": engine}

    async def go() -> None:
        try:
            await poller.poll_all()
        finally:
            await engine.client.aclose()

    asyncio.run(go())
    return poller.states["e"]


VLLM_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen2.5-7B-Instruct"} 3.0
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen2.5-7B-Instruct"} 1.0
"""


def test_vllm_models_version_and_running_requests() -> None:
    seen: list[tuple[str, str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.url.path))
        if request.url.path == "/v1/models":
            card: dict[str, Any] = {"id": "Qwen/Qwen2.5-7B-Instruct", "object": "model", "owned_by": "vllm",
                    "root": "/models/qwen2.5-7b", "parent": None, "max_model_len": 32768, "permission": []}  # fmt: skip
            return httpx.Response(200, json={"object": "list", "data": [card]})
        if request.url.path == "/version":
            return httpx.Response(200, json={"version": "0.33.0"})
        if request.url.path == "/metrics":
            return httpx.Response(200, text=VLLM_METRICS)
        return httpx.Response(404)

    st = poll_once("vllm", handler)
    assert (st.up, st.model, st.context_length, st.busy_slots, st.build) == (
        True, "Qwen/Qwen2.5-7B-Instruct", 32768, 3, "0.33.0",
    )  # fmt: skip
    assert st.slots is None  # vLLM does not say its max_num_seqs
    # cheap GETs only, never a generation
    assert {m for m, _ in seen} == {"GET"}
    assert {p for _, p in seen} == {"/v1/models", "/version", "/metrics"}


def test_engine_going_down_keeps_static_facts_and_drops_busy() -> None:
    up = {"ok": True}

    def handler(request: httpx.Request) -> httpx.Response:
        if not up["ok"]:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/props":
            return httpx.Response(200, json={"default_generation_settings": {"n_ctx": 4096}, "total_slots": 4,
                                             "model_ftype": "Q4_K - Medium", "build_info": "b1-x"})  # fmt: skip
        if request.url.path == "/slots":
            return httpx.Response(200, json=[{"id": i, "is_processing": i == 0} for i in range(4)])
        return httpx.Response(200, json={"data": [{"id": "m"}]})

    reg = CollectorRegistry()
    es = EngineSettings(name="e", url="http://engine.test", kind="llamacpp")
    poller = EngineStatePoller(settings({"e": es.url}), {}, interval=1)
    reg.register(poller)
    st = poll_once("llamacpp", handler, poller)
    assert (st.up, st.context_length, st.slots, st.busy_slots, st.quantization) == (True, 4096, 4, 1, "Q4_K - Medium")
    up["ok"] = False
    st = poll_once("llamacpp", handler, poller)
    assert st.up is False
    assert "ConnectError" in (st.error or "")
    assert reg.get_sample_value("enginemeter_engine_up", {"engine": "e"}) == 0
    assert reg.get_sample_value("enginemeter_engine_busy_slots", {"engine": "e"}) is None
    assert reg.get_sample_value("enginemeter_engine_context_length", {"engine": "e"}) == 4096
    up["ok"] = True
    assert poll_once("llamacpp", handler, poller).up is True
    assert reg.get_sample_value("enginemeter_engine_busy_slots", {"engine": "e"}) == 1


def test_engine_never_reached_has_up_zero_and_nothing_else(proxy_with_state: Callable[[Settings], Running]) -> None:
    p = proxy_with_state(settings({"gone": f"http://127.0.0.1:{free_port()}"}))
    assert p.value("enginemeter_engine_up", engine="gone") == 0
    assert p.value("enginemeter_engine_context_length", engine="gone") is None
    names = {s.name for m in p.registry.collect() for s in m.samples}
    assert "enginemeter_engine_info" not in names
    h = httpx.get(f"{p.url}/health", timeout=10).json()
    assert h["engine_state"]["engines"]["gone"]["up"] is False


def test_build_app_wires_every_stage() -> None:
    from proxy.server.app import Gateway
    from proxy.server.compose import build_app

    s = settings({"a": "http://127.0.0.1:9", "b": "http://127.0.0.1:10"}, shadows=("b",))
    full: Gateway = build_app(s).state.gateway
    assert full.mirror is not None and full.gpu is not None and full.engine_state is not None
    assert full.mirror.on_result in full.attempts.observers
