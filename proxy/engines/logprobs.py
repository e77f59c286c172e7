"""Next-token log-probabilities, per engine kind: one abstract request, each kind's own wire fields.

Three abstract requests, all greedy (temperature 0, no penalties, no bias, never llama.cpp's
``post_sampling_probs``): every engine gets the same *content* (token ids, token counts, ``k``); only the field
names differ, so nothing is sent to one engine and not the other. (One exception, which changes no figure: a
llama.cpp position it answers without probabilities is asked again with its pick banned, :data:`LLAMA_BANS`.)

- ``tokenize(messages)``: the chat template applied and tokenized by the engine itself
  (llama.cpp ``/apply-template`` then ``/tokenize`` with ``add_special`` and ``parse_special``; SGLang
  ``/v1/tokenize`` ``{"messages"}``; vLLM ``/tokenize`` ``{"messages","add_generation_prompt":true}``);
  ``tokenize_text(text)`` the same without template or special tokens (``{"prompt"}`` on SGLang and vLLM);
  ``detokenize(ids)`` the text the engine reads in ``ids`` (llama.cpp ``/detokenize`` ``content``; SGLang
  ``/v1/detokenize`` ``text``; vLLM ``/detokenize`` ``prompt``).
- ``generate(ids, n)``: the engine's own greedy continuation of ``ids``, as token ids (llama.cpp ``/completion``
  ``return_tokens``; SGLang ``/generate`` ``output_ids``; vLLM ``/v1/completions`` ``return_token_ids``, else
  ``logprobs.tokens`` with ``return_tokens_as_token_ids``).
- ``score(prompt, path, k)``: teacher forcing: at each position ``i`` of ``path``, the top-``k`` next-token
  log-probabilities after ``prompt + path[:i]`` (llama.cpp: one ``/completion`` per position, ``n_probs``, the
  prompt cache making each cheap; SGLang: one ``/generate`` with ``logprob_start_len`` =
  ``len(prompt) - 1`` and ``input_top_logprobs[1:]``; vLLM: one ``/v1/completions`` with ``prompt_logprobs`` =
  ``k``, positions ``len(prompt)...``, keeping ranks 1..k and dropping the actual token's extra entry).

What each kind returns is raw: llama.cpp's ``n_probs`` is a softmax of the raw logits whatever the sampler;
SGLang's at temperature 0 and its prompt log-probabilities are ``log_softmax`` of the raw logits; vLLM's
``prompt_logprobs`` are raw (``--logprobs-mode`` default). vLLM caps ``k`` at ``--max-logprobs`` (20 by
default): keep ``k <= 20`` for every engine. Every position is normalized to ``{token id: logprob}`` (sorted,
de-duplicated, at most ``k``). The plain OpenAI kind gives no token ids: :data:`SCORABLE` leaves it out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import httpx

#: one position: token id -> log-probability, at most k entries
TopK = dict[int, float]

#: the kinds that can generate from token ids and be teacher-forced
SCORABLE = ("llamacpp", "sglang", "vllm")


class LogprobError(RuntimeError):
    """An engine answered a log-probability request with an error or an unexpected shape."""


def top_k(entries: Sequence[tuple[int, float]], k: int) -> TopK:
    """The ``k`` most likely entries of ``(id, logprob)`` pairs, de-duplicated, most likely first."""
    best: dict[int, float] = {}
    for tid, lp in entries:
        if tid not in best or lp > best[tid]:
            best[int(tid)] = float(lp)
    return dict(sorted(best.items(), key=lambda kv: (-kv[1], kv[0]))[:k])


# ---- tokenize -------------------------------------------------------------------------------------------------


async def tokenize(
    client: httpx.AsyncClient, kind: str, messages: Sequence[Mapping[str, str]], model: str | None
) -> list[int]:
    """The token ids the engine itself makes of ``messages`` rendered as a chat prompt."""
    msgs = [dict(m) for m in messages]
    if kind == "llamacpp":
        rendered = _json(await client.post("/apply-template", json={"messages": msgs}))["prompt"]
        body: dict[str, Any] = {"content": rendered, "add_special": True, "parse_special": True}
        return [int(t) for t in _json(await client.post("/tokenize", json=body))["tokens"]]
    if kind == "sglang":
        doc = _json(await client.post("/v1/tokenize", json={"model": model, "messages": msgs}))
        return [int(t) for t in doc["tokens"]]
    if kind == "vllm":
        body = {"model": model, "messages": msgs, "add_generation_prompt": True}
        return [int(t) for t in _json(await client.post("/tokenize", json=body))["tokens"]]
    raise LogprobError(f"kind {kind!r} gives no token ids")


async def tokenize_text(client: httpx.AsyncClient, kind: str, text: str, model: str | None) -> list[int]:
    """The token ids of plain ``text`` (no template, no special tokens): two engines that agree here share a
    vocabulary even when their chat templates render a prompt otherwise."""
    if kind == "llamacpp":
        body: dict[str, Any] = {"content": text, "add_special": False, "parse_special": False}
        return [int(t) for t in _json(await client.post("/tokenize", json=body))["tokens"]]
    if kind in ("sglang", "vllm"):
        body = {"model": model, "prompt": text, "add_special_tokens": False}
        path = "/v1/tokenize" if kind == "sglang" else "/tokenize"
        return [int(t) for t in _json(await client.post(path, json=body))["tokens"]]
    raise LogprobError(f"kind {kind!r} gives no token ids")


async def detokenize(client: httpx.AsyncClient, kind: str, ids: Sequence[int], model: str | None) -> str:
    """The text ``ids`` spell in the engine's own vocabulary (its own decoder: compare two decodings by one engine,
    not one engine's with another's, whose conventions for a leading space or a special token may differ)."""
    try:
        if kind == "llamacpp":
            return str(_json(await client.post("/detokenize", json={"tokens": list(ids)}))["content"])
        if kind == "sglang":
            body = {"model": model, "tokens": list(ids), "skip_special_tokens": False}  # its default drops them
            return str(_json(await client.post("/v1/detokenize", json=body))["text"])
        if kind == "vllm":
            return str(_json(await client.post("/detokenize", json={"model": model, "tokens": list(ids)}))["prompt"])
    except (KeyError, TypeError) as exc:
        raise LogprobError(f"{kind}: no text in the detokenize answer ({type(exc).__name__}: {exc})") from None
    raise LogprobError(f"kind {kind!r} gives no token ids")


# ---- generate -------------------------------------------------------------------------------------------------


def generate_request(kind: str, ids: Sequence[int], n: int, model: str | None) -> tuple[str, dict[str, Any]]:
    """(path, body) of a greedy continuation of ``ids`` by ``n`` tokens, which must not stop early."""
    if kind == "llamacpp":
        body = {"prompt": list(ids), "n_predict": n, "temperature": 0, "return_tokens": True, "cache_prompt": True}
        return "/completion", body
    if kind == "sglang":
        sp = {"temperature": 0, "max_new_tokens": n}
        return "/generate", {"input_ids": list(ids), "sampling_params": sp, "return_logprob": True}
    if kind == "vllm":
        body = {
            "model": model,
            "prompt": list(ids),
            "max_tokens": n,
            "temperature": 0,
            "return_token_ids": True,  # choices[0].token_ids (newer builds)
            "logprobs": 1,  # with the next field, logprobs.tokens as "token_id:N" (any build since 0.6)
            "return_tokens_as_token_ids": True,
        }
        return "/v1/completions", body
    raise LogprobError(f"kind {kind!r} cannot generate from token ids")


def parse_generate(kind: str, doc: Any) -> list[int]:
    """The generated token ids of a :func:`generate_request` answer."""
    try:
        if kind == "llamacpp":
            return [int(t) for t in doc["tokens"]]
        if kind == "sglang":
            if isinstance(doc, list):
                doc = doc[0]
            if doc.get("output_ids") is not None:
                return [int(t) for t in doc["output_ids"]]
            return [int(e[1]) for e in doc["meta_info"]["output_token_logprobs"]]
        if kind == "vllm":
            choice = doc["choices"][0]
            if choice.get("token_ids") is not None:
                return [int(t) for t in choice["token_ids"]]
            return [int(str(t).removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise LogprobError(f"{kind}: no generated token ids in the answer ({type(exc).__name__}: {exc})") from None
    raise LogprobError(f"kind {kind!r} cannot generate from token ids")


async def generate(client: httpx.AsyncClient, kind: str, ids: Sequence[int], n: int, model: str | None) -> list[int]:
    path, body = generate_request(kind, ids, n, model)
    return parse_generate(kind, _json(await client.post(path, json=body)))


# ---- score ----------------------------------------------------------------------------------------------------


def score_requests(
    kind: str, prompt: Sequence[int], path: Sequence[int], k: int, model: str | None
) -> list[tuple[str, dict[str, Any]]]:
    """(path, body) of every request that teacher-forces ``path`` after ``prompt`` (llama.cpp: one per position)."""
    if kind == "llamacpp":
        return [("/completion", llama_score_body([*prompt, *path[:i]], k)) for i in range(len(path))]
    full = [*prompt, *path]
    if kind == "sglang":
        body: dict[str, Any] = {
            "input_ids": full,
            "sampling_params": {"temperature": 0, "max_new_tokens": 1},
            "return_logprob": True,
            "top_logprobs_num": k,
            "logprob_start_len": len(prompt) - 1,
        }
        return [("/generate", body)]
    if kind == "vllm":
        return [
            (
                "/v1/completions",
                {"model": model, "prompt": full, "max_tokens": 1, "temperature": 0, "prompt_logprobs": k},
            )
        ]
    raise LogprobError(f"kind {kind!r} cannot be teacher-forced")


def parse_score(kind: str, docs: Sequence[Any], n_prompt: int, m: int, k: int) -> list[TopK]:
    """The ``m`` positions' top-``k`` of the :func:`score_requests` answers, in order."""
    try:
        if kind == "llamacpp":
            out = []
            for doc in docs:
                first = doc["completion_probabilities"][0]
                out.append(top_k([(e["id"], e["logprob"]) for e in first["top_logprobs"]], k))
            return out
        if kind == "sglang":
            doc = docs[0][0] if isinstance(docs[0], list) else docs[0]
            rows = doc["meta_info"]["input_top_logprobs"][1 : m + 1]  # [0] is the prompt's last token: no prediction
            return [top_k([(e[1], e[0]) for e in row or ()], k) for row in rows]
        if kind == "vllm":
            rows = docs[0]["choices"][0]["prompt_logprobs"][n_prompt : n_prompt + m]
            return [
                top_k([(int(tid), v["logprob"]) for tid, v in (row or {}).items() if int(v.get("rank", 1)) <= k], k)
                for row in rows
            ]
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise LogprobError(f"{kind}: no log-probabilities in the answer ({type(exc).__name__}: {exc})") from None
    raise LogprobError(f"kind {kind!r} cannot be teacher-forced")


def llama_score_body(ids: Sequence[int], k: int, banned: Sequence[int] = ()) -> dict[str, Any]:
    """One llama.cpp position: its top-``k`` after ``ids``; ``banned``: tokens it may not *pick* (see
    :data:`LLAMA_BANS`), which leaves the top-``k`` as it was (computed from the raw logits before any sampler)."""
    body: dict[str, Any] = {"prompt": list(ids), "n_predict": 1, "temperature": 0, "n_probs": k}
    body |= {"cache_prompt": True, "return_tokens": True}
    if banned:
        body["logit_bias"] = [[t, False] for t in banned]
    return body


#: llama.cpp answers a position without ``completion_probabilities`` when the token it picked leaves its text an
#: incomplete UTF-8 sequence (a byte token of a multi-byte character: it waits for the rest, and with one token to
#: predict the rest never comes; on a SentencePiece vocab with random weights about 1 position in 250). The
#: answer's ``tokens`` names the pick: the position is asked again with that token banned from the pick, up to this
#: many times. A byte-level BPE vocabulary (GPT-2's; SmolLM2's, Qwen's, Llama 3's) holds many fragments of
#: multi-byte characters, so the next pick is often another: on SmolLM2-135M-Instruct's real weights the suite's
#: prompts needed a ban at 55 of 512 positions, up to 14 at one (a Chinese prompt); 4 left the engine out
LLAMA_BANS = 64


async def _llama_position(client: httpx.AsyncClient, ids: Sequence[int], k: int) -> TopK:
    """One position as :func:`score_requests` asks it; again with the pick banned while it has no probabilities."""
    banned: list[int] = []
    while True:
        doc = _json(await client.post("/completion", json=llama_score_body(ids, k, banned)))
        if not isinstance(doc, dict) or doc.get("completion_probabilities") or len(banned) >= LLAMA_BANS:
            return parse_score("llamacpp", [doc], len(ids), 1, k)[0]
        picked = [t for t in doc.get("tokens") or () if isinstance(t, int) and t not in banned]
        if not picked:
            return parse_score("llamacpp", [doc], len(ids), 1, k)[0]  # nothing to ban: the shape error it is
        banned += picked


async def score(
    client: httpx.AsyncClient, kind: str, prompt: Sequence[int], path: Sequence[int], k: int, model: str | None
) -> list[TopK]:
    """Teacher-force ``path`` after ``prompt``: the engine's top-``k`` at each of its positions."""
    reqs = score_requests(kind, prompt, path, k, model)
    if kind == "llamacpp":  # a position answered without probabilities is asked again, its pick banned
        got = [await _llama_position(client, body["prompt"], k) for _, body in reqs]
    else:
        docs = [_json(await client.post(p, json=b)) for p, b in reqs]
        got = parse_score(kind, docs, len(prompt), len(path), k)
    if len(got) != len(path):
        raise LogprobError(f"{kind}: {len(got)} scored positions for a path of {len(path)}")
    return got


def _json(r: httpx.Response) -> Any:
    if r.status_code >= 400:
        raise LogprobError(f"{r.request.method} {r.request.url.path}: HTTP {r.status_code} {r.text[:200]}")
    return r.json()
