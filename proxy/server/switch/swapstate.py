"""A swap's state document and its phase machine, pure: which engine serves in each phase, what a transition
records, what a restart does with the document it finds.

Phases (``PHASES``) and who serves in each (``SERVING``; None: nothing can take a request, it is held)::

    baseline ─start─> draining ─> stopping ─> launching ─> warming ─> watching ─pass─> complete
       ^                 │ drain_timeout        │ memory_not_returned, start_failed     │ slower, errors, died, aborted
       └── rolled_back <─┴──────── reverting <──┴───────────────────────────────────────┘
                                   │    ^ start / abort (an admin retry; a restart of the proxy too)
                                   v    │
                                   failed: the baseline did not start again (every try); no engine serves, a
                                           request gets the proxy's 503 at once

``failed`` keeps the cause of the swap back (its ``detail`` says the baseline did not start); a rollback is counted
when the retry (an admin ``start`` or ``abort``) brings the baseline back.

The document (``DOC_VERSION``) is what ``proxy.server.record.sharedstate.StateFile`` shares between the owner of
the engines (``proxy.server.switch.swapper``) and every process that serves requests (``proxy.server.switch.swaps``):
the plan (route, baseline, candidate), the phase, the engine serving, an epoch bumped at every transition, the
cause of the last transition, the outage of the last swap, a pending admin command, each serving process's report
(``reports``: requests in flight, the watch's sums) and the last ``MAX_EVENTS`` events.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, NamedTuple

from proxy.server.record.metrics import SWAP_CAUSES, SWAP_PHASES

log = logging.getLogger("enginemeter.swap")

Phase = Literal[
    "baseline",
    "draining",
    "stopping",
    "launching",
    "warming",
    "watching",
    "complete",
    "reverting",
    "rolled_back",
    "failed",
]
PHASES: tuple[str, ...] = SWAP_PHASES
#: the phases a request is served in, and by which side; every other phase holds the request (``failed`` refuses it)
SERVING: Mapping[str, Literal["baseline", "candidate"]] = {
    "baseline": "baseline",
    "rolled_back": "baseline",
    "watching": "candidate",
    "complete": "candidate",
}
#: why a swap went back to the baseline (or never left it)
CAUSES = SWAP_CAUSES
ACTIONS = ("start", "abort")
DOC_VERSION = 1
MAX_EVENTS = 30


class SwapTicket(NamedTuple):
    """What a request on a swap route is routed under: the engine serving (None: hold it) in this epoch."""

    route: int
    epoch: int
    phase: str
    serving: str | None

    def record(self) -> dict[str, Any]:
        """The request log's ``swap`` field."""
        return {"phase": self.phase, "epoch": self.epoch}


def default_state_file(host: str, port: int, route: int, env: Mapping[str, str] | None = None) -> Path:
    """Keyed by the listen address and the route: two proxies of one user never share a swap by default."""
    env = os.environ if env is None else env
    state = env.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    where = f"{host}-{port}".replace(":", "_").replace("/", "_")
    return Path(state) / "enginemeter" / f"swap-{where}-route{route}.json"


def plan_(route: int, baseline: str, candidate: str) -> dict[str, Any]:
    return {"route": route, "baseline": baseline, "candidate": candidate}


def serving(doc: Mapping[str, Any]) -> str | None:
    side = SERVING.get(str(doc.get("phase")))
    return None if side is None else str(doc["plan"][side])


def fresh(plan: dict[str, Any], run: str, config_state: str, now: float) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "v": DOC_VERSION,
        "plan": plan,
        "run": run,
        "config_state": config_state,
        "phase": "baseline",
        "serving": plan["baseline"],
        "epoch": 0,
        "since": now,
        "swap_started": None,
        "cause": "none",
        "detail": "",
        "last_answer": None,
        "first_answer": None,
        "outage_s": None,
        "back_last_answer": None,
        "back_outage_s": None,
        "phase_s": {},
        "base": {},
        "command": None,
        "reports": {},
        "rollbacks": dict.fromkeys(CAUSES, 0),
        "rejected": 0,
        "events": [],
    }
    event_(doc, "opened", "config", f"{plan['baseline']} → {plan['candidate']}, state {config_state}", now)
    return doc


def event_(doc: dict[str, Any], event: str, cause: str, detail: str, now: float) -> None:
    doc["events"] = [
        *doc["events"],
        {"ts": round(now, 3), "event": event, "phase": doc["phase"], "cause": cause, "detail": detail[:300]},
    ][-MAX_EVENTS:]


def enter(doc: dict[str, Any], phase: Phase, now: float, *, cause: str = "none", detail: str = "") -> None:
    """A transition: the phase, the engine serving, a new epoch; the time spent in the phase left, an event and a
    serve console line."""
    left = doc["phase"]
    doc["phase_s"][left] = round(now - float(doc["since"]), 3)
    if phase == "draining":
        doc.update(swap_started=now, last_answer=None, first_answer=None, outage_s=None, phase_s={}, base={})
    if phase == "reverting":
        doc.update(back_last_answer=None, back_outage_s=None)
    doc.update(phase=phase, epoch=int(doc["epoch"]) + 1, since=now, cause=cause, detail=detail[:300])
    doc["serving"] = serving(doc)
    counts = doc.setdefault("transitions", {})
    counts[phase] = int(counts.get(phase, 0)) + 1
    if phase == "rolled_back" and cause in doc["rollbacks"]:
        doc["rollbacks"][cause] += 1
    event_(doc, phase, cause, detail, now)
    plan = doc["plan"]
    what = f"swap of route {plan['route']} ({plan['baseline']} → {plan['candidate']}): {left} → {phase}"
    if phase in ("rolled_back", "failed") or cause in ("slower", "errors", "died", "start_failed"):
        log.warning("%s (%s%s)", what, cause, f": {detail}" if detail else "")
    else:
        log.info("%s%s", what, f" ({detail})" if detail else "")


def outage(doc: dict[str, Any]) -> float | None:
    """Seconds from the baseline's last answer to the candidate's first (or the baseline's first again)."""
    a, b = doc.get("last_answer"), doc.get("first_answer")
    if a is None or b is None:
        return None
    return max(0.0, float(b) - float(a))


def on_open(
    doc: dict[str, Any] | None, damaged: bool, plan: dict[str, Any], run: str, config_state: str, now: float
) -> tuple[dict[str, Any], str]:
    """Reconcile the document found at start with the configuration. Returns the document and which side to
    launch first (``baseline`` or ``candidate``); a swap the configuration asks for is a ``command`` in it.

    A phase in which no engine serves (draining … warming, reverting) returns to the baseline (``restarted``);
    ``watching`` launches the candidate and watches again; ``complete`` launches the candidate; anything else the
    baseline. A ``state`` changed in the configuration since the last start is applied (``running``: swap;
    ``aborted``: the baseline). An unreadable document starts safe: the baseline, ``rolled_back`` (``damaged``),
    never a swap."""
    if damaged:
        doc = fresh(plan, run, config_state, now)
        enter(doc, "rolled_back", now, cause="damaged", detail="the swap's state could not be read: baseline serves")
        return doc, "baseline"
    if doc is None or doc.get("v") != DOC_VERSION or doc.get("plan") != plan:
        doc = fresh(plan, run, config_state, now)
        if config_state == "running":
            doc["command"] = {"action": "start", "who": "config"}
        elif config_state == "aborted":
            enter(doc, "rolled_back", now, cause="aborted", detail="aborted in the configuration")
        return doc, "baseline"
    changed = doc.get("config_state") != config_state
    abort = changed and config_state == "aborted"
    doc.update(run=run, config_state=config_state, reports={}, command=None)
    phase = str(doc.get("phase"))
    if phase in ("watching", "complete") and not abort:
        if phase == "watching":
            enter(doc, "watching", now, cause="restarted", detail="proxy restarted: the watch starts again")
        event_(doc, "restored", "restarted", f"{doc['plan']['candidate']} launched again", now)
        return doc, "candidate"
    if abort and phase != "rolled_back":
        enter(doc, "rolled_back", now, cause="aborted", detail="aborted in the configuration")
    elif phase not in ("baseline", "rolled_back"):
        enter(doc, "rolled_back", now, cause="restarted", detail=f"proxy restarted while {phase}")
    if changed and config_state == "running":
        doc["command"] = {"action": "start", "who": "config"}
    return doc, "baseline"


def merge(parts: list[Mapping[str, Any]]) -> dict[str, list[float]]:
    """Mergeable sums ``{key: [n, mean, m2]}`` of several processes into one (Chan et al.'s parallel variance)."""
    out: dict[str, list[float]] = {}
    for part in parts:
        for key, (n, mean, m2) in part.items():
            if not (n > 0 and math.isfinite(mean) and math.isfinite(m2)):
                continue
            a = out.get(key)
            if a is None:
                out[key] = [float(n), float(mean), float(m2)]
                continue
            tot = a[0] + n
            d = mean - a[1]
            out[key] = [tot, a[1] + d * n / tot, a[2] + m2 + d * d * a[0] * n / tot]
    return out
