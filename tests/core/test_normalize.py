from __future__ import annotations

from typing import Any

import pytest

from proxy.config.settings import DEFAULT_SAMPLING
from proxy.normalize import ParamChange, normalize_request
from proxy.types import EngineKind

MSGS = [{"role": "user", "content": "hi"}]


def norm(body: dict[str, Any], kind: EngineKind, defaults: dict[str, Any] | None = None, served: str | None = "m"):  # type: ignore[no-untyped-def]
    return normalize_request(
        body,
        endpoint="chat",
        kind=kind,
        served_model=served,
        defaults=DEFAULT_SAMPLING if defaults is None else defaults,
    )


@pytest.mark.parametrize("kind", ["llamacpp", "sglang", "vllm"])
def test_every_engine_gets_the_same_explicit_sampling(kind: EngineKind) -> None:
    n = norm({"model": "alias", "messages": MSGS}, kind)
    assert n.body["model"] == "m"
    for key in ("temperature", "top_p", "min_p"):
        assert n.body[key] == DEFAULT_SAMPLING[key]
    assert n.body["top_k"] == 40
    assert ParamChange("temperature", "defaulted") in n.changes


def test_client_values_win_over_defaults() -> None:
    n = norm({"messages": MSGS, "temperature": 0, "top_k": 5}, "sglang")
    assert n.body["temperature"] == 0
    assert n.body["top_k"] == 5
    assert n.greedy
    assert ParamChange("temperature", "defaulted") not in n.changes


@pytest.mark.parametrize(("kind", "off"), [("llamacpp", 0), ("sglang", -1), ("vllm", -1)])
def test_top_k_off_is_mapped_per_engine(kind: EngineKind, off: int) -> None:
    for client_off in (0, -1):
        n = norm({"messages": MSGS, "top_k": client_off}, kind, defaults={})
        assert n.body["top_k"] == off
        assert (ParamChange("top_k", "changed") in n.changes) == (client_off != off)


def test_token_limit_aliases_become_max_tokens() -> None:
    n = norm({"messages": MSGS, "max_completion_tokens": 7}, "sglang", defaults={})
    assert n.body["max_tokens"] == 7
    assert "max_completion_tokens" not in n.body
    assert ParamChange("max_completion_tokens", "renamed") in n.changes
    n = norm({"messages": MSGS, "n_predict": 9}, "vllm", defaults={})
    assert n.body["max_tokens"] == 9
    n = norm({"messages": MSGS, "max_completion_tokens": 7}, "openai", defaults={})
    assert n.body["max_completion_tokens"] == 7


def test_repeat_penalties_are_not_converted_except_off() -> None:
    n = norm({"messages": MSGS, "repeat_penalty": 1.1}, "sglang", defaults={})
    assert "repeat_penalty" not in n.body and "repetition_penalty" not in n.body
    assert ParamChange("repeat_penalty", "dropped") in n.changes
    n = norm({"messages": MSGS, "repeat_penalty": 1.1}, "llamacpp", defaults={})
    assert n.body["repeat_penalty"] == 1.1
    n = norm({"messages": MSGS, "repetition_penalty": 1.0}, "llamacpp", defaults={})
    assert n.body["repeat_penalty"] == 1.0
    assert ParamChange("repetition_penalty", "renamed") in n.changes
    n = norm({"messages": MSGS}, "llamacpp", defaults={"repetition_penalty": 1.0})
    assert n.body["repeat_penalty"] == 1.0


def test_engine_specific_params_are_dropped_and_counted() -> None:
    n = norm({"messages": MSGS, "cache_prompt": False, "mirostat": 2}, "sglang", defaults={})
    assert "cache_prompt" not in n.body and "mirostat" not in n.body
    assert {ParamChange("cache_prompt", "dropped"), ParamChange("mirostat", "dropped")} <= set(n.changes)
    n = norm({"messages": MSGS, "cache_prompt": False}, "llamacpp", defaults={})
    assert n.body["cache_prompt"] is False
    n = norm({"messages": MSGS, "top_k": 3, "min_p": 0.1}, "openai", defaults={})
    assert "top_k" not in n.body and "min_p" not in n.body


def test_unknown_params_pass_and_are_counted_under_a_bounded_label() -> None:
    n = norm({"messages": MSGS, "my_weird_param": 1}, "llamacpp", defaults={})
    assert n.body["my_weird_param"] == 1
    assert ParamChange("other", "unknown") in n.changes


def test_stream_always_requests_usage_and_remembers_the_client_choice() -> None:
    n = norm({"messages": MSGS, "stream": True}, "llamacpp", defaults={})
    assert n.body["stream_options"] == {"include_usage": True}
    assert not n.client_wants_usage
    n = norm({"messages": MSGS, "stream": True, "stream_options": {"include_usage": True}}, "llamacpp", defaults={})
    assert n.client_wants_usage
    n = norm({"messages": MSGS, "stream_options": {"include_usage": True}}, "llamacpp", defaults={})
    assert "stream_options" not in n.body
    assert ParamChange("stream_options", "dropped") in n.changes


def test_client_body_is_not_mutated() -> None:
    body = {"messages": MSGS, "stream": True, "stream_options": {"include_usage": False}, "top_k": 0}
    before = repr(body)
    norm(body, "sglang")
    assert repr(body) == before
