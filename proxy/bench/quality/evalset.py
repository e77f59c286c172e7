"""``--eval FILE.jsonl``: a user's task file, each engine's answers to it, each answer scored.

One JSON object a line (docs/bench.md#task-accuracy)::

    {"prompt": "What is 17 * 3?", "expected": "51", "matcher": "number"}
    {"messages": [{"role": "user", "content": "Capital of France?"}], "expected": "Paris", "matcher": "regex"}

- ``prompt`` (a user message) or ``messages`` (a chat); ``expected`` (a string or a number); ``matcher``:
  ``exact`` (the answer, trimmed, equals ``expected``; the default), ``regex`` (``expected`` is a pattern
  searched in the answer, case-insensitive), ``number`` (the *last* number in the answer equals ``expected``
  within 1e-6 relative; ``1,234`` and ``$1234.00`` read as 1234); optional ``max_tokens`` (default 256).

Every engine gets every item with the run's sampling (the same body the timed cells send, mapped per kind;
not streamed; ``ignore_eos`` off so an answer can end), one at a time, after the timed cells. Records:
``eval`` per engine and item (``correct``, the answer's head). Nothing is downloaded: the file is yours.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

MATCHERS = ("exact", "regex", "number")
DEFAULT_MAX_TOKENS = 256
_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+")


class EvalFileError(ValueError):
    """The eval file is unreadable or a line is not an item; the message names the line."""


@dataclass(frozen=True)
class EvalItem:
    messages: tuple[dict[str, str], ...]
    expected: str
    matcher: str = "exact"
    max_tokens: int = DEFAULT_MAX_TOKENS


def load_eval(path: str | Path) -> list[EvalItem]:
    """The items of ``path``, strictly: an unknown matcher, a missing field or a bad regex names its line."""
    items: list[EvalItem] = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise EvalFileError(f"{path}: {exc}") from None
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            items.append(_item(json.loads(line)))
        except (ValueError, TypeError, KeyError, re.error) as exc:
            raise EvalFileError(f"{path}:{no}: {exc}") from None
    if not items:
        raise EvalFileError(f"{path}: no items")
    return items


def _item(obj: Any) -> EvalItem:
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object")
    if "messages" in obj:
        msgs = tuple({"role": str(m["role"]), "content": str(m["content"])} for m in obj["messages"])
    elif isinstance(obj.get("prompt"), str):
        msgs = ({"role": "user", "content": obj["prompt"]},)
    else:
        raise ValueError("needs 'prompt' (a string) or 'messages'")
    if "expected" not in obj:
        raise ValueError("needs 'expected'")
    matcher = str(obj.get("matcher", "exact"))
    if matcher not in MATCHERS:
        raise ValueError(f"matcher must be one of {', '.join(MATCHERS)}, not {matcher!r}")
    expected = str(obj["expected"])
    if matcher == "regex":
        re.compile(expected)
    if matcher == "number" and _number(expected) is None:
        raise ValueError(f"expected {expected!r} is not a number")
    return EvalItem(msgs, expected, matcher, int(obj.get("max_tokens", DEFAULT_MAX_TOKENS)))


def _number(text: str) -> float | None:
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", "").replace("$", ""))
    except ValueError:
        return None


def matches(item: EvalItem, answer: str) -> bool:
    """Whether ``answer`` is right by the item's matcher."""
    if item.matcher == "regex":
        return re.search(item.expected, answer, re.IGNORECASE) is not None
    if item.matcher == "number":
        got, want = _number(answer), _number(item.expected)
        return got is not None and want is not None and math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9)
    return answer.strip() == item.expected.strip()


#: (engine name, messages, max_tokens) -> (path, body): the run's body for that engine, not streamed
BodyFor = Callable[[str, Sequence[Mapping[str, str]], int], tuple[str, dict[str, Any]]]


async def run_eval(
    items: Sequence[EvalItem],
    name: str,
    client: httpx.AsyncClient,
    body_for: BodyFor,
    write: Callable[[dict[str, Any]], None],
    headers: Mapping[str, str] | None = None,
) -> int:
    """Send every item to one engine, one at a time; write an ``eval`` record each; return how many were right."""
    right = 0
    for i, item in enumerate(items):
        path, body = body_for(name, item.messages, item.max_tokens)
        answer, error = "", None
        try:
            r = await client.post(path, json=body, headers=dict(headers or {}))
            if r.status_code >= 400:
                error = f"HTTP {r.status_code} {r.text[:120]}"
            else:
                answer = str(r.json()["choices"][0]["message"].get("content") or "")
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            error = f"{type(exc).__name__}: {exc}"[:200]
        ok = error is None and matches(item, answer)
        right += ok
        rec: dict[str, Any] = {"type": "eval", "engine": name, "item": i, "correct": ok, "answer": answer[:200]}
        if error:
            rec["error"] = error
        write(rec)
    return right
