"""Engine dialects (``proxy.engines``) against the shapes each engine answers: fast, no engine process.

Each fake engine is an ``httpx.MockTransport`` over a table of answers: the real llama.cpp, SGLang 0.5.17 and
vLLM 0.26.0 of the H200 run (issue 11, ``tests/fixtures/engines/<kind>-<version>/``, read by ``tests.captured``),
a llama-server captured by scripts/capture_engine.py (``llamacpp-11434/``), and small hand-written tables for
what no capture holds (SGLang 0.5.23 and vLLM 0.33.0 as their sources answer, shared/reference/engines.md;
failures). What the dialects do against real processes (llama-server, the SGLang emulator) is in
tests/server/observe/test_enginestate.py; the proxy in front of the captures in tests/engines/test_captured_live.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from proxy import engines
from proxy.bench.run import benchconfig
from proxy.bench.run import targets as bench_engines
from proxy.config.settings import EngineSettings
from proxy.engines import quant_from_name, quant_key
from proxy.engines.sglang import HEALTH_GENERATE_TIMEOUT_S
from proxy.errors import normalize_engine_error
from proxy.server.request.upstream import Engine
from proxy.stream import read_event
from proxy.types import ENGINE_KINDS, EngineKind
from tests import captured as captures
from tests.captured import FIXTURES, GPU
from tests.helpers import run_uvicorn_app

T = TypeVar("T")
Answer = httpx.Response | Callable[[httpx.Request], httpx.Response]


class FakeEngine:
    """Answers ``(method, path)`` from a table (404 ``{"detail":"Not Found"}`` otherwise); records every call."""

    def __init__(self, table: Mapping[tuple[str, str], Answer]) -> None:
        self.table = dict(table)
        self.seen: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        a = self.table.get((request.method, request.url.path))
        if a is None:
            return httpx.Response(404, json={"detail": "Not Found"})
        return a(request) if callable(a) else a

    def paths(self) -> list[str]:
        return [r.url.path for r in self.seen]

    def run(self, fn: Callable[[httpx.AsyncClient], Coroutine[Any, Any, T]]) -> T:
        async def go() -> T:
            async with httpx.AsyncClient(base_url="http://engine.test", transport=httpx.MockTransport(self)) as c:
                return await fn(c)

        return asyncio.run(go())


def ok(doc: Any) -> httpx.Response:
    return httpx.Response(200, json=doc)


# ---- recorded shapes --------------------------------------------------------------------------------------

LLAMA_PROPS = {
    "default_generation_settings": {"n_ctx": 1024, "params": {}},
    "total_slots": 2,
    "model_alias": "tiny",
    "model_path": "/models/tiny-Q4_K_M.gguf",
    "model_ftype": "Q4_K - Medium",
    "build_info": "b11434-0c1e570",
}
LLAMA_SLOTS = [{"id": 0, "n_ctx": 1024, "is_processing": True}, {"id": 1, "n_ctx": 1024, "is_processing": False}]
MODELS_TINY = {"object": "list", "data": [{"id": "tiny", "object": "model", "owned_by": "llamacpp", "meta": {"ftype": 15}}]}  # fmt: skip

#: SGLang 0.5.17 on the H200 (tests/fixtures/engines/sglang-0.5.17/, cut down): the command line's server args
#: at the top level (max_running_requests null when not given), per-DP scheduler state with the effective value
#: and no running count
SGLANG_0517_INFO = {
    "model_path": "/tmp/m",
    "served_model_name": "tiny",
    "dtype": "bfloat16",
    "quantization": None,
    "context_length": 4096,
    "max_running_requests": None,
    "max_total_tokens": None,
    "enable_metrics": True,
    "status": "ready",
    "max_total_num_tokens": 5_400_000,
    "max_req_input_len": 4090,
    "internal_states": [
        {
            "attention_backend": "triton",
            "max_running_requests": None,
            "last_gen_throughput": 0.0,
            "memory_usage": {"weight": 13.5, "kvcache": 13.1, "token_capacity": 5_400_000},
            "effective_max_running_requests_per_dp": 4096,
        }
    ],
    "version": "0.5.17",
}
SGLANG_MODELS = {"object": "list", "data": [{"id": "tiny", "object": "model", "owned_by": "sglang", "root": "tiny", "parent": None, "max_model_len": 4096}]}  # fmt: skip
SGLANG_METRICS = '# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{engine_type="unified",model_name="tiny"} 2.0\n'  # fmt: skip
SGLANG_FLAT_OVERFLOW = {
    "object": "error",
    "message": "The input (5000 tokens) is longer than the model's context length (4096 tokens).",
    "type": "BadRequestError",
    "param": None,
    "code": 400,
}

VLLM_MODELS = {"object": "list", "data": [{"id": "tinyllama", "object": "model", "owned_by": "vllm", "root": "/tmp/m", "parent": None, "max_model_len": 4096, "permission": []}]}  # fmt: skip
VLLM_METRICS = '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0",model_name="tinyllama"} 3.0\n'  # fmt: skip
VLLM_OVERFLOW = {"error": {"message": "This model's maximum context length is 4096 tokens. However, your prompt contains 5000 input tokens.", "type": "BadRequestError", "param": "input_tokens", "code": 400}}  # fmt: skip


def llama_cpp() -> FakeEngine:
    return FakeEngine(
        {
            ("GET", "/props"): ok(LLAMA_PROPS),
            ("GET", "/slots"): ok(LLAMA_SLOTS),
            ("GET", "/v1/models"): ok(MODELS_TINY),
            ("GET", "/health"): ok({"status": "ok"}),
        }
    )


def sglang_0517() -> FakeEngine:
    return FakeEngine(
        {
            ("GET", "/server_info"): ok(SGLANG_0517_INFO),
            ("GET", "/get_server_info"): ok(SGLANG_0517_INFO),
            ("GET", "/model_info"): ok({"model_path": "/tmp/m", "is_generation": True}),
            ("GET", "/v1/models"): ok(SGLANG_MODELS),
            ("GET", "/health"): httpx.Response(200),
            ("GET", "/health_generate"): httpx.Response(200),
            ("GET", "/metrics"): httpx.Response(200, text=SGLANG_METRICS),
        }
    )


def vllm_0260() -> FakeEngine:
    return FakeEngine(
        {
            ("GET", "/version"): ok({"version": "0.26.0"}),
            ("GET", "/v1/models"): ok(VLLM_MODELS),
            ("GET", "/health"): httpx.Response(200),
            ("GET", "/ping"): httpx.Response(200),
            ("GET", "/metrics"): httpx.Response(200, text=VLLM_METRICS),
        }
    )


# ---- the registry -----------------------------------------------------------------------------------------


def test_every_kind_has_a_dialect_and_the_catch_all_is_last() -> None:
    assert tuple(engines.DIALECTS) == ENGINE_KINDS
    assert all(engines.dialect(k).kind == k for k in ENGINE_KINDS)
    assert engines.dialect(None).kind == "openai"
    assert list(engines.DIALECTS)[-1] == "openai" and not engines.DIALECTS["openai"].detect_paths


# ---- detection and probing --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fake", "kind"),
    [
        (llama_cpp(), "llamacpp"),
        (sglang_0517(), "sglang"),
        # SGLang before /server_info was renamed
        (FakeEngine({("GET", "/get_server_info"): ok({"version": "0.4.9"})}), "sglang"),
        (vllm_0260(), "vllm"),
        # vLLM in dev mode has a /server_info of its own: not SGLang
        (
            FakeEngine(
                {("GET", "/server_info"): ok({"vllm_config": "..."}), ("GET", "/version"): ok({"version": "0.33.0"})}
            ),
            "vllm",
        ),
        (FakeEngine({("GET", "/v1/models"): ok(MODELS_TINY)}), "openai"),
    ],
)
def test_detect(fake: FakeEngine, kind: EngineKind) -> None:
    assert fake.run(lambda c: engines.detect(c, 1.0)) == kind
    assert {r.method for r in fake.seen} == {"GET"}


def test_a_loading_engine_is_no_kind_yet() -> None:
    # llama-server answers every path with 503 while the model loads: it must not be taken for "openai"
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"error": {"message": "Loading model", "type": "unavailable_error", "code": 503}})  # fmt: skip

    fake = FakeEngine({(m, p): handler for m in ("GET",) for p in ("/props", "/server_info", "/get_server_info", "/version", "/v1/models")})  # fmt: skip
    assert fake.run(lambda c: engines.detect(c, 1.0)) is None
    p = fake.run(lambda c: engines.probe(c, 1.0))
    assert p.kind is None and "loading" in (p.error or "")


def test_probe_fills_only_what_is_missing() -> None:
    p = vllm_0260().run(lambda c: engines.probe(c, 1.0))
    assert (p.kind, p.model, p.context_length, p.error) == ("vllm", "tinyllama", 4096, None)
    fake = vllm_0260()
    p = fake.run(lambda c: engines.probe(c, 1.0, kind="vllm", model="declared"))
    assert (p.kind, p.model) == ("vllm", "declared")
    assert "/version" not in fake.paths()  # no detection when the kind is configured
    full = sglang_0517().run(lambda c: engines.probe(c, 1.0, full=True))
    assert full.facts is not None and (full.kind, full.model, full.facts.slots) == ("sglang", "tiny", 4096)
    # the state poll fails (a server_info it cannot read): the served model still comes from /v1/models
    broken = sglang_0517()
    broken.table[("GET", "/server_info")] = broken.table[("GET", "/get_server_info")] = httpx.Response(500)
    p = broken.run(lambda c: engines.probe(c, 1.0, kind="sglang", full=True))
    assert (p.model, p.context_length, p.facts) == ("tiny", 4096, None)
    assert p.error == "HTTP 500 from /get_server_info"


def test_probe_of_an_unreachable_engine_says_why() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    p = asyncio.run(_with(refuse, lambda c: engines.probe(c, 1.0)))
    assert p.kind is None and (p.error or "").startswith("ConnectError")


async def _with(handler: Callable[[httpx.Request], httpx.Response], fn: Callable[[httpx.AsyncClient], Coroutine[Any, Any, T]]) -> T:  # fmt: skip
    async with httpx.AsyncClient(base_url="http://engine.test", transport=httpx.MockTransport(handler)) as c:
        return await fn(c)


# ---- health -----------------------------------------------------------------------------------------------


def test_sglang_with_ready_never_calls_health() -> None:
    fake = sglang_0517()
    fake.table[("GET", "/ready")] = httpx.Response(200)
    h = fake.run(lambda c: engines.dialect("sglang").health(c, 1.0))
    assert (h.up, h.path, h.error) == (True, "/ready", None)
    fake.table[("GET", "/ready")] = httpx.Response(503)
    h = fake.run(lambda c: engines.dialect("sglang").health(c, 1.0))
    assert (h.up, h.path) == (False, "/ready") and "HTTP 503" in (h.error or "")
    assert "/health" not in fake.paths()  # /health generates a token: only where there is no /ready


def test_sglang_0517_without_ready_falls_back_to_health() -> None:
    fake = sglang_0517()  # /ready: 404
    h = fake.run(lambda c: engines.dialect("sglang").health(c, 1.0))
    assert (h.up, h.path, h.error) == (True, "/health", None)
    assert fake.paths() == ["/ready", "/health"]
    # /health polls its generation once a second: the 1 s budget of a cheap check is not enough for it
    timeout = fake.seen[-1].extensions["timeout"]
    assert timeout["read"] >= HEALTH_GENERATE_TIMEOUT_S
    # warming up: /health answers 503 until the warm-up generation is done
    fake.table[("GET", "/health")] = httpx.Response(503)
    h = fake.run(lambda c: engines.dialect("sglang").health(c, 1.0))
    assert (h.up, h.path) == (False, "/health") and "HTTP 503 from /health" in (h.error or "")


def test_health_of_llamacpp_loading_and_vllm_and_unreachable() -> None:
    loading = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
    fake = llama_cpp()
    fake.table[("GET", "/health")] = httpx.Response(503, json=loading)
    h = fake.run(lambda c: engines.dialect("llamacpp").health(c, 1.0))
    assert not h.up and h.error == "HTTP 503 from /health: Loading model"
    assert vllm_0260().run(lambda c: engines.dialect("vllm").health(c, 1.0)).up
    h = FakeEngine({("GET", "/v1/models"): ok(MODELS_TINY)}).run(lambda c: engines.dialect("openai").health(c, 1.0))
    assert (h.up, h.path) == (True, "/v1/models")

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    h = asyncio.run(_with(refuse, lambda c: engines.dialect("vllm").health(c, 1.0)))
    assert not h.up and (h.error or "").startswith("ConnectError")


def test_engine_check_reports_sglang_0517_up() -> None:
    """The proxy's /health said "HTTP 404 from /ready" for a healthy SGLang 0.5.17 (issue 11)."""
    fake = sglang_0517()

    async def go() -> dict[str, object]:
        es = EngineSettings(name="sglang", url="http://engine.test")
        client = httpx.AsyncClient(base_url=es.url, transport=httpx.MockTransport(fake))
        e = Engine(settings=es, client=client)
        try:
            return await e.check()
        finally:
            await client.aclose()

    got = asyncio.run(go())
    assert got["up"] is True and "error" not in got
    assert (got["kind"], got["model"]) == ("sglang", "tiny")


# ---- state ------------------------------------------------------------------------------------------------


def test_llamacpp_state() -> None:
    f = llama_cpp().run(lambda c: engines.dialect("llamacpp").poll(c, 1.0))
    assert f == engines.Facts(
        model="tiny",
        model_path="/models/tiny-Q4_K_M.gguf",
        context_length=1024,
        slots=2,
        busy_slots=1,
        quantization="Q4_K - Medium",
        build="b11434-0c1e570",
    )
    # --no-slots: busy unknown; no model_ftype in /props: the numeric ftype of /v1/models
    props = {k: v for k, v in LLAMA_PROPS.items() if k != "model_ftype"}
    fake = llama_cpp()
    fake.table[("GET", "/props")] = ok(props)
    fake.table[("GET", "/slots")] = httpx.Response(501, json={"error": {"code": 501, "message": "This server does not support slots endpoint.", "type": "not_supported_error"}})  # fmt: skip
    f = fake.run(lambda c: engines.dialect("llamacpp").poll(c, 1.0))
    assert (f.busy_slots, f.quantization, f.slots) == (None, "Q4_K_M", 2)


def test_sglang_0517_state_slots_from_server_args_busy_from_metrics() -> None:
    f = sglang_0517().run(lambda c: engines.dialect("sglang").poll(c, 1.0))
    assert (f.model, f.context_length, f.slots, f.busy_slots, f.quantization, f.build) == (
        "tiny", 4096, 4096, 2, "bfloat16", "0.5.17",
    )  # fmt: skip


def test_sglang_newer_state_from_internal_states() -> None:
    info = SGLANG_0517_INFO | {
        "version": "0.5.23",
        "max_running_requests": None,
        "dtype": "auto",
        "quantization": "fp8",
        "internal_states": [
            {"max_running_requests": 48, "running_batch_size": 3},
            {"max_running_requests": 48, "running_batch_size": 1},
        ],
    }
    fake = sglang_0517()
    fake.table[("GET", "/server_info")] = ok(info)
    f = fake.run(lambda c: engines.dialect("sglang").poll(c, 1.0))
    assert (f.slots, f.busy_slots, f.quantization, f.build) == (48, 4, "fp8", "0.5.23")
    assert "/metrics" not in fake.paths()  # the internal states said it


def test_vllm_0260_state() -> None:
    fake = vllm_0260()
    f = fake.run(lambda c: engines.dialect("vllm").poll(c, 1.0))
    assert f == engines.Facts(model="tinyllama", model_path="/tmp/m", context_length=4096, busy_slots=3, build="0.26.0")
    assert f.slots is None  # nothing in vLLM 0.26 reports max_num_seqs
    assert "/server_info" not in fake.paths()


# ---- prompt tokens ----------------------------------------------------------------------------------------

MSGS = [{"role": "user", "content": "hi"}]


def _json(request: httpx.Request) -> Any:
    return json.loads(request.content)


def test_llamacpp_tokens_input_tokens_then_template_and_tokenize() -> None:
    new = llama_cpp()
    new.table[("POST", "/v1/chat/completions/input_tokens")] = ok({"object": "response.input_tokens", "input_tokens": 9})  # fmt: skip
    assert new.run(lambda c: engines.dialect("llamacpp").count_prompt_tokens(c, "tiny", MSGS)) == engines.TokenCount(9, "input_tokens")  # fmt: skip

    old = llama_cpp()
    old.table[("POST", "/apply-template")] = lambda r: ok({"prompt": "<s>[INST] " + _json(r)["messages"][0]["content"]})
    old.table[("POST", "/tokenize")] = lambda r: ok({"tokens": list(range(9 if _json(r)["add_special"] and _json(r)["parse_special"] else 7))})  # fmt: skip
    n = old.run(lambda c: engines.dialect("llamacpp").count_prompt_tokens(c, "tiny", MSGS))
    assert n == engines.TokenCount(9, "apply-template+tokenize")


def test_sglang_and_vllm_tokens_with_messages() -> None:
    sg = sglang_0517()
    sg.table[("POST", "/v1/tokenize")] = lambda r: ok({"tokens": [1] * 9, "count": 9, "max_model_len": 4096}) if "messages" in _json(r) else httpx.Response(400)  # fmt: skip
    assert sg.run(lambda c: engines.dialect("sglang").count_prompt_tokens(c, "tiny", MSGS)) == engines.TokenCount(9, "v1/tokenize")  # fmt: skip
    vl = vllm_0260()
    vl.table[("POST", "/tokenize")] = lambda r: ok({"count": 9, "max_model_len": 4096, "tokens": [1] * 9, "token_strs": None}) if _json(r)["add_generation_prompt"] else httpx.Response(400)  # fmt: skip
    assert vl.run(lambda c: engines.dialect("vllm").count_prompt_tokens(c, "tinyllama", MSGS)) == engines.TokenCount(9, "tokenize")  # fmt: skip
    old = sglang_0517()
    old.table[("POST", "/v1/tokenize")] = httpx.Response(400, json=SGLANG_FLAT_OVERFLOW)
    assert old.run(lambda c: engines.dialect("sglang").count_prompt_tokens(c, "tiny", MSGS)) == engines.TokenCount(None, "v1/tokenize HTTP 400")  # fmt: skip
    n = FakeEngine({}).run(lambda c: engines.dialect("openai").count_prompt_tokens(c, "m", MSGS))
    assert n.tokens is None and "openai" in n.method


# ---- cache flush ------------------------------------------------------------------------------------------


def test_llamacpp_flush_erases_every_slot_or_says_why_not() -> None:
    fake = llama_cpp()
    fake.table[("POST", "/slots/0")] = fake.table[("POST", "/slots/1")] = ok({"id_slot": 0, "n_erased": 12})
    assert fake.run(lambda c: engines.dialect("llamacpp").flush_cache(c)) == "slot erase HTTP 200 (2 slots)"
    erased = [(r.url.path, r.url.params["action"]) for r in fake.seen if r.method == "POST"]
    assert erased == [("/slots/0", "erase"), ("/slots/1", "erase")]
    # without --slot-save-path
    no = llama_cpp()
    no.table[("POST", "/slots/0")] = httpx.Response(501, json={"error": {"code": 501, "message": "This server does not support slots action. Start it with `--slot-save-path`", "type": "not_supported_error"}})  # fmt: skip
    note = no.run(lambda c: engines.dialect("llamacpp").flush_cache(c)) or ""
    assert note.startswith("slot erase HTTP 501") and "--slot-save-path" in note


def test_sglang_and_vllm_flush() -> None:
    sg = sglang_0517()
    sg.table[("POST", "/flush_cache")] = httpx.Response(200, text="Cache flushed.\n")
    assert sg.run(lambda c: engines.dialect("sglang").flush_cache(c)) == "flush_cache HTTP 200"
    sg.table[("POST", "/flush_cache")] = httpx.Response(400, text="Flush cache failed.\n")  # requests running
    assert sg.run(lambda c: engines.dialect("sglang").flush_cache(c)) == "flush_cache HTTP 400"
    note = vllm_0260().run(lambda c: engines.dialect("vllm").flush_cache(c)) or ""
    assert note.startswith("reset_prefix_cache HTTP 404") and "DEV_MODE" in note
    assert FakeEngine({}).run(lambda c: engines.dialect("openai").flush_cache(c)) is None


# ---- error shapes -----------------------------------------------------------------------------------------


def test_sglang_flat_error_is_nested() -> None:
    body = json.dumps(SGLANG_FLAT_OVERFLOW).encode()
    nested = json.loads(engines.normalize_error(body, 400, "sglang"))
    assert nested == {"error": {k: v for k, v in SGLANG_FLAT_OVERFLOW.items() if k != "object"}}
    # the relay does not say which kind answered: the flat shape is nested whatever the kind
    assert json.loads(normalize_engine_error(body, 400)) == nested


@pytest.mark.parametrize(
    ("kind", "doc"),
    [
        ("vllm", VLLM_OVERFLOW),
        (
            "llamacpp",
            {
                "error": {
                    "code": 400,
                    "message": "request (5000 tokens) exceeds the available context size (1024 tokens), try increasing it",
                    "type": "exceed_context_size_error",
                    "n_prompt_tokens": 5000,
                    "n_ctx": 1024,
                }
            },
        ),
    ],
)
def test_nested_errors_pass_through_byte_for_byte(kind: EngineKind, doc: dict[str, Any]) -> None:
    body = json.dumps(doc, separators=(",", ":")).encode()
    assert engines.normalize_error(body, 400, kind) is body


def test_a_non_json_error_is_wrapped() -> None:
    out = json.loads(engines.normalize_error(b"Internal Server Error", 500, "vllm"))
    assert out == {"error": {"message": "Internal Server Error", "type": "upstream_error", "code": 500}}


# ---- streams ----------------------------------------------------------------------------------------------


def test_vllm_finish_reason_on_the_last_content_chunk() -> None:
    """vLLM 0.26 sends no separate finish chunk: the last token and the finish reason come in one event."""
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "tinyllama"}
    events = [
        base
        | {
            "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            ]
        },
        base | {"choices": [{"index": 0, "delta": {"content": "Hi"}, "logprobs": None, "finish_reason": None}]},
        base
        | {
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": "!"},
                    "logprobs": None,
                    "finish_reason": "length",
                    "stop_reason": None,
                }
            ]
        },
        base
        | {
            "choices": [],
            "usage": {"prompt_tokens": 9, "total_tokens": 11, "completion_tokens": 2, "prompt_tokens_details": None},
        },
    ]
    infos = [read_event(e) for e in events]
    assert [i.token for i in infos] == [False, True, True, False]
    assert [i.finish_reason for i in infos] == [None, None, "length", None]
    assert infos[3].usage is not None and infos[3].usage.completion_tokens == 2


# ---- quantization -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("names", "key"),
    [
        (("F16", "FP16", "fp16", "float16", "Float16", "half", "torch.float16", "MOSTLY_F16"), "f16"),
        (("BF16", "bf16", "bfloat16", "torch.bfloat16"), "bf16"),
        (("F32", "all F32", "float32", "fp32"), "f32"),
        (("Q4_K_M", "q4_k_m", "Q4_K - Medium", "Q4_K - Medium (guessed)"), "q4_k_m"),
        (("Q3_K - Small", "Q3_K_S"), "q3_k_s"),
        (("Q8_0", "q8_0"), "q8_0"),
        (("IQ2_XXS - 2.0625 bpw", "iq2_xxs"), "iq2_xxs"),
        (("MXFP4 MoE", "mxfp4"), "mxfp4"),
        (("fp8", "FP8"), "fp8"),
        (("compressed-tensors",), "compressed_tensors"),
    ],
)
def test_quant_key(names: tuple[str, ...], key: str) -> None:
    assert {n: quant_key(n) for n in names} == dict.fromkeys(names, key)


def test_quant_key_keeps_formats_apart_and_unknown_unknown() -> None:
    assert len({quant_key(q) for q in ("F16", "BF16", "F32", "Q8_0", "Q4_K_M", "Q4_K_S", "fp8")}) == 7
    assert quant_key(None) is None and quant_key("") is None
    assert quant_from_name("tiny-Q4_K_M.gguf") == "Q4_K_M"
    assert quant_from_name(None, "Qwen/Qwen2.5-7B-Instruct-AWQ") == "AWQ"
    assert quant_from_name("model.gguf", "Qwen/Qwen2.5-7B-Instruct") is None


# ---- the bench's probe, token count and flush over real sockets -------------------------------------------


def serve(fake: FakeEngine) -> Any:
    """``fake`` as a real HTTP server on 127.0.0.1 (the bench makes its own clients): a context manager -> URL."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        body, more = b"", True
        while more:
            msg = await receive()
            body, more = body + msg.get("body", b""), msg.get("more_body", False)
        qs = scope["query_string"].decode()
        url = "http://engine.test" + scope["path"] + (f"?{qs}" if qs else "")
        r = fake(httpx.Request(scope["method"], url, content=body))
        headers = [(k.encode(), v.encode()) for k, v in r.headers.items()]
        await send({"type": "http.response.start", "status": r.status_code, "headers": headers})
        await send({"type": "http.response.body", "body": r.content})

    return run_uvicorn_app(app, lifespan="off")


def test_bench_probe_reads_slots_and_quantization_through_the_dialects() -> None:
    """The bench's engines table had no slots for SGLang 0.5.17 or vLLM 0.26.0 (issue 11): SGLang's come from
    its server args now; vLLM reports none."""
    sg = sglang_0517()
    sg.table[("POST", "/v1/tokenize")] = ok({"tokens": [1] * 9, "count": 9, "max_model_len": 4096})
    sg.table[("POST", "/flush_cache")] = httpx.Response(200, text="Cache flushed.\n")
    with serve(sg) as url:
        t = benchconfig.Target("sglang", url)
        asyncio.run(bench_engines.probe(t))
        assert (t.kind, t.model, t.slots) == ("sglang", "tiny", 4096)
        assert (t.quantization, t.quantization_source) == ("bfloat16", "engine info")
        assert t.info == {
            "model_path": "/tmp/m",
            "context_length": 4096,
            "build": "0.5.17",
            "kv_pool_tokens": 5_400_000,
        }
        assert asyncio.run(bench_engines.count_prompt_tokens(t, "tiny", MSGS)) == (9, "v1/tokenize")
        assert asyncio.run(bench_engines.flush_cache(t)) == "flush_cache HTTP 200"
    with serve(vllm_0260()) as url:
        t = benchconfig.Target("vllm", url, quantization="BF16", quantization_source="declared")
        asyncio.run(bench_engines.probe(t))
        assert (t.kind, t.model, t.slots, t.info["build"]) == ("vllm", "tinyllama", None, "0.26.0")
        assert (t.quantization, t.quantization_source) == ("BF16", "declared")  # a declaration wins
    llama = llama_cpp()
    llama.table[("GET", "/props")] = ok({k: v for k, v in LLAMA_PROPS.items() if k != "model_ftype"})
    llama.table[("GET", "/v1/models")] = ok({"data": [{"id": "tiny"}]})
    with serve(llama) as url:
        t = benchconfig.Target("llama", url)
        asyncio.run(bench_engines.probe(t))
        # no ftype reported: the model file's name says Q4_K_M
        assert (t.kind, t.slots, t.quantization, t.quantization_source) == ("llamacpp", 2, "Q4_K_M", "model name")


# ---- replay of captured engines (tests/fixtures/engines/: the H200 run and scripts/capture_engine.py) ---------


def captured() -> list[Path]:
    return sorted([*(p.parent for p in FIXTURES.glob("*/answers.jsonl")), *GPU.values()])


def fake_of(table: Mapping[tuple[str, str], captures.Answer]) -> FakeEngine:
    def answer(a: captures.Answer) -> httpx.Response:
        return httpx.Response(a.status, content=a.body, headers={"content-type": a.content_type or "text/plain"})

    return FakeEngine({k: answer(a) for k, a in table.items() if a.status != 404})  # 404s: FakeEngine's own


def check_replay(folder: Path) -> tuple[EngineKind, engines.Health, engines.Facts, engines.TokenCount | None]:
    fake, meta = fake_of(captures.answers(folder)), captures.meta(folder)
    kind = fake.run(lambda c: engines.detect(c, 1.0))
    assert kind is not None and kind == (meta.get("kind") or kind)
    d = engines.dialect(kind)
    h = fake.run(lambda c: d.health(c, 1.0))
    assert h.up, h.error  # captured from a ready engine
    f = fake.run(lambda c: d.poll(c, 1.0))
    assert f.model and f.context_length, f
    if kind in ("llamacpp", "sglang"):
        assert f.slots, f
    if meta.get("version") and kind in ("sglang", "vllm"):
        assert f.build == meta["version"]
    n = None
    if kind != "openai":
        n = fake.run(lambda c: d.count_prompt_tokens(c, meta.get("model", "m7b"), captures.HI))
        assert n.tokens, n
    return kind, h, f, n


@pytest.mark.parametrize("folder", captured(), ids=lambda p: p.name)
def test_replay_captured_engine(folder: Path) -> None:
    check_replay(folder)


#: what the dialects must read from the real engines of the H200 run (values from the captures themselves)
GPU_FACTS: dict[str, tuple[str, engines.Facts]] = {
    # llama.cpp: /health; slots = -np 64, n_ctx per slot 8192, F16 GGUF, an sdist build
    "llamacpp": ("/health", engines.Facts(
        model="m7b", model_path="/tmp/w/m7b.gguf", context_length=8192, slots=64, busy_slots=0,
        quantization="F16", build="b0-unknown",
    )),
    # SGLang 0.5.17: no /ready (404) -> /health; slots from internal_states[0].effective_max_running_requests_per_dp
    # (the top-level max_running_requests is null); dtype float16; busy from sglang:num_running_reqs; a dummy load
    # (load_format: random weights) at mem_fraction_static 0.192, as launched
    "sglang": ("/health", engines.Facts(
        model="m7b", model_path="/tmp/w/model/m7b", context_length=8192, slots=4096, busy_slots=0,
        quantization="float16", build="0.5.17", kv_pool_tokens=107716,  # max_total_num_tokens
        weights_format="dummy", memory_share=0.192,
    )),
    # vLLM 0.26.0: /health; nothing reports max_num_seqs or the dtype; build from /version
    "vllm": ("/health", engines.Facts(
        model="m7b", model_path="/tmp/w/model/m7b", context_length=8192, slots=None, busy_slots=0,
        quantization=None, build="0.26.0",
    )),
}  # fmt: skip


@pytest.mark.parametrize("kind", list(GPU))
def test_dialects_read_the_real_engines_of_the_h200_run(kind: EngineKind) -> None:
    """Detection, health, state and token counting against the answers real llama.cpp, SGLang 0.5.17 and vLLM
    0.26.0 gave on the H200 (issue 11): kind, health path, every fact, and the token count of parity.json's
    "hi" equal to the ``usage.prompt_tokens`` a real chat completion reported."""
    got_kind, health, facts, n = check_replay(GPU[kind])
    path, want = GPU_FACTS[kind]
    assert (got_kind, health.path, health.error) == (kind, path, None)
    assert facts == want
    parity = json.loads((GPU[kind] / "parity.json").read_text())["hi"]
    assert n is not None and n.tokens == parity["prompt_tokens"] == 9


def test_sglang_0517_answers_404_on_ready_and_health_decides() -> None:
    fake = fake_of(captures.answers(GPU["sglang"]))
    h = fake.run(lambda c: engines.dialect("sglang").health(c, 1.0))
    assert (h.up, h.path) == (True, "/health")
    assert fake.paths() == ["/ready", "/health"]
    assert captures.endpoints(GPU["sglang"])["/ready"].status == 404  # the capture says so, not the fake
    # quantization keys: SGLang's dtype and llama.cpp's ftype name one format
    assert quant_key(GPU_FACTS["sglang"][1].quantization) == quant_key(GPU_FACTS["llamacpp"][1].quantization) == "f16"


@pytest.mark.parametrize("kind", list(GPU))
@pytest.mark.parametrize("name", ["overflow_nonstream.txt", "overflow_stream.txt", "overflow_max_tokens_nonstream.txt", "bad_request.txt"])  # fmt: skip
def test_captured_error_bodies_come_out_nested(kind: EngineKind, name: str) -> None:
    """Every error body the real engines sent, through ``normalize_error``: one OpenAI shape with the engine's
    message, type and code; nested bodies (llama.cpp, vLLM) pass byte for byte, SGLang's flat one is nested."""
    rec = captures.http_record(GPU[kind] / name)
    if rec.status == 200:  # llama.cpp stops at the context instead of refusing prompt + max_tokens
        assert (kind, name) == ("llamacpp", "overflow_max_tokens_nonstream.txt")
        assert rec.json()["choices"][0]["finish_reason"] == "length"
        return
    assert rec.status == 400 and rec.headers["content-type"].startswith("application/json")
    out = engines.normalize_error(rec.body, rec.status, kind)
    err = json.loads(out)["error"]
    assert isinstance(err["message"], str) and err["message"] and err["code"] == 400
    if kind == "sglang":
        flat = rec.json()
        assert flat["object"] == "error" and err == {k: v for k, v in flat.items() if k != "object"}
        assert normalize_engine_error(rec.body, rec.status) == out  # the relay nests it without knowing the kind
    else:
        assert out is rec.body
    if name.startswith("overflow"):
        assert "8192" in err["message"]


def test_vllm_stream_reads_finish_on_the_last_content_chunk() -> None:
    """vLLM 0.26.0's captured stream: no separate finish chunk; the last content event carries finish_reason,
    the usage event follows; SGLang 0.5.17's has a separate finish chunk; both count every content token."""
    for kind, finish_on_content in (("vllm", True), ("sglang", False), ("llamacpp", False)):
        events = captures.sse_events(GPU[kind] / "stream.sse")
        assert events[-1] == "[DONE]"
        infos = [read_event(json.loads(e)) for e in events[:-1]]
        tokens = [i for i in infos if i.token]
        finish = [i for i in infos if i.finish_reason]
        assert len(finish) == 1 and finish[0].finish_reason == "length"
        assert (finish[0] is tokens[-1]) == finish_on_content, kind
        usage = infos[-1].usage
        assert usage is not None and usage.completion_tokens == 24 and usage.prompt_tokens == 16
        assert sum(1 for i in tokens) <= 24


def test_replay_reads_what_the_capture_script_writes(tmp_path: Path) -> None:
    """The replay itself, on a folder written the way scripts/capture_engine.py writes one (SGLang 0.5.17)."""
    lines = []
    for (method, path), answer in sglang_0517().table.items():
        r = answer if isinstance(answer, httpx.Response) else answer(httpx.Request(method, path))
        lines.append({"method": method, "path": path, "status": r.status_code,
                      "content_type": r.headers.get("content-type", ""), "body": r.text})  # fmt: skip
    lines.append({"method": "GET", "path": "/ready", "status": 404, "content_type": "application/json", "body": "{}"})
    tokens = {"tokens": [1] * 9, "count": 9, "max_model_len": 4096}
    lines.append({"method": "POST", "path": "/v1/tokenize", "status": 200, "content_type": "application/json", "body": json.dumps(tokens)})  # fmt: skip
    (tmp_path / "answers.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (tmp_path / "meta.json").write_text(json.dumps({"kind": "sglang", "version": "0.5.17", "model": "tiny"}))
    check_replay(tmp_path)


@pytest.mark.parametrize(
    ("model_path", "quantization"), [("/tmp/w/m27b-Q4_K_M.gguf", "Q4_K_M"), ("/tmp/w/m27b.gguf", None)]
)
def test_sglang_loading_a_gguf_names_the_files_precision_not_gguf(model_path: str, quantization: str | None) -> None:
    """SGLang 0.5.17 sets ``quantization`` to ``gguf`` for a GGUF model path: that is the format. The dialect
    reports the precision the file's name carries, or none, never ``gguf`` (which no other engine reports, so
    the proxy's quantization drift would fire for every llama.cpp/SGLang pair on one file)."""
    table = captures.answers(GPU["sglang"])
    info = json.loads(table[("GET", "/server_info")].body)
    info.update(model_path=model_path, quantization="gguf", load_format="gguf")
    fake = fake_of(table)
    fake.table[("GET", "/server_info")] = ok(info)
    fake.table.pop(("GET", "/model_info"), None)
    fake.table.pop(("GET", "/get_model_info"), None)
    f = fake.run(lambda c: engines.dialect("sglang").poll(c, 1.0))
    assert (f.model_path, f.quantization, f.weights_format) == (model_path, quantization, "gguf")


@pytest.mark.parametrize(
    ("command", "share"),
    [
        (
            "python3 -m sglang.launch_server --model-path M --mem-fraction-static 0.484 --port 1",
            ("--mem-fraction-static", 0.484),
        ),
        ("python3 -m sglang.launch_server --model-path M --port 1", None),  # SGLang sizes itself
        ("vllm serve M --gpu-memory-utilization=0.5", ("--gpu-memory-utilization", 0.5)),
        ("vllm serve M", ("--gpu-memory-utilization", 0.9)),  # vLLM's default
        ("vllm serve M --kv-cache-memory 20000000000", None),  # the KV cache sized in bytes overrides the share
        ("llama-server -m m.gguf -c 4096", None),  # sized by -c and the model: no share flag
    ],
)
def test_each_kind_says_which_flag_sets_its_gpu_memory_share(command: str, share: tuple[str, float] | None) -> None:
    from proxy.procs.launch import parse_launch

    spec = parse_launch("e", command)
    assert spec.kind is not None and engines.dialect(spec.kind).memory_share(spec.argv) == share
