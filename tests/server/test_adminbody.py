"""The admin routes' bodies (proxy/server/adminbody.py) through the real proxy on a real socket.

- JSON nested 30,000 levels deep (arrays, inside a field; objects 10,000: as deep as 64 KiB holds) on ``/admin/rollout`` and ``/admin/mirror``: a 400
  marked as the proxy's, never a RecursionError's plain-text 500; the proxy answers the next command;
- a body declared at 30 MiB: a 413 answered after the head alone, the body never sent;
- a chunked body with no declared length: a 413 as soon as 64 KiB have crossed, while the client has sent only a
  part of its body and holds the rest.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import httpx
import pytest

from proxy.config.settings import EngineSettings, RouteSettings, Settings
from proxy.config.switching import RolloutSettings
from tests.helpers import ProxyFactory, ProxyUnderTest

ADMIN = {"authorization": "Bearer admin-secret"}
DEEP = 30_000


def proxy(proxy_factory: ProxyFactory, tmp_path: Path) -> ProxyUnderTest:
    """A proxy with a shadow (mirroring installed) and a rollout; the engines are never reached."""
    rollout = RolloutSettings(candidate="c", state_file=str(tmp_path / "rollout.json"))
    engines = tuple(EngineSettings(name=n, url=f"http://127.0.0.1:{9 + i}") for i, n in enumerate("abc"))
    route = RouteSettings(primary="a", shadows=("b",), rollout=rollout)
    return proxy_factory(Settings(engines=engines, routes=(route,), admin_key="admin-secret"))


def assert_marked(r: httpx.Response, status: int) -> dict[str, object]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err: dict[str, object] = r.json()["error"]
    assert err["enginemeter"] is True and err["code"] == status
    return err


@pytest.mark.parametrize("path", ["/admin/rollout", "/admin/mirror"])
def test_deep_json_is_a_400_marked_as_the_proxys(proxy_factory: ProxyFactory, tmp_path: Path, path: str) -> None:
    p = proxy(proxy_factory, tmp_path)
    bodies = [
        b"[" * DEEP + b"]" * DEEP,
        b'{"a":' * 10_000 + b"1" + b"}" * 10_000,  # as deep as 64 KiB holds
        b'{"action": ' + b"[" * DEEP + b"]" * DEEP + b"}",
        b"[" * DEEP,  # never closed
    ]
    for raw in bodies:
        err = assert_marked(p.client.post(path, content=raw, headers=ADMIN), 400)
        assert "nested too deeply" in str(err["message"])
    # brackets inside a string are not nesting: an unknown action is refused as such, not as deep
    r = p.client.post("/admin/rollout", json={"action": "[" * 100}, headers=ADMIN)
    assert r.status_code in (400, 409) and "nested" not in r.text
    # the proxy still answers, and a sound command works
    assert p.client.get(path, headers=ADMIN).status_code == 200
    if path == "/admin/mirror":
        assert p.client.post(path, json={"enabled": False}, headers=ADMIN).json()["enabled"] is False


def raw_exchange(url: str, head: bytes, body: bytes = b"") -> bytes:
    """Send ``head`` and ``body`` on a fresh connection, then read the answer; the rest of the body is never sent."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head + body)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
        return answer


@pytest.mark.parametrize("path", ["/admin/rollout", "/admin/mirror"])
def test_a_big_body_is_refused_without_being_read_whole(proxy_factory: ProxyFactory, tmp_path: Path, path: str) -> None:
    p = proxy(proxy_factory, tmp_path)
    auth = b"authorization: Bearer admin-secret\r\n"
    # declared at 30 MiB: the answer comes on the head alone (the client never sends a byte of the body)
    head = b"POST %s HTTP/1.1\r\nhost: x\r\n%scontent-length: %d\r\n\r\n" % (path.encode(), auth, 30 << 20)
    answer = raw_exchange(p.url, head)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["enginemeter"] is True
    # chunked, no declared length: refused once 64 KiB have crossed, 128 KiB sent of a body that would go on
    head = b"POST %s HTTP/1.1\r\nhost: x\r\n%stransfer-encoding: chunked\r\n\r\n" % (path.encode(), auth)
    chunk = b"%x\r\n%s\r\n" % (16384, b" " * 16384)
    answer = raw_exchange(p.url, head, chunk * 8)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["enginemeter"] is True
    # 64 KiB exactly is not too large (a 400 for what it holds, not a 413)
    r = p.client.post(path, content=b" " * (64 * 1024 - 2) + b"{}", headers=ADMIN)
    assert r.status_code != 413, r.text
