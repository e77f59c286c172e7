"""The vLLM and SGLang emulators answer the token-agreement requests as the real engines do (vLLM 0.26.0's
``/tokenize``, ``/detokenize``, ``/v1/completions`` with ``return_token_ids`` / ``prompt_logprobs``; SGLang
0.5.17's ``/v1/tokenize``, ``/v1/detokenize``, ``/generate`` with ``logprob_start_len``), in front of a real
llama-server: the shapes and offsets, each figure checked against the backend's own answer, and the agreement
phase measuring both emulators against a llama.cpp baseline on the same GGUF (the same backend: full agreement)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from fakes.sglang_emulator import EmulatorConfig
from fakes.sglang_emulator import run_in_thread as run_sglang
from proxy.bench import suite
from proxy.bench.quality.agreerun import AgreementPhase, Engine, variants
from proxy.bench.quality.readout import agreements
from proxy.embedded import make_model
from proxy.engines import logprobs
from tests.helpers import vllm_emulator

ROOT = Path(__file__).resolve().parents[2]
Factory = Callable[..., Any]
PROMPTS, TOKENS = 4, 8
#: the emulator's model flags: served as ``m``
SERVED = ("--model", "/tmp/m", "--served-model-name", "m")
MESSAGES = [{"role": "user", "content": "Tell me a story about a cat."}]


@pytest.fixture(scope="module")
def sharp_model() -> Path:
    """The agreement tests' model (tests/bench/quality/test_agreement_engines.py): a next-token distribution sharp
    enough that a KL tells engines apart."""
    return make_model(logit_scale=40.0, untiled_output=True)


def _llama_top(backend: str, ids: list[int], k: int) -> list[tuple[int, float]]:
    """The backend's own top-``k`` after ``ids`` (the llama.cpp baseline's request)."""
    doc = httpx.post(backend + "/completion", json=logprobs.llama_score_body(ids, k), timeout=60).json()
    return [(e["id"], e["logprob"]) for e in doc["completion_probabilities"][0]["top_logprobs"]]


def test_both_emulators_agree_fully_with_their_llama_server_backend(
    llama_server_factory: Factory, sharp_model: Path
) -> None:
    backend = llama_server_factory(model=sharp_model)
    records: list[dict[str, Any]] = []
    prompts = variants([p.messages for p in suite.load("builtin", ("short",))], PROMPTS)
    phase = AgreementPhase(prompts, TOKENS, records.append)

    async def measure(name: str, kind: str, url: str, model: str | None) -> bool:
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            return await phase.run(Engine(name, kind, model, c), baseline=name == "llama")

    config = EmulatorConfig(backend=backend.url, served_model_name="m")
    with vllm_emulator(backend.url, *SERVED) as vllm, run_sglang(config) as sglang:
        assert asyncio.run(measure("llama", "llamacpp", backend.url, None))
        assert asyncio.run(measure("vllm", "vllm", vllm, "m"))
        assert asyncio.run(measure("sglang", "sglang", sglang, "m"))
    assert [r for r in records if r["type"] == "quality_note"] == []
    got = agreements(records, "llama", n_boot=100)
    assert set(got) == {"vllm", "sglang"}
    for kind in ("vllm", "sglang"):
        a = got[kind]
        assert (a.prompts, a.positions, a.k) == (PROMPTS, PROMPTS * TOKENS, 20), kind
        assert a.figures["same_top"].value == 1.0 and a.figures["first_part"].value == TOKENS, kind
        # the same backend, asked in an order that reuses its cache as llama.cpp's own requests do: KL 0 (float noise)
        assert a.figures["mean_kl"].value < 1e-6 and a.figures["p99_kl"].value < 1e-5, kind
    paths: dict[str, list[list[int]]] = {r["engine"]: [] for r in records}
    for r in records:
        if r["type"] == "logprobs":
            paths[r["engine"]].append(r["path"])
    assert paths["vllm"] == paths["llama"] == paths["sglang"]


def test_vllm_completions_carry_token_ids_and_prompt_logprobs_as_vllm_shapes_them(
    llama_server_factory: Factory, sharp_model: Path
) -> None:
    backend = llama_server_factory(model=sharp_model).url
    with vllm_emulator(backend, *SERVED) as url:
        ids = httpx.post(url + "/tokenize", json={"model": "m", "messages": MESSAGES}).json()["tokens"]
        own = httpx.post(
            backend + "/completion", json={"prompt": ids, "n_predict": 4, "temperature": 0, "return_tokens": True}
        ).json()
        body = {
            "model": "m",
            "prompt": ids,
            "max_tokens": 4,
            "temperature": 0,
            "return_token_ids": True,
            "logprobs": 2,
            "return_tokens_as_token_ids": True,
        }
        choice = httpx.post(url + "/v1/completions", json=body).json()["choices"][0]
        assert choice["token_ids"] == own["tokens"] and choice["prompt_token_ids"] == ids
        assert choice["text"] == own["content"] and choice["finish_reason"] == "length"
        lp = choice["logprobs"]
        assert lp["tokens"] == [f"token_id:{t}" for t in own["tokens"]]
        for tok, top in zip(lp["tokens"], lp["top_logprobs"], strict=True):  # the pick first, then the top-2
            assert next(iter(top)) == tok and len(top) == 2  # greedy: the pick is one of them

        k = 3
        prompt = ids[:10]
        doc = httpx.post(
            url + "/v1/completions",
            json={"model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0, "prompt_logprobs": k},
        ).json()
        rows = doc["choices"][0]["prompt_logprobs"]
        assert len(rows) == len(prompt) and rows[0] is None
        for j in range(1, len(prompt)):
            row, top = rows[j], _llama_top(backend, prompt[:j], k)
            keys = [int(t) for t in row]
            assert keys[0] == prompt[j]  # the actual token first, then the top-k by rank
            ranked = sorted((v["rank"], int(t)) for t, v in row.items() if v["rank"] <= k)
            assert [t for _, t in ranked] == [t for t, _ in top] and [r for r, _ in ranked] == [1, 2, 3]
            for t, lp_ in top:
                assert row[str(t)]["logprob"] == pytest.approx(lp_, abs=1e-4)
            if prompt[j] not in [t for t, _ in top]:
                assert len(row) == k + 1 and row[str(prompt[j])]["rank"] == k + 1
                assert row[str(prompt[j])]["logprob"] < top[-1][1]
            else:
                assert len(row) == k

        r = httpx.post(
            url + "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 21}
        )
        assert r.status_code == 400
        assert r.json()["error"] == {
            "message": "Requested prompt logprobs of 21, which is greater than max allowed: 20 "
            "(parameter=prompt_logprobs, value=21)",
            "type": "BadRequestError",
            "param": "prompt_logprobs",
            "code": 400,
        }
        text = httpx.post(url + "/detokenize", json={"model": "m", "tokens": ids}).json()["prompt"]
        assert text == httpx.post(backend + "/detokenize", json={"tokens": ids}).json()["content"]
        assert text.startswith("<|im_start|>")  # decode keeps the special tokens


def test_sglang_generate_offsets_its_input_logprobs_from_logprob_start_len(
    llama_server_factory: Factory, sharp_model: Path
) -> None:
    backend = llama_server_factory(model=sharp_model).url
    with run_sglang(EmulatorConfig(backend=backend, served_model_name="m")) as url:
        ids = httpx.post(url + "/v1/tokenize", json={"model": "m", "messages": MESSAGES}).json()["tokens"][:12]
        s, k = 7, 3
        body = {
            "input_ids": ids,
            "sampling_params": {"temperature": 0, "max_new_tokens": 2},
            "return_logprob": True,
            "top_logprobs_num": k,
            "logprob_start_len": s,
        }
        doc = httpx.post(url + "/generate", json=body, timeout=60).json()
        own = httpx.post(
            backend + "/completion", json={"prompt": ids, "n_predict": 2, "temperature": 0, "return_tokens": True}
        ).json()
        meta = doc["meta_info"]
        assert doc["output_ids"] == own["tokens"] and doc["text"] == own["content"]
        assert meta["finish_reason"] == {"type": "length", "length": 2}
        assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(ids), 2)
        assert [e[1] for e in meta["input_token_logprobs"]] == ids[s:]
        assert meta["input_token_logprobs"][0] == [None, ids[s], None] and meta["input_top_logprobs"][0] is None
        assert len(meta["input_top_logprobs"]) == len(ids) - s
        for i in range(1, len(ids) - s):  # entry i: the top-k after ids[:s + i], predicting ids[s + i]
            top = _llama_top(backend, ids[: s + i], k)
            assert [(e[1], e[2]) for e in meta["input_top_logprobs"][i]] == [(t, None) for t, _ in top]
            assert [e[0] for e in meta["input_top_logprobs"][i]] == pytest.approx([lp for _, lp in top], abs=1e-4)
            assert meta["input_token_logprobs"][i][0] <= top[0][1]
        assert [e[1] for e in meta["output_token_logprobs"]] == own["tokens"]
        assert [row[0][1] for row in meta["output_top_logprobs"]] == own["tokens"]  # greedy: the pick is the top
        # what proxy/engines/logprobs.py reads: positions 1..m after logprob_start_len = len(prompt) - 1
        prompt, path = ids[:9], ids[9:12]
        scored = asyncio.run(_score(url, prompt, path))
        assert [list(p) for p in scored] == [
            [t for t, _ in _llama_top(backend, [*prompt, *path[:i]], 20)] for i in range(3)
        ]

        plain = dict(body, logprob_start_len=None, top_logprobs_num=0)
        meta = httpx.post(url + "/generate", json=plain, timeout=60).json()["meta_info"]
        assert meta["input_token_logprobs"] == [] and "input_top_logprobs" not in meta
        r = httpx.post(url + "/generate", json=dict(body, logprob_start_len=len(ids) + 1))
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(
            f"req.logprob_start_len={len(ids) + 1} is higher than the number of input tokens"
        )
        r = httpx.post(url + "/v1/detokenize", json={"model": "m", "tokens": ids})
        kept = httpx.post(url + "/v1/detokenize", json={"model": "m", "tokens": ids, "skip_special_tokens": False})
        assert kept.json()["text"] == httpx.post(backend + "/detokenize", json={"tokens": ids}).json()["content"]
        assert "<|im_start|>" in kept.json()["text"] and "<|im_start|>" not in r.json()["text"]
        assert r.json()["text"] == kept.json()["text"].replace("<|im_start|>", "").replace("<|im_end|>", "")


async def _score(url: str, prompt: list[int], path: list[int]) -> list[logprobs.TopK]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        return await logprobs.score(c, "sglang", prompt, path, 20, "m")


def test_tokenize_adds_the_bos_as_each_engine_does(llama_server_factory: Factory, tiny_model_spm: Path) -> None:
    """A vocabulary that adds a BOS (llama-spm): a plain prompt gets it unless ``add_special_tokens`` is false, a
    chat prompt exactly once (the template's), as llama-server's own template + tokenize give it."""
    backend = llama_server_factory(model=tiny_model_spm).url
    rendered = httpx.post(backend + "/apply-template", json={"messages": MESSAGES}).json()["prompt"]
    own = httpx.post(backend + "/tokenize", json={"content": rendered, "add_special": True, "parse_special": True})
    bos = httpx.post(backend + "/tokenize", json={"content": "", "add_special": True}).json()["tokens"]
    assert len(bos) == 1
    with (
        vllm_emulator(backend, *SERVED) as vllm,
        run_sglang(EmulatorConfig(backend=backend, served_model_name="m")) as sg,
    ):
        for url, path in ((vllm, "/tokenize"), (sg, "/v1/tokenize")):
            chat = httpx.post(url + path, json={"model": "m", "messages": MESSAGES}).json()["tokens"]
            assert chat == own.json()["tokens"] and chat.count(bos[0]) == 1, path
            with_bos = httpx.post(url + path, json={"model": "m", "prompt": "Hello world"}).json()["tokens"]
            without = httpx.post(url + path, json={"model": "m", "prompt": "Hello world", "add_special_tokens": False})
            assert with_bos == bos + without.json()["tokens"], path
        doubled = httpx.post(vllm + "/tokenize", json={"model": "m", "messages": MESSAGES, "add_special_tokens": True})
        assert doubled.json()["tokens"] == bos + own.json()["tokens"]  # vLLM: special tokens on top of the template's
