"""What one key's type cannot say: references between sections, duplicates, a route's switch made coherent. Each
problem goes to ``add(key path, message)``; the config file reader turns it into ``FILE:LINE: path: message``."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

from proxy.config.settings import Settings

Loc = tuple[str | int, ...]
Add = Callable[[Loc, str], None]


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # its parent package is missing
        return False


def cross_check(s: Settings, add: Add) -> None:
    """What one key's type cannot say: references between sections, duplicates."""
    names = [e.name for e in s.engines]
    known = ", ".join(names) or "none"
    for i, name in enumerate(names):
        if name in names[:i]:
            add(("engines", i, "name"), f"duplicate engine name {name!r}")
    for i, e in enumerate(s.engines):
        if bool(e.url) == bool(e.launch):
            add(("engines", i), "expected url (a running engine) or launch (a command serve starts), one")
    for i, r in enumerate(s.routes):
        refs: list[tuple[str, tuple[str, ...]]] = [("primary", (r.primary,)), ("shadows", r.shadows)]
        refs += [("split", tuple(r.split)), ("pinnable", r.pinnable), ("fallback", r.fallback)]
        for key, values in refs:
            for ref in values:
                if ref not in names:
                    add(("routes", i, key), f"unknown engine {ref!r} (engines: {known})")
        if r.split and sum(r.split.values()) <= 0:
            add(("routes", i, "split"), "expected at least one weight above 0")
        if r.rollout is not None:
            _check_rollout(s, i, add)
        if r.swap is not None:
            _check_swap(s, i, add)
    aliases = [m.alias for m in s.models]
    for i, m in enumerate(s.models):
        if m.alias in aliases[:i]:
            add(("models", i, "alias"), f"duplicate alias {m.alias!r}")
        for ref in m.engines:
            if ref not in names:
                add(("models", i, "engines", ref), f"unknown engine {ref!r} (engines: {known})")
    if s.tracing.enabled and not _installed("opentelemetry.sdk"):
        add(("tracing", "enabled"), "needs the OpenTelemetry packages: pip install 'enginemeter[otel]'")
    if s.default_route is not None and s.default_route >= len(s.routes):
        add(("default_route",), f"expected an index below {len(s.routes)} (the number of routes)")


def _check_rollout(s: Settings, i: int, add: Add) -> None:
    r = s.routes[i]
    assert r.rollout is not None
    where = ("routes", i, "rollout", "candidate")
    candidate = r.rollout.candidate
    if candidate not in [e.name for e in s.engines]:
        add(where, f"unknown engine {candidate!r} (engines: {', '.join(e.name for e in s.engines) or 'none'})")
    elif candidate == r.primary:
        add(where, f"the candidate {candidate!r} is the route's primary: a rollout moves to another engine")
    if r.split:  # the rollout sets the candidate's share
        add(("routes", i, "split"), "a route with a rollout has no split: the rollout sets the share")
    files = [x.rollout.state_file for x in s.routes[:i] if x.rollout is not None]
    if r.rollout.state_file is not None and r.rollout.state_file in files:
        add(("routes", i, "rollout", "state_file"), "another route's rollout uses this state file")


def _check_swap(s: Settings, i: int, add: Add) -> None:
    r = s.routes[i]
    assert r.swap is not None
    engines = {e.name: e for e in s.engines}
    candidate = r.swap.candidate
    if candidate not in engines:
        add(("routes", i, "swap", "candidate"), f"unknown engine {candidate!r} (engines: {', '.join(engines)})")
    elif candidate == r.primary:
        add(("routes", i, "swap", "candidate"), f"the candidate {candidate!r} is the route's primary")
    for key, name in (("primary", r.primary), ("swap.candidate", candidate)):
        if name in engines and not engines[name].launch:
            add(("routes", i, *key.split(".")), f"{name!r} has no launch command: a swap launches both engines")
    if r.rollout is not None:
        add(("routes", i, "swap"), "a route switches one way: rollout (both resident) or swap (one at a time)")
    if r.split or r.shadows:
        add(("routes", i, "swap"), "a route with a swap has no split and no shadows: one engine is resident")
    files = [x.swap.state_file for x in s.routes[:i] if x.swap is not None]
    if r.swap.state_file is not None and r.swap.state_file in files:
        add(("routes", i, "swap", "state_file"), "another route's swap uses this state file")
    for j, other in enumerate(s.routes):
        if j == i:
            continue
        used = {other.primary, *other.shadows, *other.split, *other.fallback}
        if other.swap is not None:
            used.add(other.swap.candidate)
        if other.rollout is not None:
            used.add(other.rollout.candidate)
        for name in sorted(used & {r.primary, candidate}):
            add(
                ("routes", i, "swap"),
                f"{name!r} also serves route {j}: a swap stops and starts its engines, so "
                "they belong to its route alone",
            )
