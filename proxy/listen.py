"""The proxy's own address: bound before anything slow starts (so the banner never lies and a busy port fails
at once), and never an engine's address (the proxy would call itself)."""

from __future__ import annotations

import errno
import ipaddress
import socket
from urllib.parse import urlsplit

from proxy.config.settings import EngineSettings, Settings


class BindError(OSError):
    """The proxy's own address cannot be bound (in use, not local, no permission)."""


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind (not yet listen) the proxy's TCP socket, as uvicorn would; uvicorn starts listening on it."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise BindError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        why = (exc.strerror or str(exc)).lower()
        hint = " (is another enginemeter or an engine using it? pick another with --listen)"
        raise BindError(
            f"cannot listen on {host}:{port}: {why}{hint if exc.errno == errno.EADDRINUSE else ''}"
        ) from None
    return sock


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def engine_at_listen_address(s: Settings) -> EngineSettings | None:
    """The engine whose URL is the proxy's own listen address, if any (the proxy would call itself)."""
    for e in s.engines:
        url = urlsplit(e.url)
        host = url.hostname or ""
        port = url.port or (443 if url.scheme == "https" else 80)
        if port != s.port:
            continue
        wildcard = s.host in ("0.0.0.0", "::", "")
        if host == s.host or (_loopback(host) and (wildcard or _loopback(s.host))):
            return e
    return None
