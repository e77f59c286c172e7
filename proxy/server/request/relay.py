"""Upstream call and stream relay: the hot path.

Life of one attempt (``Attempt``):

1. ``open()`` sends the normalized body and waits for the upstream headers. Transport failures raise
   ``UpstreamError`` (502/504), so the caller can fall back or answer with an OpenAI-style error. Never
   re-sent to the same engine (it may have started generating); redirects are refused, not followed.
2. Engine error status -> the engine's body passes through with its status (SGLang's flat shape nested).
3. Streams: ``open()`` also waits for the first SSE event, so an error the engine puts in its first event
   (SGLang's "queue full" under HTTP 200) still becomes a proper HTTP error before any byte reaches the client.
4. ``relay(output)`` forwards each upstream read as soon as it holds whole events: ``_on_chunk`` runs inside the
   upstream connection's read callback (``h1._H1Response.pump``) and writes to the ``Output``
   (``proxy.server.request.output``: the client's socket, an ASGI send, a buffer, nowhere). Events pass as the bytes the
   engine sent, except the documented rewrites: ``"model":"<engine name>"`` -> the client's alias (a byte
   replace, no re-serialization), and the usage event is dropped when the client did not ask for usage.
   Comments (keep-alives) and events without a ``data:`` field pass untouched. One event is at most
   ``sse.MAX_EVENT_BYTES``; a non-stream body at most ``MAX_BODY_BYTES``.
5. After the first byte, a failure becomes one in-band ``data: {"error": ...}`` event, then the stream closes.
6. Whatever happens, ``finish()`` runs exactly once and emits one ``Result``; cancelled in any phase (the client
   hung up: ``Gateway.respond``'s watcher), ``close()`` closes the upstream so the engine stops.

Per chunk ``_on_chunk`` does: one ``perf_counter_ns`` (in the read callback, before any task switch), the framer
split, one ``orjson.loads`` per event (needed to tell token events from role/finish/usage events), at most a
``bytes.replace`` for the model name, and one write. Parsing never feeds the output: pass-through events are
forwarded as the bytes that arrived.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from proxy.errors import (
    TRANSPORT_ERRORS,
    UpstreamBroken,
    UpstreamError,
    error_body,
    from_transport_error,
    normalize_engine_error,
)
from proxy.normalize import Normalized
from proxy.server.record.result import Result
from proxy.server.request.llamatimings import timings_block
from proxy.server.request.output import DISCARD, BufferOutput, Output
from proxy.server.request.rewrite import ModelRewrite
from proxy.server.request.upstream import Engine, StreamClient, UpstreamResponse
from proxy.sse import DONE, Event, EventTooLarge, SSEFramer, encode_data
from proxy.stream import error_message, finish_reason_of, has_token, loads, text_of
from proxy.timing import EngineTimings, StreamTimer, StreamTiming, Usage, usage_from_json
from proxy.types import Endpoint, Outcome, Role

log = logging.getLogger("enginemeter.relay")


PATHS: dict[Endpoint, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
MAX_ERROR_BODY = 1 << 20
#: the largest non-stream body taken from an engine (a stream's events are bounded by ``sse.MAX_EVENT_BYTES``)
MAX_BODY_BYTES = 64 << 20


@dataclass
class Attempt:
    request_id: str
    endpoint: Endpoint
    engine: Engine
    #: the pool the request goes through: the engine's own, or the mirror's for a shadow copy
    streams: StreamClient
    role: Role
    model_label: str
    #: the model name the client sent; written back into every response chunk (None: leave as is)
    client_model: str | None
    norm: Normalized
    timer: StreamTimer
    on_result: Callable[[Result], None]
    collect_text: bool = False
    #: sent upstream with the request (``traceparent``/``tracestate``; set by ``Attempts.on_new`` hooks)
    extra_headers: dict[str, str] = field(default_factory=dict)
    #: add a proxy-measured llama.cpp-shaped ``timings`` block where the engine sends none (``llamatimings``)
    add_timings: bool = False
    #: bookkeeping that can wait until the request is on its way to the engine (``Attempts.new``): run once,
    #: right after the request is written, or when the attempt finishes if it never was
    deferred: Callable[[], None] | None = None
    #: ``LoopWatch.stalled_since`` of the serving process (None: not watched)
    stalled_since: Callable[[int], bool] | None = None

    response: UpstreamResponse | None = None
    status: int = 0
    outcome: Outcome | None = None
    error: str | None = None
    usage: Usage | None = None
    engine_timings: EngineTimings | None = None
    finish_reason: str | None = None
    saw_done: bool = False
    _text: list[str] = field(default_factory=list)
    _framer: SSEFramer = field(default_factory=SSEFramer)
    _first: list[Event] = field(default_factory=list)
    _first_t: int = 0
    #: ``"model"`` -> the client's alias in every event and body (``proxy.server.request.rewrite``)
    _rewrite: ModelRewrite = field(init=False)
    _error_body: bytes | None = None
    _out: Output = DISCARD
    _finished: bool = False
    _closed_upstream: bool = False
    reserialized: int = 0
    usage_stripped: int = 0
    #: the client's own x-request-id, sent on to the engine (pairing uses ``request_id``, the proxy's)
    client_request_id: str | None = None

    def __post_init__(self) -> None:
        self._rewrite = ModelRewrite(self.client_model)

    # ------------------------------------------------------------------------------------ opening

    async def open(self) -> None:
        """Send the request and wait for headers (and, for streams, the first event). Raises UpstreamError."""
        e = self.engine
        # orjson: a 3.4 MB prompt serializes in ~2 ms instead of ~20 ms of the event loop (other streams' gaps)
        try:
            content = orjson.dumps(self.norm.body)
        except TypeError:  # a type orjson does not know (a Mapping that is not a dict): the slow way
            content = json.dumps(self.norm.body, ensure_ascii=False).encode()
        headers = {
            "content-type": "application/json",
            "accept-encoding": "identity",
            "x-request-id": self.client_request_id or self.request_id,
        }
        if self.extra_headers:
            headers.update(self.extra_headers)
        path = PATHS[self.endpoint]
        self.timer.sent()
        # No retry on the same engine, ever: once the body may have been written the engine may be generating,
        # and a second copy would run twice. Stale kept-alive connections are avoided instead (the pool drops
        # idle ones before engines do, upstream.KEEPALIVE_EXPIRY_S); a failure here falls back to the route's
        # next engine, if any.
        try:
            self.response = await self.streams.post(path, content, headers, self._run_deferred)
        except TRANSPORT_ERRORS as exc:
            raise from_transport_error(exc, e.name) from exc
        self.timer.headers()
        self.status = self.response.status_code
        if 300 <= self.status < 400:
            # redirects are never followed (a POST re-sent elsewhere): an engine that redirects is misconfigured
            await self.response.aclose()
            raise UpstreamBroken(f"engine {e.name!r} answered with a redirect ({self.status}); not followed")
        if self.status >= 400 or not self.norm.stream:
            return
        raw = self.response.aiter_raw()
        try:
            try:
                while not self._first:
                    chunk = await anext(raw)
                    self._first_t = time.perf_counter_ns()
                    self._first = self._framer.feed(chunk)
            except StopAsyncIteration:
                raise UpstreamBroken(f"engine {e.name!r} closed the stream before its first event") from None
            except TRANSPORT_ERRORS as exc:
                raise from_transport_error(exc, e.name) from exc
            except EventTooLarge as exc:
                raise UpstreamBroken(f"engine {e.name!r}: {exc}") from exc
        except BaseException:
            # whatever ends the wait for the first event (an engine fault, a shadow's deadline, the client gone):
            # free the connection and its pool slot here, whoever the caller is
            await self.response.aclose()
            raise
        self.timer.t_first_read_ns = self._first_t
        first = self._first[0]
        if not first.is_comment and not first.is_done:
            try:
                doc = loads(first.data)
            except (ValueError, RecursionError):
                doc = None
            if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
                # an error as the very first event (SGLang queue full): a real HTTP error, before any byte
                code = doc["error"].get("code")
                self.status = code if isinstance(code, int) and 400 <= code < 600 else 502
                self._error_body = json.dumps(doc).encode()
                await self.response.aclose()

    def _run_deferred(self) -> None:
        d = self.deferred
        if d is not None:
            self.deferred = None
            try:
                d()
            except Exception:  # a metrics bug must never break the traffic
                log.exception("deferred bookkeeping of %s failed", self.request_id)

    @property
    def failed_status(self) -> bool:
        return self.status >= 400

    async def error_response_body(self) -> bytes:
        """The engine's error body (for a failed status), read with a bound and normalized."""
        if self._error_body is not None:
            body = self._error_body
        else:
            assert self.response is not None
            chunks: list[bytes] = []
            size = 0
            try:
                async for chunk in self.response.aiter_raw():
                    chunks.append(chunk)
                    size += len(chunk)
                    if size > MAX_ERROR_BODY:
                        break
            except TRANSPORT_ERRORS as exc:
                chunks.append(f"(error body cut short: {exc})".encode())
            finally:
                await self.response.aclose()
            body = b"".join(chunks)
        self.outcome = "engine_error"
        self.error = body[:500].decode(errors="replace")
        return normalize_engine_error(body, self.status)

    # ------------------------------------------------------------------------------ the events

    def _process(self, events: list[Event], t_ns: int) -> bytes:
        """The per-read hot path: timestamp tokens, rewrite, filter. Returns the bytes to forward (b"": none)."""
        if len(events) == 1:  # nearly every read: one event, no list to join
            return self._event(events[0], t_ns)
        return b"".join([self._event(ev, t_ns) for ev in events])

    def _event(self, ev: Event, t_ns: int) -> bytes:
        """One event read at ``t_ns``: the bytes to forward for it (b"": dropped)."""
        raw, data, is_comment = ev
        if is_comment or not data:
            return raw  # comments and events without a data field (event:/id:/retry:) pass as they are
        return self._data(raw, data, t_ns)

    def _data(self, raw: bytes, data: bytes, t_ns: int) -> bytes:
        """An event with a (non-empty) ``data`` field: ``[DONE]``, or a JSON object to check and maybe rewrite."""
        if data == DONE:
            self.saw_done = True
            return raw
        try:
            doc = orjson.loads(data)
        except orjson.JSONDecodeError:
            try:
                doc = loads(data)  # what orjson refuses and json takes (NaN, lone surrogates) parses the same
            except (ValueError, RecursionError) as exc:  # RecursionError: json's fallback on deep nesting
                raise UpstreamBroken(f"engine {self.engine.name!r} sent a malformed event: {data[:200]!r}") from exc
        if not isinstance(doc, dict):
            raise UpstreamBroken(f"engine {self.engine.name!r} sent a non-object event")
        if "error" in doc:
            self.outcome = "engine_error"
            self.error = error_message(doc) or "engine error"
            return raw
        choices = doc.get("choices")
        if isinstance(choices, list) and choices:
            if has_token(choices):
                self.timer.token(t_ns)
                if self.collect_text:
                    self._text.append(text_of(choices))
            self.finish_reason = finish_reason_of(choices) or self.finish_reason
        if "usage" in doc and doc["usage"] is not None:
            self.usage = usage_from_json(doc["usage"]) or self.usage
            if "timings" in doc:
                self.engine_timings = EngineTimings.from_json(doc["timings"])
            elif self.add_timings and not choices and self.norm.client_wants_usage:
                # once per stream: the final usage-only event (never vLLM's per-chunk continuous usage)
                return self._with_timings(doc)
            if not self.norm.client_wants_usage:
                self.usage_stripped += 1
                if not choices:
                    return b""  # the usage-only event: the client did not ask for it
                # usage on a content event (llama.cpp /v1/completions): drop the key, re-serialize
                doc.pop("usage")
                if self.client_model is not None and "model" in doc:
                    doc["model"] = self.client_model
                self.reserialized += 1
                return encode_data(json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode())
        elif "timings" in doc:
            self.engine_timings = EngineTimings.from_json(doc["timings"])
        return self._rewrite.apply(raw, doc)

    # ------------------------------------------------------------------------------------ relaying

    def _on_chunk(self, chunk: bytes) -> bool:
        """One upstream read, in the connection's read callback: stamp, frame, process, write. True: flush."""
        t = time.perf_counter_ns()
        data = self._framer.whole(chunk)
        if data:  # nearly every read: one whole event, the read its raw bytes
            out = self._data(chunk, data, t)
        else:
            events = self._framer.feed(chunk)
            if not events:
                return False
            out = self._process(events, t)
        return self._out.write(out) if out else False

    async def relay(self, output: Output) -> None:
        """Relay the rest of the stream to ``output``. Holds the upstream response; closes it and emits the Result
        in ``finally``. Raises only cancellation (the client went away)."""
        assert self.response is not None
        self._out = output
        try:
            try:
                data = self._process(self._first, self._first_t)
                self._first = []
                if data:
                    if output.write(data):
                        await output.flush()
                    if not isinstance(output, BufferOutput):  # HTTP/1.0: the first byte goes with the last
                        self.timer.first_byte()
                else:
                    await output.flush()  # nothing to send yet: a head held for the first chunk goes alone
                await self.response.pump(self._on_chunk, output)
                await output.flush()
                if self.outcome is None and not self.saw_done and self.finish_reason is None:
                    raise UpstreamBroken(f"engine {self.engine.name!r} ended the stream before finishing")
                if self.outcome is None:
                    self.outcome = "ok"
            except TRANSPORT_ERRORS as exc:
                raise from_transport_error(exc, self.engine.name) from exc
            except EventTooLarge as exc:
                raise UpstreamBroken(f"engine {self.engine.name!r}: {exc}") from exc
        except UpstreamError as exc:
            self.outcome = exc.outcome
            self.error = exc.message
            output.write(encode_data(json.dumps(error_body(exc.message, exc.type, exc.status)).encode()))
            await output.flush()
        except BaseException:
            # cancelled (client went away) or torn down: the upstream is closed below, freeing the slot.
            # A client that hangs up after [DONE] was relayed got the whole answer: that is "ok".
            if self.outcome is None:
                self.outcome = "ok" if self.saw_done else "client_disconnect"
            raise
        finally:
            self._out = DISCARD
            await self.close()

    async def close(self, outcome: Outcome = "client_disconnect", error: str | None = None) -> None:
        """Close the upstream response and emit the Result (``outcome`` unless one is set), if not done yet.
        Idempotent.

        Also the safety net for a relay that never started (the client left before the first send), and for an
        attempt cancelled while opening (the client hung up while queued or in prefill).
        """
        try:
            if self.response is not None:
                await self.response.aclose()
                self._closed_upstream = True
        finally:
            self.finish(outcome if self.outcome is None else None, error if self.outcome is None else None)

    async def read_body(self) -> bytes:
        """Non-stream: read the whole body, record usage/timings, rewrite the model. Raises UpstreamError."""
        assert self.response is not None
        chunks: list[bytes] = []
        size = 0
        try:
            async for chunk in self.response.aiter_raw():
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise UpstreamBroken(f"engine {self.engine.name!r} sent a body over {MAX_BODY_BYTES} bytes")
                chunks.append(chunk)
        except TRANSPORT_ERRORS as exc:
            raise from_transport_error(exc, self.engine.name) from exc
        finally:
            await self.response.aclose()
        body = b"".join(chunks)
        try:
            doc = loads(body)
        except (ValueError, RecursionError) as exc:
            raise UpstreamBroken(f"engine {self.engine.name!r} sent a malformed body") from exc
        if not isinstance(doc, dict):
            raise UpstreamBroken(f"engine {self.engine.name!r} sent a non-object body")
        self.usage = usage_from_json(doc.get("usage"))
        self.engine_timings = EngineTimings.from_json(doc.get("timings"))
        choices = doc.get("choices")
        if isinstance(choices, list) and choices:
            self.finish_reason = finish_reason_of(choices)
            if self.collect_text:
                self._text.append(text_of(choices))
        # a non-stream body has no token events: TTFT/TPOT stay unset; e2e and engine timings still count
        self.outcome = "ok"
        if self.add_timings and "timings" not in doc:
            return self._with_timings(doc, data=False)
        return self._rewrite.apply(body, doc, sse=False)

    def _with_timings(self, doc: dict[str, Any], *, data: bool = True) -> bytes:
        """``doc`` with the proxy-measured ``timings`` block, re-serialized (an SSE event when ``data``)."""
        doc["timings"] = timings_block(self.timer, self.usage, stream=data)
        if self.client_model is not None and "model" in doc:
            doc["model"] = self.client_model
        raw = json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()
        return encode_data(raw) if data else raw

    @property
    def finished(self) -> bool:
        """The attempt's one Result is out (``finish``), its upstream closed (``close``) or never opened."""
        return self._finished and (self.response is None or self._closed_upstream)

    def finish(self, outcome: Outcome | None = None, error: str | None = None) -> Result | None:
        """Emit the one Result of this attempt. Idempotent."""
        if self._finished:
            return None
        self._finished = True
        self.timer.done()
        self._run_deferred()
        if outcome is not None:
            self.outcome = outcome
        if error is not None:
            self.error = error
        timing = StreamTiming.derive(self.timer, self.usage, self.engine_timings)
        result = Result(
            request_id=self.request_id,
            client_request_id=self.client_request_id,
            engine=self.engine.name,
            engine_kind=self.engine.effective_kind,
            role=self.role,
            model=self.model_label,
            endpoint=self.endpoint,
            stream=self.norm.stream,
            outcome=self.outcome or "upstream_broken",
            status=self.status,
            timing=timing,
            usage=self.usage,
            engine_timings=self.engine_timings,
            finish_reason=self.finish_reason,
            n_token_events=self.timer.n_token_events,
            greedy=self.norm.greedy,
            text="".join(self._text) if self.collect_text else None,
            text_ends=tuple(itertools.accumulate(map(len, self._text))) if self.collect_text else None,
            error=self.error,
            usage_stripped=self.usage_stripped,
            reserialized=self.reserialized + self._rewrite.reserialized,
            loop_stalled=self.stalled_since is not None and self.stalled_since(self.timer.t_received_ns),
        )
        try:
            self.on_result(result)
        except Exception:  # a metrics/comparison bug must never break the traffic
            log.exception("recording the result of %s failed", self.request_id)
        return result
