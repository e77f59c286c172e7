"""SGLang's native ``/generate`` (not streamed, one request) and ``/v1/detokenize``, from the backend's native
``/completion`` (:mod:`fakes.llama_logprobs`).

``/generate`` answers ``{"text", "output_ids", "meta_info"}`` as ``tokenizer_manager._handle_batch_output`` builds
it, ``meta_info`` holding ``id``, ``finish_reason``, ``prompt_tokens``, ``weight_version``, ``num_retractions``, the
log-probabilities when ``return_logprob`` (``add_logprob_to_meta_info``: triples ``[logprob, token id, null]``,
``return_text_in_logprobs`` false), ``reasoning_tokens``, ``completion_tokens``, ``cached_tokens``,
``e2e_latency``. Where the input log-probabilities start (``scheduler_components/logprob_result_processor.py``):
``logprob_start_len`` ``s`` (-1: the input's length, so none) gives ``len(input) - s`` entries for the tokens
``input[s:]``: ``input_token_logprobs[i]`` is ``input[s + i]``'s log-probability after ``input[:s + i]``, and
``input_top_logprobs[i]`` the top-``top_logprobs_num`` there, entry 0 ``null`` in both (``[None] +
logprobs[:-1]``: the position before ``s`` is not computed). An ``s`` past the input is refused with the
scheduler's message; the radix cache serves no prefix past ``s``. Greedy at temperature 0, else the backend's
sampler with SGLang's neutral defaults.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fakes.llama_logprobs import BackendError, Scored, detokenize, greedy, prompt_positions
from fakes.sglang_emulator.engine import SGLangEmulator
from fakes.sglang_emulator.protocol import _APIError, _read_body


def _error(message: str, status: int = 400) -> JSONResponse:
    """``http_server._create_error_response``: a ``ValueError`` from the tokenizer manager."""
    return JSONResponse({"error": {"message": message}}, status_code=status)


def _triple(lp: float | None, tid: int) -> list[Any]:
    return [lp, tid, None]


def _top(s: Scored) -> list[list[Any]]:
    return [_triple(lp, tid) for tid, lp, _ in s.top]


def _sampler(sp: dict[str, Any]) -> dict[str, Any]:
    """The backend's fields for SGLang's ``sampling_params`` beyond the greedy default."""
    extra: dict[str, Any] = {}
    if sp.get("stop"):
        extra["stop"] = [sp["stop"]] if isinstance(sp["stop"], str) else list(sp["stop"])
    if sp.get("ignore_eos"):
        extra["ignore_eos"] = True
    temperature = sp.get("temperature", 1.0)
    if temperature:  # SGLang's defaults; llama.cpp's own (top_k 40, top_p 0.95, min_p 0.05) differ
        top_k = sp.get("top_k")
        extra |= {"temperature": temperature, "top_k": 0 if top_k is None or top_k < 0 else top_k}
        extra |= {"top_p": sp.get("top_p", 1.0), "min_p": sp.get("min_p", 0.0)}
    return extra


def _finish(engine: SGLangEmulator, stop_type: str, word: str | None, n: int) -> dict[str, Any]:
    if stop_type == "word":
        return {"type": "stop", "matched": word}
    if stop_type == "eos":
        return {"type": "stop", "matched": engine.eos_token_id}
    return {"type": "length", "length": n}


async def _input_ids(engine: SGLangEmulator, body: dict[str, Any]) -> list[int]:
    ids = body.get("input_ids")
    if isinstance(ids, list) and len(ids) == 1 and isinstance(ids[0], list):
        ids = ids[0]
    if isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return [int(t) for t in ids]
    text = body.get("text")
    if isinstance(text, list) and len(text) == 1:
        text = text[0]
    if isinstance(text, str):
        return await engine.tokenize(text, add_special=True)
    raise ValueError("Either text or input_ids should be provided (one request: batches are not emulated).")


async def generate(engine: SGLangEmulator, request: Request) -> Response:
    """``POST /generate``."""
    t0 = time.perf_counter()
    try:
        body = await _read_body(request, None)
        if body.get("stream"):
            raise ValueError("the emulator's /generate is not streamed")
        ids = await _input_ids(engine, body)
        sp = dict(body.get("sampling_params") or {})
        max_new = int(sp.get("max_new_tokens", 128))
        engine.check_length(ids, max_new)
    except _APIError as exc:
        return _error(exc.message)
    except ValueError as exc:
        return _error(str(exc))
    want, k = bool(body.get("return_logprob")), int(body.get("top_logprobs_num") or 0)
    start = body.get("logprob_start_len")
    s = -1 if start is None else int(start)
    s = len(ids) if s < 0 or not want else s  # the scheduler: -1 (or no log-probabilities) means none of the input
    if s > len(ids):
        msg = f"req.logprob_start_len={s} is higher than the number of input tokens len(req.origin_input_ids)={len(ids)}. Please use a smaller logprob_start_len."
        return _error(msg)
    cached = min(engine.prefix_cache.match_and_insert(ids), s)
    engine.inflight += 1
    try:
        run = await greedy(engine.http, ids, max_new, k if want else None, _sampler(sp))
        inputs = await prompt_positions(engine.http, ids, s + 1, k) if want and s < len(ids) else []
    except BackendError as exc:
        return _error(str(exc), exc.status)
    finally:
        engine.inflight -= 1
    meta: dict[str, Any] = {
        "id": str(body.get("rid") or uuid.uuid4().hex),
        "finish_reason": _finish(engine, run.stop_type, run.stop_word, len(run.tokens)),
        "prompt_tokens": len(ids),
        "weight_version": "default",
        "num_retractions": 0,
    }
    if want:
        outputs = run.positions or []
        head = [_triple(None, ids[s])] if s < len(ids) else []
        meta["input_token_logprobs"] = head + [_triple(p.logprob, p.token) for p in inputs]
        meta["output_token_logprobs"] = [_triple(p.logprob, p.token) for p in outputs]
        meta["output_token_logprobs_length"] = len(outputs)
        if k > 0:
            meta["input_top_logprobs"] = ([None] if s < len(ids) else []) + [_top(p) for p in inputs]
            meta["output_top_logprobs"] = [_top(p) for p in outputs]
    meta |= {"reasoning_tokens": 0, "completion_tokens": len(run.tokens), "cached_tokens": cached}
    meta["e2e_latency"] = time.perf_counter() - t0
    return JSONResponse({"text": run.text, "output_ids": run.tokens, "meta_info": meta})


async def _is_special(engine: SGLangEmulator, tid: int, known: dict[int, bool]) -> bool:
    """Whether ``tid`` is a special token (what Hugging Face's ``skip_special_tokens`` drops): its text reads
    back as itself only when special tokens are parsed. Remembered per token."""
    if tid not in known:
        piece = await detokenize(engine.http, [tid])
        ask = {"content": piece, "add_special": False}
        special = (await engine.http.post("/tokenize", json=ask | {"parse_special": True})).json().get("tokens")
        plain = (await engine.http.post("/tokenize", json=ask | {"parse_special": False})).json().get("tokens")
        known[tid] = special == [tid] and plain != [tid]
    return known[tid]


async def detokenize_endpoint(engine: SGLangEmulator, request: Request, known: dict[int, bool]) -> Response:
    """``POST /v1/detokenize``: ``{"text"}`` (a list of texts for a list of lists); ``skip_special_tokens``
    (true by default) drops the special tokens first, as the tokenizer's ``decode`` does."""
    try:
        body = await _read_body(request, "tokens")
    except _APIError as exc:
        return exc.response()
    tokens, skip = body.get("tokens"), body.get("skip_special_tokens", True) is not False
    batch = isinstance(tokens, list) and bool(tokens) and all(isinstance(t, list) for t in tokens)
    lists: list[Any] = list(tokens or ()) if batch else [tokens]
    if not all(isinstance(ids, list) and all(isinstance(t, int) for t in ids) for ids in lists):
        return _APIError("Invalid input: 'tokens' must be a list of integers.").response()
    texts = []
    for ids in lists:
        keep = [t for t in ids if not (skip and await _is_special(engine, t, known))]
        try:
            texts.append(await detokenize(engine.http, keep) if keep else "")
        except BackendError as exc:
            return _APIError(
                f"Internal server error during detokenization: {exc}", "InternalServerError", 500
            ).response()
    return JSONResponse({"text": texts if batch else texts[0]})
