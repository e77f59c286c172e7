"""Readers for the captured engine answers in ``tests/fixtures/engines/`` (see the README there).

Two writers, one reading: ``scripts/gpu/capture.py`` (the H200 run of issue 11: ``endpoints.json`` with every
GET's status, content type and body, ``/metrics`` in ``metrics.txt``, raw SSE files, ``*.txt`` HTTP records,
``parity.json``) and ``scripts/capture_engine.py`` (``answers.jsonl`` + ``meta.json``). ``answers(folder)``
gives both as one table ``(method, path) -> Answer``; ``serve_answers`` puts a table on a real socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.helpers import run_uvicorn_app

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "engines"
#: the H200 captures of issue 11, by engine kind
GPU = {
    "llamacpp": FIXTURES / "llama.cpp-11434.0.0",
    "sglang": FIXTURES / "sglang-0.5.17",
    "vllm": FIXTURES / "vllm-0.26.0",
}
#: the message list of parity.json's case "hi" (scripts/gpu/capture.py PARITY_CASES)
HI = [{"role": "user", "content": "hi"}]


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    content_type: str | None
    body: bytes
    #: how long the engine took to answer (endpoints.json ``s``; 0 where not recorded)
    seconds: float = 0.0

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass(frozen=True, slots=True)
class HttpRecord:
    """A ``*.txt`` record: status line, headers (lower-cased names), raw body."""

    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def metrics_text(folder: Path) -> bytes:
    """``/metrics`` at start-up: ``metrics.txt``, except where the capture spoiled it. SGLang sent its start-up
    ``/metrics`` gzip-encoded and capture.py stored that body through a UTF-8 decode, so
    ``sglang-0.5.17/metrics.txt`` is unreadable; ``metrics_after.txt`` (read decoded) stands in."""
    body = (folder / "metrics.txt").read_bytes()
    if "\ufffd" in body.decode("utf-8", "replace"):
        return (folder / "metrics_after.txt").read_bytes()
    return body


def endpoints(folder: Path) -> dict[str, Answer]:
    """``endpoints.json``: GET path -> answer (``/metrics`` with its body from ``metrics_text``)."""
    out: dict[str, Answer] = {}
    for path, rec in json.loads((folder / "endpoints.json").read_text()).items():
        body = rec["body"].encode()
        if path == "/metrics" and rec["status"] == 200:
            body = metrics_text(folder)
        out[path] = Answer(rec["status"], rec["content_type"], body, float(rec.get("s") or 0.0))
    return out


def tokenize_answers(folder: Path, kind: str) -> dict[tuple[str, str], Answer]:
    """The token-count endpoints for the parity case "hi", assembled from ``parity.json``: the ids are the
    engine's own, the envelope is the one its source writes (the capture kept ids only)."""
    hi = json.loads((folder / "parity.json").read_text())["hi"]
    ids: list[int] = hi["ids"]
    ctype = "application/json"
    if kind == "llamacpp":
        return {
            ("POST", "/apply-template"): Answer(200, ctype, json.dumps({"prompt": hi["rendered"]}).encode()),
            ("POST", "/tokenize"): Answer(200, ctype, json.dumps({"tokens": ids}).encode()),
        }
    doc = {"tokens": ids, "count": len(ids), "max_model_len": 8192}
    path = "/v1/tokenize" if kind == "sglang" else "/tokenize"
    return {("POST", path): Answer(200, ctype, json.dumps(doc).encode())}


def answers(folder: Path) -> dict[tuple[str, str], Answer]:
    """Every recorded answer of a capture folder, whichever script wrote it."""
    if (folder / "answers.jsonl").is_file():
        table: dict[tuple[str, str], Answer] = {}
        for line in (folder / "answers.jsonl").read_text().splitlines():
            a = json.loads(line)
            table[(a["method"], a["path"])] = Answer(a["status"], a["content_type"], a["body"].encode())
        return table
    table = {("GET", p): a for p, a in endpoints(folder).items()}
    kind = next(k for k, f in GPU.items() if f == folder)
    return table | tokenize_answers(folder, kind)


def meta(folder: Path) -> dict[str, Any]:
    p = folder / "meta.json"
    return dict(json.loads(p.read_text())) if p.is_file() else {}


def sse_events(path: Path) -> list[str]:
    """The ``data:`` payloads of a raw SSE file, in order (``[DONE]`` included)."""
    text = path.read_bytes().decode()
    return [line[6:] for line in text.split("\n") if line.startswith("data: ")]


def http_record(path: Path) -> HttpRecord:
    """A ``*.txt`` record as ``scripts/gpu/capture.py`` writes it."""
    head, _, body = path.read_bytes().partition(b"\n\n")
    status_line, *lines = head.decode().split("\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return HttpRecord(int(status_line.removeprefix("status:").strip()), headers, body)


@contextlib.contextmanager
def serve_answers(table: Mapping[tuple[str, str], Answer], *, delays: bool = False) -> Iterator[str]:
    """``table`` as an HTTP server on 127.0.0.1 (404 ``{"detail":"Not Found"}`` for anything else); yields its
    URL. The answers go out as recorded: status, content type, body; with ``delays``, each after the time the
    engine took (SGLang 0.5.17's ``/health``: about 1 s)."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        more = True
        while more:
            msg = await receive()
            more = msg.get("more_body", False)
        a = table.get((scope["method"], scope["path"])) or Answer(404, "application/json", b'{"detail":"Not Found"}')
        if delays and a.seconds:
            await asyncio.sleep(a.seconds)  # the engine's own answer time, not synchronisation
        headers = [(b"content-type", a.content_type.encode())] if a.content_type else []
        await send({"type": "http.response.start", "status": a.status, "headers": headers})
        await send({"type": "http.response.body", "body": a.body})

    with run_uvicorn_app(app, lifespan="off") as url:
        yield url
