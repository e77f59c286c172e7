"""Who may read the proxy's own pages: ``/health``'s detail and ``/metrics``.

The client keys (``api_keys``) guard the generation and pass-through routes (``Gateway.authenticate``) and the
admin key the admin routes (``proxy.server.admin``). The two pages here answer monitoring, so each has a setting:

- ``/health`` (``health: key | public``, default ``key``): with ``api_keys`` set, a request without a valid key
  gets liveness only, ``{"status", "version"}`` — never the detail, which lays out the host (engine URLs with
  their user names, pids, log, model and comparison-log paths). ``public`` shows the detail to anyone. Without
  ``api_keys`` the proxy asks nobody for a key, and ``/health`` shows everything, as before.
- ``/metrics`` (``metrics.access: public | key``, default ``public``, as Prometheus expects): ``key`` answers a
  scrape without a valid key with a 401; Prometheus sends one with ``authorization: {credentials_file: ...}``.
  It needs a key to check against (``api_keys`` or ``admin_key``): without one the configuration is refused.

Either kind of key opens either page: a client key or the admin key, as a bearer token. Compared in constant
time, as text (a key may come from YAML as a number).
"""

from __future__ import annotations

import hmac

from starlette.requests import Request

from proxy.config.settings import Settings
from proxy.errors import Unauthorized

#: what ``/health`` says to a request without a key when the detail needs one
LIVENESS_KEYS = ("status", "version")


def bearer_key(settings: Settings, request: Request) -> bool:
    """Whether ``request`` carries one of the proxy's keys (a client key or the admin key) as a bearer token."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        return False
    keys = [*settings.api_keys, settings.admin_key]
    # every key compared (no early exit): the time does not tell which one matched
    hits = [hmac.compare_digest(token.encode(), str(k).encode()) for k in keys if k is not None and str(k) != ""]
    return any(hits)


def health_detail(settings: Settings, request: Request) -> bool:
    """Whether ``/health`` shows its detail to ``request`` (module docstring)."""
    return settings.health == "public" or not settings.api_keys or bearer_key(settings, request)


def check_metrics(settings: Settings, request: Request) -> None:
    """Raises ``Unauthorized`` when ``/metrics`` needs a key and ``request`` has none."""
    if settings.metrics.access == "key" and not bearer_key(settings, request):
        raise Unauthorized("missing or invalid API key (metrics.access: key)")
