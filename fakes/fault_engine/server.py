"""The fake engine: its routes, connection loop and small endpoints, request accounting, and the ways to
run it (``serve``, ``run_in_thread``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import traceback
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any

from fakes.fault_engine.config import (
    _CHAT_TEMPLATE,
    BOS_TOKEN,
    BUILD_INFO,
    EOS_TOKEN,
    MAX_HEAD_BYTES,
    FaultEngineConfig,
    KnobError,
)
from fakes.fault_engine.http1 import _BadRequest, _Conn, _json_response, _Request
from fakes.fault_engine.produce import _Outcome, _plan, produce
from fakes.fault_engine.shapes import (
    _error_body,
    _Kind,
    _text_of,
    apply_chat_template,
    fake_tokenize,
)


@dataclass(frozen=True, slots=True)
class RecordedRequest:
    method: str
    path: str
    headers: tuple[tuple[str, str], ...]
    body: bytes

    def parsed_body(self) -> Any:
        """The body as JSON, else as text, ``None`` when empty."""
        if not self.body:
            return None
        try:
            return json.loads(self.body)
        except ValueError:
            return self.body.decode("utf-8", "replace")


@dataclass(slots=True)
class _Stats:
    active: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    rejected: int = 0
    requests: int = 0
    #: when the last cancellation was noticed (``time.monotonic()``, same host: tests compare it with theirs)
    last_cancel_at: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class FaultEngine:
    """State and request handling of one fake engine; ``start()`` binds it to a socket."""

    def __init__(self, config: FaultEngineConfig | None = None) -> None:
        self.config = config or FaultEngineConfig()
        self.stats = _Stats()
        self.recorded: deque[RecordedRequest] = deque(maxlen=self.config.record_limit)
        self.server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._routes: dict[tuple[str, str], Callable[[_Conn, _Request], Awaitable[bool]]] = {
            ("GET", "/health"): self._health,
            ("GET", "/v1/health"): self._health,
            ("GET", "/props"): self._props,
            ("GET", "/models"): self._models,
            ("GET", "/v1/models"): self._models,
            ("GET", "/slots"): self._slots,
            ("GET", "/metrics"): self._metrics,
            ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/chat/completions"): self._chat,
            ("POST", "/v1/completions"): self._cmpl,
            ("POST", "/completion"): self._native,
            ("POST", "/completions"): self._native,
            ("POST", "/tokenize"): self._tokenize,
            ("POST", "/apply-template"): self._apply_template,
            ("GET", "/_fake/requests"): self._get_requests,
            ("DELETE", "/_fake/requests"): self._delete_requests,
            ("GET", "/_fake/stats"): self._get_stats,
            ("DELETE", "/_fake/stats"): self._delete_stats,
        }

    @property
    def url(self) -> str:
        if self.server is None or not self.server.sockets:
            raise RuntimeError("the fault engine is not started")
        host, port = self.server.sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    async def start(self) -> asyncio.Server:
        self.server = await asyncio.start_server(
            self._handle, self.config.host, self.config.port, limit=MAX_HEAD_BYTES, backlog=4096,
            reuse_port=self.config.reuse_port or None,
        )  # fmt: skip
        return self.server

    async def aclose(self) -> None:
        """Stop listening and drop every open connection."""
        if self.server is not None:
            self.server.close()
        # a connection accepted just before close() gets its handler task a loop turn later: repeat until no
        # handler is left, or the loop would close with one pending (an unraisable warning at exit)
        while True:
            for writer in list(self._writers):
                writer.transport.abort()
            await asyncio.sleep(0)  # let handlers of just-accepted connections register (one loop turn)
            pending = [t for t in self._tasks if not t.done()]
            if not pending:
                break
            # aborted transports end every handler by themselves; cancelling them instead would trip Python
            # 3.11's start_server callback, which calls task.exception() on a cancelled task
            _, stuck = await asyncio.wait(pending, timeout=5)
            for task in stuck:
                task.cancel()
        if self.server is not None:
            await self.server.wait_closed()

    # -- connection loop ---------------------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        conn = _Conn(reader, writer)
        try:
            while True:
                try:
                    request = await conn.read_request()
                except _BadRequest as exc:
                    await conn.send(_json_response(exc.status, _error_body(str(exc), exc.status), keep_alive=False))
                    break
                if request is None:
                    break
                if not await self._dispatch(conn, request) or not request.keep_alive:
                    break
        except (ConnectionError, OSError):
            pass
        except Exception:  # a bug here must not take the server down; say so loudly
            traceback.print_exc()
        finally:
            self._writers.discard(writer)
            self._tasks.discard(task)
            writer.close()

    async def _dispatch(self, conn: _Conn, request: _Request) -> bool:
        """Answer one request; False when the connection must close."""
        if request.method == "POST" and not request.path.startswith("/_fake/"):
            self.recorded.append(
                RecordedRequest(request.method, request.path, tuple(request.headers.items()), request.body)
            )
        handler = self._routes.get((request.method, request.path))
        if handler is None:
            await conn.send(_json_response(404, _error_body("File Not Found", 404)))
            return True
        return await handler(conn, request)

    # -- small endpoints ---------------------------------------------------------------------------------

    async def _reply(self, conn: _Conn, status: int, obj: Any) -> bool:
        await conn.send(_json_response(status, obj))
        return True

    async def _health(self, conn: _Conn, request: _Request) -> bool:
        return await self._reply(conn, 200, {"status": "ok"})

    def _params(self) -> dict[str, Any]:
        k = self.config.knobs
        return {
            "n_predict": -1,
            "seed": 4294967295,
            "temperature": 0.8,
            "top_k": 40,
            "top_p": 0.95,
            "min_p": 0.05,
            "repeat_last_n": 64,
            "repeat_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "stream": True,
            "fault_defaults": {f.name: getattr(k, f.name) for f in fields(k)},
        }

    async def _props(self, conn: _Conn, request: _Request) -> bool:
        cfg = self.config
        return await self._reply(
            conn,
            200,
            {
                "default_generation_settings": {"params": self._params(), "n_ctx": cfg.n_ctx},
                "total_slots": cfg.total_slots,
                "model_alias": cfg.model,
                "model_path": f"/models/{cfg.model}.gguf",
                "modalities": {"vision": False, "video": False, "audio": False},
                "endpoint_slots": True,
                "endpoint_props": False,
                "endpoint_metrics": False,
                "chat_template": _CHAT_TEMPLATE,
                "bos_token": BOS_TOKEN,
                "eos_token": EOS_TOKEN,
                "build_info": BUILD_INFO,
                "is_sleeping": False,
            },
        )

    async def _models(self, conn: _Conn, request: _Request) -> bool:
        name = self.config.model
        return await self._reply(
            conn,
            200,
            {
                "models": [
                    {
                        "name": name,
                        "model": name,
                        "modified_at": "",
                        "size": "",
                        "digest": "",
                        "type": "model",
                        "description": "",
                        "tags": [""],
                        "capabilities": ["completion"],
                        "parameters": "",
                        "details": {"parent_model": "", "format": "gguf", "family": "", "families": [""]},
                    }
                ],
                "object": "list",
                "data": [
                    {
                        "id": name,
                        "aliases": [name],
                        "tags": [],
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": "llamacpp",
                        "meta": {
                            "vocab_type": 2,
                            "n_vocab": 32003,
                            "n_ctx": self.config.n_ctx,
                            "n_ctx_train": self.config.n_ctx,
                            "n_embd": 64,
                            "n_params": 1_000_000,
                            "size": 4_000_000,
                            "ftype": "F16",
                        },
                    }
                ],
            },
        )

    async def _slots(self, conn: _Conn, request: _Request) -> bool:
        busy = self.stats.active
        slots = [
            {"id": i, "n_ctx": self.config.n_ctx, "speculative": False, "is_processing": i < busy}
            for i in range(self.config.total_slots)
        ]
        if request.query.get("fail_on_no_slot") and busy >= self.config.total_slots:
            return await self._reply(conn, 503, _error_body("no slot available", 503))
        return await self._reply(conn, 200, slots)

    async def _metrics(self, conn: _Conn, request: _Request) -> bool:
        message = "This server does not support metrics endpoint. Start it with `--metrics`"
        return await self._reply(conn, 501, _error_body(message, 501))

    def _json_body(self, request: _Request) -> dict[str, Any] | bytes:
        """The request's JSON object, or the error response to send."""
        try:
            body = json.loads(request.body)
        except ValueError as exc:
            return _json_response(500, _error_body(f"[json.exception.parse_error.101] parse error: {exc}", 500))
        if not isinstance(body, dict):
            return _json_response(400, _error_body("request body must be a JSON object", 400))
        return body

    async def _tokenize(self, conn: _Conn, request: _Request) -> bool:
        body = self._json_body(request)
        if isinstance(body, bytes):
            await conn.send(body)
            return True
        content = body.get("content", "")
        tokens = fake_tokenize(
            _text_of(content),
            add_special=bool(body.get("add_special", False)),
            parse_special=bool(body.get("parse_special", True)),
        )
        return await self._reply(conn, 200, {"tokens": tokens})

    async def _apply_template(self, conn: _Conn, request: _Request) -> bool:
        body = self._json_body(request)
        if isinstance(body, bytes):
            await conn.send(body)
            return True
        messages = body.get("messages")
        if not isinstance(messages, list):
            return await self._reply(conn, 400, _error_body("'messages' is required", 400))
        return await self._reply(conn, 200, {"prompt": apply_chat_template(messages)})

    async def _get_requests(self, conn: _Conn, request: _Request) -> bool:
        if request.query.get("full", ["0"])[0] not in ("", "0", "false"):
            out: list[Any] = [
                {"method": r.method, "path": r.path, "headers": dict(r.headers), "body": r.parsed_body()}
                for r in self.recorded
            ]
        else:
            out = [r.parsed_body() for r in self.recorded]
        return await self._reply(conn, 200, out)

    async def _delete_requests(self, conn: _Conn, request: _Request) -> bool:
        self.recorded.clear()
        return await self._reply(conn, 200, {"cleared": True})

    async def _get_stats(self, conn: _Conn, request: _Request) -> bool:
        return await self._reply(conn, 200, self.stats.as_dict())

    async def _delete_stats(self, conn: _Conn, request: _Request) -> bool:
        self.stats = _Stats(active=self.stats.active)
        return await self._reply(conn, 200, self.stats.as_dict())

    # -- completions -------------------------------------------------------------------------------------

    async def _chat(self, conn: _Conn, request: _Request) -> bool:
        return await self._completion(conn, request, _Kind.CHAT)

    async def _cmpl(self, conn: _Conn, request: _Request) -> bool:
        return await self._completion(conn, request, _Kind.CMPL)

    async def _native(self, conn: _Conn, request: _Request) -> bool:
        return await self._completion(conn, request, _Kind.NATIVE)

    async def _completion(self, conn: _Conn, request: _Request, kind: _Kind) -> bool:
        self.stats.requests += 1
        try:
            knobs = self.config.knobs.merged(request.headers.get("x-fault", ""))
        except KnobError as exc:
            self.stats.rejected += 1
            return await self._reply(conn, 400, _error_body(str(exc), 400))
        body = self._json_body(request)
        plan = body if isinstance(body, bytes) else _plan(kind, knobs, body, self.config)
        if isinstance(plan, bytes):
            self.stats.rejected += 1
            await conn.send(plan)
            return True
        self.stats.active += 1
        try:
            outcome = await self._race(conn, produce(conn, plan, self.config.n_ctx))
        finally:
            self.stats.active -= 1
        if outcome is _Outcome.COMPLETED:
            self.stats.completed += 1
        elif outcome is _Outcome.CANCELLED:
            self.stats.cancelled += 1
            self.stats.last_cancel_at = time.monotonic()
        elif outcome is _Outcome.REJECTED:
            self.stats.rejected += 1
        else:
            self.stats.failed += 1
        return outcome not in (_Outcome.DIED, _Outcome.CANCELLED)

    async def _race(self, conn: _Conn, producer_coro: Awaitable[_Outcome]) -> _Outcome:
        """Run the response producer until it finishes or the client goes away, whichever is first."""
        producer = asyncio.ensure_future(producer_coro)
        watcher = asyncio.ensure_future(conn.wait_gone())
        try:
            done, _ = await asyncio.wait({producer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if producer in done:
                try:
                    return producer.result()
                except (ConnectionError, OSError):
                    return _Outcome.CANCELLED
            return _Outcome.CANCELLED
        finally:
            for task in (producer, watcher):
                task.cancel()
            await asyncio.gather(producer, watcher, return_exceptions=True)


async def serve(config: FaultEngineConfig | None = None) -> asyncio.Server:
    """Start a fault engine in the running loop; close it with ``server.close()``."""
    return await FaultEngine(config).start()


@contextlib.contextmanager
def run_in_thread(config: FaultEngineConfig | None = None) -> Iterator[str]:
    """Run a fault engine on its own event loop in a daemon thread; yields its base URL."""
    loop = asyncio.new_event_loop()
    engine = FaultEngine(config)
    ready = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(engine.start())
        except BaseException as exc:
            failure.append(exc)
            ready.set()
            loop.close()
            return
        ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(engine.aclose())
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    thread = threading.Thread(target=run, name="fault-engine", daemon=True)
    thread.start()
    if not ready.wait(timeout=30):
        raise RuntimeError("the fault engine did not start within 30 s")
    if failure:
        raise failure[0]
    try:
        yield engine.url
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
