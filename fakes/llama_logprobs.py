"""Log-probabilities from a llama-server backend, in the shape the GPU engines report them: what the vLLM and SGLang
emulators build ``prompt_logprobs`` / ``input_top_logprobs`` and their generation's log-probabilities from.

- :func:`prompt_positions`: teacher forcing along a prompt. For each position ``j`` from ``start``, one native
  ``/completion`` of ``ids[:j]`` (``n_predict`` 1, greedy, ``n_probs`` ``k``, the prompt cache on) whose pick is
  forced to ``ids[j]`` by a ``logit_bias``: llama.cpp reports the top-``k`` and the pick's own log-probability
  from the raw logits, before any sampler, so the bias changes neither. What llama-server cannot tell: the rank of a token outside
  the top-``k`` (a real engine gives its rank in the whole vocabulary): :data:`OUTSIDE` says how it is filled in.
- :func:`greedy`: a greedy continuation (``return_tokens``; ``n_probs`` when log-probabilities are asked for), the
  same request :mod:`proxy.engines.logprobs` sends llama.cpp itself, so the same backend gives the same path.

A forced pick that is a byte of an unfinished UTF-8 character comes back without ``completion_probabilities``
(llama.cpp waits for the rest of the character): that position is asked again unforced, its pick banned as
:func:`proxy.engines.logprobs.llama_score_body` does, up to :data:`proxy.engines.logprobs.LLAMA_BANS` times.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from proxy.engines.logprobs import LLAMA_BANS, llama_score_body

#: the bias that makes llama.cpp pick a token (it adds to the logits the sampler sees, not to the reported ones)
FORCE = 1e6
#: a token outside the top-``k``: its rank is given as ``k + 1`` (a lower bound: llama-server reports no rank
#: beyond ``n_probs``); when its log-probability is not known either (the UTF-8 retry), the ``k``-th's is used
#: (an upper bound)
OUTSIDE = "k + 1"
#: a log-probability llama-server did not report at all (a pick held back at the end, an empty top-k): vLLM's
#: stand-in for ``-inf`` (JSON has no infinity)
UNKNOWN = -9999.0


class BackendError(RuntimeError):
    """The backend answered with an error; ``status`` its HTTP status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class Scored:
    """One position: the token there (a prompt's token, or the pick) and the top-``k`` before it."""

    token: int
    logprob: float
    text: str
    rank: int  # 1-based among the top-k; k + 1 outside it (a lower bound, see OUTSIDE)
    top: list[tuple[int, float, str]]  # (id, logprob, text), most likely first, at most k


@dataclass(frozen=True, slots=True)
class Greedy:
    """A greedy continuation: its ids and text, why it stopped, the prompt tokens the backend had cached, and
    (when asked for) each pick's position."""

    tokens: list[int]
    text: str
    stop_type: str  # llama.cpp's: "limit", "eos", "word", "none"
    stop_word: str | None  # the stop string that ended it (stop_type "word")
    cached: int
    positions: list[Scored] | None


async def _post(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> Any:
    r = await client.post(path, json=body)
    if r.status_code != 200:
        try:
            err = r.json().get("error", {})
            message = str(err.get("message", r.text)) if isinstance(err, dict) else str(err)
        except ValueError:
            message = r.text
        raise BackendError(f"backend {path}: {message}"[:500], r.status_code)
    return r.json()


def _top(first: dict[str, Any]) -> list[tuple[int, float, str]]:
    return [(int(e["id"]), float(e["logprob"]), str(e.get("token", ""))) for e in first.get("top_logprobs", ())]


def _scored(token: int, logprob: float, text: str, top: list[tuple[int, float, str]], k: int) -> Scored:
    """``top``: as llama-server answered (``n_probs`` = ``max(k, 1)``), cut to ``k`` here."""
    ids = [t for t, _, _ in top]
    return Scored(token, logprob, text, ids.index(token) + 1 if token in ids else len(ids) + 1, top[:k])


async def detokenize(client: httpx.AsyncClient, ids: Sequence[int]) -> str:
    return str((await _post(client, "/detokenize", {"tokens": list(ids)}))["content"])


async def forced(client: httpx.AsyncClient, prefix: Sequence[int], token: int, k: int) -> Scored:
    """The position after ``prefix``: its top-``k`` and ``token``'s own log-probability there."""
    body = llama_score_body(prefix, max(k, 1))
    body["logit_bias"] = [[token, FORCE]]
    doc = await _post(client, "/completion", body)
    probs = doc.get("completion_probabilities")
    if probs and int(probs[0].get("id", -1)) == token:
        first = probs[0]
        return _scored(token, float(first["logprob"]), str(first.get("token", "")), _top(first), k)
    banned: list[int] = []  # the UTF-8 retry: unforced, the pick banned until the answer has probabilities
    while not probs and len(banned) < LLAMA_BANS:
        banned += [t for t in doc.get("tokens") or () if isinstance(t, int) and t not in banned] or [token]
        doc = await _post(client, "/completion", llama_score_body(prefix, max(k, 1), banned))
        probs = doc.get("completion_probabilities")
    top = _top(probs[0]) if probs else []
    known = {t: lp for t, lp, _ in top}
    logprob = known.get(token, top[-1][1] if top else UNKNOWN)
    return _scored(token, logprob, await detokenize(client, [token]), top, k)


async def prompt_positions(client: httpx.AsyncClient, ids: Sequence[int], start: int, k: int) -> list[Scored]:
    """Positions ``start .. len(ids) - 1`` of ``ids`` (``start`` >= 1), each ``ids[j]`` after ``ids[:j]``.

    Asked last position first: each request then finds the slot's cache holding its whole prefix and computes only
    its last token, the earlier ones as the backend last computed them (a prompt by its prefill, a generated path
    by its decode, when a generation of ``ids`` came just before): the numbers llama.cpp's own per-position
    requests along a path give. First position first, every prompt token would be recomputed alone, whose float
    noise can swap two near-tied tokens."""
    got = [await forced(client, ids[:j], ids[j], k) for j in reversed(range(max(start, 1), len(ids)))]
    return got[::-1]


async def greedy(
    client: httpx.AsyncClient, ids: Sequence[int], n: int, k: int | None, extra: dict[str, Any] | None = None
) -> Greedy:
    """``n`` greedy tokens after ``ids``; ``k``: with each pick's position (its top-``k``), None: without;
    ``extra``: more ``/completion`` fields (``stop``, or a sampler's: then not greedy)."""
    body: dict[str, Any] = {"prompt": list(ids), "n_predict": n, "temperature": 0, "return_tokens": True}
    body |= {"cache_prompt": True, **(extra or {})}
    if k is not None:
        body["n_probs"] = max(k, 1)
    doc = await _post(client, "/completion", body)
    tokens = [int(t) for t in doc.get("tokens") or ()]
    positions = None
    if k is not None:
        positions = []
        probs = doc.get("completion_probabilities") or []
        for i, t in enumerate(tokens):
            if i < len(probs):
                first = probs[i]
                positions.append(_scored(t, float(first["logprob"]), str(first.get("token", "")), _top(first), k))
            else:  # an unfinished UTF-8 character at the end: llama.cpp held its bytes back
                positions.append(Scored(t, UNKNOWN, await detokenize(client, [t]), k + 1, []))
    cached = int((doc.get("timings") or {}).get("cache_n") or 0)
    stop_type = str(doc.get("stop_type") or ("limit" if len(tokens) >= n else "eos"))
    word = str(doc.get("stopping_word") or "") if stop_type == "word" else None
    return Greedy(tokens, str(doc.get("content", "")), stop_type, word, min(cached, max(len(ids) - 1, 0)), positions)
