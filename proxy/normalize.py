"""Client body -> one explicit, engine-specific body. Pure functions, no I/O.

What happens to a client request on its way to an engine of kind ``llamacpp|sglang|vllm|openai``:

1. ``model`` becomes the engine's served model name (the client's alias comes back in every response chunk).
2. Configured sampling defaults fill every param the client omitted, so all engines get explicit values
   (llama.cpp's hidden defaults differ from SGLang's/vLLM's generation_config). Each fill is counted
   (``action=defaulted``).
3. Names are mapped: ``max_completion_tokens`` and llama.cpp's ``n_predict`` become ``max_tokens``
   (``renamed``), which every engine accepts.
4. Semantics are mapped where they are truly equivalent: ``top_k`` "off" is 0 for llama.cpp and -1 for
   SGLang/vLLM (``changed``).
5. ``repeat_penalty`` (llama.cpp: over the last ``repeat_last_n``=64 tokens) and ``repetition_penalty``
   (SGLang/vLLM: over prompt + output) are **not** equivalent. A value of 1.0 means "off" in both and is
   mapped freely (``renamed``); any other value goes only to engines with that exact semantics and is
   ``dropped`` elsewhere — never silently converted.
6. Params the engine cannot take are removed (``dropped``). Params nobody knows pass through (``unknown``).
7. For streams, ``stream_options.include_usage`` is forced on; ``Normalized.client_wants_usage`` says whether
   the usage event must be stripped from the client's stream again.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from proxy.types import Endpoint, EngineKind

ALL: frozenset[EngineKind] = frozenset({"llamacpp", "sglang", "vllm", "openai"})
SELF_HOSTED: frozenset[EngineKind] = frozenset({"llamacpp", "sglang", "vllm"})
LLAMA: frozenset[EngineKind] = frozenset({"llamacpp"})
SGL_VLLM: frozenset[EngineKind] = frozenset({"sglang", "vllm"})
SGLANG: frozenset[EngineKind] = frozenset({"sglang"})
VLLM: frozenset[EngineKind] = frozenset({"vllm"})

#: param -> engine kinds that accept it with OpenAI/shared semantics
SUPPORT: Mapping[str, frozenset[EngineKind]] = {
    # OpenAI
    **dict.fromkeys(
        (
            "model", "messages", "prompt", "stream", "stream_options", "max_tokens", "max_completion_tokens",
            "temperature", "top_p", "n", "stop", "presence_penalty", "frequency_penalty", "logit_bias",
            "logprobs", "top_logprobs", "seed", "user", "tools", "tool_choice", "response_format",
            "parallel_tool_calls", "reasoning_effort", "metadata", "store", "service_tier", "modalities",
            "audio", "prediction", "function_call", "functions",
        ),
        ALL,
    ),
    "echo": SGL_VLLM | {"openai"},
    "suffix": frozenset({"openai", "sglang"}),
    "best_of": frozenset({"openai", "vllm"}),
    # self-hosted extensions
    **dict.fromkeys(("top_k", "min_p", "ignore_eos", "chat_template_kwargs", "continue_final_message",
                     "add_generation_prompt"), SELF_HOSTED),
    **dict.fromkeys(("min_tokens", "stop_token_ids", "skip_special_tokens", "spaces_between_special_tokens",
                     "priority", "return_token_ids", "cache_salt"), SGL_VLLM),
    "repeat_penalty": LLAMA,
    "repetition_penalty": SGL_VLLM,
    # llama.cpp only
    **dict.fromkeys(
        (
            "cache_prompt", "n_keep", "id_slot", "mirostat", "mirostat_tau", "mirostat_eta", "typical_p",
            "dynatemp_range", "dynatemp_exponent", "repeat_last_n", "dry_multiplier", "dry_base",
            "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers", "xtc_probability",
            "xtc_threshold", "top_n_sigma", "samplers", "grammar", "json_schema", "n_probs",
            "timings_per_token", "return_progress", "t_max_predict_ms", "n_indent", "n_cmpl",
            "post_sampling_probs", "min_keep", "reasoning_format", "return_tokens", "lora", "n_discard",
            "n_cache_reuse", "response_fields", "sse_ping_interval", "reasoning_budget_tokens",
            "parse_tool_calls",
        ),
        LLAMA,
    ),
    # SGLang only
    **dict.fromkeys(
        ("regex", "ebnf", "no_stop_trim", "separate_reasoning", "stream_reasoning", "rid", "session_params",
         "lora_path", "return_hidden_states", "custom_logit_processor", "custom_params", "stop_regex",
         "return_cached_tokens_details", "sampling_seed"),
        SGLANG,
    ),
    # vLLM only
    **dict.fromkeys(
        ("use_beam_search", "length_penalty", "include_stop_str_in_output", "prompt_logprobs",
         "allowed_token_ids", "bad_words", "structured_outputs", "truncate_prompt_tokens", "request_id",
         "include_reasoning", "thinking_token_budget", "guided_json", "guided_regex", "guided_choice"),
        VLLM,
    ),
}  # fmt: skip

#: the params a sampling default may fill
DEFAULTABLE = frozenset({"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "repeat_penalty", "seed",
                         "max_tokens", "presence_penalty", "frequency_penalty"})  # fmt: skip
TOKEN_LIMIT_ALIASES = ("max_completion_tokens", "n_predict")


class ParamChange(NamedTuple):
    """NamedTuples here, not frozen dataclasses: made on every request's path (a frozen dataclass sets each field
    with ``object.__setattr__``)."""

    param: str  # a name from SUPPORT (or "other"), so it is a bounded label
    action: str  # dropped | defaulted | renamed | changed | unknown


class Normalized(NamedTuple):
    body: dict[str, Any]
    changes: tuple[ParamChange, ...]
    stream: bool
    client_wants_usage: bool
    greedy: bool


def param_label(name: str) -> str:
    return name if name in SUPPORT or name in TOKEN_LIMIT_ALIASES else "other"


def normalize_request(
    client: Mapping[str, Any],
    *,
    endpoint: Endpoint,
    kind: EngineKind,
    served_model: str | None,
    defaults: Mapping[str, Any],
) -> Normalized:
    changes: list[ParamChange] = []
    body: dict[str, Any] = {}
    for key, value in client.items():
        if key in TOKEN_LIMIT_ALIASES:
            if kind == "openai" and key == "max_completion_tokens":
                body[key] = value
                continue
            if "max_tokens" in client and key != "n_predict":
                # both given: llama.cpp lets n_predict win; otherwise max_tokens wins and the alias goes
                changes.append(ParamChange(key, "dropped"))
                continue
            body["max_tokens"] = value
            changes.append(ParamChange(key, "renamed"))
            continue
        if key in ("repeat_penalty", "repetition_penalty"):
            _penalty(key, value, kind, body, changes)
            continue
        support = SUPPORT.get(key)
        if support is None:
            body[key] = value
            changes.append(ParamChange("other", "unknown"))
        elif kind in support:
            body[key] = value
        else:
            changes.append(ParamChange(key, "dropped"))

    # 2. explicit sampling for every engine
    for key, value in defaults.items():
        if key not in DEFAULTABLE:
            continue
        present = key in body or (
            key in ("repeat_penalty", "repetition_penalty")
            and ("repeat_penalty" in body or "repetition_penalty" in body)
        )
        if present or key in client:
            continue
        if key in ("repeat_penalty", "repetition_penalty"):
            _penalty(key, value, kind, body, changes, action_if_kept="defaulted")
        elif kind in SUPPORT[key]:
            body[key] = value
            changes.append(ParamChange(key, "defaulted"))

    # 4. top_k "off"
    if "top_k" in body and isinstance(body["top_k"], int | float) and body["top_k"] <= 0:
        off = 0 if kind == "llamacpp" else -1
        if body["top_k"] != off:
            body["top_k"] = off
            changes.append(ParamChange("top_k", "changed"))

    if served_model is not None:
        body["model"] = served_model

    stream = bool(client.get("stream"))
    wants_usage = False
    if stream:
        opts = client.get("stream_options")
        opts = dict(opts) if isinstance(opts, Mapping) else {}
        wants_usage = bool(opts.get("include_usage"))
        opts["include_usage"] = True
        body["stream_options"] = opts
    elif "stream_options" in body:
        # OpenAI rejects stream_options without stream; engines ignore it. Drop it, counted.
        del body["stream_options"]
        changes.append(ParamChange("stream_options", "dropped"))
    temp = body.get("temperature")
    greedy = isinstance(temp, int | float) and temp == 0
    del endpoint  # both endpoints share one param vocabulary today
    return Normalized(body=body, changes=tuple(changes), stream=stream, client_wants_usage=wants_usage, greedy=greedy)


def _penalty(
    key: str,
    value: Any,
    kind: EngineKind,
    body: dict[str, Any],
    changes: list[ParamChange],
    *,
    action_if_kept: str | None = None,
) -> None:
    native = "repeat_penalty" if kind == "llamacpp" else "repetition_penalty" if kind in SGL_VLLM else None
    if native is None:
        changes.append(ParamChange(key, "dropped"))
    elif key == native:
        body[key] = value
        if action_if_kept:
            changes.append(ParamChange(key, action_if_kept))
    elif isinstance(value, int | float) and value == 1.0:
        body[native] = 1.0  # "off" is the one value both semantics share
        changes.append(ParamChange(key, action_if_kept or "renamed"))
    else:
        changes.append(ParamChange(key, "dropped"))
