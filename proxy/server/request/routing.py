"""Request -> which engine serves it, which engines may take over, which shadow engines get a copy. Pure.

Order of decisions for one request:
1. the client ``model`` picks a route (its alias is listed, or the route lists ``*``); none matches ->
   the ``default_route`` or 404;
2. a pin header naming an engine allowed on that route wins (primary, split, pinnable and fallback
   engines are allowed, and a rollout's or swap's candidate); a pin to any other engine is a 400; on a swap
   route a pinned request passes the swap's gate too (held, counted; the proxy's 503 when it names the engine
   the swap keeps stopped);
3. otherwise a route's ``rollout`` (``proxy.server.switch.rollout``) sends its current share to the candidate, the
   rest to the primary, sticky the same way; the other engine of the two gets a mirrored copy while the rollout
   runs, and a candidate-served request falls back to the primary (``Dispatch.rollout`` says which state routed
   it); otherwise a weighted ``split`` picks, sticky by hashing the sticky header or the OpenAI ``user`` field
   (random when neither is present); without a split the route's primary serves;
   a route's ``swap`` (``proxy.server.switch.swaps``) sends it to the engine its phase says serves (the baseline,
   or the candidate once it serves), or marks it held (``Dispatch.held``: no engine can take it now; the gateway
   waits in the swap's bounded queue, then sends it where the phase ends); the state is read once per request;
4. ``fallback`` engines follow the chosen one, used only when it fails before the first byte;
5. shadows are the route's shadow engines other than the serving one; a request that says
   ``x-enginemeter-mirror: off`` is not mirrored (``Dispatch.mirror``; the bench sends it, so its requests
   never reach the shadow nor the comparison log). ``on`` is the default; any other value is a 400.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping
from typing import NamedTuple, Protocol

from proxy.config.settings import MIRROR_HEADER, RouteSettings, Settings
from proxy.errors import BadRequest, NotFound


class Ticket(Protocol):
    """The switch state a request on a switching route was routed under (``proxy.server.switch.rolloutstate``)."""

    @property
    def share(self) -> float: ...
    @property
    def baseline(self) -> str: ...
    @property
    def candidate(self) -> str: ...
    @property
    def counting(self) -> bool: ...


class Tickets(Protocol):
    """The rollouts' state per route (``proxy.server.switch.rollouts.Rollouts``)."""

    def ticket(self, route: int) -> Ticket | None: ...


class Gate(Protocol):
    """The swap phase a request on a swapping route was routed under (``proxy.server.switch.swapstate.SwapTicket``)."""

    @property
    def epoch(self) -> int: ...
    @property
    def serving(self) -> str | None: ...


class Gates(Protocol):
    """The swaps' state per route (``proxy.server.switch.swaps.Swaps``)."""

    def gate(self, route: int) -> Gate | None: ...


class Dispatch(NamedTuple):
    route: int
    engines: tuple[str, ...]  # the serving engine first, then fallbacks in order
    shadows: tuple[str, ...]
    sample_rate: float
    pinned: bool
    #: False: the request asked not to be mirrored (``MIRROR_HEADER: off``)
    mirror: bool = True
    #: the rollout state that routed the request (None: no rollout on the route, or the request was pinned)
    rollout: Ticket | None = None
    #: the swap phase that routed the request (None: no swap on the route)
    swap: Gate | None = None

    @property
    def engine(self) -> str:
        return self.engines[0]

    @property
    def held(self) -> bool:
        """No engine can take the request now: it waits in the swap's queue."""
        return self.swap is not None and self.swap.serving is None


def _unit(key: str) -> float:
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def pick_weighted(split: Mapping[str, float], key: str | None, rng: random.Random) -> str:
    total = sum(split.values())
    x = (_unit(key) if key else rng.random()) * total
    acc = 0.0
    last = ""
    for name, weight in split.items():
        if weight <= 0:
            continue
        acc += weight
        last = name
        if x < acc:
            return name
    return last


class Router:
    def __init__(
        self,
        settings: Settings,
        *,
        rng: random.Random | None = None,
        rollouts: Tickets | None = None,
        swaps: Gates | None = None,
    ) -> None:
        self._settings = settings
        self._rollouts = rollouts
        self._swaps = swaps
        self._rng = rng or random.Random()
        self._by_alias: dict[str, int] = {}
        self._wildcard: int | None = None
        for i, r in enumerate(settings.routes):
            for m in r.models:
                if m == "*":
                    self._wildcard = i if self._wildcard is None else self._wildcard
                else:
                    self._by_alias.setdefault(m, i)

    def route_for(self, model: str | None) -> tuple[int, RouteSettings]:
        i = self._by_alias.get(model or "", self._wildcard)
        if i is None:
            i = self._settings.default_route
        if i is None:
            raise NotFound(f"The model `{model}` does not exist", param="model")
        return i, self._settings.routes[i]

    def decide(self, model: str | None, headers: Mapping[str, str], user: str | None) -> Dispatch:
        i, route = self.route_for(model)
        allowed = {route.primary, *route.split, *route.pinnable, *route.fallback}
        if route.rollout is not None:
            allowed.add(route.rollout.candidate)
        ticket = gate = None
        if route.swap is not None and self._swaps is not None:
            allowed.add(route.swap.candidate)
            gate = self._swaps.gate(i)  # every request on a swap route, pinned or not: held, counted
        pin = headers.get(self._settings.pin_header)
        if pin:
            if pin not in allowed:
                raise BadRequest(
                    f"engine {pin!r} cannot be pinned for model `{model}`; allowed: {sorted(allowed)}",
                    param=self._settings.pin_header,
                )
            chosen, pinned = pin, True
        elif route.rollout is not None and self._rollouts is not None and (ticket := self._rollouts.ticket(i)):
            sticky = headers.get(route.sticky_header) or user
            x = _unit(sticky) if sticky else self._rng.random()
            chosen, pinned = (ticket.candidate if x < ticket.share else ticket.baseline), False
        elif gate is not None:
            chosen, pinned = gate.serving or route.primary, False
        elif route.split:
            sticky = headers.get(route.sticky_header) or user
            chosen, pinned = pick_weighted(route.split, sticky, self._rng), False
        else:
            chosen, pinned = route.primary, False
        engines = (chosen, *(f for f in route.fallback if f != chosen))
        shadows = tuple(s for s in route.shadows if s != chosen)
        if ticket is not None:
            if chosen == ticket.candidate:  # what fails before its first byte goes back to the baseline
                engines = (chosen, ticket.baseline, *(f for f in engines[1:] if f != ticket.baseline))
            other = ticket.baseline if chosen == ticket.candidate else ticket.candidate
            if ticket.counting and other not in shadows:
                shadows = (*shadows, other)
        return Dispatch(
            route=i,
            engines=engines,
            shadows=shadows,
            sample_rate=route.sample_rate,
            pinned=pinned,
            mirror=mirror_wanted(headers),
            rollout=ticket,
            swap=gate,
        )


def mirror_wanted(headers: Mapping[str, str]) -> bool:
    v = headers.get(MIRROR_HEADER)
    if v is None:
        return True
    v = v.strip().lower()
    if v in ("on", "off"):
        return v == "on"
    raise BadRequest(f"`{MIRROR_HEADER}` must be `on` or `off`, got {v[:40]!r}", param=MIRROR_HEADER)
