"""The swap run's figures from its raw files alone (scripts/gpu/swaplive.py wrote them; a run's make.sh runs this
again): the phases and their seconds, the outage of the swap and of the rollback (the proxy's own measure and the
client's), every request accounted for, the watch's decision, GPU memory in each phase.

    python3 scripts/gpu/swapreport.py DIR [OUT]  -> OUT/swap.md, OUT/swap.json, OUT/check.txt (OUT: DIR by
                                                   default); exit 1 on a FAIL

Every request the client sent is one of: served without a hold, held then served, refused by the proxy (503 with
Retry-After: the hold's bound), or failed otherwise -- and each must be in the proxy's request log (by its
``x-request-id``). The client's outage is the longest stretch without a first byte of any answer inside the swap
(start → complete) and inside the rollback (abort → rolled back); the proxy's is the swap state's ``outage_s``
(the baseline's last answer → the candidate's first), recorded at each phase change.
"""

from __future__ import annotations

import gzip
import itertools
import json
import statistics
import sys
from pathlib import Path
from typing import Any


def jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of ``path``, or of ``path.gz`` (collect.sh compresses the large ones)."""
    gz = path.with_name(path.name + ".gz")
    if path.exists():
        text = path.read_text(errors="replace")
    elif gz.exists():
        text = gzip.decompress(gz.read_bytes()).decode(errors="replace")
    else:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a kill
    return out


def actions_at(acts: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {a["action"]: a for a in acts}


def events(rows: list[dict[str, Any]], final: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Every transition the swap recorded (its own wall-clock ``ts``), from the final state file and from each
    state the poller kept, de-duplicated, in time order."""
    seen: dict[tuple[float, str], dict[str, Any]] = {}
    docs = [r["state"] for r in rows if "state" in r] + ([final] if final else [])
    for doc in docs:
        for e in doc.get("events") or []:
            seen[(float(e["ts"]), str(e["event"]))] = e
    return [seen[k] for k in sorted(seen)]


def windows(evs: list[dict[str, Any]]) -> dict[str, tuple[float, float, str]]:
    """(from, to, how it ended) of the swap (draining → watching or rolled_back) and of the way back (reverting →
    rolled_back)."""
    out: dict[str, tuple[float, float, str]] = {}
    start = None
    for e in evs:
        ev, ts = e["event"], float(e["ts"])
        if ev == "draining" and "swap" not in out:
            start = ts
        elif ev in ("watching", "rolled_back") and start is not None and "swap" not in out:
            out["swap"] = (start, ts, ev)
        if ev == "reverting":
            start = ts
        elif ev == "rolled_back" and start is not None and "swap" in out:
            out["rollback"] = (start, ts, ev)
    return out


def gap(firsts: list[float], lo: float, hi: float) -> float | None:
    """The longest stretch between two first bytes of answers around [lo, hi] (the last one before lo, the first
    one after hi included): what a client saw of the outage."""
    before = [x for x in firsts if x < lo]
    after = [x for x in firsts if x > hi]
    pts = sorted([*before[-1:], *(x for x in firsts if lo <= x <= hi), *after[:1]])
    if len(pts) < 2:
        return None
    return round(max(b - a for a, b in itertools.pairwise(pts)), 2)


def accounting(client: list[dict[str, Any]], log: list[dict[str, Any]]) -> dict[str, Any]:
    by_id = {r.get("client_request_id"): r for r in log if r.get("role", "primary") == "primary"}
    out: dict[str, Any] = {"sent": len(client), "in_request_log": 0, "missing_from_log": []}
    kinds = {"served": 0, "held_then_served": 0, "refused_503": 0, "failed": 0}
    held_s: list[float] = []
    engines: dict[str, int] = {}
    for c in client:
        rec = by_id.get(c["request_id"])
        if rec is None:
            out["missing_from_log"].append(c["request_id"])
        else:
            out["in_request_log"] += 1
        mark = (rec or {}).get("swap") or {}
        ok = c.get("status") == 200 and not c.get("error") and c.get("usage")
        if ok:
            h = float(mark.get("held_s") or 0.0)
            kinds["held_then_served" if h > 0 else "served"] += 1
            if h > 0:
                held_s.append(h)
            eng = (rec or {}).get("engine", "?")
            engines[eng] = engines.get(eng, 0) + 1
        elif c.get("status") == 503 and '"enginemeter"' in (c.get("error") or "").replace(" ", ""):
            kinds["refused_503"] += 1
        else:
            kinds["failed"] += 1
    out.update(kinds)
    out["served_by"] = engines
    out["held_s"] = {"n": len(held_s), "max": round(max(held_s), 2) if held_s else None,
                     "median": round(statistics.median(held_s), 2) if held_s else None}  # fmt: skip
    out["first_failures"] = [
        {k: c.get(k) for k in ("request_id", "status", "error")}
        for c in client
        if not (c.get("status") == 200 and not c.get("error")) and c.get("status") != 503
    ][:5]
    out["missing_from_log"] = out["missing_from_log"][:20]
    return out


def memory(gpu: Path, marks: dict[str, float]) -> dict[str, Any]:
    """The card's used MiB at the moments that matter: the max in each window between the driver's marks."""
    rows = []
    if gpu.exists():
        for line in gpu.read_text().splitlines():
            t, _, rest = line.partition("\t")
            card, _, procs = rest.partition("\t")
            used, _, total = card.partition("/")
            if used.isdigit() and total.isdigit():
                rows.append((float(t), int(used), int(total), procs))
    if not rows:
        return {"samples": 0}
    out: dict[str, Any] = {"samples": len(rows), "total_mib": rows[0][2]}
    names = sorted(marks, key=marks.get)  # type: ignore[arg-type]
    for a, b in zip(names, [*names[1:], None], strict=False):
        lo, hi = marks[a], (marks[b] if b else float("inf"))
        w = [u for t, u, _, _ in rows if lo <= t < hi]
        if w:
            out[f"{a}→{b or 'end'}"] = {"max_mib": max(w), "min_mib": min(w)}
    return out


def figures(d: Path) -> dict[str, Any]:
    acts = actions_at(jsonl(d / "actions.jsonl"))
    rows = jsonl(d / "timeline.jsonl")
    client = jsonl(d / "client.jsonl")
    run = json.loads((d / "run.json").read_text()) if (d / "run.json").exists() else {}
    final = None
    if (d / "state-final.json").exists():
        try:
            final = json.loads((d / "state-final.json").read_text())
        except ValueError:
            final = None
    fig: dict[str, Any] = {"baseline": run.get("baseline"), "candidate": run.get("candidate"),
                           "profile": run.get("profile"), "swap_settings": run.get("swap"), "error": run.get("error")}  # fmt: skip
    evs = events(rows, final)
    t0 = float(acts["start"]["t"]) if "start" in acts else (float(evs[0]["ts"]) if evs else 0.0)
    fig["events"] = [{**e, "at_s": round(float(e["ts"]) - t0, 2)} for e in evs]
    win = windows(evs)
    fig["windows"] = {k: {"from_s": round(a - t0, 2), "to_s": round(b - t0, 2), "ended": how}
                      for k, (a, b, how) in win.items()}  # fmt: skip
    ended, back = acts.get("swap_ended", {}), acts.get("rollback_ended", {})
    fig["swap_end"] = ended.get("phase")
    fig["rollback_end"] = (
        back.get("phase") if "abort" in acts else ("rolled_back" if ended.get("phase") == "rolled_back" else None)
    )
    fig["rollback_by"] = "abort" if "abort" in acts else ("the watch" if ended.get("phase") == "rolled_back" else None)
    st_swap, st_back = ended.get("state") or {}, back.get("state") or {}
    # the state's outage and phase seconds belong to the swap since its draining: a way back after a complete
    # swap (an abort) still carries the swap's (its phase seconds extend them); only the phases added are its own
    swap_ph, back_ph = st_swap.get("phase_s") or {}, st_back.get("phase_s") or {}
    same_leg = bool(swap_ph) and all(back_ph.get(k) == v for k, v in swap_ph.items())
    fig["proxy_outage_s"] = {
        "swap": st_swap.get("outage_s"),
        # the proxy's own figure for the way back since 86ba7e2; before it, none after a complete swap
        "rollback": st_back.get("back_outage_s", None if same_leg and back else st_back.get("outage_s")),
    }
    fig["phase_s"] = {
        "swap": swap_ph,
        "rollback": {k: v for k, v in back_ph.items() if k not in swap_ph or swap_ph[k] != v} if same_leg else back_ph,
    }
    fig["watch"] = st_swap.get("watch")
    fig["swap_cause"] = {"swap": st_swap.get("cause"), "rollback": st_back.get("cause") or st_swap.get("cause")}
    firsts = sorted(float(c["first_byte"]) for c in client if c.get("first_byte") and c.get("status") == 200)
    fig["client_outage_s"] = {k: gap(firsts, a, b) for k, (a, b, _) in win.items()}
    fig["requests"] = accounting(client, jsonl(d / "requests.jsonl"))
    marks = {k: float(v["t"]) for k, v in acts.items() if k in ("baseline_up", "traffic_stopped")}
    marks |= {
        e["event"] + ("" if e["event"] not in marks else "#2"): float(e["ts"]) for e in evs if e["event"] != "opened"
    }
    fig["memory"] = memory(d / "gpu.tsv", marks)
    fig["gpu_after_stop"] = run.get("gpu_after_stop")
    fig["rollbacks"] = (final or {}).get("rollbacks")
    return fig


def checks(f: dict[str, Any]) -> list[tuple[str, bool | None, str]]:
    r = f["requests"]
    out: list[tuple[str, bool | None, str]] = []
    out.append(("accounted", r["sent"] > 0 and r["in_request_log"] == r["sent"],
                f"{r['in_request_log']}/{r['sent']} client requests in the proxy's request log"))  # fmt: skip
    out.append(("nothing lost", r["failed"] == 0,
                f"served {r['served']}, held then served {r['held_then_served']}, refused 503 {r['refused_503']}, "
                f"failed {r['failed']}" + (f"; first: {r['first_failures'][0]}" if r["first_failures"] else "")))  # fmt: skip
    out.append(("swap decided", f["swap_end"] in ("complete", "rolled_back"),
                f"ended {f['swap_end']} (cause {f['swap_cause']['swap']})"))  # fmt: skip
    out.append(("back on baseline", f["rollback_end"] == "rolled_back",
                f"{f['rollback_end']} by {f['rollback_by']} (cause {f['swap_cause']['rollback']})"))  # fmt: skip
    after = str(f.get("gpu_after_stop") or "")
    if after:
        procs = after.split("\t", 1)[1] if "\t" in after else ""
        out.append(("no engine left", not procs.strip(), f"nvidia-smi after serve stopped: {after}"))
    if f.get("error"):
        out.append(("driver", False, str(f["error"])))
    return out


def cell(v: Any, unit: str = " s") -> str:
    if v is None:
        return "–"
    return f"{v:.2f}{unit}" if isinstance(v, float) else f"{v}{unit}"


def markdown(f: dict[str, Any], rows: list[tuple[str, bool | None, str]]) -> str:
    r, w = f["requests"], f["windows"]
    po, co, ps = f["proxy_outage_s"], f["client_outage_s"], f["phase_s"]
    lines = [f"# The swap under live traffic: {f['baseline']} → {f['candidate']} and back", "",
             f"Traffic: the profile `{f['profile']}` (concurrency:seconds, repeated, closed-loop clients); swap "
             f"settings `{json.dumps(f['swap_settings'])}` (the rest serve's defaults).", "",
             "| | the swap | the way back |", "|---|---|---|",
             f"| how it ended | {f['swap_end']} (cause {f['swap_cause']['swap']}) | {f['rollback_end']} by "
             f"{f['rollback_by']} (cause {f['swap_cause']['rollback']}) |",
             f"| outage, the proxy's: last answer → first answer | {cell(po['swap'])} | "
             f"{cell(po['rollback']) if po['rollback'] is not None else 'not measured by the proxy (its figure is the swap’s)'} |",
             f"| outage, the client's: longest stretch between first bytes | {cell(co.get('swap'))} | "
             f"{cell(co.get('rollback'))} |",
             f"| window (s from the start command) | {w.get('swap')} | {w.get('rollback')} |",
             f"| seconds per phase (the proxy's) | {ps['swap']} | {ps['rollback']} |", "",
             "**Every request**: "
             f"{r['sent']} sent, {r['in_request_log']} in the proxy's request log; served without a hold "
             f"{r['served']}, held then served {r['held_then_served']} (held seconds {r['held_s']}), refused with "
             f"503 past the bound {r['refused_503']}, failed {r['failed']}; served by {r['served_by']}.", "",
             f"**The watch**: {(f['watch'] or {}).get('decision')} — {(f['watch'] or {}).get('detail')}", "",
             "| regime | figure | baseline n | candidate n | Δ (candidate/baseline − 1) | interval |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for st in (f["watch"] or {}).get("streams") or []:
        iv = st.get("interval")
        ivs = f"{iv[0]:+.1%} to {iv[1]:+.1%}" if iv else "–"
        lines.append(f"| {st.get('regime')} | {st.get('metric')} | {st.get('baseline_n')} | {st.get('candidate_n')} | "
                     f"{st.get('delta', 0):+.1%} | {ivs} |")  # fmt: skip
    lines += ["", "**Transitions** (the swap's own events, seconds from the start command):", "",
              "| at | phase | cause | detail |", "|---|---|---|---|"]  # fmt: skip
    lines += [f"| {e['at_s']} | {e['event']} | {e.get('cause')} | {e.get('detail') or ''} |" for e in f["events"]]
    mem = {k: v for k, v in f["memory"].items() if isinstance(v, dict)}
    lines += ["", f"**GPU memory** (nvidia-smi every second, MiB used of {f['memory'].get('total_mib')}; each "
              "window from one transition to the next):", "", "| window | max | min |", "|---|---|---|"]  # fmt: skip
    lines += [f"| {k} | {v['max_mib']} | {v['min_mib']} |" for k, v in mem.items()]
    lines += ["", f"After serve stopped: `{f.get('gpu_after_stop')}`", "", "**Checks**", ""]
    lines += [f"- {'PASS' if ok else 'SKIP' if ok is None else 'FAIL'} {name}: {detail}" for name, ok, detail in rows]
    return "\n".join(lines) + "\n"


def main() -> int:
    d = Path(sys.argv[1])
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else d
    out.mkdir(parents=True, exist_ok=True)
    f = figures(d)
    rows = checks(f)
    f["checks"] = [{"check": n, "passed": ok, "detail": det} for n, ok, det in rows]
    (out / "swap.json").write_text(json.dumps(f, indent=1, default=str) + "\n")
    (out / "swap.md").write_text(markdown(f, rows))
    text = "\n".join(f"{n:15s} {'PASS' if ok else 'SKIP' if ok is None else 'FAIL'}  {det}" for n, ok, det in rows)
    passed = all(ok is not False for _, ok, _ in rows)
    (out / "check.txt").write_text(text + f"\n\nOVERALL: {'PASS' if passed else 'FAIL'}\n")
    print(text + f"\nOVERALL: {'PASS' if passed else 'FAIL'}")
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
