"""Issue 48's swap figures (scripts/gpu/swapreport.py) from raw files alone: every request the client sent is
accounted for against the proxy's request log (served, held then served, refused with the proxy's 503, failed),
the swap and the way back are found in the swap's own events, and a request missing from the log or failed
fails the report. The files are written here as scripts/gpu/swaplive.py writes them on the GPU machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
REPORT = ROOT / "scripts" / "gpu" / "swapreport.py"
T0 = 1_000_000.0


def jsonl(path: Path, docs: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))


def raw_run(d: Path, *, drop_from_log: int = 0, fail_one: bool = False) -> None:
    events = [
        {"ts": T0 + 0.1, "event": "draining", "cause": "none", "detail": ""},
        {"ts": T0 + 0.3, "event": "stopping", "cause": "none", "detail": ""},
        {"ts": T0 + 0.5, "event": "launching", "cause": "none", "detail": ""},
        {"ts": T0 + 90.0, "event": "warming", "cause": "none", "detail": "ready in 89.5 s"},
        {"ts": T0 + 91.0, "event": "watching", "cause": "none", "detail": ""},
        {"ts": T0 + 131.0, "event": "complete", "cause": "none", "detail": ""},
        {"ts": T0 + 141.0, "event": "reverting", "cause": "aborted", "detail": ""},
        {"ts": T0 + 146.0, "event": "rolled_back", "cause": "aborted", "detail": ""},
    ]
    swap_state = {"phase": "complete", "candidate": "vllm-fp8", "outage_s": 91.2, "phase_s": {"launching": 89.5},
                  "cause": "none", "watch": {"decision": "pass", "detail": "not slower", "streams": []}}  # fmt: skip
    back_state = {"phase": "rolled_back", "candidate": "vllm-fp8", "outage_s": 91.2, "back_outage_s": 5.5,
                  "cause": "aborted"}  # fmt: skip
    jsonl(d / "actions.jsonl", [
        {"t": T0 - 60, "action": "baseline_up"}, {"t": T0, "action": "start"},
        {"t": T0 + 131.5, "action": "swap_ended", "phase": "complete", "state": swap_state},
        {"t": T0 + 141.0, "action": "abort"},
        {"t": T0 + 146.5, "action": "rollback_ended", "phase": "rolled_back", "state": back_state},
        {"t": T0 + 170, "action": "traffic_stopped"},
    ])  # fmt: skip
    jsonl(d / "timeline.jsonl", [{"t": T0 + 146.6, "phase": "rolled_back", "state": {"events": events}}])
    # before the swap, held through the outage, on the candidate, held through the way back, after
    starts = [T0 - 10.0, T0 + 0.2, T0 + 100.0, T0 + 142.0, T0 + 150.0]
    firsts = [T0 - 9.9, T0 + 91.1, T0 + 100.1, T0 + 146.2, T0 + 150.1]
    held = [0.0, 90.9, 0.0, 4.2, 0.0]
    engines = ["llama-q4", "vllm-fp8", "vllm-fp8", "llama-q4", "llama-q4"]
    client = [{"request_id": f"swap-{i}", "status": 200, "usage": {"completion_tokens": 64}, "start": s,
               "first_byte": f, "end": f + 1.0} for i, (s, f) in enumerate(zip(starts, firsts, strict=True))]  # fmt: skip
    client.append({"request_id": "swap-5", "status": 503, "start": T0 + 1.0, "end": T0 + 301.0, "retry_after": "30",
                   "error": '{"error": {"message": "held the longest", "enginemeter": true}}'})  # fmt: skip
    if fail_one:
        client[2] = {**client[2], "status": 502, "usage": None, "error": "upstream broke"}
    log = [{"client_request_id": c["request_id"], "role": "primary", "engine": e, "swap": {"held_s": h}}
           for c, e, h in zip(client, [*engines, "none"], [*held, 300.0], strict=True)]  # fmt: skip
    jsonl(d / "client.jsonl", client)
    jsonl(d / "requests.jsonl", log[drop_from_log:])
    (d / "run.json").write_text(json.dumps({"baseline": "llama-q4", "candidate": "vllm-fp8", "profile": "1:15",
                                            "swap": {"min_dwell_s": "60"}}))  # fmt: skip


def report(d: Path) -> tuple[int, dict[str, Any]]:
    r = subprocess.run([sys.executable, str(REPORT), str(d)], capture_output=True, text=True, check=False)
    return r.returncode, json.loads((d / "swap.json").read_text())


def test_every_request_is_accounted_for_and_both_outages_found(tmp_path: Path) -> None:
    raw_run(tmp_path)
    rc, f = report(tmp_path)
    assert rc == 0, (tmp_path / "check.txt").read_text()
    r = f["requests"]
    assert (r["sent"], r["in_request_log"]) == (6, 6)
    assert (r["served"], r["held_then_served"], r["refused_503"], r["failed"]) == (3, 2, 1, 0)
    assert r["served_by"] == {"llama-q4": 3, "vllm-fp8": 2}
    assert f["swap_end"] == "complete" and f["rollback_end"] == "rolled_back" and f["rollback_by"] == "abort"
    assert f["proxy_outage_s"] == {"swap": 91.2, "rollback": 5.5}
    # the client's view: the first byte before the swap (T0 - 9.9) to the candidate's first (T0 + 91.1)
    assert f["client_outage_s"]["swap"] == 101.0
    assert f["client_outage_s"]["rollback"] == 46.1  # T0 + 100.1 (the last on the candidate) to T0 + 146.2
    assert f["windows"]["swap"]["ended"] == "watching" and f["windows"]["rollback"]["ended"] == "rolled_back"
    md = (tmp_path / "swap.md").read_text()
    assert "held then served 2" in md and "refused with 503 past the bound 1" in md


def test_a_request_missing_from_the_log_or_failed_fails_the_report(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    raw_run(tmp_path / "a", drop_from_log=1)
    rc, f = report(tmp_path / "a")
    assert rc == 1 and f["requests"]["missing_from_log"] == ["swap-0"]
    (tmp_path / "b").mkdir()
    raw_run(tmp_path / "b", fail_one=True)
    rc, f = report(tmp_path / "b")
    assert rc == 1 and f["requests"]["failed"] == 1
    assert "FAIL nothing lost" in (tmp_path / "b" / "swap.md").read_text()
