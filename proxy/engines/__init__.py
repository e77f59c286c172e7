"""Engine dialects: everything enginemeter knows about one kind of engine, one module per kind.

    base       Dialect (a plain OpenAI-compatible server), Facts, Health, TokenCount, JSON helpers
    llamacpp   llama.cpp llama-server
    sglang     SGLang (with and without /ready)
    vllm       vLLM
    openai     anything else OpenAI-compatible: the catch-all
    quant      quant_key: quantization names made comparable
    kvcache    the KV-cache formula from a model's shape
    logprobs   next-token log-probabilities per kind: tokenize, greedy from ids, teacher-forced top-k (the agreement)
    startup    the helpers every dialect shares to read a command line and its start-up log (LogFacts);
               ``started`` reads a launched engine's log file by its kind's dialect

Each dialect knows how to recognize its engine, its cheap health check, its state poll (model, context
length, slots, busy slots, quantization, build), how it counts prompt tokens without generating, how its prompt
cache is emptied, and its error shape. Adding an engine kind: a module with a ``Dialect`` subclass and its
``DIALECT``, a line in ``DIALECTS`` (detection order), the kind in ``proxy.config.settings.EngineKind``, its tests in
``tests/engines/test_engines.py``.

Docs: docs/engines.md.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import httpx

from proxy.engines import llamacpp, openai, sglang, vllm
from proxy.engines.base import Dialect, Facts, Health, PollError, TokenCount, as_int, as_str, get_json, model_card
from proxy.engines.quant import quant_from_name, quant_key
from proxy.engines.startup import LogFacts, last_launch, read_log
from proxy.types import EngineKind

__all__ = [
    "DIALECTS",
    "Dialect",
    "Facts",
    "Health",
    "PollError",
    "Probe",
    "TokenCount",
    "detect",
    "dialect",
    "normalize_error",
    "probe",
    "quant_from_name",
    "quant_key",
    "started",
]

#: in detection order; the catch-all last
DIALECTS: dict[EngineKind, Dialect] = {
    d.kind: d for d in (llamacpp.DIALECT, sglang.DIALECT, vllm.DIALECT, openai.DIALECT)
}


def dialect(kind: EngineKind | None) -> Dialect:
    """The dialect of ``kind``; the plain OpenAI one when the kind is not known (yet)."""
    return DIALECTS[kind or "openai"]


async def detect(client: httpx.AsyncClient, timeout: float) -> EngineKind | None:
    """The engine's kind; None while it cannot be told (every probe answered 503: still loading). Raises
    ``httpx.HTTPError`` when the engine cannot be reached."""
    loading = False
    for d in DIALECTS.values():
        if not d.detect_paths:
            continue
        mine = await d.detect(client, timeout)
        if mine:
            return d.kind
        loading = loading or mine is None
    return None if loading else "openai"


@dataclass
class Probe:
    """What probing learned: the kind, the served model, the context length (None: not known)."""

    kind: EngineKind | None = None
    model: str | None = None
    context_length: int | None = None
    error: str | None = None
    #: the dialect's full state poll, where the caller asked for it
    facts: Facts | None = None


async def probe(
    client: httpx.AsyncClient,
    timeout: float,
    *,
    kind: EngineKind | None = None,
    model: str | None = None,
    full: bool = False,
) -> Probe:
    """Fill in what ``kind`` / ``model`` leave out: the kind by detection, the served model and context length
    from ``GET /v1/models`` (or, with ``full``, from the dialect's state poll). Never raises: a failure is
    ``Probe.error`` (and the kind stays None while the engine is loading)."""
    p = Probe(kind=kind, model=model)
    try:
        if p.kind is None:
            p.kind = await detect(client, timeout)
            if p.kind is None:
                p.error = "engine is loading (HTTP 503)"
                return p
        if full:
            try:
                p.facts = await dialect(p.kind).poll(client, timeout)
            except PollError as exc:  # the kind's own state is unreadable: the served model may still be known
                p.error = str(exc)
        if p.facts is not None:
            p.model = p.model or p.facts.model
            p.context_length = p.facts.context_length
        else:
            card: dict[str, object] = {}
            with contextlib.suppress(PollError):  # an engine without /v1/models: the model stays unknown
                card = model_card(await get_json(client, "/v1/models", timeout))
            p.model = p.model or as_str(card.get("id"))
            p.context_length = as_int(card.get("max_model_len"))
    except (httpx.HTTPError, PollError, ValueError) as exc:
        p.error = f"{type(exc).__name__}: {exc}"[:200]
    return p


def started(path: Path, kind: EngineKind | None) -> LogFacts:
    """What an engine's log file (``proxy.procs.launch`` writes ``OUT/engines/NAME.log``; ``scripts/gpu/collect.sh`` may
    keep it as ``NAME.log.gz``) says of the engine's last start, read by its kind's dialect: the KV pool in tokens
    and bytes, the weights, the memory share, ... Empty when there is no such file, or no kind to read it by."""
    if kind is None:
        return LogFacts()
    for f in (path, path.with_name(path.name + ".gz")):
        try:
            text = read_log(f)
        except (OSError, EOFError):  # absent, unreadable, a gzip cut short
            continue
        return dialect(kind).parse_log(last_launch(text))
    return LogFacts()


def normalize_error(body: bytes, status: int, kind: EngineKind | None = None) -> bytes:
    """An engine's error body in the OpenAI shape ``{"error":{...}}``: as it is when it already is one, nested
    when it is a flat ``{"object":"error",..}`` (SGLang), wrapped when it is not JSON."""
    try:
        doc = json.loads(body)
    except ValueError:
        text = body.decode(errors="replace")[:2000]
        return json.dumps({"error": {"message": text, "type": "upstream_error", "code": status}}).encode()
    nested = dialect(kind).error_doc(doc)
    return body if nested is None else json.dumps(nested).encode()
