"""The fake engines themselves: the fault engine against llama.cpp's wire shapes (engines.md §1), the SGLang
emulator (0.5.17 by default; the captured real 0.5.17 is replayed against it in tests/engines/test_emulator_fidelity.py)
over real sockets. Emulator tests use the fault engine as backend where
timing or failures must be controlled, and a real llama-server (tests/conftest.py) for real tokens.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import selectors
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fakes.fault_engine import EOS_ID, PIECES, FaultEngineConfig, Knobs
from fakes.fault_engine import run_in_thread as run_engine
from fakes.sglang_emulator import EmulatorConfig
from fakes.sglang_emulator import run_in_thread as run_emulator
from proxy.procs.process import free_port
from tests.helpers import wait_until

if TYPE_CHECKING:
    from proxy.embedded import LlamaServer

REPO = Path(__file__).resolve().parents[2]
MSGS = [{"role": "user", "content": "hello there"}]
TIMINGS_KEYS = {
    "cache_n",
    "prompt_n",
    "prompt_ms",
    "prompt_per_token_ms",
    "prompt_per_second",
    "predicted_n",
    "predicted_ms",
    "predicted_per_token_ms",
    "predicted_per_second",
}
CONTEXT_ERROR = re.compile(r"^The input \((\d+) tokens\) is longer than the model's context length \((\d+) tokens\)\.$")


# ----------------------------------------------------------------------------------------------------------
# helpers


@dataclass
class Raw:
    """One HTTP/1.1 exchange as bytes: the head, the body's chunk payloads (one per server write), and
    whether the chunked body was terminated properly."""

    status: int
    headers: dict[str, str]
    chunks: list[bytes]
    terminated: bool

    @property
    def events(self) -> list[str]:
        """SSE data payloads, comments dropped."""
        text = b"".join(self.chunks).decode()
        return [line[6:] for line in text.split("\n") if line.startswith("data: ")]

    def json_events(self) -> list[Any]:
        return [json.loads(e) for e in self.events if e != "[DONE]"]


def raw_post(url: str, path: str, body: Any, headers: dict[str, str] | None = None, timeout: float = 10.0) -> Raw:
    """POST with Connection: close and read until the server closes; no client-side framing magic."""
    parts = urlsplit(url)
    payload = json.dumps(body).encode()
    head = [f"POST {path} HTTP/1.1", f"Host: {parts.netloc}", "Content-Type: application/json"]
    head += [f"Content-Length: {len(payload)}", "Connection: close"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout) as sock:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
        data = bytearray()
        while chunk := sock.recv(65536):
            data += chunk
    return parse_raw(bytes(data))


def parse_raw(data: bytes) -> Raw:
    head, _, rest = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    if "chunked" not in headers.get("transfer-encoding", ""):
        return Raw(int(status_line.split()[1]), headers, [rest], True)
    chunks: list[bytes] = []
    terminated = False
    while rest:
        size_line, sep, rest = rest.partition(b"\r\n")
        if not sep:
            break
        size = int(size_line, 16)
        if size == 0:
            terminated = True
            break
        if len(rest) < size + 2:
            chunks.append(rest)  # cut short by the server
            break
        chunks.append(rest[:size])
        rest = rest[size + 2 :]
    return Raw(int(status_line.split()[1]), headers, chunks, terminated)


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": "whatever-the-client-says", "messages": MSGS, **extra}


def stats(url: str) -> dict[str, int]:
    out: dict[str, int] = httpx.get(f"{url}/_fake/stats").json()
    return out


@pytest.fixture
def engine() -> Iterator[str]:
    with run_engine(FaultEngineConfig(model="fake-llama", n_ctx=64, knobs=Knobs(tokens=3))) as url:
        yield url


# ----------------------------------------------------------------------------------------------------------
# fault engine: llama.cpp shapes


def test_chat_stream_matches_llama_cpp_event_by_event(engine: str) -> None:
    raw = raw_post(engine, "/v1/chat/completions", chat_body(stream=True, stream_options={"include_usage": True}))
    assert raw.status == 200
    assert raw.headers["content-type"] == "text/event-stream"
    assert raw.headers["transfer-encoding"] == "chunked"
    assert raw.terminated

    # the role chunk and the first token share one write; the finish and usage chunks share the last one
    first_write = raw.chunks[0].decode()
    assert first_write.count("data: ") == 2 and '"role":"assistant"' in first_write and '"Hello"' in first_write
    assert raw.chunks[-2].decode().count("data: ") == 2
    assert raw.chunks[-1] == b"data: [DONE]\n\n"

    role, *tokens, finish, usage = raw.json_events()
    assert raw.events[-1] == "[DONE]"
    assert list(role) == ["choices", "created", "id", "model", "system_fingerprint", "object"]
    assert role["choices"] == [{"finish_reason": None, "index": 0, "delta": {"role": "assistant", "content": None}}]
    assert [t["choices"][0]["delta"] for t in tokens] == [{"content": p} for p in PIECES[:3]]
    assert all(t["choices"][0]["finish_reason"] is None and "usage" not in t for t in tokens)
    assert finish["choices"] == [{"finish_reason": "stop", "index": 0, "delta": {}}]
    assert usage["choices"] == []
    # EOS counts as a generated token in llama.cpp
    assert usage["usage"] == {
        "completion_tokens": 4,
        "prompt_tokens": usage["usage"]["prompt_tokens"],
        "total_tokens": 4 + usage["usage"]["prompt_tokens"],
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert set(usage["timings"]) == TIMINGS_KEYS and usage["timings"]["predicted_n"] == 4
    assert all("timings" not in e for e in (role, *tokens, finish))
    for event in (role, *tokens, finish, usage):
        assert event["model"] == "fake-llama"  # the request's model is ignored
        assert event["id"] == role["id"] and event["id"].startswith("chatcmpl-")
        assert event["object"] == "chat.completion.chunk" and event["system_fingerprint"]


def test_without_include_usage_timings_ride_on_the_finish_chunk(engine: str) -> None:
    raw = raw_post(engine, "/v1/chat/completions", chat_body(stream=True, max_tokens=2))
    *_, finish = raw.json_events()
    assert finish["choices"][0]["finish_reason"] == "length"
    assert finish["timings"]["predicted_n"] == 2
    assert raw.events[-1] == "[DONE]"


def test_non_stream_chat_and_completions_shapes(engine: str) -> None:
    chat = httpx.post(f"{engine}/v1/chat/completions", json=chat_body(max_tokens=2)).json()
    assert chat["object"] == "chat.completion" and chat["model"] == "fake-llama"
    assert chat["choices"] == [
        {"finish_reason": "length", "index": 0, "message": {"role": "assistant", "content": "Hello world"}}
    ]
    assert chat["usage"]["completion_tokens"] == 2 and set(chat["timings"]) == TIMINGS_KEYS

    cmpl = httpx.post(f"{engine}/v1/completions", json={"prompt": "one two three"}).json()
    assert cmpl["object"] == "text_completion"
    assert cmpl["choices"][0] == {"text": "Hello world,", "index": 0, "logprobs": None, "finish_reason": "stop"}
    assert cmpl["usage"]["prompt_tokens"] == 4  # BOS + three words


def test_completions_stream_has_text_and_usage_on_the_final_event(engine: str) -> None:
    raw = raw_post(engine, "/v1/completions", {"prompt": "a b", "stream": True})
    *tokens, final = raw.json_events()
    assert [t["choices"][0]["text"] for t in tokens] == list(PIECES[:3])
    assert final["choices"][0]["finish_reason"] == "stop" and final["usage"]["completion_tokens"] == 4
    assert "timings" in final and raw.events[-1] == "[DONE]"


def test_native_completion_stream_ends_without_done(engine: str) -> None:
    raw = raw_post(engine, "/completion", {"prompt": "a b", "stream": True})
    *tokens, final = raw.json_events()
    assert [t["tokens_predicted"] for t in tokens] == [1, 2, 3]
    assert final["stop"] is True and final["stop_type"] == "eos" and final["tokens_predicted"] == 4
    assert "[DONE]" not in raw.events and raw.terminated


def test_multi_token_events_and_timings_per_token(engine: str) -> None:
    body = chat_body(stream=True, timings_per_token=True)
    raw = raw_post(engine, "/v1/chat/completions", body, {"x-fault": "tokens=7 multi=3"})
    role, *tokens, finish = raw.json_events()
    assert "timings" not in role  # timings sit on the last event of a write
    assert [t["choices"][0]["delta"]["content"] for t in tokens] == [
        "".join(PIECES[0:3]),
        "".join(PIECES[3:6]),
        PIECES[6],
    ]
    assert [t["timings"]["predicted_n"] for t in tokens] == [3, 6, 7]
    assert finish["timings"]["predicted_n"] == 8


def test_ping_comments_between_tokens(engine: str) -> None:
    raw = raw_post(engine, "/v1/chat/completions", chat_body(stream=True), {"x-fault": "ping,cadence_ms=5"})
    assert raw.chunks.count(b":\n\n") >= 3
    assert raw.events[-1] == "[DONE]"


def test_headers_go_out_before_the_first_token(engine: str) -> None:
    with httpx.Client(timeout=10) as client:
        t0 = time.perf_counter()
        with client.stream(
            "POST", f"{engine}/v1/chat/completions", json=chat_body(stream=True), headers={"x-fault": "ttft_ms=500"}
        ) as resp:
            t_headers = time.perf_counter() - t0
            next(resp.iter_raw())
            t_first = time.perf_counter() - t0
    assert t_headers < 0.3 < 0.45 < t_first


# ----------------------------------------------------------------------------------------------------------
# fault engine: faults


def test_die_after_closes_without_terminator(engine: str) -> None:
    raw = raw_post(engine, "/v1/chat/completions", chat_body(stream=True), {"x-fault": "tokens=10 die_after=2"})
    assert raw.status == 200 and not raw.terminated
    assert len(raw.json_events()) == 3  # role + 2 tokens
    assert "[DONE]" not in raw.events
    with pytest.raises(httpx.RemoteProtocolError):
        httpx.post(f"{engine}/v1/chat/completions", json=chat_body(stream=True), headers={"x-fault": "die_after=1"})
    wait_until(lambda: stats(engine)["failed"] == 2, timeout=5)


def test_malformed_event_then_the_stream_goes_on(engine: str) -> None:
    raw = raw_post(engine, "/v1/chat/completions", chat_body(stream=True), {"x-fault": "malformed_after=1"})
    assert b"data: {not json\n\n" in raw.chunks
    assert raw.events.index("{not json") == 2  # after role + first token
    assert raw.events[-1] == "[DONE]" and raw.terminated


def test_error_after_is_in_band_and_has_no_done(engine: str) -> None:
    raw = raw_post(engine, "/v1/chat/completions", chat_body(stream=True), {"x-fault": "error_after=2"})
    assert raw.status == 200 and raw.terminated
    *_, last = raw.json_events()
    assert set(last) == {"error"} and last["error"]["code"] == 500 and last["error"]["type"] == "server_error"
    assert "[DONE]" not in raw.events
    first = httpx.post(
        f"{engine}/v1/chat/completions", json=chat_body(stream=True), headers={"x-fault": "error_after=0"}
    )
    assert first.status_code == 500 and first.json()["error"]["type"] == "server_error"


def test_error_statuses_use_llama_cpp_bodies(engine: str) -> None:
    resp = httpx.post(f"{engine}/v1/chat/completions", json=chat_body(stream=True), headers={"x-fault": "status=503"})
    assert resp.status_code == 503
    assert resp.json() == {"error": {"code": 503, "message": "fault injected: status 503", "type": "unavailable_error"}}

    long_prompt = [{"role": "user", "content": "word " * 100}]
    resp = httpx.post(f"{engine}/v1/chat/completions", json={"messages": long_prompt, "stream": True})
    assert resp.status_code == 400  # before any header, so a plain JSON error even for a stream
    error = resp.json()["error"]
    assert error["type"] == "exceed_context_size_error" and error["n_ctx"] == 64 and error["n_prompt_tokens"] > 64
    assert error["message"].startswith(f"request ({error['n_prompt_tokens']} tokens) exceeds the available context")

    resp = httpx.post(f"{engine}/v1/chat/completions", json=chat_body(), headers={"x-fault": "no_such_knob=1"})
    assert resp.status_code == 400 and "no_such_knob" in resp.json()["error"]["message"]


def test_requests_are_recorded_and_can_be_cleared(engine: str) -> None:
    body = chat_body(temperature=0.25, seed=7)
    httpx.post(f"{engine}/v1/chat/completions", json=body, headers={"x-probe": "yes"})
    assert httpx.get(f"{engine}/_fake/requests").json() == [body]
    (full,) = httpx.get(f"{engine}/_fake/requests", params={"full": "1"}).json()
    assert full["path"] == "/v1/chat/completions" and full["headers"]["x-probe"] == "yes"
    httpx.delete(f"{engine}/_fake/requests")
    assert httpx.get(f"{engine}/_fake/requests").json() == []


def test_client_disconnect_mid_stream_counts_as_cancelled(engine: str) -> None:
    with (
        httpx.Client(timeout=10) as client,
        client.stream(
            "POST",
            f"{engine}/v1/chat/completions",
            json=chat_body(stream=True),
            headers={"x-fault": "tokens=1000 cadence_ms=20"},
        ) as resp,
    ):
        chunks = resp.iter_raw()  # dropping this iterator would close the response
        next(chunks)
        assert stats(engine)["active"] == 1
    wait_until(lambda: (s := stats(engine))["active"] == 0 and s["cancelled"] == 1, timeout=5)
    assert stats(engine)["completed"] == 0


@pytest.mark.parametrize("fault", ["hang", "hang_before_headers", "stall_after=1"])
def test_a_hung_request_is_cancelled_when_the_client_leaves(engine: str, fault: str) -> None:
    with _connect(engine) as sock:
        payload = json.dumps(chat_body(stream=True)).encode()
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"x-fault: {fault}\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        wait_until(lambda: stats(engine)["active"] == 1, timeout=5)
    wait_until(lambda: (s := stats(engine))["active"] == 0 and s["cancelled"] == 1, timeout=5)


def _connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return socket.create_connection((parts.hostname, parts.port), timeout=10)


def test_keep_alive_pipelining_and_a_broken_client(engine: str) -> None:
    with _connect(engine) as sock:
        payload = json.dumps(chat_body(max_tokens=1)).encode()
        post = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        # two requests in one write, then a third on the same connection
        sock.sendall(post + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = bytearray()
        while chunk := sock.recv(65536):
            data += chunk
    assert data.count(b"HTTP/1.1 200 OK") == 3
    assert data.count(b'{"status":"ok"}') == 2

    with _connect(engine) as sock:
        sock.sendall(b"\x16\x03\x01 not http at all\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 400")
    with _connect(engine) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{")  # then vanish
    assert httpx.get(f"{engine}/health").json() == {"status": "ok"}


def test_info_endpoints_look_like_llama_cpp(engine: str) -> None:
    props = httpx.get(f"{engine}/props").json()
    assert props["default_generation_settings"]["n_ctx"] == 64 and "params" in props["default_generation_settings"]
    assert {"total_slots", "model_path", "build_info"} <= set(props)
    models = httpx.get(f"{engine}/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "fake-llama"
    assert models["data"][0]["owned_by"] == "llamacpp" and models["models"][0]["name"] == "fake-llama"
    slots = httpx.get(f"{engine}/slots").json()
    assert len(slots) == props["total_slots"] and not any(s["is_processing"] for s in slots)
    assert httpx.get(f"{engine}/metrics").status_code == 501
    assert httpx.get(f"{engine}/nope").status_code == 404


def test_cli_prints_a_ready_line_and_serves() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "fakes.fault_engine", "--port", "0", "--tokens", "2", "--model", "cli-model"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert proc.stdout is not None
        line = _readline(proc.stdout, timeout=20)
        match = re.fullmatch(r"READY (http://127\.0\.0\.1:\d+)\n", line)
        assert match, line
        chat = httpx.post(f"{match[1]}/v1/chat/completions", json=chat_body(), timeout=10).json()
        assert chat["model"] == "cli-model" and chat["usage"]["completion_tokens"] == 3
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()
    assert proc.returncode == 0


def _readline(stream: Any, timeout: float) -> str:
    with selectors.DefaultSelector() as sel:
        sel.register(stream, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise TimeoutError("no output")
    line: str = stream.readline()
    return line


# ----------------------------------------------------------------------------------------------------------
# SGLang emulator


RID = re.compile(r"[0-9a-f]{32}")
STREAM_KEYS = ["id", "object", "created", "model", "choices"]
CHOICE_KEYS = ["index", "delta", "logprobs", "finish_reason", "matched_stop"]


@contextlib.contextmanager
def emulate(backend: str, **options: Any) -> Iterator[str]:
    with run_emulator(EmulatorConfig(backend=backend, served_model_name="tiny", **options)) as url:
        yield url


def sglang_body(**extra: Any) -> dict[str, Any]:
    return {"model": "client-model", "messages": MSGS, "temperature": 0, "max_tokens": 8, **extra}


def prompt_tokens(url: str, messages: list[dict[str, str]]) -> int:
    count: int = httpx.post(f"{url}/v1/tokenize", json={"model": "tiny", "messages": messages}).json()["count"]
    return count


def test_emulator_chat_stream_matches_sglang_event_by_event(llama_server: LlamaServer) -> None:
    with emulate(llama_server.url) as url:
        raw = raw_post(url, "/v1/chat/completions", sglang_body(stream=True, stream_options={"include_usage": True}))
        n_prompt = prompt_tokens(url, MSGS)
    assert raw.status == 200 and raw.headers["content-type"].startswith("text/event-stream")
    assert raw.events[-1] == "[DONE]"
    role, *contents, finish, usage = raw.json_events()
    rid = role["id"]
    assert RID.fullmatch(rid)
    for event in (role, *contents, finish, usage):
        assert list(event) == STREAM_KEYS + (["usage"] if event is usage else [])
        assert event["id"] == rid and event["model"] == "client-model"  # echoes the request's model
        assert event["object"] == "chat.completion.chunk"
    for event in (role, *contents, finish):
        assert len(event["choices"]) == 1 and list(event["choices"][0]) == CHOICE_KEYS
    assert role["choices"][0] == {
        "index": 0,
        "delta": {"reasoning_content": None, "role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
        "matched_stop": None,
    }
    assert 1 <= len(contents) <= 8
    for event in contents:
        choice = event["choices"][0]
        assert list(choice["delta"]) == ["reasoning_content", "content"] and choice["delta"]["content"]
        assert choice["delta"]["reasoning_content"] is None and choice["finish_reason"] is None
    assert finish["choices"][0] == {
        "index": 0,
        "delta": {"reasoning_content": None},
        "logprobs": None,
        "finish_reason": "length",
        "matched_stop": None,
    }
    assert usage["choices"] == []
    assert usage["usage"] == {
        "prompt_tokens": n_prompt,
        "total_tokens": n_prompt + 8,
        "completion_tokens": 8,
        "prompt_tokens_details": None,
        "reasoning_tokens": 0,
    }  # 0.5.17 sends no completion_tokens_details


def test_emulator_non_stream_chat_and_completions(llama_server: LlamaServer) -> None:
    with emulate(llama_server.url, enable_cache_report=True) as url:
        chat = httpx.post(f"{url}/v1/chat/completions", json=sglang_body(), timeout=30).json()
        raw = raw_post(url, "/v1/completions", {"model": "m", "prompt": "Once upon", "max_tokens": 4, "stream": True})
        cmpl = httpx.post(f"{url}/v1/completions", json={"prompt": "Once upon", "max_tokens": 4}, timeout=30).json()
    assert list(chat) == ["id", "object", "created", "model", "choices", "usage", "metadata"]
    assert chat["object"] == "chat.completion" and chat["model"] == "client-model"
    (choice,) = chat["choices"]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["message"]["reasoning_content"] is None
    assert (choice["finish_reason"], choice["matched_stop"]) == ("length", None)
    assert chat["usage"]["completion_tokens"] == 8
    assert list(chat["usage"]["prompt_tokens_details"]) == ["cached_tokens"]  # --enable-cache-report

    *chunks, done = raw.events
    assert done == "[DONE]"
    events = [json.loads(c) for c in chunks]
    assert all(e["object"] == "text_completion" and e["usage"] is None for e in events)
    assert [e["choices"][0]["finish_reason"] for e in events][-1] == "length"
    assert events[-1]["choices"][0]["text"]  # the last token's text rides with the finish reason
    assert cmpl["model"] == "default" and cmpl["usage"]["completion_tokens"] == 4


def test_emulator_stop_string_is_matched_stop(llama_server: LlamaServer) -> None:
    with emulate(llama_server.url) as url:
        greedy = httpx.post(f"{url}/v1/chat/completions", json=sglang_body(), timeout=30).json()
        text = greedy["choices"][0]["message"]["content"]
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        stopped = httpx.post(f"{url}/v1/chat/completions", json=sglang_body(stop=[stop]), timeout=30).json()
    (choice,) = stopped["choices"]
    assert (choice["finish_reason"], choice["matched_stop"]) == ("stop", stop)
    assert text.startswith(choice["message"]["content"]) and stop not in choice["message"]["content"]


def test_emulator_context_too_long_is_a_400_even_for_streams(llama_server: LlamaServer) -> None:
    long_messages = [{"role": "user", "content": "one two three four five six " * 8}]
    with emulate(llama_server.url, context_length=32) as url:
        n_prompt = prompt_tokens(url, long_messages)
        resp = httpx.post(f"{url}/v1/chat/completions", json=sglang_body(messages=long_messages, stream=True))
    assert resp.status_code == 400 and resp.headers["content-type"] == "application/json"
    body = resp.json()
    assert body == {
        "object": "error",
        "message": body["message"],
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    match = CONTEXT_ERROR.fullmatch(body["message"])
    assert match and (int(match[1]), int(match[2])) == (n_prompt, 32)


def test_emulator_rejects_a_colon_model_unless_it_is_the_served_name(llama_server: LlamaServer) -> None:
    config = EmulatorConfig(backend=llama_server.url, served_model_name="org/tiny:q4")
    with run_emulator(config) as url:
        for stream in (False, True):
            resp = httpx.post(f"{url}/v1/chat/completions", json=sglang_body(model="qwen2.5:7b", stream=stream))
            assert resp.status_code == 400
            assert resp.json()["message"].startswith("LoRA adapter '7b' was requested, but LoRA is not enabled.")
        ok = httpx.post(f"{url}/v1/chat/completions", json=sglang_body(model="org/tiny:q4"), timeout=30)
        assert ok.status_code == 200 and ok.json()["model"] == "org/tiny:q4"


def test_emulator_validation_errors(llama_server: LlamaServer) -> None:
    with emulate(llama_server.url) as url:
        missing = httpx.post(f"{url}/v1/chat/completions", json={"model": "m"})
        empty = httpx.post(f"{url}/v1/chat/completions", json=sglang_body(messages=[]))
        not_json = httpx.post(f"{url}/v1/chat/completions", content=b"{}", headers={"content-type": "text/plain"})
        bad_type = httpx.post(f"{url}/v1/chat/completions", json=sglang_body(max_tokens="many"))
    assert missing.status_code == 400 and missing.json()["type"] == "Bad Request"
    assert "messages" in missing.json()["message"]
    assert empty.status_code == 400 and empty.json()["message"] == "Messages cannot be empty."
    assert not_json.status_code == 400 and not_json.json()["type"] == "Bad Request"
    assert bad_type.status_code == 400 and "max_tokens" in bad_type.json()["message"]


def test_emulator_queue_of_zero_rejects_every_request(llama_server: LlamaServer) -> None:
    with emulate(llama_server.url, max_queued_requests=0) as url:
        plain = httpx.post(f"{url}/v1/chat/completions", json=sglang_body())
        raw = raw_post(url, "/v1/chat/completions", sglang_body(stream=True))
    assert plain.status_code == 503
    assert plain.json() == {
        "object": "error",
        "message": "The request queue is full.",
        "type": "503",
        "param": None,
        "code": 503,
    }
    assert raw.status == 200  # the first "chunk" of the stream is the abort
    (error,) = raw.json_events()
    assert error == {
        "error": {
            "object": "error",
            "message": "The request queue is full.",
            "type": "SERVICE_UNAVAILABLE",
            "param": None,
            "code": 503,
        }
    }
    assert raw.events[-1] == "[DONE]"


def test_emulator_info_endpoints_and_metrics(llama_server: LlamaServer) -> None:
    with emulate(llama_server.url, enable_metrics=True) as url:
        health = httpx.get(f"{url}/health", timeout=30)
        assert (health.status_code, health.content) == (200, b"")
        assert httpx.get(f"{url}/ready").status_code == 404  # 0.5.17
        info = httpx.get(f"{url}/server_info").json()
        assert info["version"] == "0.5.17" and info["served_model_name"] == "tiny"
        assert info["context_length"] is None and info["max_running_requests"] is None  # not on the command line
        (state,) = info["internal_states"]
        backend = httpx.get(f"{llama_server.url}/props").json()
        assert state["effective_max_running_requests_per_dp"] == backend["total_slots"]
        assert info["max_total_num_tokens"] == backend["default_generation_settings"]["n_ctx"] * backend["total_slots"]
        assert httpx.get(f"{url}/get_server_info").json()["version"] == "0.5.17"
        assert httpx.get(f"{url}/model_info").json()["model_path"] == backend["model_path"]
        t0 = int(time.time())
        models = httpx.get(f"{url}/v1/models").json()
        created = models["data"][0]["created"]  # the second it answered: read once, never from a second call
        assert isinstance(created, int) and t0 <= created <= int(time.time())
        assert models == {
            "object": "list",
            "data": [
                {
                    "id": "tiny",
                    "object": "model",
                    "created": created,
                    "owned_by": "sglang",
                    "root": "tiny",
                    "parent": None,
                    "max_model_len": backend["default_generation_settings"]["n_ctx"],
                }
            ],
        }
        flushed = httpx.post(f"{url}/flush_cache")
        assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed.")
        raw_post(url, "/v1/chat/completions", sglang_body(stream=True))
        text = httpx.get(f"{url}/metrics").text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    stream_labels = (("engine_type", "unified"), ("is_streaming", "true"), ("model_name", "tiny"))
    assert samples[("sglang:time_to_first_token_seconds_count", stream_labels)] == 1
    assert samples[("sglang:e2e_request_latency_seconds_count", stream_labels)] == 1
    assert samples[("sglang:generation_tokens_total", stream_labels)] == 8
    itl = (("engine_type", "unified"), ("model_name", "tiny"))
    assert samples[("sglang:inter_token_latency_seconds_count", itl)] == 7  # one per token after the first
    gauge_labels = (*itl[:1], ("model_name", "tiny"), ("moe_ep_rank", "0"), ("pp_rank", "0"), ("tp_rank", "0"))
    assert samples[("sglang:num_running_reqs", gauge_labels)] == 0
    assert not any(name.endswith("_created") for name, _ in samples)


def test_emulator_metrics_only_when_enabled(llama_server: LlamaServer) -> None:
    with emulate(llama_server.url) as url:
        assert httpx.get(f"{url}/metrics").status_code == 404


@pytest.fixture
def slow_backend() -> Iterator[str]:
    with run_engine(FaultEngineConfig(model="fake-llama", knobs=Knobs(tokens=3))) as url:
        yield url


def test_emulator_sends_headers_only_with_the_first_token(slow_backend: str) -> None:
    with emulate(slow_backend) as url, httpx.Client(timeout=10) as client:
        t0 = time.perf_counter()
        with client.stream(
            "POST", f"{url}/v1/chat/completions", json=sglang_body(stream=True), headers={"x-fault": "ttft_ms=600"}
        ) as resp:
            t_headers = time.perf_counter() - t0
            first = next(resp.iter_raw())
            t_first = time.perf_counter() - t0
    assert t_headers >= 0.55  # llama.cpp itself would have sent them at once (test above)
    assert t_first - t_headers < 0.2 and b'"role":"assistant"' in first


def test_emulator_queue_counts_running_and_waiting_requests(slow_backend: str) -> None:
    with emulate(slow_backend, max_running_requests=1, max_queued_requests=1) as url, httpx.Client(timeout=10) as c:
        with contextlib.ExitStack() as stack:
            for _ in range(2):  # one running, one waiting: both admitted, both stall after a token
                resp = stack.enter_context(
                    c.stream(
                        "POST",
                        f"{url}/v1/chat/completions",
                        json=sglang_body(stream=True),
                        headers={"x-fault": "stall_after=1"},
                    )
                )
                assert resp.status_code == 200
            state = httpx.get(f"{url}/_emulator/state").json()
            assert (state["running"], state["waiting"]) == (1, 1)
            full = httpx.post(f"{url}/v1/chat/completions", json=sglang_body())
            assert full.status_code == 503 and full.json()["message"] == "The request queue is full."
            raw = raw_post(url, "/v1/chat/completions", sglang_body(stream=True))
            assert raw.status == 200 and raw.json_events()[0]["error"]["code"] == 503
        # the clients left: their backend requests are cancelled and the queue drains
        wait_until(lambda: stats(slow_backend)["cancelled"] == 2, timeout=10)
        wait_until(lambda: httpx.get(f"{url}/_emulator/state").json()["inflight"] == 0)
        assert httpx.post(f"{url}/v1/chat/completions", json=sglang_body()).status_code == 200


def test_emulator_backend_failure_mid_stream_ends_with_error_then_done(slow_backend: str) -> None:
    with emulate(slow_backend) as url:
        raw = raw_post(url, "/v1/chat/completions", sglang_body(stream=True), {"x-fault": "tokens=5 die_after=2"})
    assert raw.status == 200 and raw.events[-1] == "[DONE]"
    role, first, second, error = raw.json_events()
    assert role["choices"][0]["delta"]["role"] == "assistant"
    assert [first["choices"][0]["delta"]["content"], second["choices"][0]["delta"]["content"]] == list(PIECES[:2])
    assert error["error"]["code"] == 500 and error["error"]["type"] == "INTERNAL_SERVER_ERROR"
    assert raw.events[-2].startswith('{"error": {"object": "error"')  # json.dumps spacing, as SGLang


def test_emulator_eos_stop_reports_the_eos_token_id(slow_backend: str) -> None:
    with emulate(slow_backend) as url:
        body = httpx.post(f"{url}/v1/completions", json={"prompt": "a b", "max_tokens": 100}).json()
    (choice,) = body["choices"]
    assert choice["text"] == "".join(PIECES[:3])
    assert (choice["finish_reason"], choice["matched_stop"]) == ("stop", EOS_ID)
    assert body["usage"]["completion_tokens"] == 4  # the EOS token counts


def test_emulator_cli_prints_a_ready_line(slow_backend: str) -> None:
    port = free_port()
    argv = ["--port", str(port), "--backend", slow_backend, "--served-model-name", "cli-sglang"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "fakes.sglang_emulator", *argv],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert proc.stdout is not None
        assert _readline(proc.stdout, timeout=30) == f"READY http://127.0.0.1:{port}\n"
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"] == "cli-sglang"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()
    assert proc.returncode == 0
