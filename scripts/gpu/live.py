"""enginemeter live in front of real engines: the proxy (this tree's ``enginemeter serve``) with its collectors and
request log on, greedy streams through it, and the checks that the proxy's own figures are right. Fails loudly:
exit 1 and the cause printed when an engine is down, ``/health`` says degraded, a request fails, or a check
fails -- never "0 errors" beside a degraded proxy (issue 26).

    python3 scripts/gpu/live.py --out DIR --engine NAME=URL [--engine NAME=URL ...] [--pid NAME=PID ...]
        [--shadow NAME] [--requests 6 --concurrency 2 --max-tokens 256] [--fake-nvml]
        [--profile 1:15,2:10,32:15,1:10,64:20,2:10,8:15] [--workers N]

``--profile``: live traffic instead of a fixed batch -- a recorded concurrency mix replayed through the proxy,
CONCURRENCY:SECONDS segments one after another (each segment keeps that many streams in flight, back to back,
until its time is up; requests started in it finish). The traffic profile the proxy saw is then taken from
serve itself (its last log line ``traffic served: ...; to weigh a bench's answer by it: --traffic SPEC``, else
its /health ``traffic`` section read just before shutdown) and written to DIR/traffic.txt (SPEC, one line) and
summary.json, for ``enginemeter report --traffic SPEC``; the check ``traffic`` fails when none was recorded.

The first engine is the primary; ``--shadow NAME`` mirrors every request to NAME (sample_rate 1, comparison log
on). The checks (DIR/check.txt, one PASS/FAIL row each; DIR/summary.json):
  health         enginemeter's /health ``ok`` and every engine ``up`` (before and after the traffic)
  requests       every request through the proxy answered 200 with its usage
  decode         per request, the proxy's decode tok/s (its request log) vs llama.cpp's own
                 ``timings.predicted_per_second`` for that request: the median deviation within
                 --decode-tolerance (2 %), the worst shown beside it
  memory         (with --pid) GPU memory used/total and each engine's memory vs nvidia-smi within 1 %, and each
                 engine found by its port with its own pid (scripts/gpu/memcheck.py); without nvidia-smi: skipped,
                 or with --fake-nvml a recorded reading replayed through the proxy's NVML seam (the CPU smoke)
  traffic        (with --profile) the proxy's traffic profile recorded (traffic.txt), and its share at each level
                 of requests in flight (1, 2, 3-4, 5-8, ...) within 5 points of the exact profile of the proxy's
                 own request log (every request's start and end: ``--traffic requests.jsonl``) -- under
                 ``serve --workers`` the record must be the whole proxy's, not one worker's
Files: enginemeter.yaml, proxy.log, health-before.json, health-after.json, metrics.txt, requests.jsonl (the
proxy's request log), client.json (what the client saw), compare.jsonl (with --shadow).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(ROOT))

import memcheck  # noqa: E402

from proxy.bench.live.trafficsource import traffic_from  # noqa: E402
from proxy.levels import LEVELS, by_level, representative  # noqa: E402
from proxy.procs.process import free_port  # noqa: E402

TRAFFIC_LINE = re.compile(r"to weigh a bench's answer by it: --traffic (\S+)")

PROMPTS = [
    "Explain, step by step, how a transformer language model turns a prompt into its next token.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "List five uses of a GPU outside of graphics and explain each in a sentence.",
    "请用三句话介绍长城的历史。",
]


def log(msg: str) -> None:
    print(f"[live {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def config(port: int, engines: dict[str, str], shadow: str | None, out: Path) -> str:
    names = list(engines)
    lines = [f"listen: 127.0.0.1:{port}", "engines:"]
    for name, url in engines.items():
        lines += [f"  - name: {name}", f"    url: {url}"]
    lines += ["routes:", '  - models: ["*"]', f"    primary: {names[0]}"]
    if shadow:
        lines += [f"    shadows: [{shadow}]", "    sample_rate: 1.0"]
    lines += [f"    pinnable: [{', '.join(names[1:])}]"] if names[1:] else []
    lines += ["mirror:", f"  enabled: {'true' if shadow else 'false'}", f"  log_path: {out / 'compare.jsonl'}",
              f"request_log: {{path: {out / 'requests.jsonl'}}}",
              "collectors: {gpu: true, gpu_interval: 0.5, engine_interval: 2.0}"]  # fmt: skip
    return "\n".join(lines) + "\n"


def get_json(url: str) -> tuple[int, Any]:
    r = httpx.get(url, timeout=30, trust_env=False)
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, r.text


def health_problems(doc: Any) -> list[str]:
    """What makes /health not healthy: its status and each engine that is not up, with the engine's error."""
    if not isinstance(doc, dict):
        return [f"/health is not JSON: {str(doc)[:200]}"]
    out = [] if doc.get("status") == "ok" else [f"/health status {doc.get('status')!r}"]
    for e in doc.get("engines", []):
        if not e.get("up"):
            out.append(f"engine {e.get('name')} ({e.get('kind')}, {e.get('url')}) down: {e.get('error', 'no error')}")
    return out


def one(url: str, i: int, max_tokens: int) -> dict[str, Any]:
    """One greedy stream with usage; the engine's own ``timings`` where it sends them (llama.cpp)."""
    rid = f"live-{i}"
    body = {"model": "live", "messages": [{"role": "user", "content": f"[{i}] {PROMPTS[i % len(PROMPTS)]}"}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    res: dict[str, Any] = {"i": i, "request_id": rid}
    t0 = time.perf_counter()
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers={"x-request-id": rid},
                          timeout=600, trust_env=False) as r:  # fmt: skip
            res["status"] = r.status_code
            if r.status_code != 200:
                res["error"] = r.read().decode("utf-8", "replace")[:500]
                return res
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                doc = json.loads(line[6:])
                if doc.get("usage"):
                    res["usage"] = doc["usage"]
                if doc.get("timings"):
                    res["timings"] = doc["timings"]
                if doc.get("error"):
                    res["error"] = json.dumps(doc["error"])[:500]
    except httpx.HTTPError as exc:
        res["error"] = repr(exc)
    res["e2e_s"] = round(time.perf_counter() - t0, 3)
    return res


def parse_profile(text: str) -> list[tuple[int, float]]:
    """``1:15,2:10,32:15`` -> [(1, 15.0), (2, 10.0), (32, 15.0)]: concurrency and seconds per segment."""
    out = []
    for part in text.split(","):
        c, _, s = part.strip().partition(":")
        if not s or int(c) < 1 or float(s) <= 0:
            raise ValueError(f"--profile: {part!r} is not CONCURRENCY:SECONDS")
        out.append((int(c), float(s)))
    return out


def replay(url: str, profile: list[tuple[int, float]], max_tokens: int) -> list[dict[str, Any]]:
    """Each segment: ``c`` workers sending streams back to back until the segment's end (the last ones finish)."""
    results: list[dict[str, Any]] = []
    lock = threading.Lock()
    counter = iter(range(10**9))
    for seg, (c, seconds) in enumerate(profile):
        end = time.monotonic() + seconds
        log(f"segment {seg + 1}/{len(profile)}: concurrency {c} for {seconds:g} s")

        def worker(end: float = end, seg: int = seg) -> None:
            while time.monotonic() < end:
                with lock:
                    i = next(counter)
                r = one(url, i, max_tokens)
                r["segment"] = seg
                with lock:
                    results.append(r)

        threads = [threading.Thread(target=worker) for _ in range(c)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return results


def traffic_spec(proxy_log: str, health: Any) -> tuple[str | None, str]:
    """The ``--traffic`` spec serve printed at shutdown, else one built from /health's ``traffic`` section."""
    found = TRAFFIC_LINE.findall(proxy_log)
    if found:
        return found[-1], "serve's shutdown line"
    shares = ((health or {}).get("traffic") or {}).get("busy_shares") if isinstance(health, dict) else None
    if shares:
        spec = ",".join(f"c{representative(k):g}={v * 100:.0f}" for k, v in shares.items() if round(v * 100) > 0)
        return spec, "/health traffic before shutdown"
    return None, "none: serve printed no traffic line and /health had no busy shares"


#: the largest difference, in points of busy time at one level, between the proxy's record and its request log
TRAFFIC_POINTS = 5.0


def traffic_agreement(spec: str, request_log: Path) -> tuple[bool, str]:
    """The proxy's recorded profile (SPEC) against the exact one of its request log, level by level."""
    if not request_log.exists():
        return False, f"no request log at {request_log}"
    recorded = {n: 100 * v for n, v in by_level(traffic_from(spec).concurrency).items()}
    exact = {n: 100 * v for n, v in by_level(traffic_from(str(request_log)).concurrency).items()}
    names = [n for n, _, _ in LEVELS if n in recorded or n in exact]
    worst = max(names, key=lambda n: abs(recorded.get(n, 0.0) - exact.get(n, 0.0)))
    gap = abs(recorded.get(worst, 0.0) - exact.get(worst, 0.0))
    row = ", ".join(f"{n}: {recorded.get(n, 0.0):.0f}/{exact.get(n, 0.0):.0f}" for n in names)
    return gap <= TRAFFIC_POINTS, (f"recorded/request log, % of busy time per level in flight: {row}; worst "
                                   f"{worst} off by {gap:.1f} points (bound {TRAFFIC_POINTS:g})")  # fmt: skip


class Checks:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, bool | None]] = []  # (check, detail, passed; None: skipped)

    def add(self, check: str, detail: str, ok: bool | None) -> None:
        self.rows.append((check, detail, ok))
        log(f"{'PASS' if ok else 'SKIP' if ok is None else 'FAIL'} {check}: {detail}")

    @property
    def passed(self) -> bool:
        return bool(self.rows) and all(ok is not False for _, _, ok in self.rows)

    def render(self) -> str:
        w = max(len(c) for c, _, _ in self.rows)
        out = [f"{c.ljust(w)}  {'PASS' if ok else 'SKIP' if ok is None else 'FAIL'}  {d}" for c, d, ok in self.rows]
        return "\n".join([*out, "", f"OVERALL: {'PASS' if self.passed else 'FAIL'}"])


def decode_rows(checks: Checks, client: list[dict[str, Any]], records: list[dict[str, Any]], primary: str,
                tol: float, min_tokens: int) -> list[dict[str, Any]]:  # fmt: skip
    """Per request: the proxy's decode tok/s (request log) vs the engine's ``timings.predicted_per_second``."""
    by_id = {
        r.get("client_request_id"): r for r in records if r.get("engine") == primary and r.get("role") == "primary"
    }
    rows = []
    for c in client:
        rec, eng = by_id.get(c["request_id"]), (c.get("timings") or {}).get("predicted_per_second")
        if rec is None or not eng or not rec.get("decode_tps") or (rec.get("completion_tokens") or 0) < min_tokens:
            continue
        rows.append({"request_id": c["request_id"], "proxy_decode_tps": rec["decode_tps"], "engine_decode_tps": eng,
                     "ratio": rec["decode_tps"] / eng, "completion_tokens": rec.get("completion_tokens")})  # fmt: skip
    if not rows:
        checks.add("decode", f"no request of {primary} with the engine's own timings and a decode rate in the proxy's "
                   "request log (llama.cpp sends timings; other kinds do not)", None)  # fmt: skip
        return rows
    median = statistics.median(abs(x["ratio"] - 1) for x in rows)
    worst = max(rows, key=lambda x: abs(x["ratio"] - 1))
    # judged on the median: one request whose first chunks a loaded client read late should not decide it
    checks.add("decode", f"{len(rows)} requests, proxy vs engine decode tok/s: median deviation {median:.2%}, worst "
               f"{worst['ratio']:.4f} ({worst['proxy_decode_tps']:.2f} vs {worst['engine_decode_tps']:.2f} tok/s); "
               f"bound ±{tol:.0%} on the median", median <= tol)  # fmt: skip
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--engine", action="append", required=True, metavar="NAME=URL")
    ap.add_argument("--pid", action="append", default=[], metavar="NAME=PID", help="the engine's process (memory)")
    ap.add_argument("--shadow", help="mirror every request to this engine")
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--tolerance", type=float, default=0.01, help="memory vs nvidia-smi (default 1 %%)")
    ap.add_argument("--decode-tolerance", type=float, default=0.02, help="proxy vs engine decode (default 2 %%)")
    ap.add_argument("--profile", type=parse_profile, default=None, help="CONCURRENCY:SECONDS,...: live traffic")
    ap.add_argument("--fake-nvml", action="store_true", help="no GPU here: replay a recorded reading (CPU smoke)")
    ap.add_argument("--workers", type=int, default=None, help="serve --workers N (default: serve's own default)")
    a = ap.parse_args()
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    engines = dict(e.split("=", 1) for e in a.engine)
    pids = {n: int(p) for n, p in (x.split("=", 1) for x in a.pid)}
    primary = next(iter(engines))
    checks = Checks()
    summary: dict[str, Any] = {"date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "engines": engines}

    port = free_port()
    cfg = out / "enginemeter.yaml"
    cfg.write_text(config(port, engines, a.shadow, out))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    serve = [sys.executable, "-m", "proxy.cli", "serve", "--config", str(cfg), "--log-level", "info"]
    serve += ["--workers", str(a.workers)] if a.workers else []
    gpu = shutil.which("nvidia-smi") is not None and not a.fake_nvml
    if a.fake_nvml and pids:
        fake = str(out / "fake-nvml.json")
        memcheck.write_fake(fake, pids)
        env["PATH"] = memcheck.fake_smi_dir(str(out / "bin"), fake) + os.pathsep + env["PATH"]
        os.environ["PATH"] = env["PATH"]  # our own nvidia-smi calls (memcheck.compare) read the same file
        serve = [sys.executable, str(HERE / "memcheck.py"), "fake-serve", "--config", str(cfg), "--fake", fake]
        gpu = True
    url = f"http://127.0.0.1:{port}"
    with open(out / "proxy.log", "wb") as proxy_log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(serve, cwd=ROOT, stdout=proxy_log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the proxy exited {proc.returncode}: {(out / 'proxy.log').read_text()[-1500:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the proxy did not answer /health within 60 s")
            time.sleep(0.3)
        # every engine up, or the cause (the proxy probes at start and polls every 2 s)
        deadline = time.monotonic() + 20
        while True:
            _, h0 = get_json(f"{url}/health")
            problems = health_problems(h0)
            if not problems or time.monotonic() > deadline:
                break
            time.sleep(1)
        (out / "health-before.json").write_text(json.dumps(h0, indent=1) + "\n")
        checks.add("health before", "; ".join(problems) or "ok, every engine up", not problems)
        if problems:
            raise RuntimeError("; ".join(problems))

        t1 = time.perf_counter()
        if a.profile:
            summary["profile"] = [{"concurrency": c, "seconds": s} for c, s in a.profile]
            client = replay(url, a.profile, a.max_tokens)
        else:
            with ThreadPoolExecutor(a.concurrency) as pool:
                client = list(pool.map(lambda i: one(url, i, a.max_tokens), range(a.requests)))
        summary["client_wall_s"] = round(time.perf_counter() - t1, 2)
        (out / "client.json").write_text(json.dumps(client, indent=1) + "\n")
        bad = [c for c in client if c.get("status") != 200 or c.get("error") or not c.get("usage")]
        checks.add("requests", f"{len(client) - len(bad)}/{len(client)} answered 200 with usage"
                   + (f"; first failure: {bad[0].get('status')} {bad[0].get('error')}" if bad else ""), not bad)  # fmt: skip

        # the request log is written off the event loop: wait until it holds every request
        log_path = out / "requests.jsonl"
        deadline = time.monotonic() + 20
        records: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            records = [json.loads(x) for x in log_path.read_text().splitlines()] if log_path.exists() else []
            if sum(1 for r in records if r.get("role") == "primary") >= len(client):
                break
            time.sleep(0.3)
        summary["decode"] = decode_rows(checks, client, records, primary, a.decode_tolerance, min(64, a.max_tokens))

        if not pids:
            checks.add("memory", "no --pid given: not compared", None)
        elif not gpu:
            checks.add("memory", "no nvidia-smi on this machine: not compared (the CPU smoke uses --fake-nvml)", None)
        else:
            table = memcheck.compare(url, pids, tolerance=a.tolerance, out_dir=str(out))
            (out / "memory.txt").write_text(table.render() + "\n")
            failed = [r for r in table.rows if r[4] != "PASS"]
            detail = f"{len(table.rows) - len(failed)}/{len(table.rows)} rows within {a.tolerance:.0%} (memory.txt)"
            if failed:
                detail += f"; first failure: {failed[0][0]}: proxy {failed[0][1]} vs {failed[0][2]}"
            checks.add("memory" + (" (recorded reading)" if a.fake_nvml else ""), detail, table.passed)
        summary["memory_rows"] = [list(r) for r in table.rows] if pids and gpu else []

        _, h1 = get_json(f"{url}/health")
        summary["traffic_health"] = h1.get("traffic") if isinstance(h1, dict) else None
        (out / "health-after.json").write_text(json.dumps(h1, indent=1) + "\n")
        problems = health_problems(h1)
        checks.add("health after", "; ".join(problems) or "ok, every engine up", not problems)
        (out / "metrics.txt").write_text(httpx.get(f"{url}/metrics", timeout=30, trust_env=False).text)
    except Exception as exc:  # the cause, loudly: the run's results must not read as a pass
        checks.add("live", f"stopped: {exc}", False)
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
    if a.profile:
        spec, source = traffic_spec(
            (out / "proxy.log").read_text(errors="replace"), {"traffic": summary.get("traffic_health")}
        )
        summary["traffic"], summary["traffic_source"] = spec, source
        if spec:
            (out / "traffic.txt").write_text(spec + "\n")
        checks.add("traffic", f"--traffic {spec} (from {source})" if spec else source, spec is not None)
        if spec:
            ok, detail = traffic_agreement(spec, out / "requests.jsonl")
            summary["traffic_agreement"] = detail
            checks.add("traffic vs log", detail, ok)
    summary["checks"] = [{"check": c, "detail": d, "passed": ok} for c, d, ok in checks.rows]
    summary["passed"] = checks.passed
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    (out / "check.txt").write_text(checks.render() + "\n")
    print(checks.render())
    if not checks.passed:
        print("live: FAILED — " + "; ".join(f"{c}: {d}" for c, d, ok in checks.rows if ok is False), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
