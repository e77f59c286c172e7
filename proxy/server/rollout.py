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

**One truth for every worker and every restart.** The state lives in a memory-mapped file beside
``rollout.state_file`` (``proxy.server.sharedstate.StateFile``): every process of the proxy maps it, writes it under an ``flock`` and bumps
its generation. A request reads the 8-byte generation and parses the state only after it changed, so a rollback
made by any worker routes the next request of every worker to the baseline. Pairs and failures update it where
they are recorded (once per pair, ~50 µs, never per chunk); successful attempts are counted locally and written
with the next update or once a second. Each transition also replaces ``state_file`` itself, a JSON copy for people
(and for a lost map). A worker that restarts maps the current state; a proxy that restarts finds it too, carries
on at the step it was at (the step's test and dwell start again) and records ``restored``; a changed plan
(candidate, baseline, steps) starts from step 0.

Commands (``POST /admin/rollout`` or ``rollout.state`` in the config at start): ``start`` (from step 0),
``pause`` (the share holds; a rollback still happens), ``resume``, ``abort`` (share 0). Requests pinned to an
engine by the pin header keep it and are not part of the rollout's share or statistics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from prometheus_client.core import Metric

from proxy.errors import BadRequest, NotFound, ProxyError
from proxy.sequential import ALPHA, MIN_EFFECT, Interval, LiveVerdict, Regime, Stream, sentence
from proxy.server.context import current
from proxy.server.metrics import ROLLBACK_CAUSES, RolloutSample, rollout_families
from proxy.server.result import Result
from proxy.server.sharedstate import StateFile
from proxy.server.tasks import held
from proxy.settings import RolloutSettings, Settings

if TYPE_CHECKING:
    from proxy.server.compare import Comparison, Side
    from proxy.server.pairing import Pending

log = logging.getLogger("enginemeter.rollout")

State = Literal["running", "paused", "rolled_back", "aborted", "complete"]
Action = Literal["start", "pause", "resume", "abort"]
ACTIONS: tuple[Action, ...] = ("start", "pause", "resume", "abort")
#: states in which the rollout mirrors both ways and judges the pairs
COUNTING: frozenset[str] = frozenset({"running", "paused"})
#: outcomes that are the candidate's failure (a 4xx engine_error is the request's fault; a client that hangs up
#: says nothing about the engine)
FAILED = frozenset({"connect_error", "timeout", "upstream_broken"})
DOC_VERSION = 1
MAX_EVENTS = 30
TICK_S = 1.0


class Conflict(ProxyError):
    """The command does not apply to the rollout's state (resume a rolled-back rollout, ...)."""

    status = 409
    type = "invalid_request_error"


class StateUnavailable(ProxyError):
    """The state file cannot be written, or another proxy's rollout replaced it."""

    status = 503
    type = "enginemeter_error"


class Ticket(NamedTuple):
    """What routed a request on a rollout route: the state it was routed under (one per state file write)."""

    route: int
    epoch: int
    step: int
    share: float
    state: str
    baseline: str
    candidate: str

    @property
    def counting(self) -> bool:
        """True while the rollout mirrors both ways and counts the request's pair and failures."""
        return self.state in COUNTING

    def record(self) -> dict[str, Any]:
        """The request log's ``rollout`` field."""
        return {"step": self.step, "share": self.share, "state": self.state}


def default_state_file(route: int, env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    state = env.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "enginemeter" / f"rollout-route{route}.json"


# ============================================================================================== one route


def _plan(route: int, baseline: str, s: RolloutSettings) -> dict[str, Any]:
    return {"route": route, "baseline": baseline, "candidate": s.candidate, "steps": list(s.steps)}


def _cs_dump(verdict: LiveVerdict) -> dict[str, Any]:
    out = {}
    for st, cs in verdict.streams.items():
        out[f"{st.regime}/{st.metric}"] = {
            "n": cs.n, "mean": cs.mean, "m2": cs._m2,
            "lo": cs.lo if math.isfinite(cs.lo) else None, "hi": cs.hi if math.isfinite(cs.hi) else None,
            "decision": cs.decision, "decided_after": cs.decided_after, "drift": cs.drift,
        }  # fmt: skip
    return out


def _cs_load(verdict: LiveVerdict, data: Mapping[str, Any]) -> LiveVerdict:
    for st, cs in verdict.streams.items():
        d = data.get(f"{st.regime}/{st.metric}")
        if not d:
            continue
        cs.n, cs.mean, cs._m2 = int(d["n"]), float(d["mean"]), float(d["m2"])
        cs.lo = -math.inf if d["lo"] is None else float(d["lo"])
        cs.hi = math.inf if d["hi"] is None else float(d["hi"])
        cs.decision, cs.decided_after, cs.drift = d["decision"], d["decided_after"], bool(d["drift"])
    return verdict


def _figures(side: Side) -> dict[str, Any]:
    return {"upstream_ttft_s": side.upstream_ttft_s, "ttft_s": side.ttft_s, "tpot_s": side.tpot_s,
            "e2e_s": side.e2e_s, "completion_tokens": side.completion_tokens}  # fmt: skip


class Rollout:
    """One route's rollout in this process: a view of its state file, and the updates this process makes."""

    def __init__(self, route: int, baseline: str, settings: RolloutSettings, path: Path, *, run: str,
                 min_effect: float = MIN_EFFECT) -> None:  # fmt: skip
        self.route = route
        self.baseline = baseline
        self.settings = settings
        self.path = path
        self.run = run
        self.min_effect = min_effect
        #: per step: the chance of a false "slower" over the whole rollout is at most ALPHA
        self.alpha = ALPHA / len(settings.steps)
        self.plan = _plan(route, baseline, settings)
        self.file: StateFile | None = None
        self._gen = b""
        self._ticket: Ticket | None = None
        self._doc: dict[str, Any] | None = None
        #: candidate attempts ended here and not yet written: [attempts, served]
        self._unwritten = [0, 0]

    # ------------------------------------------------------------------------------- the request path

    def ticket(self) -> Ticket | None:
        """The state to route this request under: an 8-byte compare; the file is read only after a change."""
        f = self.file
        if f is None:
            return None
        gen = f.gen()
        if gen != self._gen:
            try:
                self._gen, doc = f.read()
            except ValueError as exc:
                self._gen = gen
                log.error("rollout of route %d: unreadable state (%s): keeping the last one", self.route, exc)
                return self._ticket
            if doc is not None and doc.get("plan") == self.plan:
                self._seen(doc)
            elif doc is not None and self._ticket is not None:
                log.error(
                    "rollout of route %d: %s.shm holds another plan: keeping the last state", self.route, self.path
                )
        return self._ticket

    def _seen(self, doc: dict[str, Any]) -> None:
        self._doc = doc
        self._ticket = Ticket(self.route, int(doc["epoch"]), int(doc["step"]), float(doc["share"]), str(doc["state"]),
                              self.baseline, self.settings.candidate)  # fmt: skip

    # ------------------------------------------------------------------------------- updates

    def _update(self, change: Callable[[dict[str, Any], float], bool], *, now: float | None = None) -> dict[str, Any]:
        """Under the lock: read, ``change(doc, now)`` (True: it changed something), evaluate, and write if
        anything changed (a transition is flushed to disk)."""
        f = self.file
        assert f is not None
        now = time.time() if now is None else now
        with f.locked():
            gen = f.gen()
            # the document this process read or wrote last is current unless another one wrote since
            doc = self._doc if gen == self._gen and self._doc is not None else f.read()[1]
            if doc is None or doc.get("plan") != self.plan:
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

    def on_pair(self, ticket: Ticket, c: Comparison, regime: Regime | None) -> None:
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
            v = _cs_load(self._verdict(), doc["verdict"])
            v.add(regime, _figures(base), _figures(cand))
            doc["verdict"] = _cs_dump(v)
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
            _command(doc, action, who, now)
            return True

        return self._update(apply)

    # ------------------------------------------------------------------------------- the decision

    def _sentence(self, st: Stream, i: Interval) -> str:
        return sentence(self.settings.candidate, self.baseline, st, i, self.min_effect)

    def _verdict(self) -> LiveVerdict:
        return LiveVerdict(self.baseline, self.settings.candidate, alpha=self.alpha, min_effect=self.min_effect)

    def _evaluate(self, doc: dict[str, Any], now: float) -> None:
        s = self.settings
        e = math.log1p(self.min_effect)
        if doc["errors"] >= s.min_errors and doc["errors"] > s.error_budget * doc["attempts"]:
            detail = (f"{s.candidate} failed {doc['errors']} of its {doc['attempts']} attempts at step {doc['step']} "
                      f"(budget {s.error_budget:.1%}, at least {s.min_errors}); last: {doc.get('last_error')}")  # fmt: skip
            _rollback(doc, "errors", detail, now)
            return
        v = _cs_load(self._verdict(), doc["verdict"])
        for st, cs in v.streams.items():
            if math.isfinite(cs.lo) and cs.lo > e:
                _rollback(doc, "slower", self._sentence(st, cs.state()), now)
                return
        if doc["state"] == "paused":
            return
        cause, detail = self._hold(doc, v, now, e)
        if cause is not None:
            doc["cause"], doc["detail"] = cause, detail
            return
        _advance(doc, now)

    def _hold(self, doc: dict[str, Any], v: LiveVerdict, now: float, e: float) -> tuple[str | None, str]:
        """Why the step cannot advance yet (None: it can)."""
        s = self.settings
        pairs: dict[str, int] = doc["pairs"]
        total = sum(pairs.values())
        checked = 0
        for regime in ("decode", "load", "long"):
            n = pairs.get(regime, 0)
            if n == 0 or n < s.regime_share * total:
                continue
            for st, cs in v.streams.items():
                if st.regime != regime or cs.n < s.regime_share * n:
                    continue  # the metric is missing for most of the regime's pairs (e.g. TPOT of non-streams)
                if cs.n < s.min_pairs:
                    return "pairs", f"{cs.n} of {s.min_pairs} pairs {st.regime} ({st.label})"
                if s.gate == "not_worse" and not cs.hi < e:
                    return "not_yet", self._sentence(st, cs.state())
                checked += 1
        if checked == 0:
            return "pairs", f"{total} pairs at this step; {s.min_pairs} needed in a regime"
        if doc["share"] > 0 and doc["served"] < s.min_requests:
            return "requests", f"{doc['served']} of {s.min_requests} requests served by {s.candidate}"
        if now - doc["since"] < s.min_dwell_s:
            return "dwell", f"each step lasts {s.min_dwell_s:g} s at least"
        return None, ""

    # ------------------------------------------------------------------------------- start, state

    def open(self, config_state: str, *, now: float | None = None) -> None:
        """Open the state file and reconcile it with the configuration: a new plan starts; the same plan in a
        new proxy run is restored where it was (said so); a ``state`` changed in the config is applied."""
        now = time.time() if now is None else now
        self.file = f = StateFile(self.path)
        with f.locked():
            doc = self._read_quietly(f)
            if doc is None:
                with contextlib.suppress(ValueError):
                    doc = f.read_copy()
            if doc is None or doc.get("v") != DOC_VERSION or doc.get("plan") != self.plan:
                old = doc.get("plan") if isinstance(doc, dict) else None
                doc = _fresh(self.plan, self.run, config_state, now)
                why = "a new rollout" if old is None else f"the plan changed (was {old})"
                log.info("rollout of route %d: %s → %s, steps %s (%s): state %s, from %s", self.route, self.baseline,
                         self.settings.candidate, list(self.settings.steps), why, doc["state"], self.path)  # fmt: skip
            else:
                if doc["run"] != self.run:
                    doc["run"] = self.run
                    if doc["state"] in COUNTING:
                        _new_epoch(doc, now)
                    _event(
                        doc, "restored", "config", f"proxy restarted; the step's test starts again ({self.path})", now
                    )
                    log.warning("rollout of route %d restored from %s: step %d (share %g), state %s", self.route,
                                self.path, doc["step"], doc["share"], doc["state"])  # fmt: skip
                if doc["config_state"] != config_state:
                    action: Action = {"running": "resume", "paused": "pause", "aborted": "abort"}[config_state]  # type: ignore[assignment]
                    if action == "resume" and doc["state"] not in COUNTING:
                        action = "start"
                    with contextlib.suppress(Conflict):
                        _command(doc, action, "config", now)
                    doc["config_state"] = config_state
                if doc["state"] in COUNTING:
                    self._evaluate(doc, now)
            self._gen = f.write(doc, durable=True)
        self._seen(doc)

    @staticmethod
    def _read_quietly(f: StateFile) -> dict[str, Any] | None:
        try:
            return f.read()[1]
        except ValueError:
            log.error("rollout state %s.shm is not valid: starting from the JSON copy", f.path)
            return None

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
        v = _cs_load(self._verdict(), doc.get("verdict") or {})
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
        }

    def sample(self) -> RolloutSample | None:
        """What a scrape shows. Runs in a scrape's thread: reads its own copy of the map, never this process's
        cached document (the event loop changes that one in place) nor the cache itself."""
        f = self.file
        try:
            doc = f.read()[1] if f is not None else None
        except ValueError:
            return None
        if doc is None or doc.get("plan") != self.plan:
            return None
        return RolloutSample(
            route=str(self.route), baseline=self.baseline, candidate=self.settings.candidate, step=int(doc["step"]),
            share=float(doc["share"]), state=str(doc["state"]), cause=str(doc["cause"]),
            step_seconds=max(0.0, time.time() - float(doc["since"])), pairs=dict(doc["pairs"]),
            attempts=int(doc["attempts"]), errors=int(doc["errors"]), rollbacks=dict(doc["rollbacks"]),
        )  # fmt: skip


# ============================================================================================== transitions


def _fresh(plan: dict[str, Any], run: str, config_state: str, now: float) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "v": DOC_VERSION, "plan": plan, "run": run, "config_state": config_state, "state": "running",
        "step": 0, "share": plan["steps"][0], "epoch": 0, "since": now, "cause": "pairs", "detail": "",
        "pairs": {}, "verdict": {}, "attempts": 0, "served": 0, "errors": 0, "last_error": None,
        "rollbacks": dict.fromkeys(ROLLBACK_CAUSES, 0), "events": [],
    }  # fmt: skip
    _event(doc, "started", "config", f"steps {plan['steps']}", now)
    if config_state == "paused":
        _command(doc, "pause", "config", now)
    elif config_state == "aborted":
        doc.update(state="aborted", share=0.0, cause="config", detail="aborted in the configuration")
    return doc


def _event(doc: dict[str, Any], event: str, cause: str, detail: str, now: float) -> None:
    doc["events"] = [*doc["events"], {"ts": round(now, 3), "event": event, "step": doc["step"],
                                      "share": doc["share"], "cause": cause, "detail": detail}][-MAX_EVENTS:]  # fmt: skip


def _new_epoch(doc: dict[str, Any], now: float) -> None:
    """A step's test starts: its pairs, counts and dwell from zero (pairs routed before are not counted)."""
    doc.update(epoch=doc["epoch"] + 1, since=now, pairs={}, verdict={}, attempts=0, served=0, errors=0,
               last_error=None)  # fmt: skip


def _rollback(doc: dict[str, Any], cause: str, detail: str, now: float) -> None:
    step, share = doc["step"], doc["share"]
    doc.update(state="rolled_back", share=0.0, cause=cause, detail=detail)
    doc["rollbacks"][cause] = doc["rollbacks"].get(cause, 0) + 1
    _event(doc, "rolled_back", cause, detail, now)
    log.warning("rollout of route %s ROLLED BACK at step %d (share %g → 0): %s: %s",
                doc["plan"]["route"], step, share, cause, detail)  # fmt: skip


def _advance(doc: dict[str, Any], now: float) -> None:
    steps = doc["plan"]["steps"]
    if doc["step"] + 1 >= len(steps):
        doc.update(state="complete", cause="none", detail=f"{doc['plan']['candidate']} serves the route")
        _event(doc, "completed", "none", doc["detail"], now)
        log.info("rollout of route %s complete: %s serves the route", doc["plan"]["route"], doc["plan"]["candidate"])
        return
    doc.update(step=doc["step"] + 1, share=steps[doc["step"] + 1], cause="pairs", detail="")
    _new_epoch(doc, now)
    _event(doc, "advanced", "none", f"share {doc['share']:g}", now)
    log.info("rollout of route %s advanced to step %d (share %g)", doc["plan"]["route"], doc["step"], doc["share"])


def _command(doc: dict[str, Any], action: Action, who: str, now: float) -> None:
    state = doc["state"]
    if action == "start":
        doc.update(state="running", step=0, share=doc["plan"]["steps"][0], cause="pairs", detail="")
        _new_epoch(doc, now)
        _event(doc, "started", who, f"steps {doc['plan']['steps']}", now)
    elif action == "pause":
        if state == "paused":
            return
        if state != "running":
            raise Conflict(f"the rollout is {state}: only a running rollout can be paused")
        doc.update(state="paused", cause=who, detail=f"paused by {who}")
        _event(doc, "paused", who, "", now)
    elif action == "resume":
        if state == "running":
            return
        if state != "paused":
            raise Conflict(f"the rollout is {state}: `resume` needs a paused rollout; `start` begins again at step 0")
        doc.update(state="running", cause="pairs", detail="")
        _event(doc, "resumed", who, "", now)
    elif action == "abort":
        if state in ("aborted", "rolled_back"):
            return
        doc.update(state="aborted", share=0.0, cause=who, detail=f"aborted by {who}")
        doc["rollbacks"][who] = doc["rollbacks"].get(who, 0) + 1
        _event(doc, "aborted", who, "", now)
        log.warning("rollout of route %s aborted by %s: share → 0", doc["plan"]["route"], who)
    log.info("rollout of route %s: %s by %s → %s", doc["plan"]["route"], action, who, doc["state"])


# ============================================================================================== every route


@dataclass(eq=False)
class Rollouts:
    """Every route's rollout: the router's ``ticket``, the mirror's pair observer, the Attempts observer, the
    lifespan (open, tick, close), the admin commands, /health and the metrics collector."""

    settings: Settings
    run: str
    by_route: dict[int, Rollout]

    @classmethod
    def of(cls, settings: Settings, run: str, env: Mapping[str, str] | None = None) -> Rollouts | None:
        by_route = {}
        for i, r in enumerate(settings.routes):
            if r.rollout is None:
                continue
            path = Path(r.rollout.state_file).expanduser() if r.rollout.state_file else default_state_file(i, env)
            by_route[i] = Rollout(i, r.primary, r.rollout, path, run=run, min_effect=settings.mirror.min_effect)
        return cls(settings, run, by_route) if by_route else None

    def ticket(self, route: int) -> Ticket | None:
        ro = self.by_route.get(route)
        return ro.ticket() if ro is not None else None

    def on_pair(self, e: Pending, c: Comparison, regime: Regime | None) -> None:
        """A ``Mirror.pair_observers`` hook: comparable pairs of requests a rollout routed."""
        t = e.rollout
        if isinstance(t, Ticket) and t.counting:
            self.by_route[t.route].on_pair(t, c, regime)

    def on_result(self, r: Result) -> None:
        """An ``Attempts`` observer: the candidate's attempts of requests a rollout routed (in their context)."""
        ctx = current()
        t = ctx.rollout if ctx is not None else None
        if isinstance(t, Ticket) and t.counting and r.engine == t.candidate:
            self.by_route[t.route].on_result(r, t)

    def command(self, route: int | None, action: str) -> dict[str, Any]:
        if action not in ACTIONS:
            raise BadRequest(f"`action` must be one of {list(ACTIONS)}, got {str(action)[:40]!r}", param="action")
        if route is None:
            if len(self.by_route) != 1:
                raise BadRequest(f"`route` is required: rollouts on routes {sorted(self.by_route)}", param="route")
            route = next(iter(self.by_route))
        ro = self.by_route.get(route)
        if ro is None:
            raise BadRequest(
                f"route {route} has no rollout (rollouts on routes {sorted(self.by_route)})", param="route"
            )
        if ro.file is None:
            raise NotFound("the rollout is not open yet (the proxy is starting)")
        try:
            ro.command(action, "admin")
        except (OSError, ValueError) as exc:
            raise StateUnavailable(f"cannot update the rollout's state in {ro.path}: {exc}") from None
        return ro.state()

    def state(self) -> list[dict[str, Any]]:
        return [ro.state() for ro in self.by_route.values()]

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        for i, ro in self.by_route.items():
            r = self.settings.routes[i].rollout
            assert r is not None
            try:
                ro.open(r.state)
            except OSError as exc:  # the proxy does not start: a rollout it cannot keep must not run unguarded
                log.error("rollout of route %d: cannot open its state at %s: %s", i, ro.path, exc)
                raise
        try:
            async with held(self._tick_forever):
                yield
        finally:
            for ro in self.by_route.values():
                ro.close()

    async def _tick_forever(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)  # a periodic timer, not a synchronisation
            for ro in self.by_route.values():
                try:
                    ro.tick()
                except Exception:
                    log.exception("rollout of route %d: tick failed", ro.route)

    # a prometheus_client collector: every scrape reads the shared file (any worker answers the same)
    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> list[Metric]:
        return rollout_families([s for ro in self.by_route.values() if (s := ro.sample()) is not None])
