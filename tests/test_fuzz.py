"""Property-based fuzzing of the request path (hypothesis): generated bodies and headers against the real proxy on
a real socket, in front of the fault engine. Whatever a client sends:

- the proxy never answers with a 5xx of its own (the engine here is healthy, so any 5xx would be the proxy's);
- every error is OpenAI-shaped (``{"error": {"message": str, ...}}``), and the proxy's own say so
  (``"enginemeter": true``);
- every request is counted exactly once in ``enginemeter_requests_total``, and the in-flight gauge is back
  to 0 once the answer is in;
- a 200 stream ends with ``[DONE]`` or one in-band error event.

About 2,500 examples in all (~50 s on 2 cores); ``derandomize`` keeps CI runs the same (``FUZZ_RANDOM=1`` explores new examples).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fakes.fault_engine import FaultEngineConfig, Knobs, run_in_thread
from proxy.settings import EngineSettings, ModelAlias, RouteSettings, Settings, Timeouts
from tests.helpers import ProxyUnderTest, start_proxy

ALIAS = "team-model"
KEY = "sk-fuzz"
RANDOM = bool(os.environ.get("FUZZ_RANDOM"))
# hypothesis warns while printing a large failing example; the failure itself is what matters
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisWarning")]
FUZZ = settings(
    deadline=None,
    database=None,
    derandomize=not RANDOM,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def proxy() -> Iterator[ProxyUnderTest]:
    with ExitStack() as stack:
        engine_url = stack.enter_context(run_in_thread(FaultEngineConfig(model="engine-name", knobs=Knobs(tokens=3))))
        s = Settings(
            engines=(
                EngineSettings(name="fake", url=engine_url, kind="llamacpp", timeouts=Timeouts(connect=2, read=10)),
            ),
            routes=(RouteSettings(models=(ALIAS,), primary="fake"), RouteSettings(models=("*",), primary="fake")),
            models=(ModelAlias(alias=ALIAS, engines={"fake": "served-name"}),),
            api_keys=frozenset({KEY}),
        )
        yield start_proxy(stack, s)


# ---------------------------------------------------------------------------------------------- strategies

#: any code point, lone surrogates included (json.dumps writes them as \udXXX escapes)
any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=20)
json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True) | any_text
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_text, inner, max_size=4),
    max_leaves=8,
)
messages = (
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant"]) | any_text},
            optional={"content": any_text | json_values, "name": any_text},
        ),
        max_size=3,
    )
    | json_values
)
chat_bodies = st.fixed_dictionaries(
    {"messages": messages},
    optional={
        "model": st.sampled_from([ALIAS, "other-model", ""]) | any_text | json_values,
        "stream": st.booleans() | json_values,
        "max_tokens": st.integers(-5, 8) | json_values,
        "max_completion_tokens": st.integers(0, 8) | json_values,
        "temperature": st.floats(allow_nan=True, allow_infinity=True) | json_values,
        "top_p": st.floats(0, 1) | json_values,
        "top_k": st.integers(-1, 100) | json_values,
        "n": st.integers(0, 2) | json_values,
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": json_values}) | json_values,
        "user": any_text | json_values,
        "stop": json_values,
        "seed": json_values,
        "prompt": json_values,
        "extra": json_values,
    },
)


@st.composite
def raw_bodies(draw: st.DrawFn) -> bytes:
    """Bytes a client might send: a chat body (NaN/Infinity/lone surrogates allowed), any JSON value, a cut-off
    or deeply nested document, or plain bytes."""
    kind = draw(st.sampled_from(["chat", "value", "cut", "deep", "bytes"]))
    if kind == "chat":
        return json.dumps(draw(chat_bodies)).encode()
    if kind == "value":
        return json.dumps(draw(json_values)).encode()
    if kind == "cut":
        doc = json.dumps(draw(chat_bodies)).encode()
        return doc[: draw(st.integers(0, max(0, len(doc) - 1)))]
    if kind == "deep":
        depth = draw(st.integers(200, 3000))
        opener = draw(st.sampled_from([b"[", b'{"a":']))
        closer = b"]" if opener == b"[" else b"}"
        return b'{"messages":' + opener * depth + b"1" + closer * depth + b"}"
    return draw(st.binary(max_size=200))


header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=60)
header_sets = st.fixed_dictionaries(
    {},
    optional={
        "authorization": st.sampled_from([f"Bearer {KEY}", "Bearer", "bearer " + KEY, "Basic x"]) | header_text,
        "content-type": st.sampled_from(["application/json", "text/plain"]) | header_text,
        "x-request-id": header_text,
        "x-enginemeter-engine": st.sampled_from(["fake", "nope"]) | header_text,
        "x-session-id": header_text,
        "accept": header_text,
        "user-agent": header_text,
        "content-encoding": st.sampled_from(["gzip", "identity"]) | header_text,
    },
)
paths = st.sampled_from(["/v1/chat/completions", "/v1/completions"])


# ------------------------------------------------------------------------------------------------- checks


def check(p: ProxyUnderTest, before: float, r: httpx.Response) -> None:
    if r.status_code >= 400:
        try:
            doc = r.json()
        except ValueError:
            raise AssertionError(f"{r.status_code} with a body that is not JSON: {r.content[:200]!r}") from None
        assert isinstance(doc, dict) and isinstance(doc.get("error"), dict), doc
        assert isinstance(doc["error"].get("message"), str), doc
        if r.status_code >= 500:
            raise AssertionError(f"a 5xx with a healthy engine: {doc}")
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [e for e in r.content.split(b"\n\n") if e]
        assert events, "an empty stream"
        last = events[-1]
        assert last == b"data: [DONE]" or b'"error"' in last, last[:200]
    else:
        assert isinstance(r.json(), dict)
    assert p.total("enginemeter_requests_total") == before + 1, "not counted exactly once"
    assert p.total("enginemeter_in_flight_requests") == 0


def send(p: ProxyUnderTest, path: str, raw: bytes, headers: Mapping[bytes, bytes]) -> None:
    before = p.total("enginemeter_requests_total")
    r = p.client.post(path, content=raw, headers=headers)
    check(p, before, r)


# ---------------------------------------------------------------------------------------------------- tests


@settings(FUZZ, max_examples=1200)
@given(path=paths, raw=raw_bodies())
def test_any_body_gets_a_shaped_answer_counted_once(proxy: ProxyUnderTest, path: str, raw: bytes) -> None:
    send(proxy, path, raw, {b"authorization": f"Bearer {KEY}".encode(), b"content-type": b"application/json"})


@settings(FUZZ, max_examples=900)
@given(path=paths, headers=header_sets, body=chat_bodies)
def test_any_headers_get_a_shaped_answer_counted_once(
    proxy: ProxyUnderTest, path: str, headers: dict[str, str], body: dict[str, Any]
) -> None:
    # as bytes: latin-1 values are legal on the wire (httpx would encode str as ASCII); h11 refuses edge blanks
    raw_headers = {k.encode(): v.strip(" \t").encode("latin-1") for k, v in headers.items()}
    send(proxy, path, json.dumps(body).encode(), raw_headers)


@settings(FUZZ, max_examples=400)
@given(
    path=paths,
    model=any_text,
    content=any_text,
    stream=st.booleans(),
    max_tokens=st.integers(0, 4),
)
def test_plausible_requests_are_answered(
    proxy: ProxyUnderTest, path: str, model: str, content: str, stream: bool, max_tokens: int
) -> None:
    body: dict[str, Any] = {"model": model, "stream": stream, "max_tokens": max_tokens}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": content}]
    else:
        body["prompt"] = content
    send(proxy, path, json.dumps(body).encode(), {b"authorization": f"Bearer {KEY}".encode()})
