from __future__ import annotations

import pytest

from proxy.sse import SSEFramer, encode_data


def test_splits_events_and_keeps_raw_bytes() -> None:
    f = SSEFramer()
    stream = b'data: {"a":1}\n\n:\n\ndata: [DONE]\n\n'
    events = f.feed(stream)
    assert [e.raw for e in events] == [b'data: {"a":1}\n\n', b":\n\n", b"data: [DONE]\n\n"]
    assert b"".join(e.raw for e in events) == stream
    assert events[0].data == b'{"a":1}'
    assert events[1].is_comment
    assert events[2].is_done
    assert f.pending == b""


@pytest.mark.parametrize("cut", range(1, 30))
def test_any_split_point_gives_the_same_events(cut: int) -> None:
    stream = b'data: {"x":"y"}\n\ndata: {"z":2}\n\n: ping\n\n'
    whole = [e.raw for e in SSEFramer().feed(stream)]
    f = SSEFramer()
    parts = f.feed(stream[:cut]) + f.feed(stream[cut:])
    assert [e.raw for e in parts] == whole
    assert f.pending == b""


def test_partial_event_stays_pending() -> None:
    f = SSEFramer()
    assert f.feed(b'data: {"a"') == []
    assert f.pending == b'data: {"a"'
    (ev,) = f.feed(b":1}\n\n")
    assert ev.data == b'{"a":1}'


def test_crlf_and_multiline_data() -> None:
    f = SSEFramer()
    events = f.feed(b"data: a\r\ndata: b\r\n\r\ndata:c\n\n")
    assert [e.data for e in events] == [b"a\nb", b"c"]
    assert events[0].raw == b"data: a\r\ndata: b\r\n\r\n"


def test_event_field_is_not_a_comment() -> None:
    (ev,) = SSEFramer().feed(b"event: error\ndata: {}\n\n")
    assert not ev.is_comment
    assert ev.data == b"{}"


def test_encode_data() -> None:
    assert encode_data(b"{}") == b"data: {}\n\n"


@pytest.mark.parametrize(
    "read",
    [
        b'data: {"a":1}\n\n',  # the fast path: one single-line event, the read itself
        b"data: \n\n",
        b"data: a\rb\n\n",  # a bare CR ends a line (SSE): two lines, not one
        b"data: a\n\n\n",  # an empty event after it
        b"data: a\ndata: b\n\n",  # two data lines
        b"data: a\n\ndata: b\n\n",  # two events in one read
        b"data:a\n\n",  # no space after the colon
        b"data: a\n",  # not whole yet
    ],
)
def test_a_read_gives_the_events_a_byte_by_byte_feed_gives(read: bytes) -> None:
    """The one-event fast path and the general framing agree (each byte fed alone takes the general one)."""
    whole = SSEFramer()
    slow = SSEFramer()
    by_bytes = [e for i in range(len(read)) for e in slow.feed(read[i : i + 1])]
    got = whole.feed(read)
    assert got == by_bytes
    assert whole.pending == slow.pending
    if got and got[0].raw == read:
        assert got[0].raw is read  # forwarded as the very bytes that came
