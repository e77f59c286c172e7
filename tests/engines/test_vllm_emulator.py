"""The vLLM 0.26 emulator (``python -m fakes.vllm_emulator``) in front of a real CPU llama-server: vLLM's command
line, its answers as captured on the H200 (tests/fixtures/engines/vllm-0.26.0/), enginemeter's vLLM dialect
recognising it, and vLLM's refusal to start when one request of ``--max-model-len`` does not fit the KV cache --
the path the GPU harness's vllm_fp8 arm retries (scripts/gpu/orchestrate.sh)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from proxy import engines
from proxy.embedded import LlamaServer
from tests.helpers import start_vllm_emulator, vllm_emulator

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures" / "engines" / "vllm-0.26.0"


#: vLLM's flags as the 27B plan launches it (scripts/gpu/plan27b.sh)
FLAGS = ("--model", "/tmp/w/model/m27b", "--served-model-name", "m27b", "--quantization", "fp8", "--load-format",
         "dummy", "--dtype", "bfloat16", "--attention-backend", "TRITON_ATTN", "--gpu-memory-utilization", "0.505",
         "--max-num-seqs", "64")  # fmt: skip


@pytest.fixture
def vllm(llama_server: LlamaServer) -> Iterator[str]:
    with vllm_emulator(llama_server.url, *FLAGS, "--max-model-len", "1024") as url:
        yield url


def test_endpoints_answer_as_vllm_0_26(vllm: str) -> None:
    captured = json.loads((FIX / "endpoints.json").read_text())
    for path in ("/health", "/ping", "/version", "/server_info", "/ready", "/props", "/slots", "/load"):
        r = httpx.get(vllm + path)
        assert r.status_code == captured[path]["status"], path
        if path in ("/health", "/ping"):
            assert r.content == b""
    assert httpx.get(vllm + "/version").json() == {"version": "0.26.0"}
    card = httpx.get(vllm + "/v1/models").json()["data"][0]
    real = json.loads(captured["/v1/models"]["body"])["data"][0]
    assert set(card) == set(real)
    assert (card["id"], card["max_model_len"], card["owned_by"], card["root"]) == (
        "m27b", 1024, "vllm", "/tmp/w/model/m27b")  # fmt: skip
    metrics = httpx.get(vllm + "/metrics").text
    assert 'gpu_memory_utilization="0.505"' in metrics and "vllm:num_requests_running{" in metrics


def test_enginemeter_detects_it_as_vllm(vllm: str) -> None:
    async def go() -> object:
        async with httpx.AsyncClient(base_url=vllm) as client:
            return await engines.detect(client, 5)

    assert asyncio.run(go()) == "vllm"


def test_stream_carries_finish_reason_on_the_last_content_chunk(vllm: str) -> None:
    body = {"model": "m27b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", vllm + "/v1/chat/completions", json=body, timeout=60) as r:
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    real = [json.loads(x[6:]) for x in (FIX / "stream.sse").read_text().splitlines() if x.startswith("data: {")]
    assert events[0]["choices"][0]["delta"] == real[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert set(events[0]) == set(real[0])
    last_content, usage = events[-2], events[-1]
    assert last_content["choices"][0]["finish_reason"] == "length" and last_content["choices"][0]["delta"]["content"]
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-2])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8
    assert set(usage["usage"]) == set(real[-1]["usage"])
    assert events[1]["id"].startswith("chatcmpl-") and {e["model"] for e in events} == {"m27b"}


def test_context_overflow_is_vllms_nested_400(vllm: str) -> None:
    body = {"model": "m27b", "messages": [{"role": "user", "content": "word " * 1200}], "max_tokens": 16}
    r = httpx.post(vllm + "/v1/chat/completions", json=body, timeout=60)
    real = json.loads((FIX / "overflow_nonstream.txt").read_text().split("\n\n", 1)[1])
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == set(real["error"]) and err["param"] == "input_tokens" and err["type"] == "BadRequestError"
    assert err["message"].startswith("This model's maximum context length is 1024 tokens.")


def test_refuses_to_start_when_one_request_does_not_fit_the_kv_cache(llama_server: LlamaServer) -> None:
    proc, _ = start_vllm_emulator(llama_server.url, *FLAGS, "--max-model-len", "4096", "--emulate-kv-tokens", "3000")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "To serve at least one request with the model's max seq len (4096)" in out
    assert "the estimated maximum model length is 3000" in out
    assert "non-default args:" in out and "'gpu_memory_utilization': 0.505" in out
