"""Property-based fuzzing of the request path (hypothesis): generated bodies and headers against the real proxy on
a real socket, in front of the fault engine. Whatever a client sends:

- the proxy never answers with a 5xx of its own (the engine here is healthy, so any 5xx would be the proxy's);
- every error is OpenAI-shaped (``{"error": {"message": str, ...}}``), and the proxy's own say so
  (``"enginemeter": true``);
- every request is counted exactly once in ``enginemeter_requests_total``, and the in-flight gauge is back
  to 0 once the answer is in;
- a 200 stream ends with ``[DONE]`` or one in-band error event.

The same for the pass-through routes, with generated paths (dot segments, encoded dots and slashes, doubled
slashes, the proxy's own paths spelt otherwise) and methods: an engine's own answer passes (unmarked, any
status), the proxy's refusals are marked 404s, and whatever reaches the engine is a normalised path of the
pass-through set (never ``..``, ``//``, an encoded dot or slash, a generation path); a request answered by a
route is counted once, a path refused before any route is not a request (no count). And once more against
``enginemeter serve --workers 2`` (a subprocess; counts read from the merged ``/metrics``).

About 3,350 examples in all (~2.5 min on 2 cores); ``derandomize`` keeps CI runs the same (``FUZZ_RANDOM=1``
explores new examples).
"""

from __future__ import annotations

import http.client
import json
import os
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fakes.fault_engine import FaultEngineConfig, Knobs, run_in_thread
from proxy.config.settings import EngineSettings, ModelAlias, RouteSettings, Settings, Timeouts
from tests.helpers import ProcessServer, ProxyUnderTest, start_proxy, wait_until

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
def engine() -> Iterator[str]:
    with run_in_thread(FaultEngineConfig(model="engine-name", knobs=Knobs(tokens=3))) as url:
        yield url


@pytest.fixture(scope="module")
def proxy(engine: str) -> Iterator[ProxyUnderTest]:
    with ExitStack() as stack:
        engine_url = engine
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


# --------------------------------------------------------------------------------------------- pass-through

#: path segments a hostile or clumsy client writes; "%00"-style escapes stay escapes on the wire
segments = st.sampled_from(
    ["..", ".", "", "%2e%2e", "%2E", ".%2e", "%2f", "%2F", "%252e%252e", "%252f", "%5c", "%5C", "slots", "0",
     "completion", "chat", "completions", "embeddings", "tokenize", "detokenize", "models", "v1", "%63hat", "a%20b",
     ";", "..;", "%00", "%0a", "~", "props"]
) | st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters="/?#%"), max_size=6)  # fmt: skip


@st.composite
def targets(draw: st.DrawFn) -> str:
    prefix = draw(st.sampled_from(["/v1/", "/", "//", "/tokenize", "/tokenize/", "/detokenize", "/v1", "/v1//"]))
    path = prefix + "/".join(draw(st.lists(segments, max_size=5)))
    return path + draw(st.sampled_from(["", "?action=erase", "?a=%2e%2e/b", "?"]))


methods = st.sampled_from(["POST", "POST", "GET", "DELETE", "PUT"])
content_types = st.sampled_from(["application/json", "application/x-www-form-urlencoded", "text/plain", "multipart/form-data; boundary=x", ""])  # fmt: skip
OWN = ("/v1/chat/completions", "/v1/completions", "/v1/models")


def forwardable(path: str) -> bool:
    """What may reach the engine: a normalised path of the pass-through set (independent of proxy/server/request/paths.py)."""
    p = path.partition("?")[0]
    segs = p.split("/")[1:]
    if re.search(r"%(2e|2f|5c)|\\", p, re.IGNORECASE) or "//" in p or any(s in (".", "..") for s in segs):
        return False
    if p.rstrip("/") in OWN:
        return False
    return p in ("/tokenize", "/detokenize") or p.startswith("/v1/")


def raw(url: str, method: str, target: str, body: bytes, headers: Mapping[str, str]) -> tuple[int, dict[str, str], bytes]:  # fmt: skip
    u = url.removeprefix("http://")
    host, port = u.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, target, body=body or None, headers=dict(headers))
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def check_passthrough(
    engine_url: str, total: Callable[[], float], in_flight: Callable[[], float], send: Callable[[], tuple[int, dict[str, str], bytes]]
) -> None:  # fmt: skip
    seen = len(httpx.get(f"{engine_url}/_fake/requests?full=1", timeout=10).json())
    before = total()
    status, headers, body = send()
    doc: Any = None
    if headers.get("content-type", "").startswith("application/json"):
        try:
            doc = json.loads(body)
        except ValueError:
            raise AssertionError(f"{status}: JSON content-type, body not JSON: {body[:200]!r}") from None
    err: dict[str, Any] = doc["error"] if isinstance(doc, dict) and isinstance(doc.get("error"), dict) else {}
    marked = err.get("enginemeter") is True
    if marked:
        assert isinstance(err.get("message"), str) and err.get("code") == status, doc
        assert status < 500, f"the proxy's own {status} with a healthy engine: {doc}"
    elif "x-enginemeter-engine" not in headers:
        raise AssertionError(f"{status} from neither the proxy (marked) nor an engine: {body[:200]!r}")
    refused = marked and status == 404 and err["message"].startswith("Not Found:")
    if refused:  # a path refused before any route: not a request
        assert total() == before, "a refused path was counted"
    else:
        wait_until(lambda: total() >= before + 1, timeout=5, message="counted")
        assert total() == before + 1, "not counted exactly once"
    wait_until(lambda: in_flight() == 0, timeout=5, message="in flight back to 0")
    new = httpx.get(f"{engine_url}/_fake/requests?full=1", timeout=10).json()[seen:]
    assert all(forwardable(q["path"]) for q in new), [q["path"] for q in new]
    if refused:
        assert new == [], [q["path"] for q in new]


@settings(FUZZ, max_examples=500)
@given(method=methods, target=targets(), raw_body=raw_bodies(), ctype=content_types)
def test_any_pass_through_path_and_body_stays_confined_and_counted(
    proxy: ProxyUnderTest, engine: str, method: str, target: str, raw_body: bytes, ctype: str
) -> None:
    headers = {"authorization": f"Bearer {KEY}", **({"content-type": ctype} if ctype else {})}
    check_passthrough(
        engine,
        lambda: proxy.total("enginemeter_requests_total"),
        lambda: proxy.total("enginemeter_in_flight_requests"),
        lambda: raw(proxy.url, method, target, raw_body if method in ("POST", "PUT") else b"", headers),
    )


# ------------------------------------------------------------------------------------------ serve --workers 2


@pytest.fixture(scope="module")
def workers(engine: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    directory = tmp_path_factory.mktemp("fuzz-workers") / "metrics"
    with ProcessServer(
        "proxy.cli", "serve", "--primary", f"fake={engine}", "--listen", "127.0.0.1:{port}", "--workers", "2",
        "--log-level", "warning", ready_path="/health", startup_timeout=60,
        env={"PROMETHEUS_MULTIPROC_DIR": str(directory), "ENGINEMETER_API_KEYS": KEY, "ENGINEMETER_ADMIN_KEY": ""},
    ) as server:  # fmt: skip
        yield server.url


def scraped(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", headers={"connection": "close"}, timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


@settings(FUZZ, max_examples=200)
@given(path=paths, raw_body=raw_bodies())
def test_workers_any_body_gets_a_shaped_answer_counted_once(workers: str, path: str, raw_body: bytes) -> None:
    before = scraped(workers, "enginemeter_requests_total")
    headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json", "connection": "close"}
    r = httpx.post(f"{workers}{path}", content=raw_body, headers=headers, timeout=30)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and r.status_code < 500, err
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        last = [e for e in r.content.split(b"\n\n") if e][-1]
        assert last == b"data: [DONE]" or b'"error"' in last, last[:200]
    wait_until(lambda: scraped(workers, "enginemeter_requests_total") >= before + 1, timeout=5, message="counted")
    assert scraped(workers, "enginemeter_requests_total") == before + 1
    wait_until(lambda: scraped(workers, "enginemeter_in_flight_requests") == 0, timeout=5)


@settings(FUZZ, max_examples=150)
@given(method=methods, target=targets(), raw_body=raw_bodies(), ctype=content_types)
def test_workers_any_pass_through_path_stays_confined_and_counted(
    workers: str, engine: str, method: str, target: str, raw_body: bytes, ctype: str
) -> None:
    headers = {"authorization": f"Bearer {KEY}", "connection": "close", **({"content-type": ctype} if ctype else {})}
    check_passthrough(
        engine,
        lambda: scraped(workers, "enginemeter_requests_total"),
        lambda: scraped(workers, "enginemeter_in_flight_requests"),
        lambda: raw(workers, method, target, raw_body if method in ("POST", "PUT") else b"", headers),
    )
