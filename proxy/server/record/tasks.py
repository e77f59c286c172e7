"""A background loop held for the app's lifetime: started on enter, cancelled and awaited on exit (a task kept
referenced, so the loop cannot lose it; its cancellation never leaks into the lifespan)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any


@contextlib.asynccontextmanager
async def held(run: Callable[[], Coroutine[Any, Any, None]]) -> AsyncIterator[None]:
    task = asyncio.ensure_future(run())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
