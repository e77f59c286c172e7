"""The Starlette app (routes, lifespan, the admin and info endpoints) and ``run_in_thread``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from http import HTTPStatus
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from prometheus_client.exposition import generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from fakes.sglang_emulator import native
from fakes.sglang_emulator.config import FLUSHED, EmulatorConfig
from fakes.sglang_emulator.engine import SGLangEmulator
from fakes.sglang_emulator.serving import _Serving

#: what real SGLang 0.5.17 answered on the H200 (tests/fixtures/engines/sglang-0.5.17/endpoints.json): its server
#: args as given, the scheduler-only keys of internal_states[0], /model_info's embedding block
TEMPLATE_0517 = Path(__file__).with_name("sglang-0.5.17.json")
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _template() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(TEMPLATE_0517.read_text())
    return doc


def _is_gguf(path: str | None) -> bool:
    """SGLang's ``check_gguf_file``: a file named ``*.gguf`` or whose first four bytes are the GGUF magic."""
    p = Path(path) if path else None
    if p is None or not p.is_file():
        return False
    if p.suffix == ".gguf":
        return True
    try:
        with p.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def server_info(engine: SGLangEmulator, template: dict[str, Any]) -> dict[str, Any]:
    """``/server_info`` as 0.5.17 builds it: every server arg as given on the command line (``max_running_requests``
    ``null`` unless set), then ``status``, the KV pool, ``max_req_input_len``, ``startup_time``, ``internal_states``
    (the args again, plus memory, throughput and the effective running-request limit), ``version``."""
    config = engine.config
    args = dict(template["server_args"])
    args.update(
        model_path=engine.model_path,
        tokenizer_path=engine.model_path,
        served_model_name=engine.served_model_name,
        host=config.host,
        port=config.port,
        context_length=config.context_length,
        max_running_requests=config.max_running_requests,
        max_queued_requests=config.max_queued_requests,
        mem_fraction_static=config.mem_fraction_static
        if config.mem_fraction_static is not None
        else args.get("mem_fraction_static"),
        # SGLang's ServerArgs: a model path that is a GGUF file sets quantization = load_format = "gguf"
        load_format="gguf" if _is_gguf(engine.model_path) else config.load_format or "auto",
        quantization="gguf" if _is_gguf(engine.model_path) else config.quantization or args.get("quantization"),
        dtype=config.dtype or "auto",
        enable_metrics=config.enable_metrics,
        enable_cache_report=config.enable_cache_report,
        stream_response_default_include_usage=config.stream_response_default_include_usage,
        skip_server_warmup=False,
        kv_events=None,
    )
    kv_events = args.pop("kv_events")
    startup = {"load_weight": 0.0, "kv_cache_allocation": 0.0, "scheduler_e2e": 0.0, "cuda_graph": {}}
    graph = dict.fromkeys(("prefill", "decode", "target_verify", "draft_prefill", "draft_decode", "draft_extend"), 0.0)
    startup["cuda_graph"] = graph
    state = {k: v for k, v in args.items() if k != "custom_sigquit_handler"}
    state.update(template["state_overrides"], startup_time=startup)
    state.update(template["state_only"])
    state.update(
        last_gen_throughput=engine.metrics.recent_throughput() if engine.metrics is not None else 0.0,
        memory_usage={
            "weight": 0.0,
            "kvcache": 0.0,
            "startup_available": 0.0,
            "token_capacity": engine.max_total_num_tokens,
            "token_capacity_swa": None,
            "graph": graph,
        },
        effective_max_running_requests_per_dp=engine.max_running_requests,
    )
    return {
        **args,
        "status": "ready",
        "max_total_num_tokens": engine.max_total_num_tokens,
        "max_req_input_len": engine.max_req_input_len,
        "startup_time": {**startup, "tokenizer_e2e": 0.0},
        "internal_states": [state],
        "version": config.version,
        "kv_events": kv_events,
    }


def create_app(config: EmulatorConfig, *, transport: httpx.AsyncBaseTransport | None = None) -> Starlette:
    """The emulator as an ASGI app; its lifespan waits for the backend and reads its /props."""
    engine = SGLangEmulator(config)
    serving = _Serving(engine)
    template = _template()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await engine.start(transport)
        try:
            yield
        finally:
            await engine.stop()

    async def health(request: Request) -> Response:
        # http_server.health_generate: a real 1-token generation; answered at once when busy. Real SGLang waits
        # for the scheduler's output checking once a second (0.5.17 on the H200: ~1.0 s): health_idle_s
        if engine.inflight > 0:
            return Response(status_code=200)
        body = {"prompt": [0], "n_predict": 1, "temperature": 0.0, "cache_prompt": False}
        t0 = time.monotonic()
        try:
            resp = await asyncio.wait_for(engine.http.post("/completion", json=body), timeout=20.0)
        except (httpx.HTTPError, TimeoutError):
            return Response(status_code=503)
        if resp.status_code != 200:
            return Response(status_code=503)
        await asyncio.sleep(max(0.0, config.health_idle_s - (time.monotonic() - t0)))
        return Response(status_code=200)

    async def empty_200(request: Request) -> Response:
        return Response(status_code=200)

    async def model_info(request: Request) -> Response:
        info: dict[str, Any] = {
            "model_path": engine.model_path,
            "tokenizer_path": engine.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
        }
        if config.v0517:
            return JSONResponse(info | {"embedding": template["model_info_embedding"]})
        # 0.5.23 as its source reads (shared/reference/engines.md §2.5)
        newer = {"served_model_name": engine.served_model_name, "load_format": "auto", "reasoning_parser": None,
                 "tool_call_parser": None, "disaggregation_mode": "null"}  # fmt: skip
        return JSONResponse(info | newer)

    async def get_server_info(request: Request) -> Response:
        return JSONResponse(server_info(engine, template))

    async def emulator_state(request: Request) -> Response:
        """Test hook (not SGLang): the live counts behind the published gauges."""
        running = min(engine.inflight, engine.max_running_requests)
        return JSONResponse({"inflight": engine.inflight, "running": running, "waiting": engine.inflight - running})

    async def models(request: Request) -> Response:
        card = {
            "id": engine.served_model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sglang",
            "root": engine.served_model_name,
            "parent": None,
            "max_model_len": engine.context_length,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def model_card(request: Request) -> Response:
        name = request.path_params["model"]
        if name != engine.served_model_name:
            error = {
                "message": f"The model '{name}' does not exist",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }
            return JSONResponse({"error": error}, status_code=404)
        card = {
            "id": name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sglang",
            "root": name,
            "parent": None,
            "max_model_len": engine.context_length,
        }
        return JSONResponse(card)

    async def flush_cache(request: Request) -> Response:
        if engine.inflight > 0:
            return Response("Flush cache failed.\n", status_code=400)
        engine.prefix_cache.clear()
        return Response(FLUSHED, status_code=200)

    async def metrics(request: Request) -> Response:
        assert engine.registry is not None
        # SGLang's multiprocess exposition: the 0.0.4 text format (real 0.5.17's content type)
        return Response(generate_latest(engine.registry), media_type=METRICS_CONTENT_TYPE)

    specials: dict[int, bool] = {}  # token id -> special (what skip_special_tokens drops), learnt per token

    async def generate(request: Request) -> Response:
        return await native.generate(engine, request)

    async def detokenize(request: Request) -> Response:
        return await native.detokenize_endpoint(engine, request, specials)

    async def not_found(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 404
        return JSONResponse({"detail": HTTPStatus(status).phrase}, status_code=status)

    routes = [
        Route("/v1/chat/completions", serving.chat, methods=["POST"]),
        Route("/v1/completions", serving.completions, methods=["POST"]),
        Route("/v1/tokenize", serving.tokenize, methods=["POST"]),
        Route("/tokenize", serving.tokenize, methods=["POST"]),
        Route("/v1/detokenize", detokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/generate", generate, methods=["POST", "PUT"]),
        Route("/health", health, methods=["GET"]),
        Route("/health_generate", health, methods=["GET"]),
        Route("/model_info", model_info, methods=["GET"]),
        Route("/get_model_info", model_info, methods=["GET"]),
        Route("/server_info", get_server_info, methods=["GET"]),
        Route("/get_server_info", get_server_info, methods=["GET"]),
        Route("/ping", empty_200, methods=["GET"]),
        Route("/_emulator/state", emulator_state, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model_card, methods=["GET"]),
        Route("/flush_cache", flush_cache, methods=["GET", "POST"]),
    ]
    if config.has_ready:
        routes.append(Route("/ready", empty_200, methods=["GET"]))
    if config.enable_metrics:
        routes.append(Route("/metrics", metrics, methods=["GET"]))
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: not_found, 405: not_found})
    app.state.emulator = engine
    return app


@contextlib.contextmanager
def run_in_thread(config: EmulatorConfig, *, port: int = 0, startup_timeout_s: float = 60.0) -> Iterator[str]:
    """Serve the emulator with uvicorn in a thread, on ``port`` (0: a free one); yields its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((config.host, port))
    host, port = sock.getsockname()[:2]
    app = create_app(replace(config, port=port))
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2, access_log=False)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="sglang-emulator", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + startup_timeout_s
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the SGLang emulator did not start (is the backend up?)")
            time.sleep(0.02)
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
