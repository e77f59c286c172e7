"""Incremental SSE framer: upstream bytes in, whole events out. Pure: no clock, no I/O.

Invariants:
- an event's ``raw`` bytes are exactly the bytes the upstream sent for it, terminator included, so a
  pass-through event is forwarded without re-serialization;
- bytes that do not yet form a whole event stay buffered (``pending``) until the next ``feed``;
- comments (``:`` lines, e.g. llama.cpp's ``:\\n\\n`` keep-alive) are events with ``is_comment``.

The common terminator is ``\\n\\n``; ``\\r\\n\\r\\n`` and ``\\r\\r`` are accepted too (SSE spec).

One event may be at most ``max_event_bytes`` (``EventTooLarge``, a ``ValueError``, past it). An event longer
than one read is collected as a list of reads and joined once a read holds a line break, so a big event costs
linear time, not one copy of the whole buffer per read.
"""

from __future__ import annotations

from typing import NamedTuple

DONE = b"[DONE]"
#: the largest single event accepted from an engine (a big tool call or logprobs event is well under 1 MiB)
MAX_EVENT_BYTES = 8 << 20


class EventTooLarge(ValueError):
    """An event grew past the framer's ``max_event_bytes`` before its terminator."""


class Event(NamedTuple):
    """One whole event. A tuple, not a frozen dataclass: made once per event on the hot path, and a frozen
    dataclass's ``__init__`` (one ``object.__setattr__`` per field) cost 4 % of the proxy's CPU at 1,000 requests/s."""

    raw: bytes
    #: the joined ``data:`` field (b"" when the event has none)
    data: bytes
    is_comment: bool

    @property
    def is_done(self) -> bool:
        return self.data == DONE


def _parse(raw: bytes) -> Event:
    data: list[bytes] = []
    has_field = False
    for line in raw.splitlines():
        if not line:
            continue
        if line.startswith(b":"):
            continue
        has_field = True
        name, _, value = line.partition(b":")
        if name == b"data":
            data.append(value[1:] if value.startswith(b" ") else value)
        # other fields (event:, id:, retry:) stay in raw and are otherwise ignored
    return Event(raw=raw, data=b"\n".join(data), is_comment=not has_field)


class SSEFramer:
    """Feed it byte chunks as they arrive; it returns the events completed by each chunk."""

    __slots__ = ("_buf", "_parts", "_size", "max_event_bytes")

    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self._buf = b""
        #: reads of an unfinished event, not yet joined (only when it is longer than one read)
        self._parts: list[bytes] = []
        self._size = 0
        self.max_event_bytes = max_event_bytes

    @property
    def pending(self) -> bytes:
        return b"".join(self._parts) if self._parts else self._buf

    def whole(self, chunk: bytes) -> bytes | None:
        """The data of ``chunk`` when nothing is pending and the read is one whole single-line ``data:`` event
        (the shape of nearly every read from every engine we front: one event a write); else None, and the read
        goes to ``feed``. The relay's per-read fast path: no event tuple, no list, and the read itself is the
        event's raw bytes."""
        if (
            not self._buf
            and chunk.startswith(b"data: ")
            and chunk.find(b"\n", 6) == len(chunk) - 2
            and chunk[-1] == 10  # b"\n"
            and b"\r" not in chunk
        ):
            return chunk[6:-2]
        return None

    def feed(self, chunk: bytes) -> list[Event]:
        data = self.whole(chunk)
        if data is not None:
            # the read is one whole single-line event: the read itself is the event's raw bytes, no split, no copy
            return [Event(chunk, data, False)]
        if self._buf:
            # an unfinished event: collect reads until one could end it (a line break), then join once
            self._parts.append(chunk)
            self._size += len(chunk)
            if b"\n" not in chunk and b"\r" not in chunk:
                if self._size > self.max_event_bytes:
                    raise EventTooLarge(f"an SSE event exceeds {self.max_event_bytes} bytes")
                return []
            buf = b"".join(self._parts)
        else:
            buf = chunk
        events: list[Event] = []
        start = 0
        if b"\r" not in buf:
            # fast path: every engine we front frames with "\n\n"
            while True:
                end = buf.find(b"\n\n", start)
                if end < 0:
                    break
                raw = buf[start : end + 2]
                if raw.startswith(b"data: ") and buf.find(b"\n", start + 6, end) < 0:
                    # one "data: " line, the shape of nearly every event: no line splitting
                    events.append(Event(raw, raw[6:-2], False))
                else:
                    events.append(_parse(raw))
                start = end + 2
        else:
            while True:
                end, width = _find_terminator(buf, start)
                if end < 0:
                    break
                events.append(_parse(buf[start : end + width]))
                start = end + width
        self._buf = buf[start:] if start < len(buf) else b""
        parts = self._parts
        if parts:
            parts.clear()
        if self._buf:
            parts.append(self._buf)
        self._size = len(self._buf)
        if self._size > self.max_event_bytes:
            raise EventTooLarge(f"an SSE event exceeds {self.max_event_bytes} bytes")
        return events


def _find_terminator(buf: bytes, start: int) -> tuple[int, int]:
    best = (-1, 0)
    for term in (b"\r\n\r\n", b"\n\n", b"\r\r"):
        i = buf.find(term, start)
        if i >= 0 and (best[0] < 0 or i < best[0]):
            best = (i, len(term))
    return best


def encode_data(payload: bytes) -> bytes:
    """Frame one JSON payload as an SSE data event."""
    return b"data: " + payload + b"\n\n"
