"""Admin endpoints, behind ``settings.admin_key`` (a bearer token, separate from the client API keys).

- ``GET /admin/mirror``  -> the mirroring state (``Mirror.state()``: enabled, per-route rates, in flight,
  sent/dropped counts, pending pairs, comparison log).
- ``POST /admin/mirror`` with ``{"enabled": bool?, "sample_rate": float?, "route": int?}`` -> changes it at run
  time and answers with the new state. ``sample_rate`` without ``route`` applies to every route.
- ``GET /admin/rollout`` -> every route's rollout (``Rollout.state()``: state, step, share, cause, the step's pairs
  and verdict, recent events).
- ``POST /admin/rollout`` with ``{"action": "start"|"pause"|"resume"|"abort", "route": int?}`` -> applies it to the
  shared state (every worker follows at its next request) and answers with that route's rollout. ``route`` may be
  left out when one route has a rollout. A command the state does not allow (``resume`` a rolled-back rollout)
  is a 409.
- On a route with a ``swap`` (``proxy.server.switch.swaps``), the same route takes ``{"action": "start"|"abort",
  "route": int?}``: written for the owner of the engines to carry out at its next tick (the answer says the
  ``command``; GET or /health then show the phases). GET lists the swaps under ``swaps``.

No admin key configured -> 404 (the endpoints do not exist); a wrong or missing key -> 401. Every error is the
OpenAI-style envelope marked ``"enginemeter": true``. Bodies are read and parsed bounded (``adminbody``: 413 past
64 KiB before reading it whole, 400 for deep or invalid JSON).
"""

from __future__ import annotations

import hmac
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from proxy.errors import BadRequest, NotFound, ProxyError, Unauthorized
from proxy.server.adminbody import admin_object, read_admin_body
from proxy.server.mirror.shadows import Mirror
from proxy.server.request.responses import error_response
from proxy.server.switch.rollouts import Rollouts
from proxy.server.switch.swaps import Swaps


def _authorize(key: object, request: Request) -> None:
    # ``key`` may come from YAML as a number (``admin_key: 1234``): compared as text, never a 500
    if key is None or key == "":
        raise NotFound(f"Not Found: {request.method} {request.url.path} (no admin_key configured)")
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), str(key).encode()):
        raise Unauthorized("missing or invalid admin key")


def _parse_rollout(raw: bytes) -> tuple[int | None, str]:
    doc = admin_object(raw, {"action", "route"})
    action, route = doc.get("action"), doc.get("route")
    if not isinstance(action, str):
        raise BadRequest("`action` is required: start, pause, resume or abort", param="action")
    if route is not None and (isinstance(route, bool) or not isinstance(route, int)):
        raise BadRequest("`route` must be an integer", param="route")
    return route, action


def _parse(raw: bytes) -> dict[str, Any]:
    doc = admin_object(raw, {"enabled", "sample_rate", "route"})
    enabled, rate, route = doc.get("enabled"), doc.get("sample_rate"), doc.get("route")
    if enabled is not None and not isinstance(enabled, bool):
        raise BadRequest("`enabled` must be a boolean", param="enabled")
    if rate is not None and (isinstance(rate, bool) or not isinstance(rate, int | float)):
        raise BadRequest("`sample_rate` must be a number", param="sample_rate")
    if route is not None and (isinstance(route, bool) or not isinstance(route, int)):
        raise BadRequest("`route` must be an integer", param="route")
    return doc


def admin_routes(
    admin_key: str | None, mirror: Mirror | None, rollouts: Rollouts | None = None, swaps: Swaps | None = None
) -> list[Route]:
    async def mirror_state(request: Request) -> Response:
        try:
            _authorize(admin_key, request)
            if mirror is None:
                raise NotFound("mirroring is not installed")
            if request.method == "POST":
                doc = _parse(await read_admin_body(request))
                rate = doc.get("sample_rate")
                mirror.set(
                    enabled=doc.get("enabled"),
                    sample_rate=float(rate) if rate is not None else None,
                    route=doc.get("route"),
                )
        except ProxyError as exc:
            return error_response(exc, "")
        return JSONResponse(mirror.state())

    async def rollout_state(request: Request) -> Response:
        try:
            _authorize(admin_key, request)
            if rollouts is None and swaps is None:
                raise NotFound("no route has a rollout or a swap (routes[].rollout, routes[].swap in the config)")
            if request.method == "POST":
                route, action = _parse_rollout(await read_admin_body(request))
                if swaps is not None and (route in swaps.by_route or (route is None and rollouts is None)):
                    return JSONResponse(swaps.command(route, action))
                if rollouts is None:
                    raise BadRequest(f"route {route} has no swap or rollout", param="route")
                return JSONResponse(rollouts.command(route, action))
        except ProxyError as exc:
            return error_response(exc, "")
        out: dict[str, Any] = {"rollouts": rollouts.state() if rollouts is not None else []}
        if swaps is not None:
            out["swaps"] = swaps.state()
        return JSONResponse(out)

    return [
        Route("/admin/mirror", mirror_state, methods=["GET", "POST"]),
        Route("/admin/rollout", rollout_state, methods=["GET", "POST"]),
    ]
