"""vLLM's ``/v1/completions`` where the answer carries tokens (``entrypoints/openai/completion/serving.py``
``request_output_to_completion_response``): ``return_token_ids`` (``choices[0].token_ids``, ``prompt_token_ids``),
``logprobs`` (``CompletionLogProbs``, ``return_tokens_as_token_ids``: ``"token_id:N"``) and ``prompt_logprobs``,
from the backend's native ``/completion`` (:mod:`fakes.llama_logprobs`). Not streamed; one prompt (a string or
token ids); greedy at temperature 0, else the backend's sampler with vLLM's neutral defaults.

``prompt_logprobs: k`` is a list as long as the prompt: ``None`` first, then at each position ``j`` a dict
``{"<id>": {"logprob", "rank", "decoded_token"}}`` holding the prompt's own token ``prompt[j]`` first (vLLM's
``append_logprobs_for_next_position``: the actual token, then ranks 1..k; one entry when it is among them) -- its
rank outside the top-k is ``k + 1`` here (:data:`fakes.llama_logprobs.OUTSIDE`: the backend reports no rank past
its ``n_probs``; vLLM gives the true one). ``k`` or ``logprobs`` over ``--max-logprobs`` (20) is refused as
vLLM's ``SamplingParams._validate_logprobs`` does.
"""

from __future__ import annotations

import secrets
import time
from typing import TYPE_CHECKING, Any

from fakes.llama_logprobs import Greedy, Scored, greedy, prompt_positions
from fakes.vllm_emulator.config import FINGERPRINT

if TYPE_CHECKING:
    from fakes.vllm_emulator.server import Emulator

#: vLLM's ``-inf`` clamp (``clamp_prompt_logprobs``, ``_create_completion_logprobs``)
FLOOR = -9999.0
#: llama.cpp's stop type -> vLLM's finish_reason
FINISH = {"limit": "length", "eos": "stop", "word": "stop", "none": "stop"}


class Refused(ValueError):
    """A request vLLM refuses with a 400 (``VLLMValidationError``): the message as vLLM's ``__str__`` writes it."""

    def __init__(self, message: str, param: str | None = None, value: Any = None) -> None:
        extras = [f"{n}={v}" for n, v in (("parameter", param), ("value", value)) if v is not None]
        super().__init__(f"{message} ({', '.join(extras)})" if extras else message)
        self.param = param


def wants_tokens(body: dict[str, Any]) -> bool:
    """Whether a completions request asks for what only this path answers (token ids in or out, log-probs)."""
    if body.get("stream"):
        return False
    prompt = body.get("prompt")
    ids = isinstance(prompt, list) and bool(prompt) and all(isinstance(t, int | list) for t in prompt)
    return ids or any(body.get(f) is not None for f in ("return_token_ids", "prompt_logprobs", "logprobs"))


def check_logprobs(body: dict[str, Any], max_logprobs: int, vocab: int) -> None:
    """``SamplingParams._validate_logprobs``: ``logprobs`` and ``prompt_logprobs`` (-1: the vocabulary) at most
    ``max_logprobs``."""
    for field, what in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
        n = body.get(field)
        if n is None or n == 0:
            continue
        if n == -1:
            n = vocab
        if n > max_logprobs:
            message = f"Requested {what} logprobs of {n}, which is greater than max allowed: {max_logprobs}"
            raise Refused(message, field, n)


def prompt_ids(prompt: Any) -> list[int] | str:
    """The request's one prompt: token ids, or a string to tokenize."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [int(t) for t in prompt]
    raise Refused("the emulator answers one prompt (a string or a list of token ids)", "prompt")


def prompt_logprobs(positions: list[Scored]) -> list[dict[str, Any] | None]:
    """``choices[0].prompt_logprobs``: ``None``, then each position's actual token and its top-k."""
    out: list[dict[str, Any] | None] = [None]
    for s in positions:
        row = {str(s.token): {"logprob": max(s.logprob, FLOOR), "rank": s.rank, "decoded_token": s.text}}
        for rank, (tid, lp, text) in enumerate(s.top, 1):
            row[str(tid)] = {"logprob": max(lp, FLOOR), "rank": rank, "decoded_token": text}
        out.append(row)
    return out


def sample_logprobs(run: Greedy, as_id: bool) -> dict[str, Any]:
    """``CompletionLogProbs``: per generated token its text (or ``token_id:N``), log-probability and the top
    dict (the pick first, then the top-n: n + 1 entries when the pick is not among them)."""
    offsets: list[int] = []
    logprobs: list[float | None] = []
    tokens: list[str] = []
    tops: list[dict[str, float] | None] = []
    offset = 0
    for s in run.positions or ():
        name = f"token_id:{s.token}" if as_id else s.text
        top = {name: max(s.logprob, FLOOR)}
        for tid, lp, text in s.top:
            top[f"token_id:{tid}" if as_id else text] = max(lp, FLOOR)
        offsets.append(offset)
        offset += len(name)
        logprobs.append(max(s.logprob, FLOOR))
        tokens.append(name)
        tops.append(top)
    return {"text_offset": offsets, "token_logprobs": logprobs, "tokens": tokens, "top_logprobs": tops}


async def complete(emu: Emulator, body: dict[str, Any], ids: list[int]) -> dict[str, Any]:
    """The whole answer for ``ids``; ``emu``: the server's (its client, config and counters)."""
    client, n = emu.client, int(body.get("max_tokens") or 16)
    extra: dict[str, Any] = {}
    if body.get("stop"):
        extra["stop"] = [body["stop"]] if isinstance(body["stop"], str) else list(body["stop"])
    temperature = body.get("temperature", 1.0)
    if temperature:  # vLLM's sampler defaults; llama.cpp's own (top_k 40, top_p 0.95, min_p 0.05) differ
        extra |= {"temperature": temperature, "top_k": body.get("top_k") or 0, "top_p": body.get("top_p", 1.0)}
        extra |= {"min_p": body.get("min_p", 0.0)} | ({"seed": body["seed"]} if body.get("seed") is not None else {})
    k_prompt, k_sample = body.get("prompt_logprobs"), body.get("logprobs")
    emu.running += 1
    try:
        run = await greedy(client, ids, n, None if k_sample is None else int(k_sample), extra)
        # after the generation: the prompt's positions then reuse the cache it left (llama_logprobs.prompt_positions)
        positions = None if k_prompt is None else await prompt_positions(client, ids, 1, int(k_prompt))
    finally:
        emu.running -= 1
    as_ids = bool(body.get("return_token_ids"))
    choice = {
        "index": 0,
        "text": run.text,
        "logprobs": None if k_sample is None else sample_logprobs(run, bool(body.get("return_tokens_as_token_ids"))),
        "finish_reason": FINISH.get(run.stop_type, "stop"),
        "stop_reason": run.stop_word,
        "token_ids": run.tokens if as_ids else None,
        "prompt_logprobs": None if positions is None else prompt_logprobs(positions),
        "prompt_token_ids": ids if as_ids else None,
        "routed_experts": None,
    }
    usage = emu.usage(
        {
            "prompt_tokens": len(ids),
            "completion_tokens": len(run.tokens),
            "prompt_tokens_details": {"cached_tokens": run.cached},
        }
    )
    emu.requests += 1
    emu.prompt_tokens += usage["prompt_tokens"]
    emu.generation_tokens += usage["completion_tokens"]
    return {
        "id": f"cmpl-{secrets.token_hex(8)}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": emu.config.served_model_name,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": FINGERPRINT,
        "usage": usage,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }
