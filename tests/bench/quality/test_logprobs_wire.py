"""The per-kind wire of ``proxy.engines.logprobs``: the same content to every kind (ids, counts, k, temperature 0),
each kind's own field names, and answers in each engine's real shape read back to ``{id: logprob}`` lists.
Shapes: llama.cpp from a live llama-server (tests/bench/quality/test_agreement_engines.py runs it for real);
SGLang ``/generate`` ``meta_info.input_top_logprobs`` (``[logprob, id, text]`` triples, the first position
``None``) and vLLM ``prompt_logprobs`` (``{"<id>": {logprob, rank, decoded_token}}``, the prompt's own token
added beside the top-k with its own rank) from their sources (docs/bench.md#token-agreement)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from proxy.engines import logprobs

P, C = [11, 12, 13], [21, 22]


@pytest.mark.parametrize("kind", ["llamacpp", "sglang", "vllm"])
def test_every_kind_gets_the_same_content_greedy(kind: str) -> None:
    _path, body = logprobs.generate_request(kind, P, 8, "m")
    flat = repr(body)
    assert "[11, 12, 13]" in flat and "8" in flat and "'temperature': 0" in flat
    assert "post_sampling_probs" not in flat and "penalty" not in flat and "logit_bias" not in flat
    for _, b in logprobs.score_requests(kind, P, C, 20, "m"):
        assert "20" in repr(b) and "'temperature': 0" in repr(b)


def test_llamacpp_is_teacher_forced_one_position_at_a_time() -> None:
    reqs = logprobs.score_requests("llamacpp", P, C, 5, None)
    assert [b["prompt"] for _, b in reqs] == [P, [*P, 21]]
    assert all(b["n_probs"] == 5 and b["n_predict"] == 1 for _, b in reqs)
    doc = {
        "completion_probabilities": [
            {"id": 7, "logprob": -0.1, "top_logprobs": [{"id": 7, "token": "a", "bytes": [97], "logprob": -0.1},
                                                       {"id": 3, "token": "b", "bytes": [98], "logprob": -2.5}]}
        ]
    }  # fmt: skip
    assert logprobs.parse_score("llamacpp", [doc, doc], 3, 2, 5) == [{7: -0.1, 3: -2.5}] * 2
    assert logprobs.parse_generate("llamacpp", {"tokens": [5, 6], "content": "xy"}) == [5, 6]


def test_sglang_reads_the_input_top_logprobs_after_the_prompt() -> None:
    ((path, body),) = logprobs.score_requests("sglang", P, C, 2, None)
    assert path == "/generate" and body["input_ids"] == [*P, *C] and body["logprob_start_len"] == 2
    assert body["top_logprobs_num"] == 2 and body["return_logprob"] is True
    doc = {
        "text": "z",
        "output_ids": [9],
        "meta_info": {
            "input_top_logprobs": [None, [[-0.2, 21, None], [-1.9, 4, None]], [[-0.7, 22, None], [-0.9, 8, None]]],
            "output_top_logprobs": [[[-0.1, 9, None]]],
        },
    }
    assert logprobs.parse_score("sglang", [doc], 3, 2, 2) == [{21: -0.2, 4: -1.9}, {22: -0.7, 8: -0.9}]
    assert logprobs.parse_generate("sglang", doc) == [9]
    no_ids = {"text": "z", "meta_info": {"output_token_logprobs": [[-0.1, 9, None], [-0.3, 10, None]]}}
    assert logprobs.parse_generate("sglang", no_ids) == [9, 10]


def test_vllm_keeps_the_top_k_by_rank_and_drops_the_prompt_tokens_extra_entry() -> None:
    ((path, body),) = logprobs.score_requests("vllm", P, C, 2, "m")
    assert path == "/v1/completions" and body == {
        "model": "m", "prompt": [*P, *C], "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2
    }  # fmt: skip
    entry = {"logprob": -0.3, "rank": 1, "decoded_token": "a"}
    doc = {
        "choices": [
            {
                "text": "q",
                "token_ids": [5],
                "prompt_logprobs": [
                    None,
                    {"12": {"logprob": -1.0, "rank": 1, "decoded_token": "x"}},
                    {"13": {"logprob": -1.0, "rank": 1, "decoded_token": "y"}},
                    {"21": {"logprob": -4.0, "rank": 9, "decoded_token": "p"}, "4": entry,
                     "6": {"logprob": -1.5, "rank": 2, "decoded_token": "b"}},
                    {"22": {"logprob": -0.2, "rank": 1, "decoded_token": "q"}, "8": {"logprob": -2.0, "rank": 2, "decoded_token": "c"}},
                ],
            }
        ]
    }  # fmt: skip
    assert logprobs.parse_score("vllm", [doc], 3, 2, 2) == [{4: -0.3, 6: -1.5}, {22: -0.2, 8: -2.0}]
    assert logprobs.parse_generate("vllm", doc) == [5]
    older = {
        "choices": [
            {"text": "q", "logprobs": {"tokens": ["token_id:5", "token_id:17"], "token_logprobs": [-0.1, -0.2]}}
        ]
    }
    assert logprobs.parse_generate("vllm", older) == [5, 17]


def test_a_kind_without_token_ids_and_a_wrong_shape_are_errors() -> None:
    with pytest.raises(logprobs.LogprobError, match="cannot"):
        logprobs.generate_request("openai", P, 4, None)
    with pytest.raises(logprobs.LogprobError, match="no log-probabilities"):
        logprobs.parse_score("vllm", [{"choices": []}], 3, 2, 2)


def test_top_k_sorts_dedupes_and_cuts() -> None:
    assert logprobs.top_k([(3, -2.0), (1, -0.5), (3, -1.0), (2, -0.5)], 2) == {1: -0.5, 2: -0.5}


def test_a_llamacpp_position_without_probabilities_is_asked_again_with_its_pick_banned() -> None:
    """llama.cpp's answer when its pick ends in an incomplete UTF-8 sequence (seen on the H100, 2026-12-07: a
    SentencePiece byte token, ``KeyError: 'completion_probabilities'``): the tokens, no probabilities."""
    top = [{"id": 131, "token": "\\xe2", "bytes": [226], "logprob": -0.2}, {"id": 9, "token": "a", "logprob": -1.8}]
    bodies: list[dict[str, Any]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        if [131, False] in body.get("logit_bias", []):
            return httpx.Response(
                200, json={"tokens": [9], "completion_probabilities": [{"id": 9, "top_logprobs": top}]}
            )
        return httpx.Response(200, json={"tokens": [131], "content": ""})

    async def run(transport: httpx.MockTransport) -> list[logprobs.TopK]:
        async with httpx.AsyncClient(transport=transport, base_url="http://llama") as c:
            return await logprobs.score(c, "llamacpp", P, C[:1], 5, None)

    assert asyncio.run(run(httpx.MockTransport(answer))) == [{131: -0.2, 9: -1.8}]
    assert [b.get("logit_bias") for b in bodies] == [None, [[131, False]]]
    assert all(b["prompt"] == P and b["n_probs"] == 5 for b in bodies)

    # a pick that never completes: asked LLAMA_BANS + 1 times, then the shape error, not a loop
    picks = iter(range(200, 300))
    never = httpx.MockTransport(lambda r: httpx.Response(200, json={"tokens": [next(picks)], "content": ""}))
    with pytest.raises(logprobs.LogprobError, match="completion_probabilities"):
        asyncio.run(run(never))


@pytest.mark.parametrize(
    ("kind", "path", "field"),
    # SGLang 0.5.17 http_server.py /v1/detokenize -> DetokenizeResponse(text); vLLM 0.26 serve/tokenize
    # /detokenize -> DetokenizeResponse(prompt); llama.cpp /detokenize -> {"content"}
    [("llamacpp", "/detokenize", "content"), ("sglang", "/v1/detokenize", "text"), ("vllm", "/detokenize", "prompt")],
)
def test_detokenize_reads_each_kinds_own_field(kind: str, path: str, field: str) -> None:
    seen: list[tuple[str, Any]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, json.loads(request.content)))
        return httpx.Response(200, json={field: "<s> [INST] hi"})

    async def run() -> str:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer), base_url="http://e") as c:
            return await logprobs.detokenize(c, kind, P, "m")

    assert asyncio.run(run()) == "<s> [INST] hi"
    assert seen[0][0] == path and seen[0][1]["tokens"] == P
    if kind == "sglang":  # its default skips special tokens: two id lists differing in a BOS would read alike
        assert seen[0][1]["skip_special_tokens"] is False
    with pytest.raises(logprobs.LogprobError, match="no text"):
        asyncio.run(_detok_wrong_shape(kind))


async def _detok_wrong_shape(kind: str) -> str:
    transport = httpx.MockTransport(lambda r: httpx.Response(200, json={"other": 1}))
    async with httpx.AsyncClient(transport=transport, base_url="http://e") as c:
        return await logprobs.detokenize(c, kind, P, "m")
