"""A rollout's state document and its transitions, pure: what each step, rollback and command does to it.

The document (``DOC_VERSION``) is what ``proxy.server.record.sharedstate.StateFile`` shares between the proxy's processes
and what ``state_file`` holds for people: the plan (route, baseline, candidate, steps), the step and its share,
the state (``running``, ``paused``, ``rolled_back``, ``aborted``, ``complete``), the cause of the last transition,
the step's counts and confidence sequences, and the last ``MAX_EVENTS`` events. ``proxy.server.switch.rollout`` decides
when; this module says how.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from proxy.config.switching import RolloutSettings
from proxy.errors import ProxyError
from proxy.sequential import Interval, LiveVerdict, Stream
from proxy.server.record.metrics import ROLLBACK_CAUSES
from proxy.server.switch.statedoc import StateDamaged, default_state_path, need

if TYPE_CHECKING:
    from proxy.server.mirror.compare import Side

log = logging.getLogger("enginemeter.rollout")

State = Literal["running", "paused", "rolled_back", "aborted", "complete"]
STATES: tuple[State, ...] = ("running", "paused", "rolled_back", "aborted", "complete")
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


def default_state_file(host: str, port: int, route: int, env: Mapping[str, str] | None = None) -> Path:
    """``$XDG_STATE_HOME/enginemeter/rollout-HOST-PORT-routeN.json``: keyed by the listen address and the route."""
    return default_state_path("rollout", host, port, route, env)


def share_of(state: str, step: int, steps: list[float]) -> float:
    """The candidate's share that (state, step) means: the step's while running or paused, the last step's once
    complete, 0 when aborted or rolled back."""
    if state in COUNTING:
        return float(steps[step])
    return float(steps[-1]) if state == "complete" else 0.0


def checked(doc: dict[str, Any], plan: dict[str, Any]) -> dict[str, Any]:
    """``doc`` when it is a sound state document (``StateDamaged`` otherwise): every field the rollout reads of the
    type and range it needs, the step within the plan's steps and the share the one (state, step) means — an edited
    ``share`` is damage, not an order. A document of another plan or version is returned unchecked beyond its
    plan (the caller starts the new plan)."""
    if doc.get("v") != DOC_VERSION or doc.get("plan") != plan:
        need(doc, "plan", dict)
        return doc
    steps = plan["steps"]
    state = need(doc, "state", str, lambda v: v in STATES)
    step = need(doc, "step", int, lambda v: 0 <= v < len(steps))
    share = need(doc, "share", float)
    if share != share_of(state, step, steps):
        raise StateDamaged(f"share {share:g} does not follow state {state} at step {step} of {steps}")
    for name in ("epoch", "attempts", "served", "errors"):
        need(doc, name, int, lambda v: v >= 0)
    need(doc, "since", float)
    for name in ("run", "config_state", "cause", "detail"):
        need(doc, name, str)
    need(doc, "pairs", dict, lambda v: all(isinstance(n, int) and not isinstance(n, bool) for n in v.values()))
    need(doc, "verdict", dict)
    need(doc, "rollbacks", dict, lambda v: all(isinstance(n, int) for n in v.values()))
    need(doc, "events", list)
    return doc


def safe(plan: dict[str, Any], run: str, config_state: str, why: str, now: float) -> dict[str, Any]:
    """The state a rollout starts in when its file cannot be trusted: aborted, every request to the baseline, the
    reason in its detail and events. ``start`` (admin) begins the plan again."""
    doc = fresh(plan, run, config_state, now)
    detail = f"state file damaged ({why[:200]}): aborted, all traffic to the baseline; `start` begins again"
    doc.update(state="aborted", share=0.0, cause="config", detail=detail)
    event_(doc, "aborted", "config", detail, now)
    log.error("rollout of route %s: %s", plan["route"], detail)
    return doc


def plan_(route: int, baseline: str, s: RolloutSettings) -> dict[str, Any]:
    return {"route": route, "baseline": baseline, "candidate": s.candidate, "steps": list(s.steps)}


def cs_dump(verdict: LiveVerdict) -> dict[str, Any]:
    out = {}
    for st, cs in verdict.streams.items():
        out[f"{st.regime}/{st.metric}"] = {
            "n": cs.n,
            "mean": cs.mean,
            "m2": cs._m2,
            "lo": cs.lo if math.isfinite(cs.lo) else None,
            "hi": cs.hi if math.isfinite(cs.hi) else None,
            "decision": cs.decision,
            "decided_after": cs.decided_after,
            "drift": cs.drift,
        }
    return out


def cs_load(verdict: LiveVerdict, data: Mapping[str, Any]) -> LiveVerdict:
    for st, cs in verdict.streams.items():
        d = data.get(f"{st.regime}/{st.metric}")
        if not d:
            continue
        cs.n, cs.mean, cs._m2 = int(d["n"]), float(d["mean"]), float(d["m2"])
        cs.lo = -math.inf if d["lo"] is None else float(d["lo"])
        cs.hi = math.inf if d["hi"] is None else float(d["hi"])
        cs.decision, cs.decided_after, cs.drift = d["decision"], d["decided_after"], bool(d["drift"])
    return verdict


def figures_(side: Side) -> dict[str, Any]:
    return {
        "upstream_ttft_s": side.upstream_ttft_s,
        "ttft_s": side.ttft_s,
        "tpot_s": side.tpot_s,
        "e2e_s": side.e2e_s,
        "completion_tokens": side.completion_tokens,
    }


def fresh(plan: dict[str, Any], run: str, config_state: str, now: float) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "v": DOC_VERSION,
        "plan": plan,
        "run": run,
        "config_state": config_state,
        "state": "running",
        "step": 0,
        "share": plan["steps"][0],
        "epoch": 0,
        "since": now,
        "cause": "pairs",
        "detail": "",
        "pairs": {},
        "verdict": {},
        "attempts": 0,
        "served": 0,
        "errors": 0,
        "last_error": None,
        "rollbacks": dict.fromkeys(ROLLBACK_CAUSES, 0),
        "events": [],
    }
    event_(doc, "started", "config", f"steps {plan['steps']}", now)
    if config_state == "paused":
        command_(doc, "pause", "config", now)
    elif config_state == "aborted":
        doc.update(state="aborted", share=0.0, cause="config", detail="aborted in the configuration")
    return doc


def event_(doc: dict[str, Any], event: str, cause: str, detail: str, now: float) -> None:
    doc["events"] = [
        *doc["events"],
        {
            "ts": round(now, 3),
            "event": event,
            "step": doc["step"],
            "share": doc["share"],
            "cause": cause,
            "detail": detail,
        },
    ][-MAX_EVENTS:]


def new_epoch(doc: dict[str, Any], now: float) -> None:
    """A step's test starts: its pairs, counts and dwell from zero (pairs routed before are not counted)."""
    doc.update(epoch=doc["epoch"] + 1, since=now, pairs={}, verdict={}, attempts=0, served=0, errors=0, last_error=None)


def rollback(doc: dict[str, Any], cause: str, detail: str, now: float) -> None:
    step, share = doc["step"], doc["share"]
    doc.update(state="rolled_back", share=0.0, cause=cause, detail=detail)
    doc["rollbacks"][cause] = doc["rollbacks"].get(cause, 0) + 1
    event_(doc, "rolled_back", cause, detail, now)
    log.warning(
        "rollout of route %s ROLLED BACK at step %d (share %g → 0): %s: %s",
        doc["plan"]["route"],
        step,
        share,
        cause,
        detail,
    )


def advance(doc: dict[str, Any], now: float) -> None:
    steps = doc["plan"]["steps"]
    if doc["step"] + 1 >= len(steps):
        doc.update(state="complete", cause="none", detail=f"{doc['plan']['candidate']} serves the route")
        event_(doc, "completed", "none", doc["detail"], now)
        log.info("rollout of route %s complete: %s serves the route", doc["plan"]["route"], doc["plan"]["candidate"])
        return
    doc.update(step=doc["step"] + 1, share=steps[doc["step"] + 1], cause="pairs", detail="")
    new_epoch(doc, now)
    event_(doc, "advanced", "none", f"share {doc['share']:g}", now)
    log.info("rollout of route %s advanced to step %d (share %g)", doc["plan"]["route"], doc["step"], doc["share"])


def command_(doc: dict[str, Any], action: Action, who: str, now: float) -> None:
    state = doc["state"]
    if action == "start":
        doc.update(state="running", step=0, share=doc["plan"]["steps"][0], cause="pairs", detail="")
        new_epoch(doc, now)
        event_(doc, "started", who, f"steps {doc['plan']['steps']}", now)
    elif action == "pause":
        if state == "paused":
            return
        if state != "running":
            raise Conflict(f"the rollout is {state}: only a running rollout can be paused")
        doc.update(state="paused", cause=who, detail=f"paused by {who}")
        event_(doc, "paused", who, "", now)
    elif action == "resume":
        if state == "running":
            return
        if state != "paused":
            raise Conflict(f"the rollout is {state}: `resume` needs a paused rollout; `start` begins again at step 0")
        doc.update(state="running", cause="pairs", detail="")
        event_(doc, "resumed", who, "", now)
    elif action == "abort":
        if state in ("aborted", "rolled_back"):
            return
        doc.update(state="aborted", share=0.0, cause=who, detail=f"aborted by {who}")
        doc["rollbacks"][who] = doc["rollbacks"].get(who, 0) + 1
        event_(doc, "aborted", who, "", now)
        log.warning("rollout of route %s aborted by %s: share → 0", doc["plan"]["route"], who)
    log.info("rollout of route %s: %s by %s → %s", doc["plan"]["route"], action, who, doc["state"])


def evaluate(
    doc: dict[str, Any], s: RolloutSettings, empty: LiveVerdict, say: Callable[[Stream, Interval], str], now: float
) -> None:
    """The step's decision, applied to ``doc``: roll back (errors over budget, a stream slower), hold (the cause
    says what it waits for), or advance. ``empty``: a fresh verdict the step's sequences are loaded into; ``say``:
    a stream's interval in words."""
    e = math.log1p(empty.min_effect)
    if doc["errors"] >= s.min_errors and doc["errors"] > s.error_budget * doc["attempts"]:
        detail = (
            f"{s.candidate} failed {doc['errors']} of its {doc['attempts']} attempts at step {doc['step']} "
            f"(budget {s.error_budget:.1%}, at least {s.min_errors}); last: {doc.get('last_error')}"
        )
        rollback(doc, "errors", detail, now)
        return
    v = cs_load(empty, doc["verdict"])
    for st, cs in v.streams.items():
        if math.isfinite(cs.lo) and cs.lo > e:
            rollback(doc, "slower", say(st, cs.state()), now)
            return
    if doc["state"] == "paused":
        return
    cause, detail = hold(doc, s, v, say, now, e)
    if cause is not None:
        doc["cause"], doc["detail"] = cause, detail
        return
    advance(doc, now)


def hold(
    doc: dict[str, Any],
    s: RolloutSettings,
    v: LiveVerdict,
    say: Callable[[Stream, Interval], str],
    now: float,
    e: float,
) -> tuple[str | None, str]:
    """Why the step cannot advance yet (None: it can)."""
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
                return "not_yet", say(st, cs.state())
            checked += 1
    if checked == 0:
        return "pairs", f"{total} pairs at this step; {s.min_pairs} needed in a regime"
    if doc["share"] > 0 and doc["served"] < s.min_requests:
        return "requests", f"{doc['served']} of {s.min_requests} requests served by {s.candidate}"
    if now - doc["since"] < s.min_dwell_s:
        return "dwell", f"each step lasts {s.min_dwell_s:g} s at least"
    return None, ""
