"""Request paths, normalised once for every HTTP request before routing and before forwarding (``ProxyApp``).

The path is taken as the server decoded it (the ASGI ``path``: percent-decoded once), then:

- **refused** (404) when it still holds an encoded dot, slash or backslash (``%2e``, ``%2f``, ``%5c``: the client
  encoded it twice, which no OpenAI client does and which an engine behind the proxy might decode again), a
  backslash (some servers read it as ``/``) or a control character;
- **normalised**: runs of slashes become one, and dot segments (``.``, ``..``) are resolved the way RFC 3986's
  remove_dot_segments does (``..`` never climbs above ``/``).

Then ``route_path`` decides:

- the proxy's own routes (``OWN_PATHS``: the generation routes, ``/v1/models``) answer only at their canonical
  path: any other spelling that normalises to one (``/v1/./chat/completions``, ``/v1//chat/completions``,
  ``/v1/chat/completions/``) is a 404 that names the canonical path, never a request the engine would serve
  unmeasured;
- any other path continues as its normalised form, which replaces ``path`` (and ``raw_path``) in the scope.
  Pass-through forwards that form, percent-encoded again by ``upstream_path``, never the client's raw string;
  what it forwards at all is the router's set (``/v1/*`` but the proxy's own paths, ``/tokenize``,
  ``/detokenize``), so ``/v1/../slots`` (``/slots``) is the router's 404.
"""

from __future__ import annotations

import re
from urllib.parse import quote

#: the proxy's own paths under /v1 (generation and the model list): reachable only at exactly these
OWN_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models"})

_REFUSED = re.compile(r"%(?:2e|2f|5c)|[\\\x00-\x1f\x7f]", re.IGNORECASE)
#: what ``quote`` leaves as it is in a path segment (RFC 3986 pchar, and ``/`` between segments)
_SAFE = "/:@!$&'()*+,;=-._~"


def normalize_path(path: str) -> str | None:
    """The normalised form of a decoded request path, or None when it must be refused (module docstring)."""
    if not path.startswith("/") or _REFUSED.search(path):
        return None
    segments = path.split("/")[1:]
    out: list[str] = []
    last = len(segments) - 1
    for i, seg in enumerate(segments):
        if seg == "..":
            if out:
                out.pop()
            if i == last:
                out.append("")  # "/a/b/.." is "/a/", as in RFC 3986
        elif seg == ".":
            if i == last:
                out.append("")
        elif seg or i == last:  # an empty segment inside is a doubled slash; at the end, a trailing one
            out.append(seg)
    return "/" + "/".join(out)


def route_path(path: str) -> tuple[str | None, str]:
    """(the path to route, "") or (None, why it is a 404) for a decoded request path."""
    norm = normalize_path(path)
    if norm is None:
        return None, "the path holds an encoded dot, slash or backslash, or a control character"
    own = norm.rstrip("/")
    if own in OWN_PATHS and path != own:
        return None, f"the proxy serves this route only at {own}"
    return norm, ""


def upstream_path(path: str) -> str:
    """A normalised path percent-encoded for the request line to an engine."""
    return quote(path, safe=_SAFE)
