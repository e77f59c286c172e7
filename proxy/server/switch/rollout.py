"""The guarded switch: a route's live traffic moves to a candidate engine step by step, and back by itself.

A route with ``rollout:`` sends the share of the current step (e.g. 0 → 1 % → 10 % → 50 % → 100 %) to the
candidate and the rest to its primary (the *baseline*). Whichever of the two serves a request, the other gets a
mirrored copy (the route's ``sample_rate``), so every step keeps producing *pairs* — the same request on both
engines at the same moment — and the live verdict's statistics (``proxy.sequential``) stay paired, hence valid
under drifting traffic.

Per step, from the pairs routed at that step (a fresh confidence sequence per step, Bonferroni over the steps:
the chance of rolling back a candidate that is not slower is at most ``ALPHA`` over the whole rollout):

- **roll back** (share 0, within one request) as soon as any stream's anytime-valid interval of
  ``candidate / baseline − 1`` lies wholly above ``+mirror.min_effect`` (``slower``), or the candidate's failed
  attempts exceed ``error_budget`` of its attempts with at least ``min_errors`` of them (``errors``);
- **advance** once the step has lasted ``min_dwell_s``, the candidate served ``min_requests`` (share > 0), and every
  regime with at least ``regime_share`` of the step's pairs has ``min_pairs`` pairs in every stream it measures
  and none of them slower (``gate: not_slower``: not worse beyond the noise floor), or — ``gate: not_worse`` —
  every such interval's upper end below ``+min_effect`` (shown not worse); after the last step the rollout is
  ``complete`` (the candidate serves the route);
- **hold** otherwise; the cause says what the step waits for (``pairs``, ``not_yet``, ``requests``, ``dwell``).

**One truth for every worker and every restart.** The state lives in a shared file beside
``rollout.state_file`` (``proxy.server.record.sharedstate.StateFile``): every process of the proxy reads it, writes
it under an ``flock`` and bumps its generation. A request reads the 8-byte generation and parses the state only after it changed, so a rollback
made by any worker routes the next request of every worker to the baseline. Pairs and failures update it where
they are recorded (once per pair, ~50 µs, never per chunk); successful attempts are counted locally and written
with the next update or once a second. Each transition also replaces ``state_file`` itself, a JSON copy for people
(and for a lost map). A worker that restarts maps the current state; a proxy that restarts finds it too, carries
on at the step it was at (the step's test and dwell start again) and records ``restored``; a changed plan
(candidate, baseline, steps) starts from step 0.

**Damage starts it safe.** What the file says is checked (``rolloutstate.checked``: every field's type and range,
the share the one its state and step mean); a state that fails — cut, NUL-filled, edited — starts the route
aborted, all to the baseline, logged (``rolloutstate.safe``), never re-armed. A shared file found damaged while
serving is laid out again from the JSON copy when that is sound. The file belongs to one proxy run (``run``): a
proxy started later takes it; the earlier one then routes all to the baseline and its updates fail
(``StateUnavailable``, 503), said once.

Commands (``POST /admin/rollout`` or ``rollout.state`` in the config at start): ``start`` (from step 0),
``pause`` (the share holds; a rollback still happens), ``resume``, ``abort`` (share 0). Requests pinned to an
engine by the pin header keep it and are not part of the rollout's share or statistics.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from proxy.config.switching import RolloutSettings
from proxy.sequential import ALPHA, MIN_EFFECT, Interval, LiveVerdict, Regime, Stream, sentence
from proxy.server.record.metrics import RolloutSample
from proxy.server.record.result import Result
from proxy.server.record.sharedstate import StateFile
from proxy.server.switch.rolloutstate import (
    COUNTING,
    DOC_VERSION,
    FAILED,
    Action,
    Conflict,
    StateUnavailable,
    Ticket,
    checked,
    command_,
    cs_dump,
    cs_load,
    evaluate,
    event_,
    figures_,
    fresh,
    new_epoch,
    plan_,
    safe,
)
from proxy.server.switch.statedoc import read_state

if TYPE_CHECKING:
    from proxy.server.mirror.compare import PairComparison

log = logging.getLogger("enginemeter.rollout")


class Rollout:
    """One route's rollout in this process: a view of its state file, and the updates this process makes."""

    def __init__(
        self,
        route: int,
        baseline: str,
        settings: RolloutSettings,
        path: Path,
        *,
        run: str,
        min_effect: float = MIN_EFFECT,
    ) -> None:
        self.route = route
        self.baseline = baseline
        self.settings = settings
        self.path = path
        self.run = run
        self.min_effect = min_effect
        #: per step: the chance of a false "slower" over the whole rollout is at most ALPHA
        self.alpha = ALPHA / len(settings.steps)
        self.plan = plan_(route, baseline, settings)
        self.file: StateFile | None = None
        self._gen = b""
        self._ticket: Ticket | None = None
        #: why this proxy no longer holds the state file (another proxy's rollout took it); None: it holds it
        self.lost: str | None = None
        self._doc: dict[str, Any] | None = None
        #: candidate attempts ended here and not yet written: [attempts, served]
        self._unwritten = [0, 0]

    # ------------------------------------------------------------------------------- the request path

    def ticket(self) -> Ticket | None:
        """The state to route this request under: an 8-byte read; the file is read only after a change. A cut or
        garbled file is recovered (``_recover``); a file another proxy took leaves this one routing to the baseline
        alone (``_lose``)."""
        f = self.file
        if f is None:
            return None
        try:
            gen = f.gen()
            if gen != self._gen:
                self._reread(f, gen)
        except OSError as exc:
            self._recover(f"cannot read {self.path}.shm: {exc}")
        return self._ticket

    def _reread(self, f: StateFile, gen: bytes) -> None:
        self._gen = gen
        try:
            self._gen, doc = f.read()
            doc = checked(doc, self.plan) if doc is not None else None
        except ValueError as exc:  # StateDamaged too
            self._recover(f"{self.path}.shm: {exc}")
            return
        if doc is None:
            self._recover(f"{self.path}.shm was cut")
        elif doc.get("plan") != self.plan or doc.get("run") != self.run:
            self._lose(doc)
        elif self.lost is None:
            self._seen(doc)

    def _recover(self, why: str) -> None:
        """The shared file was found cut or garbled while serving: laid out again from the JSON copy when that is
        sound and this proxy's (the step's counts start again), else aborted (``safe``); logged. If even that
        cannot be written, this process routes everything to the baseline."""
        f = self.file
        if f is None or self.lost is not None:
            return
        log.error("rollout of route %d: %s: recovering", self.route, why)
        try:
            with f.locked():
                found, got = read_state(f, lambda d: checked(d, self.plan))
                if isinstance(got, dict):  # sound: this proxy's state, or another proxy's (then it is theirs)
                    doc = got
                    if doc.get("plan") != self.plan or doc.get("run") != self.run:
                        self._lose(doc)
                        return
                    if doc["state"] in COUNTING:
                        new_epoch(doc, time.time())
                else:
                    doc = safe(
                        self.plan, self.run, self.settings.state, why if found == "none" else str(got), time.time()
                    )
                self._gen = f.write(doc, durable=True)
        except OSError as exc:
            log.error(
                "rollout of route %d: cannot lay out %s.shm again (%s): all to the baseline", self.route, self.path, exc
            )
            self._ticket = self._safe_ticket()
            return
        self._seen(doc)

    def _lose(self, doc: dict[str, Any]) -> None:
        """Another proxy's rollout (another run, or another plan) holds the state file: this proxy stops routing to
        the candidate and its updates fail (``StateUnavailable``), said once."""
        if self.lost is None:
            self.lost = f"{self.path} is held by another proxy (run {doc.get('run')}, plan {doc.get('plan')})"
            log.error(
                "rollout of route %d: %s: this proxy routes all to the baseline, its commands fail",
                self.route,
                self.lost,
            )
        self._ticket = self._safe_ticket()

    def _safe_ticket(self) -> Ticket:
        epoch = self._ticket.epoch if self._ticket is not None else 0
        return Ticket(self.route, epoch, 0, 0.0, "aborted", self.baseline, self.settings.candidate)

    def _seen(self, doc: dict[str, Any]) -> None:
        self._doc = doc
        self._ticket = Ticket(
            self.route,
            int(doc["epoch"]),
            int(doc["step"]),
            float(doc["share"]),
            str(doc["state"]),
            self.baseline,
            self.settings.candidate,
        )

    # ------------------------------------------------------------------------------- updates

    def _update(self, change: Callable[[dict[str, Any], float], bool], *, now: float | None = None) -> dict[str, Any]:
        """Under the lock: read, ``change(doc, now)`` (True: it changed something), evaluate, and write if
        anything changed (a transition is flushed to disk)."""
        self.ticket()  # a damaged file is recovered first
        f = self.file
        assert f is not None
        now = time.time() if now is None else now
        with f.locked():
            gen = f.gen()
            # the document this process read or wrote last is current unless another one wrote since
            doc = self._doc if gen == self._gen and self._doc is not None else f.read()[1]
            if self.lost is not None:
                raise StateUnavailable(self.lost)
            if doc is not None:
                doc = checked(doc, self.plan)
            if doc is None or doc.get("plan") != self.plan or doc.get("run") != self.run:
                if doc is not None:
                    self._lose(doc)
                raise StateUnavailable(f"{self.path} no longer holds this rollout (another proxy's?)")
            try:
                before = (doc["state"], doc["step"], doc["cause"], doc["detail"])
                dirty = self._flush(doc)
                dirty = change(doc, now) or dirty
                if doc["state"] in COUNTING:
                    self._evaluate(doc, now)
                after = (doc["state"], doc["step"], doc["cause"], doc["detail"])
                if dirty or after != before:
                    gen = f.write(doc, durable=after[:2] != before[:2])
            except BaseException:
                self._gen = b""  # the cached document may be half-changed: read it again
                raise
        self._gen = gen
        self._seen(doc)
        return doc

    def _flush(self, doc: dict[str, Any]) -> bool:
        attempts, served = self._unwritten
        self._unwritten = [0, 0]
        if doc["state"] not in COUNTING or not attempts:
            return False
        doc["attempts"] += attempts
        doc["served"] += served
        return True

    def on_pair(self, ticket: Ticket, c: PairComparison, regime: Regime | None) -> None:
        """A comparable pair of a request this rollout routed: one observation per stream of its regime."""
        if regime is None or self.file is None:
            return
        p, s = c.primary, c.shadow
        if {p.engine, s.engine} != {self.baseline, self.settings.candidate}:
            return
        base, cand = (p, s) if p.engine == self.baseline else (s, p)

        def add(doc: dict[str, Any], now: float) -> bool:
            if doc["epoch"] != ticket.epoch or doc["state"] not in COUNTING:
                return False  # routed under an earlier step
            v = cs_load(self._verdict(), doc["verdict"])
            v.add(regime, figures_(base), figures_(cand))
            doc["verdict"] = cs_dump(v)
            doc["pairs"][regime] = doc["pairs"].get(regime, 0) + 1
            return True

        self._update(add)

    def on_result(self, r: Result, ticket: Ticket) -> None:
        """One attempt on the candidate of a request this rollout routed (served or mirrored)."""
        if r.outcome == "client_disconnect" or r.outcome == "rejected":
            return
        failed = r.outcome in FAILED or (r.outcome == "engine_error" and r.status >= 500)
        if not failed:
            self._unwritten[0] += 1
            self._unwritten[1] += r.role == "primary"
            return
        if self.file is None:
            return

        def fail(doc: dict[str, Any], now: float) -> bool:
            if doc["state"] not in COUNTING:
                return False
            doc["attempts"] += 1
            doc["served"] += r.role == "primary"
            doc["errors"] += 1
            doc["last_error"] = f"{r.role} attempt: {r.outcome} {r.error or ''}".strip()[:300]
            return True

        self._update(fail)

    def tick(self, now: float | None = None) -> None:
        """Once a second: write the attempts counted here, let a step whose dwell has passed advance."""
        doc = self._doc
        if self.file is None or doc is None or doc["state"] not in COUNTING:
            self._unwritten = [0, 0]
            return
        if self._unwritten == [0, 0] and doc["state"] == "paused":
            return
        self._update(lambda doc, now: False, now=now)

    def command(self, action: Action, who: Literal["admin", "config"]) -> dict[str, Any]:
        def apply(doc: dict[str, Any], now: float) -> bool:
            command_(doc, action, who, now)
            return True

        return self._update(apply)

    # ------------------------------------------------------------------------------- the decision

    def _sentence(self, st: Stream, i: Interval) -> str:
        return sentence(self.settings.candidate, self.baseline, st, i, self.min_effect)

    def _verdict(self) -> LiveVerdict:
        return LiveVerdict(self.baseline, self.settings.candidate, alpha=self.alpha, min_effect=self.min_effect)

    def _evaluate(self, doc: dict[str, Any], now: float) -> None:
        evaluate(doc, self.settings, self._verdict(), self._sentence, now)

    # ------------------------------------------------------------------------------- start, state

    def open(self, config_state: str, *, now: float | None = None) -> None:
        """Open the state file and reconcile it with the configuration: a new plan starts; the same plan in a
        new proxy run is restored where it was (said so); a ``state`` changed in the config is applied."""
        now = time.time() if now is None else now
        self.file = f = StateFile(self.path)
        with f.locked():
            found, got = read_state(f, lambda d: checked(d, self.plan))
            doc = got if isinstance(got, dict) else None
            if isinstance(got, dict) and _started(str(got.get("run", ""))) > _started(self.run):
                self._lose(got)  # a proxy started after this one holds the file: leave it to that one
                return
            if found == "damaged":
                doc = safe(self.plan, self.run, config_state, str(got), now)
            elif doc is None or doc.get("v") != DOC_VERSION or doc.get("plan") != self.plan:
                old = doc.get("plan") if isinstance(doc, dict) else None
                doc = fresh(self.plan, self.run, config_state, now)
                why = "a new rollout" if old is None else f"the plan changed (was {old})"
                log.info(
                    "rollout of route %d: %s → %s, steps %s (%s): state %s, from %s",
                    self.route,
                    self.baseline,
                    self.settings.candidate,
                    list(self.settings.steps),
                    why,
                    doc["state"],
                    self.path,
                )
            else:
                if doc["run"] != self.run:
                    doc["run"] = self.run
                    if doc["state"] in COUNTING:
                        new_epoch(doc, now)
                    event_(
                        doc, "restored", "config", f"proxy restarted; the step's test starts again ({self.path})", now
                    )
                    log.warning(
                        "rollout of route %d restored from %s: step %d (share %g), state %s",
                        self.route,
                        self.path,
                        doc["step"],
                        doc["share"],
                        doc["state"],
                    )
                if doc["config_state"] != config_state:
                    action: Action = {"running": "resume", "paused": "pause", "aborted": "abort"}[config_state]  # type: ignore[assignment]
                    if action == "resume" and doc["state"] not in COUNTING:
                        action = "start"
                    with contextlib.suppress(Conflict):
                        command_(doc, action, "config", now)
                    doc["config_state"] = config_state
                if doc["state"] in COUNTING:
                    self._evaluate(doc, now)
            self._gen = f.write(doc, durable=True)
        self._seen(doc)

    def close(self) -> None:
        if self.file is not None:
            with contextlib.suppress(Exception):
                self.tick()
            self.file.close()
            self.file = None

    def state(self) -> dict[str, Any]:
        """The /health and /admin/rollout view (this process's last read of the file)."""
        self.ticket()
        doc = self._doc or {}
        v = cs_load(self._verdict(), doc.get("verdict") or {})
        now = time.time()
        return {
            "route": self.route,
            "baseline": self.baseline,
            "candidate": self.settings.candidate,
            "steps": list(self.settings.steps),
            "state": doc.get("state"),
            "step": doc.get("step"),
            "share": doc.get("share"),
            "cause": doc.get("cause"),
            "detail": doc.get("detail"),
            "step_seconds": round(now - doc["since"], 3) if "since" in doc else None,
            "pairs": doc.get("pairs"),
            "attempts": doc.get("attempts"),
            "served": doc.get("served"),
            "errors": doc.get("errors"),
            "rollbacks": doc.get("rollbacks"),
            "alpha_per_step": self.alpha,
            "verdict": [
                {"regime": st.regime, "metric": st.metric, **i.to_json(), "text": self._sentence(st, i)}
                for st, i in v.states().items()
            ],
            "events": (doc.get("events") or [])[-10:],
            "state_file": str(self.path),
            **({"state": "aborted", "share": 0.0, "cause": "config", "detail": self.lost} if self.lost else {}),
        }

    def sample(self) -> RolloutSample | None:
        """What a scrape shows. Runs in a scrape's thread: reads its own copy of the map, never this process's
        cached document (the event loop changes that one in place) nor the cache itself."""
        f = self.file
        try:
            doc = f.read()[1] if f is not None else None
            doc = checked(doc, self.plan) if doc is not None else None
        except (ValueError, OSError):
            return None
        if doc is None or doc.get("plan") != self.plan or doc.get("run") != self.run:
            return None
        return RolloutSample(
            route=str(self.route),
            baseline=self.baseline,
            candidate=self.settings.candidate,
            step=int(doc["step"]),
            share=float(doc["share"]),
            state=str(doc["state"]),
            cause=str(doc["cause"]),
            step_seconds=max(0.0, time.time() - float(doc["since"])),
            pairs=dict(doc["pairs"]),
            attempts=int(doc["attempts"]),
            errors=int(doc["errors"]),
            rollbacks=dict(doc["rollbacks"]),
        )


def _started(run: str) -> str:
    """A run id's start time (``20261203T101500Z`` of ``20261203T101500Z-3fa2``), which orders proxies' runs."""
    return run.partition("-")[0]
