"""llama.cpp's wire shapes: the fake tokenizer and chat template, error bodies, ``timings``, and the
stream events and whole responses of one resolved request (``_Plan``)."""

from __future__ import annotations

import enum
import json
import random
import re
import string
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Final

from fakes.fault_engine.config import BOS_ID, BUILD_INFO, PIECES, SPECIAL_IDS, Knobs

# ----------------------------------------------------------------------------------------------------------
# fake tokenizer and template


_WORD = re.compile(r"\s*(?:<\|[a-z_]+\|>|[^\s<]+|<)")


def fake_tokenize(text: str, *, add_special: bool = False, parse_special: bool = True) -> list[int]:
    """One id per whitespace-led word or special token; stable across runs."""
    ids = [
        SPECIAL_IDS[piece.lstrip()]
        if parse_special and piece.lstrip() in SPECIAL_IDS
        else 10 + zlib.crc32(piece.encode()) % 32000
        for piece in _WORD.findall(text)
    ]
    return [BOS_ID, *ids] if add_special else ids


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def apply_chat_template(messages: list[Any]) -> str:
    """ChatML rendering with the generation prompt, as llama.cpp's default template does."""
    out = [
        f"<|im_start|>{m.get('role', 'user')}\n{_text_of(m.get('content'))}<|im_end|>\n"
        for m in messages
        if isinstance(m, dict)
    ]
    return "".join(out) + "<|im_start|>assistant\n"


def _prompt_text(path_kind: _Kind, body: dict[str, Any]) -> str:
    if path_kind is _Kind.CHAT:
        messages = body.get("messages")
        return apply_chat_template(messages if isinstance(messages, list) else [])
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        return " ".join(str(t) for t in prompt)
    return str(prompt)


def _count_prompt(path_kind: _Kind, body: dict[str, Any]) -> int:
    prompt = body.get("prompt")
    if path_kind is not _Kind.CHAT and isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return len(prompt)  # token ids are used as given, no BOS added
    return len(fake_tokenize(_prompt_text(path_kind, body), add_special=True))


def _piece(i: int) -> str:
    return PIECES[i % len(PIECES)]


def _rand_id() -> str:
    return "".join(random.choices(string.ascii_letters + string.digits, k=32))


# ----------------------------------------------------------------------------------------------------------
# llama.cpp response shapes


class _Kind(enum.Enum):
    CHAT = "chat"  # /v1/chat/completions
    CMPL = "cmpl"  # /v1/completions
    NATIVE = "native"  # /completion, /completions


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def _event(obj: Any) -> bytes:
    return b"data: " + _dumps(obj) + b"\n\n"


def _error_body(message: str, code: int, type_: str | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "error": {"code": code, "message": message, "type": type_ or _ERROR_TYPES.get(code, "server_error"), **extra}
    }


_ERROR_TYPES: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    500: "server_error",
    501: "not_supported_error",
    503: "unavailable_error",
}


@dataclass(slots=True)
class _Clock:
    """Generation timestamps (loop clock, s) for llama.cpp's ``timings``."""

    t_slot: float
    t_first: float | None = None
    t_last: float | None = None

    def timings(self, prompt_n: int, cache_n: int, n_gen: int) -> dict[str, Any]:
        t_first = self.t_first if self.t_first is not None else self.t_slot
        t_last = self.t_last if self.t_last is not None else t_first
        prompt_ms = (t_first - self.t_slot) * 1e3
        predicted_ms = (t_last - t_first) * 1e3
        steps = max(n_gen - 1, 0)  # "the first token is free"
        return {
            "cache_n": cache_n,
            "prompt_n": prompt_n,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n > 0 else 0.0,
            "prompt_per_second": 1e3 / prompt_ms * prompt_n if prompt_ms > 0 else 0.0,
            "predicted_n": n_gen,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / steps if steps > 0 else 0.0,
            "predicted_per_second": 1e3 / predicted_ms * steps if predicted_ms > 0 else 0.0,
        }


@dataclass(slots=True)
class _Plan:
    """One completion request, resolved."""

    kind: _Kind
    knobs: Knobs
    stream: bool
    include_usage: bool
    timings_per_token: bool
    prompt_tokens: int
    n_tokens: int  # content tokens to emit
    hit_limit: bool  # ends on the token limit ("length") rather than EOS ("stop")
    prompt_text: str
    model: str
    cmpl_id: str = field(default_factory=lambda: "chatcmpl-" + _rand_id())
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def n_decoded(self) -> int:
        return self.n_tokens if self.hit_limit else self.n_tokens + 1  # the EOS token counts

    @property
    def finish_reason(self) -> str:
        return "length" if self.hit_limit else "stop"

    @property
    def cache_n(self) -> int:
        return min(self.knobs.cached, self.prompt_tokens)

    def usage(self) -> dict[str, Any]:
        return {
            "completion_tokens": self.n_decoded,
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.n_decoded + self.prompt_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cache_n},
        }

    def timings(self, clock: _Clock, n_gen: int) -> dict[str, Any]:
        return clock.timings(self.prompt_tokens - self.cache_n, self.cache_n, n_gen)

    # -- stream events -----------------------------------------------------------------------------------

    def _chat_chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        return {
            "choices": [{"finish_reason": finish_reason, "index": 0, "delta": delta}],
            "created": self.created,
            "id": self.cmpl_id,
            "model": self.model,
            "system_fingerprint": BUILD_INFO,
            "object": "chat.completion.chunk",
        }

    def token_events(self, text: str, first: bool, n_gen: int, clock: _Clock) -> bytes:
        """The write for one token event: for chat the role chunk rides along with the first token."""
        timings = self.timings(clock, n_gen) if self.timings_per_token else None
        objs: list[dict[str, Any]]
        if self.kind is _Kind.CHAT:
            objs = [self._chat_chunk({"content": text})]
            if first:
                objs.insert(0, self._chat_chunk({"role": "assistant", "content": None}))
        elif self.kind is _Kind.CMPL:
            objs = [
                {
                    "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": None}],
                    "created": self.created,
                    "model": self.model,
                    "system_fingerprint": BUILD_INFO,
                    "object": "text_completion",
                    "id": self.cmpl_id,
                }
            ]
        else:
            objs = [
                {
                    "index": 0,
                    "content": text,
                    "tokens": fake_tokenize(text),
                    "stop": False,
                    "id_slot": -1,
                    "tokens_predicted": n_gen,
                    "tokens_evaluated": self.prompt_tokens,
                }
            ]
        if timings is not None:
            objs[-1]["timings"] = timings
        return b"".join(_event(o) for o in objs)

    def final_events(self, clock: _Clock) -> bytes:
        timings = self.timings(clock, self.n_decoded)
        if self.kind is _Kind.CHAT:
            objs = [self._chat_chunk({}, self.finish_reason)]
            if self.include_usage:
                usage_chunk = self._chat_chunk({})
                usage_chunk["choices"] = []
                usage_chunk["usage"] = self.usage()
                objs.append(usage_chunk)
            objs[-1]["timings"] = timings
            return b"".join(_event(o) for o in objs)
        if self.kind is _Kind.CMPL:
            return _event(self.cmpl_response("", timings))
        return _event(self.native_response("", timings))

    @property
    def terminator(self) -> bytes:
        return b"" if self.kind is _Kind.NATIVE else b"data: [DONE]\n\n"

    # -- whole responses ---------------------------------------------------------------------------------

    def text(self) -> str:
        return "".join(_piece(i) for i in range(self.n_tokens))

    def chat_response(self, timings: dict[str, Any]) -> dict[str, Any]:
        return {
            "choices": [
                {
                    "finish_reason": self.finish_reason,
                    "index": 0,
                    "message": {"role": "assistant", "content": self.text()},
                }
            ],
            "created": self.created,
            "model": self.model,
            "system_fingerprint": BUILD_INFO,
            "object": "chat.completion",
            "usage": self.usage(),
            "id": self.cmpl_id,
            "timings": timings,
        }

    def cmpl_response(self, text: str, timings: dict[str, Any]) -> dict[str, Any]:
        return {
            "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": self.finish_reason}],
            "created": self.created,
            "model": self.model,
            "system_fingerprint": BUILD_INFO,
            "object": "text_completion",
            "usage": self.usage(),
            "id": self.cmpl_id,
            "timings": timings,
        }

    def native_response(self, text: str, timings: dict[str, Any]) -> dict[str, Any]:
        return {
            "index": 0,
            "content": text,
            "tokens": [],
            "id_slot": 0,
            "stop": True,
            "model": self.model,
            "tokens_predicted": self.n_decoded,
            "tokens_evaluated": self.prompt_tokens,
            "generation_settings": {"n_predict": -1, "stream": self.stream},
            "prompt": self.prompt_text,
            "has_new_line": False,
            "truncated": False,
            "stop_type": "limit" if self.hit_limit else "eos",
            "stopping_word": "",
            "tokens_cached": self.prompt_tokens + self.n_decoded - 1,
            "timings": timings,
        }

    def whole_response(self, clock: _Clock) -> dict[str, Any]:
        timings = self.timings(clock, self.n_decoded)
        if self.kind is _Kind.CHAT:
            return self.chat_response(timings)
        if self.kind is _Kind.CMPL:
            return self.cmpl_response(self.text(), timings)
        return self.native_response(self.text(), timings)
