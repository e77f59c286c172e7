"""The swap on one GPU under live traffic (issue 48 item 1): ``enginemeter serve`` launches the baseline from its
command line, a recorded burst profile flows through it without a pause, the swap to the candidate is started by
``POST /admin/rollout {"action": "start"}``, watched to its end (complete or rolled back by itself), then aborted
(the rollback: the candidate stopped, its GPU memory back, the baseline launched again); then more traffic and a
clean stop. Raw files only; the figures come from ``scripts/gpu/swapreport.py DIR`` (make.sh runs it again).

    python3 scripts/gpu/swaplive.py --out DIR --baseline NAME='COMMAND' --candidate NAME='COMMAND'
        [--profile 1:15,2:10,32:15,1:10,64:20,2:10,8:15] [--before-s 95] [--after-s 30] [--tail-s 30]
        --model NAME [--swap KEY=VALUE ...] [--max-tokens 64] [--swap-timeout-s 900] [--nvidia-smi]

``--swap KEY=VALUE`` sets the route's ``swap:`` keys (``min_dwell_s=60``, ``queue_max_wait_s=300``, ...; the rest
are serve's defaults). The profile repeats until the run ends: every client is a closed loop (one stream at a time,
back to back), so a held client holds one request.

Files in DIR: enginemeter.yaml, proxy.log (serve's console: every phase change), requests.jsonl (the proxy's
request log: each request's ``swap`` field, phase and held seconds), client.jsonl (each request as the client saw
it: wall-clock start/first byte/end, status, Retry-After, error), timeline.jsonl (every 0.5 s: the swap's state as
``GET /admin/rollout`` gives it; the whole document at each phase change), gpu.tsv (every second: the card's used
memory and every GPU process, from nvidia-smi), actions.jsonl (what this driver did and when), state-final.json
(the swap's state file at the end), health-*.json, metrics.txt, run.json (the arguments, the times), xdg/ (serve's
state: the launched engines' logs under enginemeter/serve-HOST-PORT/engines/).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(ROOT))

from live import PROMPTS, parse_profile  # noqa: E402

from proxy.procs.process import free_port  # noqa: E402

ADMIN_KEY = "swap-run"
ENDS = ("complete", "rolled_back")


def log(msg: str) -> None:
    print(f"[swap {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def scalar(v: str) -> str:
    """A YAML scalar for a ``--swap`` value: numbers and words as given, anything else quoted."""
    try:
        float(v)
        return v
    except ValueError:
        return json.dumps(v)


def config(port: int, base: tuple[str, str], cand: tuple[str, str], swap: dict[str, str], out: Path) -> str:
    lines = [f"listen: 127.0.0.1:{port}", f"admin_key: {ADMIN_KEY}", "engines:"]
    for name, cmd in (base, cand):
        lines += [f"  - name: {name}", f"    launch: {json.dumps(cmd)}"]
    lines += ["routes:", '  - models: ["*"]', f"    primary: {base[0]}", "    swap:", f"      candidate: {cand[0]}"]
    lines += [f"      {k}: {scalar(v)}" for k, v in swap.items()]
    lines += [f"      state_file: {out / 'swap-state.json'}", f"request_log: {{path: {out / 'requests.jsonl'}}}",
              "collectors: {gpu: true, gpu_interval: 0.5, engine_interval: 2.0}"]  # fmt: skip
    return "\n".join(lines) + "\n"


class Jsonl:
    """Append-only JSON lines, one lock: the traffic threads, the poller and the driver write their own files."""

    def __init__(self, path: Path) -> None:
        self.fh = open(path, "a", encoding="utf-8")  # noqa: SIM115 -- closed by close()
        self.lock = threading.Lock()

    def write(self, doc: dict[str, Any]) -> None:
        with self.lock:
            self.fh.write(json.dumps(doc, separators=(",", ":")) + "\n")
            self.fh.flush()

    def close(self) -> None:
        self.fh.close()


def one(url: str, i: int, max_tokens: int, seg: int, conc: int, model: str) -> dict[str, Any]:
    """One greedy stream with usage, timed by the wall clock (the proxy's request log and the poller's rows use
    the same clock)."""
    rid = f"swap-{i}"
    body = {"model": model, "messages": [{"role": "user", "content": f"[{i}] {PROMPTS[i % len(PROMPTS)]}"}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    res: dict[str, Any] = {"i": i, "request_id": rid, "segment": seg, "concurrency": conc, "start": time.time()}
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers={"x-request-id": rid},
                          timeout=httpx.Timeout(1800, connect=30), trust_env=False) as r:  # fmt: skip
            res["status"] = r.status_code
            if r.status_code != 200:
                res["retry_after"] = r.headers.get("retry-after")
                res["error"] = r.read().decode("utf-8", "replace")[:400]
            else:
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    res.setdefault("first_byte", time.time())
                    doc = json.loads(line[6:])
                    if doc.get("usage"):
                        res["usage"] = doc["usage"]
                    if doc.get("error"):
                        res["error"] = json.dumps(doc["error"])[:400]
    except httpx.HTTPError as exc:
        res["error"] = repr(exc)[:400]
    res["end"] = time.time()
    return res


def traffic(url: str, profile: list[tuple[int, float]], max_tokens: int, model: str, stop: threading.Event,
            out: Jsonl) -> None:  # fmt: skip
    """The profile, segment after segment, round and round until ``stop``; requests in flight then finish."""
    counter = itertools.count()
    lock = threading.Lock()
    for seg, (c, seconds) in enumerate(itertools.cycle(profile)):
        if stop.is_set():
            return
        end = time.monotonic() + seconds

        def worker(end: float = end, seg: int = seg, c: int = c) -> None:
            while time.monotonic() < end and not stop.is_set():
                with lock:
                    i = next(counter)
                out.write(one(url, i, max_tokens, seg, c, model))

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(c)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def swap_state(doc: Any) -> dict[str, Any] | None:
    """The route's swap in an /admin/rollout answer (or any document holding one): the dict with a phase."""
    if isinstance(doc, dict):
        if "phase" in doc and "candidate" in doc:
            return doc
        for v in doc.values():
            found = swap_state(v)
            if found is not None:
                return found
    if isinstance(doc, list):
        for v in doc:
            found = swap_state(v)
            if found is not None:
                return found
    return None


def admin(url: str, action: str | None = None) -> tuple[int, Any]:
    headers = {"authorization": f"Bearer {ADMIN_KEY}"}
    if action is None:
        r = httpx.get(f"{url}/admin/rollout", headers=headers, timeout=10, trust_env=False)
    else:
        r = httpx.post(f"{url}/admin/rollout", headers=headers, json={"action": action}, timeout=10, trust_env=False)
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, r.text


class Poller(threading.Thread):
    """Every 0.5 s the swap's state (a row; the whole state at each phase change); every 1 s nvidia-smi."""

    def __init__(self, url: str, out: Path, smi: bool) -> None:
        super().__init__(daemon=True)
        self.url, self.smi, self.stop = url, smi, threading.Event()
        self.rows = Jsonl(out / "timeline.jsonl")
        self.gpu = open(out / "gpu.tsv", "a", encoding="utf-8") if smi else None  # noqa: SIM115
        self.phase: str | None = None
        self.state: dict[str, Any] | None = None

    def run(self) -> None:
        last_smi = 0.0
        while not self.stop.is_set():
            now = time.time()
            try:
                status, doc = admin(self.url)
                st = swap_state(doc) if status == 200 else None
            except httpx.HTTPError as exc:
                status, st = 0, None
                doc = repr(exc)
            if st is not None:
                changed = st.get("phase") != self.phase
                self.phase, self.state = st.get("phase"), st
                row = {"t": now, "phase": st.get("phase"), "serving": st.get("serving"), "epoch": st.get("epoch"),
                       "held": st.get("held"), "counts": st.get("counts"), "outage_s": st.get("outage_s")}  # fmt: skip
                if changed:
                    row["state"] = st
                self.rows.write(row)
            else:
                self.rows.write({"t": now, "status": status, "error": str(doc)[:300]})
            if self.gpu is not None and now - last_smi >= 1.0:
                last_smi = now
                self.gpu.write(f"{now:.3f}\t{smi_line()}\n")
                self.gpu.flush()
            self.stop.wait(0.5)
        self.rows.close()
        if self.gpu is not None:
            self.gpu.close()


def smi_line() -> str:
    """``used_mib/total_mib<TAB>pid:used_mib,...``: the card and every GPU process."""
    q = ["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"]
    apps = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
    try:
        card = subprocess.run(q, capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
        procs = subprocess.run(apps, capture_output=True, text=True, timeout=10).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError, IndexError) as exc:
        return f"error\t{exc!r}"
    used, total = (x.strip() for x in card.split(","))
    return f"{used}/{total}\t" + ",".join(p.replace(" ", "").replace(",", ":") for p in procs if p.strip())


def wait_phase(poller: Poller, want: tuple[str, ...], timeout: float, proc: subprocess.Popen[bytes]) -> str | None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if poller.phase in want:
            return poller.phase
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited {proc.returncode} while waiting for {want}")
        time.sleep(0.25)
    return None


def serve_up(url: str, proc: subprocess.Popen[bytes], timeout: float, out: Path) -> Any:
    """Until /health answers ok with every engine up (the baseline launched and ready); the document."""
    end = time.monotonic() + timeout
    doc: Any = None
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited {proc.returncode}: {(out / 'proxy.log').read_text()[-1500:]}")
        try:
            r = httpx.get(f"{url}/health", timeout=5, trust_env=False)
            doc = r.json()
            if r.status_code == 200 and doc.get("status") == "ok":
                return doc
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(1)
    raise RuntimeError(f"serve not healthy after {timeout:g} s: {str(doc)[:500]}")


def save(url: str, path: Path, what: str) -> None:
    try:
        r = httpx.get(f"{url}{what}", timeout=30, trust_env=False)
        path.write_text(r.text if what == "/metrics" else json.dumps(r.json(), indent=1) + "\n")
    except (httpx.HTTPError, ValueError) as exc:
        path.write_text(f"error: {exc!r}\n")


def drive(a: argparse.Namespace, url: str, proc: subprocess.Popen[bytes], out: Path, run: dict[str, Any]) -> None:
    acts = Jsonl(out / "actions.jsonl")

    def act(what: str, **kw: Any) -> None:
        acts.write({"t": time.time(), "action": what, **kw})
        log(f"{what} {kw if kw else ''}")

    health = serve_up(url, proc, a.ready_timeout_s, out)
    (out / "health-start.json").write_text(json.dumps(health, indent=1) + "\n")
    act("baseline_up")
    poller = Poller(url, out, a.nvidia_smi)
    poller.start()
    stop = threading.Event()
    client = Jsonl(out / "client.jsonl")
    feeder = threading.Thread(target=traffic, args=(url, a.profile, a.max_tokens, a.model, stop, client), daemon=True)
    feeder.start()
    act("traffic_started", profile=a.profile_text)
    try:
        time.sleep(a.before_s)
        status, doc = admin(url, "start")
        act("start", status=status, answer=swap_state(doc) or doc)
        end = wait_phase(poller, ENDS, a.swap_timeout_s, proc)
        act("swap_ended", phase=end, state=poller.state)
        if end == "complete":
            time.sleep(a.after_s)
            status, doc = admin(url, "abort")
            act("abort", status=status, answer=swap_state(doc) or doc)
            time.sleep(1.0)
            back = wait_phase(poller, ("rolled_back",), a.swap_timeout_s, proc)
            act("rollback_ended", phase=back, state=poller.state)
        time.sleep(a.tail_s)
    finally:
        stop.set()
        act("traffic_stopping")
        feeder.join(timeout=a.max_tokens * 2 + 120)
        client.close()
        act("traffic_stopped", alive=feeder.is_alive())
        save(url, out / "health-end.json", "/health")
        save(url, out / "metrics.txt", "/metrics")
        poller.stop.set()
        poller.join(timeout=10)
        acts.close()
    run["ended"] = time.time()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--baseline", required=True, metavar="NAME=COMMAND")
    ap.add_argument("--candidate", required=True, metavar="NAME=COMMAND")
    ap.add_argument("--profile", default="1:15,2:10,32:15,1:10,64:20,2:10,8:15")
    ap.add_argument("--before-s", type=float, default=95.0, help="traffic on the baseline before the swap starts")
    ap.add_argument("--after-s", type=float, default=30.0, help="traffic on the candidate before the abort")
    ap.add_argument("--tail-s", type=float, default=30.0, help="traffic after the rollback")
    ap.add_argument("--swap", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model", required=True, help="the model name both engines serve (vLLM refuses any other)")
    ap.add_argument("--ready-timeout-s", type=float, default=600.0)
    ap.add_argument("--swap-timeout-s", type=float, default=900.0)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--nvidia-smi", action="store_true", default=shutil.which("nvidia-smi") is not None)
    a = ap.parse_args()
    a.profile_text, a.profile = a.profile, parse_profile(a.profile)
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    base, cand = (tuple(x.split("=", 1)) for x in (a.baseline, a.candidate))
    swap = dict(x.split("=", 1) for x in a.swap)
    port = free_port()
    (out / "enginemeter.yaml").write_text(config(port, base, cand, swap, out))
    run: dict[str, Any] = {"argv": sys.argv[1:], "started": time.time(), "port": port, "swap": swap,
                           "baseline": base[0], "candidate": cand[0], "profile": a.profile_text}  # fmt: skip
    cmd = [sys.executable, "-m", "proxy.cli", "serve", "--config", str(out / "enginemeter.yaml"), "--log-level", "info"]
    cmd += ["--workers", str(a.workers)] if a.workers else []
    url = f"http://127.0.0.1:{port}"
    with open(out / "proxy.log", "wb") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", "XDG_STATE_HOME": str(out / "xdg")})  # fmt: skip
    rc = 0
    try:
        drive(a, url, proc, out, run)
    except Exception as exc:  # the cause, loudly; the raw files so far stay
        run["error"] = repr(exc)
        log(f"FAILED: {exc!r}")
        rc = 1
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            run["serve_killed"] = True
        run["serve_rc"] = proc.returncode
        state = out / "swap-state.json"
        if state.exists():
            shutil.copy(state, out / "state-final.json")
        if a.nvidia_smi:  # every engine gone with serve: no GPU process left (up to 60 s for the memory)
            end = time.monotonic() + 60
            while (line := smi_line()).partition("\t")[2].strip() and time.monotonic() < end:
                time.sleep(1)
            run["gpu_after_stop"] = line
        (out / "run.json").write_text(json.dumps(run, indent=1, default=str) + "\n")
    report = subprocess.run([sys.executable, str(HERE / "swapreport.py"), str(out)], check=False)
    return rc or report.returncode


if __name__ == "__main__":
    raise SystemExit(main())
