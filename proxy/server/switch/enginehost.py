"""The engines ``serve`` launches (``engines[].launch``) and the swaps that switch them (``EngineHost``).

At start, each launched engine's command gets its port (``{port}``: a free one, kept for the whole run, so a
relaunch listens where the proxy already sends) and the settings get its URL (``with_urls``). ``start`` then runs
an event loop in a thread of its own and, in it, launches every launched engine a route needs — a route's
primary, shadows, split and fallback engines, never a swap's candidate — and a ``SwapOwner`` per swap route (it
launches the engine that serves that route, reconciling the state found: a restart mid-swap); ``start`` returns
once they are ready, or raises ``LaunchError``. The thread lives as long as the engines: an engine's
parent-death signal is tied to the thread that spawned it.

``stop`` (the proxy's end: SIGTERM, Ctrl-C, a failed start) cancels the owners and stops every engine's process
group, then kills what is left: no engine outlives ``serve``. In one process the app's requests read the swap's
state from the same shared file the workers of ``serve --workers`` read (``proxy.server.switch.swaps``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
from concurrent.futures import Future
from pathlib import Path

from proxy.config.settings import Settings
from proxy.procs.launch import Launched, Launcher, LaunchSpec, parse_launch
from proxy.server.switch.swapper import OwnerLost, SwapOwner
from proxy.server.switch.swaps import state_path

log = logging.getLogger("enginemeter.swap")

#: how long ``stop`` waits for the owners' loop to stop the engines before killing what is left
STOP_WAIT_S = 60.0


def launch_specs(settings: Settings) -> dict[str, LaunchSpec]:
    """Each launched engine's command, parsed, ``{port}`` filled; ``ValueError`` naming what is wrong."""
    return {e.name: parse_launch(e.name, e.launch) for e in settings.engines if e.launch}


def with_urls(settings: Settings, specs: dict[str, LaunchSpec]) -> Settings:
    """The settings with each launched engine's URL (and kind, when its command says it) filled in."""
    engines = []
    for e in settings.engines:
        spec = specs.get(e.name)
        if spec is not None:
            e = dataclasses.replace(e, url=spec.url, kind=e.kind or spec.kind)
        engines.append(e)
    return dataclasses.replace(settings, engines=tuple(engines))


def needed_at_start(settings: Settings) -> list[str]:
    """The launched engines that routes without a swap need (the swaps launch their own)."""
    launched = {e.name for e in settings.engines if e.launch}
    out: list[str] = []
    for r in settings.routes:
        if r.swap is not None:
            continue
        for name in (r.primary, *r.shadows, *r.split, *r.fallback):
            if name in launched and name not in out:
                out.append(name)
    return out


class EngineHost:
    """The launched engines and swap owners of one ``serve`` run (module docstring)."""

    def __init__(self, settings: Settings, specs: dict[str, LaunchSpec], *, log_dir: Path, reporters: int = 1) -> None:
        self.settings = settings
        self.specs = specs
        self.launcher = Launcher(out_dir=log_dir, grace_s=10.0)
        self.owners: list[SwapOwner] = []
        for i, r in enumerate(settings.routes):
            if r.swap is None:
                continue
            # no settling of the idle memory reading after ready: that would add seconds to the outage
            launcher = dataclasses.replace(
                self.launcher,
                ready_timeout_s=r.swap.ready_timeout_s,
                memory_timeout_s=r.swap.memory_timeout_s,
                settle_timeout_s=0.0,
            )
            path = state_path(settings, i)
            run = settings.run_id or "run"
            band = settings.mirror.min_effect
            self.owners.append(SwapOwner(i, r.primary, r.swap, specs, path, run, launcher, reporters, band))
        self.engines: list[Launched] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._main: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None

    def wanted(self) -> bool:
        return bool(self.owners or needed_at_start(self.settings))

    def start(self) -> None:
        """Launch what the routes need and start the owners; returns once ready, or raises ``LaunchError``."""
        ready: Future[None] = Future()
        self._thread = threading.Thread(target=self._thread_main, args=(ready,), name="enginemeter-engines")
        self._thread.start()
        try:
            ready.result()
        except BaseException:
            self.stop()
            raise

    def _thread_main(self, ready: Future[None]) -> None:
        loop = self._loop = asyncio.new_event_loop()
        try:
            self._main = loop.create_task(self._run(ready))
            loop.run_until_complete(self._main)
        except BaseException as exc:  # cancelled by stop, or a failure already given to ready
            if not ready.done():
                ready.set_exception(exc)
        finally:
            loop.close()

    async def _run(self, ready: Future[None]) -> None:
        try:
            for name in needed_at_start(self.settings):
                self.engines.append(await self.launcher.start(self.specs[name]))
                log.info("engine %s launched: %s", name, self.engines[-1].url)
            for owner in self.owners:
                await owner.open(owner.settings.state)
            ready.set_result(None)
            # until stop cancels it: the owners drive their swaps; the engines run meanwhile
            await asyncio.gather(*(self._drive(o) for o in self.owners), asyncio.Event().wait())
        finally:
            await self._close()

    async def _drive(self, owner: SwapOwner) -> None:
        """The owner's loop, kept alive: a failure (a state file the disk refuses, a bug) is logged and the loop
        goes on from the state's phase; another proxy's plan in the file stops the driving, not the engine."""
        while True:
            try:
                await owner.run()
            except OwnerLost as exc:
                log.error("swap of route %d: %s; the swap stops (the engine it runs stays up)", owner.route, exc)
                await asyncio.Event().wait()  # keep serving what runs until the proxy ends
            except Exception:
                log.exception("swap of route %d: the owner's loop failed; going on", owner.route)
                await asyncio.sleep(1.0)  # a pause before trying again, not a synchronisation

    async def _close(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.gather(*(o.close() for o in self.owners), return_exceptions=True)
        for eng in self.engines:
            if not eng.stopped:
                eng.returncode = await eng.process.stop_async(self.launcher.grace_s)
                eng.stopped = True

    def stop(self) -> None:
        """Stop every engine (owners' included); blocks until they are gone. Idempotent."""
        loop, main, thread = self._loop, self._main, self._thread
        if loop is not None and main is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(main.cancel)
        if thread is not None:
            thread.join(STOP_WAIT_S)
        for eng in [*self.engines, *(e for o in self.owners for e in o.launched)]:
            eng.process.stop(1.0)  # idempotent: what the loop could not stop
