"""The one documented change to what an engine answers: its ``"model"`` value becomes the name the client asked for
(its alias), as a byte replace in the bytes the engine sent, never a re-serialization unless the bytes are spelled
in a way the replace cannot find (then it is counted: ``enginemeter_reserialized_events_total``).

- ``ModelRewrite``: the relay's, once per event or non-stream body (``proxy.server.request.relay``). The engine's name is
  learned from the first parsed event and kept; an engine that changes it mid-stream is followed.
- ``replace_model``: pass-through bodies (``proxy.server.passthrough``), which are never parsed: both spellings
  (``"model":"x"`` and ``"model": "x"``), first match only, else the body as it came.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from proxy.sse import encode_data


class ModelRewrite:
    """``"model":<engine's name>`` -> ``"model":<alias>`` in each event (``alias`` None: nothing is rewritten)."""

    __slots__ = ("_from", "_src", "_to", "alias", "reserialized")

    def __init__(self, alias: str | None) -> None:
        self.alias = alias
        #: events (or bodies) re-serialized because the byte replace found nothing to replace
        self.reserialized = 0
        self._src: Any = None
        self._from: bytes | None = None
        self._to = b""

    def apply(self, raw: bytes, doc: dict[str, Any], sse: bool = True) -> bytes:
        """``raw`` (an SSE event when ``sse``, else a whole body) with its model renamed; ``doc`` is its parse."""
        model = doc.get("model")
        if model is None:
            return raw
        if model != self._src:  # the first event, or an engine that changes its name mid-stream
            alias = self.alias
            self._src = model
            if alias is None or model == alias:
                self._from = None  # nothing to rewrite
            else:
                self._from = b'"model":' + json.dumps(model, ensure_ascii=False).encode()
                self._to = b'"model":' + json.dumps(alias, ensure_ascii=False).encode()
        if self._from is None:
            return raw
        out = raw.replace(self._from, self._to, 1)
        if out is not raw:  # bytes.replace gives back the very object when there is nothing to replace
            return out
        # unusual formatting (spaces after the colon): re-serialize this one event (or body), counted
        doc["model"] = self.alias
        self.reserialized += 1
        data = json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()
        return encode_data(data) if sse else data


def replace_model(body: bytes, served: str, alias: str) -> bytes:
    """A pass-through body with the engine's ``served`` model name replaced by ``alias`` (first match only)."""
    for sep in (b":", b": "):
        old = b'"model"' + sep + orjson.dumps(served)
        if old in body:
            return body.replace(old, b'"model"' + sep + orjson.dumps(alias), 1)
    return body
