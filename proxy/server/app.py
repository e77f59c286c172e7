"""The gateway: one generation request, top to bottom like its life:

receive -> authenticate -> read body (bounded in size and time) -> parse (orjson)
        -> route -> [mirror copy] -> normalize -> open upstream (fallback while nothing was sent)
        -> relay stream / body -> one Result each

From the end of the body on, a watcher waits on ``receive()``: a client that hangs up in any phase cancels the
attempt, which closes the upstream connection (``Gateway.respond``, ``proxy.server.request.hangup``). The
generation routes are raw ASGI apps for that reason: they own ``receive`` for the whole request. Their routes,
the lifespan and the fast path past Starlette are ``proxy.server.asgi``'s.

The request's clock starts when the server parsed its head (``proxy.server.record.loopwatch``), and every answer carries
the proxy's share of the time as ``Server-Timing`` (``proxy.server.request.responses``).

The stages are the ``Gateway``'s typed fields; ``proxy.server.compose.build_app`` (the composition root) builds them.
None of them imports this module: each gets the narrow things it needs (engines, metrics, ``Attempts``).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
import orjson
from prometheus_client import CollectorRegistry
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from proxy.config.settings import Settings
from proxy.errors import (
    BadRequest,
    PayloadTooLarge,
    ProxyError,
    RequestTimeout,
    Unauthorized,
    UpstreamError,
)
from proxy.gpu.monitor import GpuMonitor
from proxy.server.mirror.shadows import Mirror
from proxy.server.observe.enginestate import EngineStatePoller
from proxy.server.observe.inflight import TrafficProfile
from proxy.server.observe.livediagnosis import LiveDiagnosis
from proxy.server.record.context import current
from proxy.server.record.loopwatch import LoopWatch
from proxy.server.record.metrics import Metrics
from proxy.server.record.result import new_request_id
from proxy.server.request.attempts import Attempts, Failed, Streaming, run_attempt
from proxy.server.request.hangup import ClientGone, guarded
from proxy.server.request.responses import RelayResponse, error_response, scope_timer, server_timing
from proxy.server.request.routing import Dispatch, Router
from proxy.server.request.upstream import Engine, make_client
from proxy.server.switch.rollouts import Rollouts
from proxy.server.switch.swapqueue import Mark, SwapUnavailable
from proxy.server.switch.swaps import Swaps
from proxy.timing import StreamTimer
from proxy.types import Endpoint, Outcome

log = logging.getLogger("enginemeter")

#: a request body must arrive within this long once its headers are in (a slow-body client is cut off: 408)
BODY_TIMEOUT_S = 30.0
#: orjson serializes at most this many levels of nesting
MAX_DEPTH = 254
#: the longest client x-request-id echoed and sent on
MAX_CLIENT_ID = 200


def parse_body(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object, or ``BadRequest``. orjson refuses what an engine must never see and
    Python's json would let through or choke on: NaN/Infinity, lone surrogates (``\\ud800``), nesting past
    1,024 levels (a RecursionError, i.e. a plain-text 500, in ``json``); what parses must also serialize again
    (the body goes on to the engine), which bounds nesting at orjson's 254 levels."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    # nesting deeper than orjson writes needs that many brackets: count them (C speed) before serializing
    if raw.count(b"[") + raw.count(b"{") >= MAX_DEPTH:
        try:
            orjson.dumps(body)
        except orjson.JSONEncodeError:
            raise BadRequest("request body is nested too deeply") from None
    return body


def make_engines(settings: Settings) -> dict[str, Engine]:
    return {e.name: Engine(settings=e, client=make_client(e)) for e in settings.engines}


@dataclass
class Gateway:
    """Everything a request needs, each collaborator a typed field; built once per app (``build_app``)."""

    settings: Settings
    registry: CollectorRegistry
    metrics: Metrics
    router: Router
    engines: dict[str, Engine]
    attempts: Attempts
    #: the mirroring stage; None: no shadow copies, /admin/mirror answers 404
    mirror: Mirror | None = None
    #: the routes' rollouts (``proxy.server.switch.rollouts``); None: no route has one, /admin/rollout answers 404
    rollouts: Rollouts | None = None
    #: the routes' swaps (``proxy.server.switch.swaps``): the hold queue, the phase; None: no route has one
    swaps: Swaps | None = None
    gpu: GpuMonitor | None = None
    engine_state: EngineStatePoller | None = None
    #: the live diagnosis of local llama.cpp engines (``proxy.server.observe.livediagnosis``)
    diagnosis: LiveDiagnosis | None = None
    #: the event loop's lag, queue and GC pauses (``proxy.server.record.loopwatch``); None: not watched
    loop_watch: LoopWatch | None = None
    #: time at each number of requests in flight (``proxy.server.observe.inflight``); None: not recorded
    traffic: TrafficProfile | None = None
    #: /health sections of collectors that run in another process (``serve --workers``: worker 0's snapshot)
    health_sections: Callable[[], dict[str, Any]] | None = None
    #: called once the app has shut down (``enginemeter serve`` stops its embedded engines here)
    on_shutdown: Sequence[Callable[[], None]] = ()
    body_timeout_s: float = BODY_TIMEOUT_S

    # ----------------------------------------------------------------------------- the request

    def authenticate(self, request: Request) -> None:
        keys = self.settings.api_keys
        if not keys:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        # an empty key in the config never matches (``api_keys: [""]`` is no way to switch auth off);
        # the comparison is constant-time per key
        ok = scheme.lower() == "bearer" and bool(token)
        ok = ok and any(k and hmac.compare_digest(token.encode(), str(k).encode()) for k in keys)
        if not ok:
            raise Unauthorized("missing or invalid API key")

    async def read_body(self, request: Request, receive: Receive) -> bytes:
        """The request body, bounded in size (``max_body_bytes``, 413) and time (``body_timeout_s``, 408).
        Raises ``ClientGone`` if the client hangs up first."""
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise PayloadTooLarge(f"request body is {declared} bytes; the limit is {limit}")
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.body_timeout_s):  # anyio's fail_after: ~3 % of a request's CPU (py-spy)
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        raise ClientGone()
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
                    if chunk:
                        chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            raise RequestTimeout(f"request body not received within {self.body_timeout_s:g} s") from None
        return b"".join(chunks)

    async def parse(self, raw: bytes) -> dict[str, Any]:
        """The body as a JSON object (``parse_body``), on the event loop. Not in a worker thread: orjson holds the
        GIL for the whole parse, so a thread stalled the loop just as long (measured: 110 ms either way for an
        11 MB document) and added a hop. A 3.5 MB prompt takes ~5 ms; ``max_body_bytes`` bounds it, and the
        stall shows in ``enginemeter_event_loop_lag_seconds``."""
        return parse_body(raw)

    @staticmethod
    def validate(body: dict[str, Any], endpoint: Endpoint) -> None:
        if "model" in body and not isinstance(body["model"], str):
            raise BadRequest("`model` must be a string", param="model")
        if "stream" in body and not isinstance(body["stream"], bool):
            raise BadRequest("`stream` must be a boolean", param="stream")
        if endpoint == "chat":
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise BadRequest("`messages` must be a non-empty array", param="messages")
        elif "prompt" not in body:
            raise BadRequest("`prompt` is required", param="prompt")
        for key in ("max_tokens", "max_completion_tokens", "n"):
            v = body.get(key)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise BadRequest(f"`{key}` must be a non-negative integer", param=key)
        for key in ("temperature", "top_p", "min_p", "top_k"):
            v = body.get(key)
            if v is not None and (not isinstance(v, int | float) or isinstance(v, bool)):
                raise BadRequest(f"`{key}` must be a number", param=key)

    async def generate(self, scope: Scope, receive: Receive, send: Send, endpoint: Endpoint) -> None:
        """One generation request, start to end (a raw ASGI handler: it owns ``receive``)."""
        timer = scope_timer(scope)
        request = Request(scope)
        # the proxy's own id pairs primary and shadow; a client's x-request-id is echoed and sent on to the
        # engine, never trusted to be unique
        request_id = new_request_id()
        client_id = request.headers.get("x-request-id")
        client_id = client_id[:MAX_CLIENT_ID] if client_id else None
        echo = {"x-request-id": client_id} if client_id else {}
        body: dict[str, Any] | None = None
        try:
            self.authenticate(request)
            raw = await self.read_body(request, receive)
            body = await self.parse(raw)
            self.validate(body, endpoint)
            user = body.get("user")
            decision = self.router.decide(body.get("model"), request.headers, user if isinstance(user, str) else None)
        except ClientGone:
            self.rejected(endpoint, body, "client_disconnect")
            return
        except ProxyError as exc:
            self.rejected(endpoint, body, "rejected")
            await error_response(exc, request_id, headers=echo, timer=timer)(scope, receive, send)
            return
        if decision.rollout is not None and (ctx := current()) is not None:
            ctx.rollout = decision.rollout  # the request's attempts, copies included, count for its rollout
        mirrored = False
        if self.mirror is not None and decision.shadows:
            mirrored = self.mirror.submit(decision, body, endpoint, request_id, client_id, timer.t_received_ns)
        await self.respond(scope, receive, send, request_id, client_id, endpoint, decision, body, timer, mirrored)

    async def respond(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        request_id: str,
        client_id: str | None,
        endpoint: Endpoint,
        decision: Dispatch,
        body: dict[str, Any],
        timer: StreamTimer,
        mirrored: bool,
    ) -> None:
        """Serve the primary while a watcher waits on ``receive()``: the client hanging up in any phase (queued,
        prefill, streaming, a non-stream wait) cancels the attempt at once, which closes the upstream connection
        so the engine stops working for nobody (counted ``client_disconnect``)."""
        response: Response | RelayResponse | None = None
        mark: Mark | None = None
        if self.traffic is not None:
            self.traffic.enter()
        try:
            guard = guarded(
                scope,
                receive,
                send,
                request_id,
                begun=lambda: response is not None,
                log=log,
                what="request",
                timer=timer,
            )
            async with guard as watch:
                if decision.swap is not None and self.swaps is not None:  # once per request: the swap's phase
                    try:
                        mark = await self.swaps.admit(decision.route, decision.engine if decision.pinned else None)
                    except asyncio.CancelledError:  # the client hung up while held: its one outcome
                        self.rejected(endpoint, body, "client_disconnect")
                        raise
                    except SwapUnavailable as exc:  # held past the bounds, or no engine (failed): the proxy's 503
                        self.rejected(endpoint, body, "rejected")
                        watch.disarm()
                        headers = {**({"x-request-id": client_id} if client_id else {}), **exc.headers}
                        await error_response(exc, request_id, headers=headers, timer=timer)(scope, receive, send)
                        return
                    decision = decision._replace(engines=(mark.engine,))
                response = await self.serve(
                    request_id, endpoint, decision, body, timer, collect_text=mirrored, client_id=client_id
                )
                if isinstance(response, RelayResponse):
                    response.on_end = watch.disarm
                else:
                    watch.disarm()  # a whole body: one write, nothing left to cancel
                await response(scope, receive, send)
                watch.answered = True
        finally:
            if mark is not None and self.swaps is not None:
                self.swaps.done(mark)
            if self.traffic is not None:
                self.traffic.leave()

    async def serve(
        self,
        request_id: str,
        endpoint: Endpoint,
        decision: Dispatch,
        body: dict[str, Any],
        timer: StreamTimer,
        collect_text: bool = False,
        client_id: str | None = None,
    ) -> Response | RelayResponse:
        """The primary: the first engine whose attempt is not a ``Failed`` (nor a 5xx with engines left) answers."""
        last_exc: UpstreamError | None = None
        echo = {"x-request-id": client_id} if client_id else {}
        for i, name in enumerate(decision.engines):
            if i > 0:
                timer = timer.retry()
            attempt = self.attempts.new(
                request_id=request_id,
                endpoint=endpoint,
                engine=self.engines[name],
                role="primary",
                body=body,
                timer=timer,
                collect_text=collect_text,
                client_request_id=client_id,
            )
            try:
                out = await run_attempt(attempt)
            except BaseException as exc:
                # cancelled (the client hung up) or a bug: close the upstream (the engine frees its slot) and
                # end the attempt with its one Result
                cancelled = isinstance(exc, anyio.get_cancelled_exc_class())
                with anyio.CancelScope(shield=True):
                    if cancelled:
                        await attempt.close("client_disconnect")
                    else:
                        await attempt.close("upstream_broken", f"proxy error: {exc!r}")
                raise
            headers = {"x-enginemeter-engine": name, "x-enginemeter-request-id": request_id, **echo}
            if isinstance(out, Streaming):
                return RelayResponse(attempt, headers)
            if isinstance(out, Failed):
                last_exc = out.error
                continue
            if out.engine_error and out.status >= 500 and i + 1 < len(decision.engines):
                continue
            headers["server-timing"] = server_timing(timer)
            return Response(out.body, status_code=out.status, headers=headers, media_type="application/json")
        assert last_exc is not None
        return error_response(last_exc, request_id, engine=decision.engines[-1], headers=echo, timer=timer)

    def rejected(self, endpoint: Endpoint, body: dict[str, Any] | None, outcome: Outcome) -> None:
        """A request that never reached an engine still ends in exactly one outcome (engine="none")."""
        stream = "true" if body is not None and body.get("stream") is True else "false"
        model = body.get("model") if body is not None else None
        label = self.attempts.model_label(model if isinstance(model, str) else None)
        self.metrics.requests.labels("none", label, "primary", stream, endpoint, outcome).inc()
