"""proxy/server/request/rewrite.py: the engine's model name -> the client's alias, as bytes; re-serialized only when the
bytes are spelled otherwise, and then counted."""

from __future__ import annotations

from collections.abc import Mapping

import orjson

from proxy.server.request.rewrite import ModelRewrite, replace_model


def _event(doc: Mapping[str, object], spaced: bool = False) -> bytes:
    data = orjson.dumps(doc)
    if spaced:
        data = data.replace(b'"model":', b'"model": ')
    return b"data: " + data + b"\n\n"


def test_the_compact_spelling_is_a_byte_replace_of_that_value_only() -> None:
    rw = ModelRewrite("alias")
    doc = {"id": "x", "model": "engine-7b", "choices": [{"delta": {"content": "engine-7b"}}]}
    raw = _event(doc)
    out = rw.apply(raw, orjson.loads(raw[6:-2]))
    assert out == raw.replace(b'"model":"engine-7b"', b'"model":"alias"')
    assert b'"content":"engine-7b"' in out  # the same string elsewhere is the engine's text: untouched
    assert rw.reserialized == 0


def test_another_spelling_is_re_serialized_and_counted() -> None:
    rw = ModelRewrite("alias")
    raw = _event({"model": "engine-7b", "choices": []}, spaced=True)
    out = rw.apply(raw, orjson.loads(raw[6:-2]))
    assert out.startswith(b"data: ") and out.endswith(b"\n\n")
    assert orjson.loads(out[6:-2])["model"] == "alias"
    assert rw.reserialized == 1


def test_no_alias_or_the_same_name_leaves_the_bytes_as_they_came() -> None:
    raw = _event({"model": "m", "choices": []})
    for rw in (ModelRewrite(None), ModelRewrite("m")):
        assert rw.apply(raw, orjson.loads(raw[6:-2])) is raw
        assert rw.reserialized == 0


def test_an_engine_that_changes_its_name_mid_stream_is_followed_and_a_body_is_no_event() -> None:
    rw = ModelRewrite("alias")
    for name in ("a", "b", "a"):
        raw = _event({"model": name})
        assert orjson.loads(rw.apply(raw, orjson.loads(raw[6:-2]))[6:-2])["model"] == "alias"
    body = orjson.dumps({"model": "b", "choices": []}).replace(b'"model":', b'"model" :')
    out = rw.apply(body, orjson.loads(body), sse=False)
    assert not out.startswith(b"data:") and orjson.loads(out)["model"] == "alias"
    assert rw.reserialized == 1


def test_pass_through_bodies_take_both_spellings_and_nothing_else() -> None:
    assert replace_model(b'{"model":"e","x":1}', "e", "a") == b'{"model":"a","x":1}'
    assert replace_model(b'{"model": "e"}', "e", "a") == b'{"model": "a"}'
    assert replace_model(b'{"model" : "e"}', "e", "a") == b'{"model" : "e"}'
