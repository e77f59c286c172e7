"""The Starlette app (routes, lifespan, the admin and info endpoints) and ``run_in_thread``."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from http import HTTPStatus

import httpx
import uvicorn
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from fakes.sglang_emulator.config import FLUSHED, SGLANG_VERSION, EmulatorConfig
from fakes.sglang_emulator.engine import SGLangEmulator
from fakes.sglang_emulator.metrics import THROUGHPUT_WINDOW_S
from fakes.sglang_emulator.serving import _Serving


def create_app(config: EmulatorConfig, *, transport: httpx.AsyncBaseTransport | None = None) -> Starlette:
    """The emulator as an ASGI app; its lifespan waits for the backend and reads its /props."""
    engine = SGLangEmulator(config)
    serving = _Serving(engine)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await engine.start(transport)
        try:
            yield
        finally:
            await engine.stop()

    async def health(request: Request) -> Response:
        # http_server.health_generate: a real 1-token generation; answered at once when busy
        if engine.inflight > 0:
            return Response(status_code=200)
        body = {"prompt": [0], "n_predict": 1, "temperature": 0.0, "cache_prompt": False}
        try:
            resp = await asyncio.wait_for(engine.http.post("/completion", json=body), timeout=20.0)
        except (httpx.HTTPError, TimeoutError):
            return Response(status_code=503)
        return Response(status_code=200 if resp.status_code == 200 else 503)

    async def ready(request: Request) -> Response:
        return Response(status_code=200)

    async def model_info(request: Request) -> Response:
        return JSONResponse(
            {
                "model_path": engine.model_path,
                "served_model_name": engine.served_model_name,
                "tokenizer_path": engine.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "load_format": "auto",
                "reasoning_parser": None,
                "tool_call_parser": None,
                "disaggregation_mode": "null",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
            }
        )

    async def server_info(request: Request) -> Response:
        m = engine.metrics
        throughput = 0.0
        if m is not None:
            m._trim(time.monotonic())
            throughput = sum(n for _, n in m.recent_tokens) / THROUGHPUT_WINDOW_S
        return JSONResponse(
            {
                "model_path": engine.model_path,
                "tokenizer_path": engine.model_path,
                "served_model_name": engine.served_model_name,
                "host": config.host,
                "port": config.port,
                "context_length": engine.context_length,
                "max_running_requests": engine.max_running_requests,
                "max_queued_requests": config.max_queued_requests,
                "max_total_tokens": engine.context_length * engine.max_running_requests,
                "tp_size": 1,
                "dp_size": 1,
                "pp_size": 1,
                "stream_interval": 1,
                "stream_output": False,
                "schedule_policy": "fcfs",
                "sampling_defaults": "model",
                "enable_metrics": config.enable_metrics,
                "enable_cache_report": config.enable_cache_report,
                "stream_response_default_include_usage": config.stream_response_default_include_usage,
                "allow_auto_truncate": False,
                "enable_lora": False,
                "skip_server_warmup": True,
                "backend": config.backend,  # emulator only: where tokens come from
                "launch_command": "python -m fakes.sglang_emulator",
                "startup_time": engine.startup_time,
                "internal_states": [
                    {
                        "last_gen_throughput": throughput,
                        "num_running_reqs": min(engine.inflight, engine.max_running_requests),
                        "num_queue_reqs": max(0, engine.inflight - engine.max_running_requests),
                        "avg_spec_accept_length": None,
                    }
                ],
                "version": SGLANG_VERSION,
                "frontend": "python",
            }
        )

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
        return Response(FLUSHED, status_code=200)

    async def metrics(request: Request) -> Response:
        assert engine.registry is not None
        return Response(generate_latest(engine.registry), media_type=CONTENT_TYPE_LATEST)

    async def not_found(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 404
        return JSONResponse({"detail": HTTPStatus(status).phrase}, status_code=status)

    routes = [
        Route("/v1/chat/completions", serving.chat, methods=["POST"]),
        Route("/v1/completions", serving.completions, methods=["POST"]),
        Route("/v1/tokenize", serving.tokenize, methods=["POST"]),
        Route("/tokenize", serving.tokenize, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/health_generate", health, methods=["GET"]),
        Route("/model_info", model_info, methods=["GET"]),
        Route("/get_model_info", model_info, methods=["GET"]),
        Route("/server_info", server_info, methods=["GET"]),
        Route("/get_server_info", server_info, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model_card, methods=["GET"]),
        Route("/flush_cache", flush_cache, methods=["GET", "POST"]),
    ]
    if config.ready_endpoint:
        routes.append(Route("/ready", ready, methods=["GET"]))
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
