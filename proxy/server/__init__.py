"""Composition root: the app with every extension wired in. ``enginemeter serve`` and tests use this."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette

from proxy.server import enginestate, gpu
from proxy.server.admin import install_admin
from proxy.server.app import Gateway, create_app
from proxy.server.mirror import install_mirror
from proxy.settings import Settings


def extensions() -> list[Callable[[Gateway], Any]]:
    """Optional stages (mirroring, collectors), each installed by a function taking the Gateway."""
    exts: list[Callable[[Gateway], Any]] = [install_mirror, install_admin]
    exts += [gpu.install, enginestate.install]
    return exts


def build_app(
    settings: Settings,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    registry: CollectorRegistry | None = None,
) -> Starlette:
    return create_app(settings, transport=transport, registry=registry, extensions=extensions())
