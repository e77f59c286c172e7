"""The SGLang emulator against real SGLang 0.5.17 (issue 11): every request ``scripts/gpu/capture.py`` sent to
the real server on the H200 is sent to the emulator, and the answers must have the captured structure — status,
content type, keys, value types, the order of stream events, error texts up to their numbers. Ids, timestamps,
token counts and generated text differ by nature and are not compared (except where a relation holds on both,
such as cached = prompt - 1 on a repeat).

Fast: the emulator runs over a ``fakes.fault_engine`` backend (word tokenizer, a fixed text), no llama-server.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fakes.fault_engine import FaultEngineConfig, Knobs
from fakes.fault_engine import run_in_thread as run_engine
from fakes.sglang_emulator import EmulatorConfig
from fakes.sglang_emulator import run_in_thread as run_emulator
from tests import captured
from tests.helpers import wait_until

REAL = captured.GPU["sglang"]
MODEL = "m7b"
HAIKU = [{"role": "user", "content": "Write a haiku about GPUs."}]
LONG = " ".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog near the river bank." for i in range(40))


def chat(stream: bool, messages: list[dict[str, str]], max_tokens: int, usage: bool = True) -> dict[str, Any]:
    """The request body of scripts/gpu/capture.py's ``chat``."""
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    if stream:
        body["stream"] = True
        if usage:
            body["stream_options"] = {"include_usage": True}
    return body


def shape(x: Any) -> Any:
    """The structure of a JSON value: keys (in order) and value types; a list by the shapes of its items."""
    if isinstance(x, dict):
        return {k: shape(v) for k, v in x.items()}
    if isinstance(x, list):
        return [shape(v) for v in x[:1]]
    if isinstance(x, bool):
        return "bool"
    if isinstance(x, int | float):
        return "number"
    return "null" if x is None else type(x).__name__


def sse(text: str) -> list[str]:
    return [line[6:] for line in text.split("\n") if line.startswith("data: ")]


def numbers_out(message: str) -> str:
    return re.sub(r"\d+", "N", message)


@pytest.fixture(scope="module")
def emulator() -> Iterator[str]:
    """SGLang 0.5.17 as started on the H200 (context 8192, --enable-metrics --enable-cache-report), over a fault
    engine that generates up to max_tokens (finish "length", as the captures)."""
    backend_config = FaultEngineConfig(model="fault", n_ctx=20000, knobs=Knobs(tokens=4096))
    with run_engine(backend_config) as backend:
        config = EmulatorConfig(
            backend=backend,
            served_model_name=MODEL,
            context_length=8192,
            enable_metrics=True,
            enable_cache_report=True,
            idle_metrics_s=0.3,
        )
        with run_emulator(config) as url:
            yield url


# ---- endpoints ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", list(captured.endpoints(REAL)))
def test_get_endpoints_answer_as_real_sglang(emulator: str, path: str) -> None:
    real = captured.endpoints(REAL)[path]
    got = httpx.get(f"{emulator}{path}", timeout=30)
    assert got.status_code == real.status
    assert got.headers.get("content-type") == real.content_type
    if path == "/metrics":
        return  # families: test_metric_families_are_real_ones
    if real.content_type == "application/json":
        want, have = real.json(), got.json()
        if path in ("/server_info", "/get_server_info"):
            check_server_info(want, have)
        else:
            assert shape(have) == shape(want)
    else:
        assert got.content == real.body == b""


def check_server_info(real: dict[str, Any], got: dict[str, Any]) -> None:
    assert list(got) == list(real)  # 465 keys: the server args, then status .. version, kv_events
    for key in ("max_running_requests", "max_total_tokens", "max_queued_requests", "status", "max_total_num_tokens",
                "max_req_input_len", "version", "context_length", "dtype", "quantization", "served_model_name"):  # fmt: skip
        assert shape(got[key]) == shape(real[key]), key
    assert (got["max_running_requests"], got["status"], got["version"]) == (None, "ready", "0.5.17")
    assert got["max_req_input_len"] == got["context_length"] - 6  # real: 8186 of 8192
    (state,) = got["internal_states"]
    (real_state,) = real["internal_states"]
    assert sorted(state) == sorted(real_state)
    assert shape(state["memory_usage"]) == shape(real_state["memory_usage"])
    assert state["memory_usage"]["token_capacity"] == got["max_total_num_tokens"]
    assert shape(state["effective_max_running_requests_per_dp"]) == "number"
    assert "num_running_reqs" not in state and "num_queue_reqs" not in state


def test_health_can_take_as_long_as_real_sglang_when_idle(emulator: str) -> None:
    """Real 0.5.17 took ~1.0 s for /health and /health_generate when idle; the emulator only with
    ``health_idle_s`` (default 0, so tests stay fast)."""
    real_s = captured.endpoints(REAL)["/health"].seconds
    assert real_s > 0.9
    t0 = time.perf_counter()
    assert httpx.get(f"{emulator}/health", timeout=10).status_code == 200
    assert time.perf_counter() - t0 < 0.9  # the real wait, and more, is not there by default (generous: a loaded CI)
    with run_engine(FaultEngineConfig(model="fault")) as backend:
        with run_emulator(EmulatorConfig(backend=backend, health_idle_s=0.6)) as url:
            t0 = time.perf_counter()
            r = httpx.get(f"{url}/health", timeout=10)
            assert (r.status_code, r.content) == (200, b"") and time.perf_counter() - t0 >= 0.55


# ---- chat and completions ----------------------------------------------------------------------------------


def events_of(text: str) -> tuple[list[dict[str, Any]], str]:
    *events, done = sse(text)
    return [json.loads(e) for e in events], done


def split_chat(events: list[dict[str, Any]]) -> tuple[Any, list[Any], Any, list[Any]]:
    """role chunk, content chunks, finish chunk, what follows (the usage chunk, if any)."""
    role, *rest = events
    i = next(i for i, e in enumerate(rest) if e["choices"] and e["choices"][0]["finish_reason"])
    return role, rest[:i], rest[i], rest[i + 1 :]


@pytest.mark.parametrize(("name", "usage", "max_tokens"), [("stream.sse", True, 24), ("stream_nousage.sse", False, 8)])
def test_chat_stream_event_by_event(emulator: str, name: str, usage: bool, max_tokens: int) -> None:
    real_events, real_done = events_of((REAL / name).read_text())
    headers = json.loads((REAL / "stream.headers.json").read_text())
    with httpx.stream("POST", f"{emulator}/v1/chat/completions", json=chat(True, HAIKU, max_tokens, usage)) as r:
        assert r.status_code == headers["status"]
        for h in ("content-type", "transfer-encoding"):
            assert r.headers.get(h) == headers["headers"][h], h
        got_events, got_done = events_of(r.read().decode())
    assert got_done == real_done == "[DONE]"
    real_role, real_contents, real_finish, real_tail = split_chat(real_events)
    role, contents, finish, tail = split_chat(got_events)
    assert role["choices"][0]["delta"] == real_role["choices"][0]["delta"]
    assert shape(role) == shape(real_role)
    assert contents and {json.dumps(shape(c)) for c in contents} == {json.dumps(shape(c)) for c in real_contents}
    assert shape(finish) == shape(real_finish)
    assert finish["choices"][0]["delta"] == real_finish["choices"][0]["delta"] == {"reasoning_content": None}
    assert finish["choices"][0]["finish_reason"] == real_finish["choices"][0]["finish_reason"] == "length"
    assert len(tail) == len(real_tail) == (1 if usage else 0)
    if usage:
        assert shape(tail[0]) == shape(real_tail[0])  # no completion_tokens_details, reasoning_tokens: 0
        assert tail[0]["choices"] == [] and tail[0]["usage"]["completion_tokens"] == max_tokens


def test_chat_non_stream(emulator: str) -> None:
    real = json.loads((REAL / "nonstream.json").read_text())
    headers = json.loads((REAL / "nonstream.headers.json").read_text())
    r = httpx.post(f"{emulator}/v1/chat/completions", json=chat(False, HAIKU, 24), timeout=30)
    assert r.status_code == headers["status"] and r.headers["content-type"] == headers["headers"]["content-type"]
    got = r.json()
    assert shape(got) == shape(real)  # "tool_calls": null, usage without completion_tokens_details
    assert got["choices"][0]["message"]["tool_calls"] is None


def test_completions_stream_and_non_stream(emulator: str) -> None:
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    real_events, _ = events_of((REAL / "completions.sse").read_text())
    with httpx.stream("POST", f"{emulator}/v1/completions", json=body | {"stream": True, "stream_options": {"include_usage": True}}) as r:  # fmt: skip
        got_events, done = events_of(r.read().decode())
    assert done == "[DONE]"
    *real_texts, real_usage = real_events
    *texts, usage = got_events
    assert {json.dumps(shape(e)) for e in texts} == {json.dumps(shape(e)) for e in real_texts}
    assert all(e["usage"] is None for e in texts)
    assert [bool(e["choices"][0]["finish_reason"]) for e in texts] == [False] * (len(texts) - 1) + [True]
    assert shape(usage) == shape(real_usage)
    real_whole = json.loads((REAL / "completions_nonstream.json").read_text())
    assert shape(httpx.post(f"{emulator}/v1/completions", json=body, timeout=30).json()) == shape(real_whole)


def test_cached_tokens_like_the_radix_cache(emulator: str) -> None:
    """Real 0.5.17: a never-seen prompt still hits the template prefix earlier requests left (4 of 901); a repeat
    hits all but its last token (900 of 901), streamed or not."""
    real = json.loads((REAL / "cached.json").read_text())
    real_stream = events_of((REAL / "cached_stream.sse").read_text())[0][-1]["usage"]
    assert 0 < real["first"]["prompt_tokens_details"]["cached_tokens"] < 10
    messages = [{"role": "user", "content": f"[sglang {time.time()}] {LONG}"}]
    httpx.post(f"{emulator}/v1/chat/completions", json=chat(False, HAIKU, 2), timeout=30)  # an earlier chat
    usages = [httpx.post(f"{emulator}/v1/chat/completions", json=chat(False, messages, 4), timeout=30).json()["usage"] for _ in range(2)]  # fmt: skip
    with httpx.stream("POST", f"{emulator}/v1/chat/completions", json=chat(True, messages, 4)) as r:
        stream_usage = events_of(r.read().decode())[0][-1]["usage"]
    for got, want in ((usages[0], real["first"]), (usages[1], real["second"]), (stream_usage, real_stream)):
        assert shape(got) == shape(want)
    n = usages[0]["prompt_tokens"]
    assert 0 < usages[0]["prompt_tokens_details"]["cached_tokens"] < n / 10
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] == n - 1
    assert stream_usage["prompt_tokens_details"]["cached_tokens"] == n - 1
    assert real["second"]["prompt_tokens_details"]["cached_tokens"] == real["second"]["prompt_tokens"] - 1


# ---- errors ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "words", "max_tokens", "stream"),
    [
        ("overflow_nonstream.txt", 9000, 16, False),
        ("overflow_stream.txt", 9000, 16, True),
        # the fake tokenizer counts one token a word (real: two for "hello "): as many words as real tokens
        ("overflow_max_tokens_nonstream.txt", 7240, 1000, False),
    ],
)
def test_context_errors(emulator: str, name: str, words: int, max_tokens: int, stream: bool) -> None:
    real = captured.http_record(REAL / name)
    messages = [{"role": "user", "content": "hello " * words}]
    r = httpx.post(f"{emulator}/v1/chat/completions", json=chat(stream, messages, max_tokens), timeout=60)
    assert r.status_code == real.status == 400
    assert r.headers["content-type"] == real.headers["content-type"]
    got, want = r.json(), real.json()
    assert shape(got) == shape(want)
    assert numbers_out(got["message"]) == numbers_out(want["message"])
    assert {k: v for k, v in got.items() if k != "message"} == {k: v for k, v in want.items() if k != "message"}


def test_unknown_model_is_served_and_echoed(emulator: str) -> None:
    real = captured.http_record(REAL / "bad_model.txt")
    r = httpx.post(f"{emulator}/v1/chat/completions", json=chat(False, HAIKU, 4) | {"model": "no-such-model"})
    assert r.status_code == real.status == 200
    assert shape(r.json()) == shape(real.json()) and r.json()["model"] == real.json()["model"] == "no-such-model"


def test_validation_error_text(emulator: str) -> None:
    real = captured.http_record(REAL / "bad_request.txt")
    r = httpx.post(f"{emulator}/v1/chat/completions", json={"model": MODEL, "messages": "not a list"})
    assert r.status_code == real.status == 400
    got, want = r.json(), real.json()
    assert shape(got) == shape(want) and got["type"] == want["type"] == "Bad Request"

    def where_out(message: str) -> str:  # the install path and line of http_server.py
        return re.sub(
            r'File ".*?/sglang/srt/entrypoints/http_server\.py", line \d+', "File HTTP_SERVER, line N", message
        )

    assert where_out(got["message"]) == where_out(want["message"])


# ---- metrics -----------------------------------------------------------------------------------------------


def families(text: str) -> dict[str, tuple[str, frozenset[str], frozenset[str]]]:
    """family -> (type, label names but ``le``, bucket bounds)"""
    out = {}
    for f in text_string_to_metric_families(text):
        labels = frozenset(k for s in f.samples for k in s.labels if k != "le")
        bounds = frozenset(s.labels["le"] for s in f.samples if "le" in s.labels)
        out[f.name] = (f.type, labels, bounds)
    return out


def test_metric_families_are_real_ones(emulator: str) -> None:
    """Every family the emulator serves exists in real 0.5.17 with the same type, labels and buckets; the two
    that only newer SGLang has are absent."""
    httpx.post(f"{emulator}/v1/chat/completions", json=chat(True, HAIKU, 8), timeout=30)
    real = families((REAL / "metrics_after.txt").read_text())
    got = families(httpx.get(f"{emulator}/metrics").text)
    assert set(got) <= set(real), set(got) - set(real)
    for name, (kind, labels, bounds) in got.items():
        assert (kind, labels) == real[name][:2], name
        if bounds:
            assert bounds == real[name][2], name
    for name in ("sglang:request_time_per_output_token_seconds", "sglang:num_aborted_requests"):
        assert name not in got and name not in real
    must = {"sglang:num_running_reqs", "sglang:time_to_first_token_seconds", "sglang:inter_token_latency_seconds",
            "sglang:e2e_request_latency_seconds", "sglang:prompt_tokens", "sglang:generation_tokens",
            "sglang:cached_tokens", "sglang:num_requests", "sglang:kv_used_tokens", "sglang:max_total_num_tokens"}  # fmt: skip
    assert must <= set(got)


def gauge(url: str, name: str) -> float:
    for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in f.samples:
            if s.name == name:
                return float(s.value)
    raise AssertionError(name)


def test_running_gauge_is_published_periodically_not_per_request() -> None:
    """Real 0.5.17: ``sglang:num_running_reqs`` stayed 0 five chunks into a live stream (disconnect.json): the
    scheduler publishes it at prefill (the count before the new request) and every 40 decode steps. The emulator
    too; its live count is on ``/_emulator/state``."""
    real = json.loads((REAL / "disconnect.json").read_text())
    assert (real["gauge"], real["before"], real["during"]) == ("sglang:num_running_reqs", 0.0, 0.0)
    with run_engine(FaultEngineConfig(model="fault", knobs=Knobs(tokens=200))) as backend:
        config = EmulatorConfig(backend=backend, enable_metrics=True, idle_metrics_s=30)
        with run_emulator(config) as url, httpx.Client(timeout=10) as c:
            body = chat(True, HAIKU, 200)
            with c.stream("POST", f"{url}/v1/chat/completions", json=body, headers={"x-fault": "stall_after=5"}) as r:
                chunks = r.iter_raw()  # kept: a dropped iterator closes the response
                next(chunks)
                wait_until(lambda: httpx.get(f"{url}/_emulator/state").json()["running"] == 1)
                assert gauge(url, "sglang:num_running_reqs") == 0  # as real 0.5.17, five chunks in
            with c.stream("POST", f"{url}/v1/chat/completions", json=body, headers={"x-fault": "stall_after=45"}) as r:
                lines = r.iter_lines()
                for _ in range(2 * 45):
                    next(lines)
                assert gauge(url, "sglang:num_running_reqs") == 1  # published at the 40th decode step
            # the client left: the idle scheduler sees its gauge is stale (1, none running) and republishes at once,
            # not after its 30 s idle window (0.5.17 metrics_reporter._maybe_log_idle_metrics, gauge_stale)
            wait_until(lambda: httpx.get(f"{url}/_emulator/state").json()["inflight"] == 0)
            wait_until(lambda: gauge(url, "sglang:num_running_reqs") == 0, timeout=5)


# ---- versions ----------------------------------------------------------------------------------------------


def test_version_0523_has_ready_and_its_own_shapes() -> None:
    with run_engine(FaultEngineConfig(model="fault", knobs=Knobs(tokens=3))) as backend:
        with run_emulator(EmulatorConfig(backend=backend, version="0.5.23", enable_metrics=True)) as url:
            assert httpx.get(f"{url}/ready").status_code == 200
            assert httpx.get(f"{url}/server_info").json()["version"] == "0.5.23"
            assert "served_model_name" in httpx.get(f"{url}/model_info").json()
            usage = httpx.post(f"{url}/v1/chat/completions", json=chat(False, HAIKU, 2)).json()["usage"]
            assert "completion_tokens_details" in usage
            assert "sglang:num_aborted_requests" in families(httpx.get(f"{url}/metrics").text)
        with run_emulator(EmulatorConfig(backend=backend, ready_endpoint=True)) as url:
            assert httpx.get(f"{url}/ready").status_code == 200  # 0.5.17 shapes, /ready forced on
    with pytest.raises(ValueError, match="not emulated"):
        EmulatorConfig(backend="http://x", version="0.4.0")


def test_prefix_cache_shares_prefixes_and_forgets_within_its_budget() -> None:
    from fakes.sglang_emulator.engine import _PrefixCache

    cache = _PrefixCache(capacity_tokens=10)
    assert cache.match_and_insert([1, 2, 3, 4]) == 0
    assert cache.match_and_insert([1, 2, 9]) == 2  # the shared prefix
    assert cache.match_and_insert([1, 2, 3, 4]) == 3  # a repeat: all but the last token
    assert cache.match_and_insert([7, 8, 9, 10, 11]) == 0  # 12 tokens held > 10: [1, 2, 9] goes (least recent)
    assert cache.match_and_insert([1, 2, 9]) == 2  # [1, 2] still held by [1, 2, 3, 4]; [1, 2, 3, 4] goes
    assert cache.match_and_insert([1, 2, 3, 5]) == 2
    cache.clear()
    assert cache.match_and_insert([1, 2, 3, 5]) == 0
