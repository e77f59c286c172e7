"""The dialect base: what every engine kind is asked, the records it answers with, and the JSON helpers the
dialects share.

A dialect is stateless: every method takes the engine's ``httpx.AsyncClient`` (base URL, auth, timeouts set).
``detect`` and ``poll`` raise ``httpx.HTTPError`` on transport failures, and ``poll`` raises ``PollError`` for a
status or body it cannot use; ``health``, ``count_prompt_tokens`` and ``flush_cache`` never raise for either,
they say what happened. Nothing here ever generates a token, except SGLang's ``/health`` where an old SGLang
has no other readiness signal (``proxy.engines.sglang``).

The base class is the plain OpenAI-compatible server (``proxy.engines.openai``): ``GET /v1/models`` for
health and state, no tokenizer, no cache control. Each engine module overrides what its engine does better.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import httpx

from proxy.engines.startup import LogFacts, flag_value, int_flag
from proxy.stream import loads
from proxy.types import EngineKind

Message = Mapping[str, Any]


class PollError(Exception):
    """The engine answered, but not with something a state poll can use (a status, a non-JSON body)."""


@dataclass(frozen=True, slots=True)
class Facts:
    """What an engine says about its own configuration and load (None: not reported)."""

    #: served model id (``/v1/models`` ``data[0].id``)
    model: str | None = None
    model_path: str | None = None
    #: the longest request the engine accepts, in tokens (llama.cpp: per slot)
    context_length: int | None = None
    #: requests run at once: llama.cpp slots, SGLang max running requests; vLLM does not say
    slots: int | None = None
    busy_slots: int | None = None
    #: as the engine names it (``quant_key`` makes names comparable)
    quantization: str | None = None
    build: str | None = None
    #: the KV pool's capacity in tokens, all running requests together (SGLang ``max_total_num_tokens``); a
    #: request longer than this cannot run whatever ``context_length`` says (None: not reported)
    kv_pool_tokens: int | None = None
    #: the weights' file format when the engine names one apart from the precision (SGLang: ``gguf``, ``dummy``)
    weights_format: str | None = None
    #: the share of the GPU's memory it took (SGLang ``mem_fraction_static``): what it says, not what was asked
    memory_share: float | None = None


@dataclass(frozen=True, slots=True)
class Health:
    up: bool
    #: the path whose answer decided
    path: str
    error: str | None = None


@dataclass(frozen=True, slots=True)
class TokenCount:
    tokens: int | None
    #: the endpoint that counted, or why nothing did
    method: str


# ---- JSON helpers -----------------------------------------------------------------------------------------


def as_int(v: object) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str) and v.isdigit():
        return int(v)
    return None


def as_str(v: object) -> str | None:
    return v if isinstance(v, str) and v else None


def as_dict(v: object) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


async def get_json(client: httpx.AsyncClient, path: str, timeout: float) -> Any:
    """GET ``path`` -> parsed JSON. Raises PollError (status or body) or httpx.HTTPError (transport)."""
    r = await client.get(path, timeout=timeout)
    if r.status_code != 200:
        raise PollError(f"HTTP {r.status_code} from {path}")
    try:
        return loads(r.content)  # orjson first: polled every few seconds, with every stream waiting on the same loop
    except ValueError as exc:
        raise PollError(f"{path} did not return JSON") from exc


async def first_json(client: httpx.AsyncClient, paths: Iterable[str], timeout: float) -> Any:
    """The first of ``paths`` that answers JSON (newer name first, deprecated names after)."""
    last: PollError | None = None
    for p in paths:
        try:
            return await get_json(client, p, timeout)
        except PollError as exc:
            last = exc
    assert last is not None
    raise last


def model_card(doc: Any) -> dict[str, Any]:
    """``/v1/models`` -> the first model card (``{}`` when there is none)."""
    data = doc.get("data") if isinstance(doc, dict) else None
    if isinstance(data, list) and data and isinstance(data[0], dict):
        return data[0]
    return {}


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.M)


def metric_sum(text: str, names: Sequence[str]) -> int | None:
    """The sum of these gauges (over every label set) in a Prometheus text page; None when none is there."""
    found = [float(v) for name, v in _SAMPLE.findall(text) if name in names]
    return round(sum(found)) if found else None


async def metrics_busy(client: httpx.AsyncClient, names: Sequence[str], timeout: float) -> int | None:
    """Requests running (or waiting) as the engine's ``/metrics`` counts them; None when it does not say."""
    with contextlib.suppress(httpx.HTTPError):
        r = await client.get("/metrics", timeout=timeout)
        return metric_sum(r.text, names) if r.status_code == 200 else None
    return None


def short(exc: BaseException, limit: int = 200) -> str:
    return f"{type(exc).__name__}: {exc}"[:limit]


def body_message(r: httpx.Response, limit: int = 120) -> str:
    """A short reason from an error response: its ``error.message`` / ``message`` / ``detail``, else its text."""
    try:
        doc = r.json()
    except ValueError:
        return r.text.strip()[:limit]
    if isinstance(doc, dict):
        err = doc.get("error")
        for v in (err.get("message") if isinstance(err, dict) else err, doc.get("message"), doc.get("detail")):
            if isinstance(v, str) and v:
                return v[:limit]
    return r.text.strip()[:limit]


async def get_health(client: httpx.AsyncClient, path: str, timeout: float) -> Health | httpx.Response:
    """GET ``path``: its response, or a down ``Health`` when the transport failed."""
    try:
        return await client.get(path, timeout=timeout)
    except httpx.HTTPError as exc:
        return Health(False, path, short(exc))


def health_of(r: httpx.Response, path: str) -> Health:
    if r.status_code == 200:
        return Health(True, path)
    why = body_message(r)
    return Health(False, path, f"HTTP {r.status_code} from {path}" + (f": {why}" if why else ""))


def nest_flat_error(doc: Any) -> dict[str, Any] | None:
    """The flat ``{"object":"error","message",..,"code"}`` (SGLang, vLLM before its 2025 split) nested the
    OpenAI way, ``{"error":{"message",..,"code"}}``; None when ``doc`` is not that shape."""
    if isinstance(doc, dict) and "error" not in doc and doc.get("object") == "error":
        return {"error": {k: v for k, v in doc.items() if k != "object"}}
    return None


# ---- the dialect ------------------------------------------------------------------------------------------


class Dialect:
    """A plain OpenAI-compatible server; engine modules subclass it."""

    kind: ClassVar[EngineKind] = "openai"
    #: the cheap readiness check (never a generation)
    health_path: ClassVar[str] = "/v1/models"
    #: GETs whose 200 answer says "this kind" (``is_mine`` may look at the body); empty: matches nothing
    detect_paths: ClassVar[tuple[str, ...]] = ()
    #: GETs that must all answer 200 before a launched engine counts as ready (its own start-up signal)
    ready_paths: ClassVar[tuple[str, ...]] = ("/v1/models",)
    #: where the engine listens when its command line does not say (None: the command must say)
    default_host: ClassVar[str] = "127.0.0.1"
    default_port: ClassVar[int | None] = None
    host_flags: ClassVar[tuple[str, ...]] = ("--host",)
    port_flags: ClassVar[tuple[str, ...]] = ("--port",)
    #: the flag that sets the share of the GPU's memory the engine takes (weights, KV pool, graphs: its footprint
    #: is a setting, not the model's), and the share when the command does not give it (None: sized otherwise)
    memory_share_flag: ClassVar[str | None] = None
    memory_share_default: ClassVar[float | None] = None
    #: what the engine holds beyond its share (CUDA context, graphs, activations), as (bytes at least, share of a
    #: budget): what a share fitted to a budget leaves for it
    memory_reserve: ClassVar[tuple[int, float]] = (1 << 30, 0.0)

    def launched_by(self, argv: Sequence[str]) -> bool:
        """Whether ``argv`` starts an engine of this kind (the plain dialect recognizes no command)."""
        return False

    def listen_address(self, argv: Sequence[str]) -> tuple[str, int | None]:
        """(host, port) the command ``argv`` makes the engine listen on, with this kind's defaults."""
        host = flag_value(argv, *self.host_flags) or self.default_host
        return host, int_flag(argv, *self.port_flags) or self.default_port

    def memory_share(self, argv: Sequence[str]) -> tuple[str, float] | None:
        """(flag, share of the GPU's memory) the command ``argv`` launches the engine with; None when this kind
        has no such flag or the command leaves the size to the engine."""
        if self.memory_share_flag is None:
            return None
        v = flag_value(argv, self.memory_share_flag)
        try:
            share = float(v) if v is not None else self.memory_share_default
        except ValueError:
            return None
        return (self.memory_share_flag, share) if share is not None and 0 < share <= 1 else None

    def reserve_bytes(self, budget_bytes: int) -> int:
        """What to leave under ``budget_bytes`` beside the share (``memory_reserve``)."""
        least, share = self.memory_reserve
        return max(least, int(share * budget_bytes))

    def parse_log(self, text: str) -> LogFacts:
        """What the engine's start-up log says about itself (``text``: its last start, see ``startup``)."""
        return LogFacts()

    async def startup(self, client: httpx.AsyncClient, timeout: float) -> LogFacts:
        """The start-up facts the engine tells over HTTP (SGLang ``/server_info``, vLLM ``/metrics``, llama.cpp
        ``/props``): the same record as its log's, what neither says left None. Never raises."""
        return LogFacts()

    def is_mine(self, path: str, r: httpx.Response) -> bool:
        return True

    async def detect(self, client: httpx.AsyncClient, timeout: float) -> bool | None:
        """True: this kind; False: not; None: cannot tell yet (503: the engine is still loading)."""
        loading = False
        for path in self.detect_paths:
            r = await client.get(path, timeout=timeout)
            if r.status_code == 200 and self.is_mine(path, r):
                return True
            loading = loading or r.status_code == 503
        return None if loading else False

    async def health(self, client: httpx.AsyncClient, timeout: float) -> Health:
        got = await get_health(client, self.health_path, timeout)
        return got if isinstance(got, Health) else health_of(got, self.health_path)

    async def poll(self, client: httpx.AsyncClient, timeout: float) -> Facts:
        card = model_card(await get_json(client, "/v1/models", timeout))
        return Facts(model=as_str(card.get("id")), context_length=as_int(card.get("max_model_len")))

    async def busy(self, client: httpx.AsyncClient, timeout: float) -> int | None:
        """Requests the engine is running or holding in its queue right now, whoever sent them (the bench reads
        it to notice other clients); None when the kind does not say."""
        return None

    async def count_prompt_tokens(
        self, client: httpx.AsyncClient, model: str | None, messages: Sequence[Message]
    ) -> TokenCount:
        """Prompt tokens as the engine counts them for a chat completion of ``messages``, without generating."""
        return TokenCount(None, f"no tokenizer endpoint for kind {self.kind}")

    async def flush_cache(self, client: httpx.AsyncClient) -> str | None:
        """Empty the engine's prompt cache; a note saying what happened, None when the kind has no such call."""
        return None

    def error_doc(self, doc: Any) -> dict[str, Any] | None:
        """An error body in the OpenAI shape; None when ``doc`` already is one (or is no error we know)."""
        return nest_flat_error(doc)
