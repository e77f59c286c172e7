"""The owner of a swap route's engines (``SwapOwner``): it launches the one that serves, drives the phases of a
swap and of the swap back, and watches the candidate. One per route with ``swap:``, run by
``proxy.server.switch.enginehost`` in the process that owns the launched engines (``serve``; the supervisor under
``--workers``: a restarted worker never relaunches an engine).

A swap (``POST /admin/rollout {"action": "start"}`` or ``swap.state: running``), each step a phase of the shared
document (``proxy.server.switch.swapstate``) that every serving process follows at its next request:

1. ``draining``: new requests are held; the baseline's requests in flight finish — every serving process reports
   its count in this phase, and the owner waits until all say 0 (``drain_timeout_s``; past it the swap is
   abandoned, ``drain_timeout``: a stream is never cut). The baseline's last answer is the end of the last of them.
2. ``stopping``: the baseline's process group stopped, its GPU memory back (``memory_timeout_s``; not back:
   the baseline is launched again, ``memory_not_returned``).
3. ``launching``: the candidate started, ready by its kind's signal (``ready_timeout_s``; it exits or times out:
   the swap back, ``start_failed``).
4. ``warming``: ``warmup_requests`` short requests (a failure: ``start_failed``).
5. ``watching``: the candidate serves, held requests first. Every tick the serving processes' figures are merged
   and judged (``proxy.server.switch.swapwatch``): ``slower`` or ``errors`` swap back; the candidate's process
   gone or its readiness failing ``UNREADY_CHECKS`` times in a row swaps back (``died``); a watch that passes is
   ``complete`` (the baseline's engine name stays as the rollback record).

The swap back (``reverting``): the candidate's requests in flight finish (bounded), it stops, its memory comes
back, the baseline is launched (tried ``RELAUNCH_TRIES`` times) and warmed, then ``rolled_back`` with the cause.
An ``abort`` command swaps back from any phase at its next step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from proxy import engines as dialects
from proxy.config.switching import SwapSettings
from proxy.procs.launch import Launched, Launcher, LaunchSpec
from proxy.procs.process import LaunchError
from proxy.server.record.sharedstate import StateFile
from proxy.server.switch.swapstate import PHASES, Phase, enter, merge, on_open, outage, plan_
from proxy.server.switch.swapwatch import judge, rows

log = logging.getLogger("enginemeter.swap")

TICK_S = 0.05
UNREADY_CHECKS = 3
CHECK_S = 1.0
RELAUNCH_TRIES = 3


class OwnerLost(Exception):
    """The state file no longer holds this swap (another proxy's, or damaged beyond reading)."""


@dataclass
class SwapOwner:
    """One route's swap, driven from the process that owns its engines (module docstring)."""

    route: int
    baseline: str
    settings: SwapSettings
    specs: Mapping[str, LaunchSpec]
    path: Path
    run_id: str
    launcher: Launcher
    #: serving processes that report (1, or the number of workers)
    reporters: int = 1
    band: float = 0.05
    engine: Launched | None = None
    file: StateFile | None = None
    _unready: int = 0
    _checked: float = 0.0
    _watch_seen: str = ""
    #: the complete swap's engine was found not serving (said once)
    _down: bool = False
    launched: list[Launched] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.plan = plan_(self.route, self.baseline, self.settings.candidate)
        self.candidate = self.settings.candidate

    # ------------------------------------------------------------------------------- the document

    def _update(self, change: Callable[[dict[str, Any], float], Any]) -> dict[str, Any]:
        """Under the lock: read, ``change(doc, now)``, written when it changed anything (a transition durably)."""
        f = self.file
        assert f is not None
        now = time.time()
        with f.locked():
            doc = self._read()
            before = json.dumps(doc, sort_keys=True)
            epoch = doc["epoch"]
            change(doc, now)
            if json.dumps(doc, sort_keys=True) != before:
                f.write(doc, durable=doc["epoch"] != epoch)
        return doc

    def _read(self) -> dict[str, Any]:
        """The document as it is now; ``OwnerLost`` when it no longer holds this swap of this run."""
        assert self.file is not None
        try:
            doc = self.file.read()[1]
        except ValueError:
            doc = None
        if doc is None or doc.get("plan") != self.plan or doc.get("run") != self.run_id or not _well_formed(doc):
            raise OwnerLost(f"{self.path} no longer holds this swap (another proxy's, or damaged)")
        return doc

    def _enter(self, phase: Phase, cause: str = "none", detail: str = "") -> dict[str, Any]:
        return self._update(lambda doc, now: enter(doc, phase, now, cause=cause, detail=detail))

    def _take_command(self) -> str | None:
        taken: list[str] = []

        def take(doc: dict[str, Any], now: float) -> None:
            cmd = doc.get("command")
            if isinstance(cmd, dict) and cmd.get("action") in ("start", "abort"):
                taken.append(str(cmd["action"]))
            doc["command"] = None

        doc = self._read()
        if doc.get("command") is None:
            return None
        self._update(take)
        return taken[0] if taken else None

    def _reports(self, doc: dict[str, Any]) -> list[dict[str, Any]]:
        reps = doc.get("reports")
        if not isinstance(reps, dict):
            return []
        return [r for r in reps.values() if isinstance(r, dict) and r.get("epoch") == doc["epoch"]]

    # ------------------------------------------------------------------------------- the engines

    async def _launch(self, name: str) -> Launched:
        eng = await self.launcher.start(self.specs[name])
        self.launched.append(eng)
        self.engine = eng
        log.info("swap of route %d: %s ready in %.1f s (pid %d)", self.route, name, eng.ready_s or 0.0, eng.pid)
        return eng

    async def _stop(self) -> bool | None:
        eng, self.engine = self.engine, None
        if eng is None:
            return True
        await self.launcher.stop(eng)
        return eng.memory_returned

    async def _warm(self, eng: Launched) -> None:
        """``warmup_requests`` short generations; an ``httpx.HTTPError`` or a status ≥ 400 raises ``LaunchError``."""
        if self.settings.warmup_requests == 0:
            return
        async with httpx.AsyncClient(base_url=eng.url, trust_env=False, timeout=60.0) as client:
            model = None
            try:
                ids = (await client.get("/v1/models")).json().get("data") or []
                model = ids[0].get("id") if ids else None
            except (httpx.HTTPError, ValueError, AttributeError):
                pass
            for _ in range(self.settings.warmup_requests):
                body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "model": model}
                try:
                    r = await client.post("/v1/chat/completions", json={k: v for k, v in body.items() if v})
                except httpx.HTTPError as exc:
                    raise LaunchError(f"{eng.spec.name}: warm-up request failed: {exc!r}") from None
                if r.status_code >= 400:
                    raise LaunchError(f"{eng.spec.name}: warm-up request answered {r.status_code}: {r.text[:200]}")

    async def _bring_up(self, name: str) -> None:
        """Launch and warm ``name``; raises ``LaunchError`` (the engine stopped) when it cannot."""
        eng = await self._launch(name)
        try:
            await self._warm(eng)
        except LaunchError:
            await self._stop()
            raise

    async def _alive(self) -> bool:
        """The serving engine's process is there and (checked every ``CHECK_S``) ready."""
        eng = self.engine
        if eng is None or not eng.process.is_running():
            return False
        now = time.monotonic()
        if now - self._checked < CHECK_S:
            return True
        self._checked = now
        ok = True
        try:
            async with httpx.AsyncClient(base_url=eng.url, trust_env=False, timeout=5.0) as client:
                for p in dialects.dialect(eng.kind).ready_paths:
                    ok = ok and (await client.get(p)).status_code == 200
        except httpx.HTTPError:
            ok = False
        self._unready = 0 if ok else self._unready + 1
        return self._unready < UNREADY_CHECKS

    # ------------------------------------------------------------------------------- start and the loop

    async def open(self, config_state: str) -> None:
        """Read the state (defensively), reconcile it with the config and launch the engine that serves."""
        self.file = f = StateFile(self.path)
        now = time.time()
        with f.locked():
            damaged = False
            try:
                doc = f.read()[1]
            except ValueError:
                doc, damaged = None, True
            if doc is None and not damaged:
                try:
                    doc = f.read_copy()
                except ValueError:
                    damaged = True
            if doc is not None and not _well_formed(doc):
                damaged = True
            doc, side = on_open(doc, damaged, self.plan, self.run_id, config_state, now)
            f.write(doc, durable=True)
        name = self.candidate if side == "candidate" else self.baseline
        try:
            await self._bring_up(name)
        except LaunchError as exc:
            if side != "candidate":
                raise
            self._enter("reverting", "start_failed", str(exc)[:300])
            await self._back_to_baseline("start_failed", str(exc)[:300])

    async def run(self) -> None:
        """Until cancelled: commands, the watch, the serving engine's health."""
        while True:
            await asyncio.sleep(TICK_S)  # the owner's tick, not a synchronisation
            action = self._take_command()
            doc = self._read()
            phase = doc["phase"]
            if action is not None and phase == "failed":
                await self._retry(doc, action)
            elif action == "start" and phase in ("baseline", "rolled_back"):
                await self.swap()
            elif action == "start":
                log.warning("swap of route %d: start ignored while %s", self.route, phase)
            elif action == "abort" and phase in ("watching", "complete"):
                await self.swap_back("aborted", "aborted by admin")
            elif phase == "watching":
                await self._watch_tick(doc)
            elif phase == "rolled_back" and doc.get("back_last_answer") and doc.get("back_outage_s") is None:
                self._back_tick(doc)
            elif phase == "complete":
                alive = await self._alive()
                if alive == self._down:  # said once per change
                    self._down = not alive
                    say = log.error if self._down else log.info
                    say(
                        "swap of route %d: %s %s",
                        self.route,
                        self.candidate,
                        "is not serving" if self._down else "serves",
                    )

    async def swap(self) -> None:
        """baseline → draining → stopping → launching → warming → watching (module docstring)."""
        s = self.settings
        doc = self._enter("draining", "none", f"{self.baseline} → {self.candidate}")
        reps = await self._drained(self.baseline, s.drain_timeout_s)
        if reps is None:
            why = f"requests on {self.baseline} still in flight after {s.drain_timeout_s:g} s: the swap is abandoned"
            self._enter("rolled_back", "drain_timeout", why)
            return
        ends = [float(r["last_end"][self.baseline]) for r in reps if self.baseline in (r.get("last_end") or {})]
        last = max([float(doc["swap_started"]), *ends])
        base = merge([r.get("base") or {} for r in reps])
        self._update(lambda d, now: d.update(last_answer=last, base=base))
        if self._aborted():
            self._enter("rolled_back", "aborted", "aborted by admin before the baseline stopped")
            return
        self._enter("stopping")
        if await self._stop() is False:
            detail = f"{self.baseline}'s GPU memory did not come back within {s.memory_timeout_s:g} s"
            self._enter("reverting", "memory_not_returned", detail)
            await self._back_to_baseline("memory_not_returned", detail)
            return
        self._enter("launching", "none", f"{self.candidate} (engines[{self.candidate}].launch)")
        try:
            eng = await self._launch(self.candidate)
            self._enter("warming", "none", f"ready in {eng.ready_s or 0:.1f} s")
            await self._warm(eng)
        except LaunchError as exc:
            await self.swap_back("start_failed", str(exc).splitlines()[0][:300], drain=False)
            return
        if self._aborted():
            await self.swap_back("aborted", "aborted by admin while the candidate started")
            return
        self._enter("watching", "none", "the candidate serves")
        self._watch_seen = ""

    def _aborted(self) -> bool:
        """An ``abort`` command is pending (taken: the caller swaps back)."""
        cmd = self._read().get("command")
        if not (isinstance(cmd, dict) and cmd.get("action") == "abort"):
            return False
        self._update(lambda d, now: d.update(command=None))
        return True

    async def _drained(self, engine: str, timeout_s: float) -> list[dict[str, Any]] | None:
        """The reports of every serving process in this phase once none has a request on ``engine`` in flight;
        None past ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            doc = self._read()
            reps = self._reports(doc)
            if len(reps) >= self.reporters and all((r.get("in_flight") or {}).get(engine, 0) <= 0 for r in reps):
                return reps
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(TICK_S)  # polls the reports until the deadline

    async def _watch_tick(self, doc: dict[str, Any]) -> None:
        s = self.settings
        reps = [r for r in (doc.get("reports") or {}).values() if r.get("watch_epoch") == doc["epoch"]]
        cand = merge([r.get("cand") or {} for r in reps])
        counts = {k: sum(int((r.get("counts") or {}).get(k, 0)) for r in reps) for k in ("attempts", "errors")}
        decision, detail = judge(s, self.band, doc.get("base") or {}, cand, counts, time.time() - float(doc["since"]))
        firsts = [float(r["first_answer"]) for r in reps if r.get("first_answer")]
        if doc.get("outage_s") is None and firsts:
            done = self._update(lambda d, now: d.update(first_answer=min(firsts)))
            gap = outage(done)
            self._update(lambda d, now: d.update(outage_s=gap))
            log.info(
                "swap of route %d: outage %s s (the baseline's last answer → the candidate's first)", self.route, gap
            )
        if detail != self._watch_seen:
            self._watch_seen = detail
            streams = rows(doc.get("base") or {}, cand)
            watch = {"decision": decision, "detail": detail, "counts": counts, "streams": streams}
            self._update(lambda d, now: d.update(watch=watch))
        if not await self._alive():
            eng = self.engine
            why = f"exited with {eng.process.returncode}" if eng and not eng.process.is_running() else "unready"
            await self.swap_back("died", f"{self.candidate} {why}", drain=False)
        elif decision in ("slower", "errors"):
            await self.swap_back(decision, detail)
        elif decision == "pass":
            self._enter("complete", "none", f"{detail}; rollback record: engines[{self.baseline}].launch")
            record = {"engine": self.baseline, "launch": f"engines[{self.baseline}].launch in the config"}
            self._update(lambda d, now: d.update(rollback_record=record))

    async def swap_back(self, cause: str, detail: str, *, drain: bool = True) -> None:
        """The same swap in reverse: drain the candidate (bounded, then cut), stop it, the baseline back."""
        doc = self._read()
        if doc["phase"] != "reverting":
            doc = self._enter("reverting", cause, detail)
        live = drain and self.engine is not None and self.engine.process.is_running()
        reps = await self._drained(self.candidate, self.settings.drain_timeout_s) if live else None
        if live and reps is None:
            log.warning("swap of route %d: %s's requests still in flight: stopped anyway", self.route, self.candidate)
        reps = reps or self._reports(self._read())
        ends = [float(r["last_end"][self.candidate]) for r in reps if self.candidate in (r.get("last_end") or {})]
        last = max([float(doc["since"]), *ends])
        self._update(lambda d, now: d.update(back_last_answer=last))
        await self._stop()
        await self._back_to_baseline(cause, detail)

    def _back_tick(self, doc: dict[str, Any]) -> None:
        """The way back's outage, once a serving process has the baseline's first answer of this epoch: the
        candidate's last answer (or the swap back's start) → that first answer."""
        reps = [r for r in (doc.get("reports") or {}).values() if r.get("back_epoch") == doc["epoch"]]
        firsts = [float(r["back_first"]) for r in reps if r.get("back_first")]
        if not firsts:
            return
        gap = round(max(0.0, min(firsts) - float(doc["back_last_answer"])), 3)
        self._update(lambda d, now: d.update(back_outage_s=gap))
        log.info(
            "swap of route %d: the way back's outage %s s (the candidate's last answer → the baseline's first)",
            self.route,
            gap,
        )

    async def _back_to_baseline(self, cause: str, detail: str) -> None:
        """The baseline launched again (``RELAUNCH_TRIES`` tries): ``rolled_back`` with the cause; every try failed:
        ``failed`` (no engine serves; requests get the proxy's 503 until an admin command retries)."""
        why = await self._relaunch_baseline()
        if why is None:
            self._enter("rolled_back", cause, detail)
        else:
            self._enter("failed", cause, f"{self.baseline} did not start again ({why}); after: {detail}")

    async def _retry(self, doc: dict[str, Any], action: str) -> None:
        """An admin ``start`` or ``abort`` in ``failed``: the baseline launched again, the swap back's cause kept."""
        cause = str(doc.get("cause") or "none")
        self._enter("reverting", cause, f"{action} by admin: the baseline launched again")
        await self._back_to_baseline(cause, f"retried by admin ({action})")

    async def _relaunch_baseline(self) -> str | None:
        """None once the baseline serves; else the last try's error."""
        why = ""
        for i in range(RELAUNCH_TRIES):
            try:
                await self._bring_up(self.baseline)
                return None
            except LaunchError as exc:
                why = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
                log.error(
                    "swap of route %d: the baseline %s did not start (try %d of %d): %s",
                    self.route,
                    self.baseline,
                    i + 1,
                    RELAUNCH_TRIES,
                    why,
                )
        return why

    async def close(self) -> None:
        """Stop whatever engine this owner has running (the proxy is ending)."""
        for eng in self.launched:
            if not eng.stopped:
                eng.returncode = await eng.process.stop_async(self.launcher.grace_s)
                eng.stopped = True
        self.engine = None
        if self.file is not None:
            self.file.close()
            self.file = None


def _well_formed(doc: dict[str, Any]) -> bool:
    """Enough of a swap document to resume from: a known phase, an integer epoch, the events list."""
    epoch = doc.get("epoch")
    return (
        doc.get("phase") in PHASES
        and isinstance(epoch, int)
        and not isinstance(epoch, bool)
        and isinstance(doc.get("events"), list)
        and isinstance(doc.get("rollbacks"), dict)
        and isinstance(doc.get("phase_s"), dict)
    )
