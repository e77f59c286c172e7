"""Reading a switch's shared state defensively (the rollout's, the swap's): what a damaged file means, and where a
state file lives by default.

A state document comes from a file anyone with the user's rights can cut, NUL-fill or edit. What it says is
trusted only once every field has the type and range its reader needs (``need``), and what is derived from other
fields is checked against them by the reader (the rollout's share follows its state and step). A document that
fails is ``StateDamaged``: the switch then starts safe (all traffic to the baseline, aborted, logged), never
re-armed. ``read_state`` reads the shared map, then the JSON copy, and says which of three cases it found:
a sound document, none at all (a new switch may start), or damage.

``default_state_path`` keys the file by the proxy's listen address and the route, so two proxies of one user on one
host never share a state file unless the operator names the same one.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

from proxy.server.record.sharedstate import StateFile

T = TypeVar("T")
Found = Literal["sound", "none", "damaged"]


class StateDamaged(ValueError):
    """A state document that cannot be trusted: unreadable, cut, of the wrong shape, or contradicting itself."""


def need(doc: Mapping[str, Any], name: str, kind: type[T], ok: Callable[[T], bool] | None = None) -> T:
    """``doc[name]`` when it is a ``kind`` (an int is no bool; a float is finite, an int accepted) that passes
    ``ok``; else ``StateDamaged`` naming the field."""
    v = doc.get(name)
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    good = isinstance(v, kind) and not (kind is not bool and isinstance(v, bool))
    good = good and not (isinstance(v, float) and not math.isfinite(v))
    if not good or (ok is not None and not ok(v)):  # type: ignore[arg-type]
        raise StateDamaged(f"`{name}` is {str(v)[:60]!r}")
    return v  # type: ignore[return-value]


def read_state(f: StateFile, check: Callable[[dict[str, Any]], dict[str, Any]]) -> tuple[Found, dict[str, Any] | str]:
    """The state under ``f``'s lock at start: the shared map's document if it is sound, else the JSON copy's.
    ``("sound", doc)``: ``check(doc)`` passed (it returns the document, raises ``StateDamaged`` or ``ValueError``);
    ``("none", "")``: neither holds a document (a first start); ``("damaged", why)``: one of them holds something
    that is not a sound document (the caller starts safe and says why)."""

    def shared() -> dict[str, Any] | None:
        return f.read()[1]

    why = ""
    readers: list[tuple[str, Callable[[], dict[str, Any] | None]]] = [
        (f"{f.path}.shm", shared),
        (str(f.path), f.read_copy),
    ]
    for name, read in readers:
        try:
            doc = read()
        except (ValueError, OSError) as exc:  # json's errors are ValueErrors
            why = why or f"{name}: {exc}"
            continue
        if doc is None:
            continue
        try:
            return "sound", check(doc)
        except (StateDamaged, ValueError, KeyError, TypeError) as exc:
            why = why or f"{name}: {exc}"
    return ("damaged", why) if why else ("none", "")


def default_state_path(kind: str, host: str, port: int, route: int, env: Mapping[str, str] | None = None) -> Path:
    """``$XDG_STATE_HOME/enginemeter/{kind}-{host}-{port}-route{N}.json`` (``~/.local/state`` without it): one
    file per listen address and route, so two proxies of one user on one host never share one by default."""
    env = os.environ if env is None else env
    state = env.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    where = re.sub(r"[^A-Za-z0-9.]+", "_", host.strip("[]")) or "any"
    return Path(state) / "enginemeter" / f"{kind}-{where}-{port}-route{route}.json"
