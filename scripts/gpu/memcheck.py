#!/usr/bin/env python3
"""GPU memory, the proxy's figures against nvidia-smi's (issue 4's check, a step of scripts/gpu/live.py).

Standard library only, except ``fake-serve``, which runs the proxy itself.

    memcheck.py compare --proxy URL --engine NAME=PID [--engine NAME=PID ...] [--tolerance 0.01] [--out FILE]
    memcheck.py fake-serve --config CFG --fake JSON    the proxy with a recorded NVML reader (CPU smoke)
    memcheck.py fake-smi --fake JSON ARGS...            an nvidia-smi stand-in over the same JSON (CPU smoke)

nvidia-smi reports MiB (2**20 bytes); NVML and the proxy report bytes. ``compare`` converts, takes nvidia-smi
before and after the scrape and insists they agree (memory was not moving), and checks within ``tolerance``
relative to nvidia-smi's figure (plus 1 MiB for nvidia-smi's rounding): GPU memory used and total, each engine's
memory, and each engine's attribution (found by its port, its own pid and none of the others'). Without a GPU
(no nvidia-smi) the CPU smoke passes ``--fake``: a recorded reading naming the real engine pids, replayed by the
proxy's NVML seam and by a fake nvidia-smi alike -- it exercises this code and the proxy's attribution, not a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

MIB = 2**20
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = SAMPLE.match(line)
        if m:
            out.append((m[1], dict(LABEL.findall(m[2] or "")), float(m[3])))
    return out


def pick(
    samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str
) -> list[tuple[dict[str, str], float]]:
    return [(lab, v) for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items())]


def smi(*query: str) -> list[list[str]]:
    out = subprocess.run(
        ["nvidia-smi", *query, "--format=csv,noheader,nounits"], capture_output=True, text=True, check=True
    )
    return [[c.strip() for c in line.split(",")] for line in out.stdout.splitlines() if line.strip()]


def smi_state() -> tuple[list[list[str]], list[list[str]]]:
    return smi("--query-gpu=index,memory.used,memory.total"), smi("--query-compute-apps=pid,used_memory")


class Table:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str, str, str]] = []
        self.notes: list[str] = []

    def add(self, check: str, proxy: str, ref: str, diff: str, ok: bool) -> None:
        self.rows.append((check, proxy, ref, diff, "PASS" if ok else "FAIL"))

    def bytes_row(self, check: str, proxy_b: float | None, smi_mib: float | None, tol: float) -> None:
        if proxy_b is None or smi_mib is None:
            self.add(check, fmt(proxy_b), "-" if smi_mib is None else f"{smi_mib:.0f} MiB", "-", False)
            return
        ref = smi_mib * MIB
        diff = proxy_b - ref
        rel = abs(diff) / ref if ref else (0.0 if proxy_b == 0 else 1.0)
        ok = abs(diff) <= tol * ref + MIB
        self.add(
            check, fmt(proxy_b), f"{smi_mib:.0f} MiB ({ref / 1e9:.3f} GB)", f"{rel * 100:+.3f} %".replace("+", ""), ok
        )

    @property
    def passed(self) -> bool:
        return bool(self.rows) and all(r[4] == "PASS" for r in self.rows)

    def render(self) -> str:
        head = ("check", "proxy (/metrics)", "nvidia-smi", "|diff|", "result")
        widths = [max(len(str(r[i])) for r in [head, *self.rows]) for i in range(5)]
        line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True))  # noqa: E731
        out = [line(head), line(tuple("-" * w for w in widths)), *(line(r) for r in self.rows)]
        out += ["", *self.notes, "", f"OVERALL: {'PASS' if self.passed else 'FAIL'}"]
        return "\n".join(out)


def fmt(b: float | None) -> str:
    return "absent" if b is None else f"{b:.0f} B ({b / 1e9:.3f} GB)"


def compare(
    proxy: str, engines: dict[str, int], *, tolerance: float = 0.01, timeout: float = 60.0, out_dir: str | None = None
) -> Table:
    """The table of checks for the proxy at ``proxy`` and the engines ``{name: pid}``."""
    t = Table()
    # 1. a successful sample that has found every engine's GPU process
    deadline = time.monotonic() + timeout
    samples: list[tuple[str, dict[str, str], float]] = []
    gpu_health = json.loads(http_get(f"{proxy}/health")[1]).get("gpu", {})
    if not gpu_health.get("enabled"):
        t.notes.append(f"the proxy's GPU collectors are off: {gpu_health.get('reason')}")
        deadline = 0.0  # nothing will come: report at once
    while time.monotonic() < deadline:
        samples = parse_metrics(http_get(f"{proxy}/metrics")[1].decode())
        okv = pick(samples, "enginemeter_gpu_sample_success")
        procs = {lab["engine"]: v for lab, v in pick(samples, "enginemeter_engine_gpu_processes")}
        if okv and okv[0][1] == 1 and all(procs.get(n, 0) >= 1 for n in engines):
            break
        time.sleep(0.5)
    else:
        if deadline:
            t.notes.append(f"no successful sample attributing GPU processes to {list(engines)} within {timeout:.0f}s")
    # 2. nvidia-smi, then two fresh proxy samples, then nvidia-smi again; retry while memory moves
    health: dict[str, Any] = {}
    before = after = smi_state()
    for _attempt in range(10):
        before = smi_state()
        n0 = json.loads(http_get(f"{proxy}/health")[1]).get("gpu", {}).get("samples", 0)
        deadline = time.monotonic() + (30 if gpu_health.get("enabled") else 0)
        while time.monotonic() < deadline:
            health = json.loads(http_get(f"{proxy}/health")[1])
            if health.get("gpu", {}).get("samples", 0) >= n0 + 2:
                break
            time.sleep(0.1)
        text = http_get(f"{proxy}/metrics")[1].decode()
        samples = parse_metrics(text)
        after = smi_state()
        if before == after:
            break
        t.notes.append(f"nvidia-smi changed during the scrape; retrying ({before} -> {after})")
    if before != after:
        t.notes.append("memory never held still across a scrape; comparing against the second nvidia-smi reading")
    gpus, apps = after
    if out_dir:
        with open(os.path.join(out_dir, "metrics.txt"), "w") as f:
            f.write(text)
        with open(os.path.join(out_dir, "health.json"), "w") as f:
            json.dump(health, f, indent=2)
        with open(os.path.join(out_dir, "nvidia-smi.csv"), "w") as f:
            f.write("# --query-gpu=index,memory.used,memory.total (MiB)\n")
            f.writelines(",".join(r) + "\n" for r in gpus)
            f.write("# --query-compute-apps=pid,used_memory (MiB)\n")
            f.writelines(",".join(r) + "\n" for r in apps)

    # 3. per GPU
    for idx, used, total in gpus:
        pu = pick(samples, "enginemeter_gpu_memory_used_bytes", gpu=idx)
        pt = pick(samples, "enginemeter_gpu_memory_total_bytes", gpu=idx)
        pr = pick(samples, "enginemeter_gpu_memory_reserved_bytes", gpu=idx)
        t.bytes_row(f"gpu {idx} memory used", pu[0][1] if pu else None, float(used), tolerance)
        t.bytes_row(f"gpu {idx} memory total", pt[0][1] if pt else None, float(total), tolerance)
        if pu:
            name = pu[0][0].get("name", "?")
            res = f"{pr[0][1] / MIB:.0f} MiB" if pr else "n/a (NVML v1)"
            t.notes.append(f"gpu {idx}: {name}; NVML reserved {res}")

    # 4. each engine's processes, and 5. attribution: the engine found by its port, naming its own pid
    smi_pids = {int(p): float(m) for p, m in apps if p.isdigit() and m.replace(".", "", 1).isdigit()}
    attribution = health.get("gpu", {}).get("engines", {})
    for eng, pid in engines.items():
        peng = pick(samples, "enginemeter_engine_gpu_memory_used_bytes", engine=eng)
        proxy_eng = sum(v for _, v in peng) if peng else None
        t.bytes_row(f"engine {eng} (pid {pid}) memory", proxy_eng, smi_pids.get(pid), tolerance)
        att = attribution.get(eng, {})
        # right engine: its own pid, and none of the other engines' pids
        others = {p for n, p in engines.items() if n != eng}
        gpu_pids = set(att.get("gpu_pids", []))
        ok = pid in gpu_pids and pid in smi_pids and not gpu_pids & others
        t.add(
            f"engine {eng} attribution",
            f"source={att.get('source')} pids={att.get('pids')} gpu_pids={att.get('gpu_pids')}",
            f"pid {pid} on GPU" if pid in smi_pids else f"pid {pid} not listed",
            "-",
            ok,
        )
        es = health.get("engine_state", {}).get("engines", {}).get(eng, {})
        peak = pick(samples, "enginemeter_engine_gpu_memory_peak_bytes", engine=eng)
        t.notes.append(
            f"engine {eng}: up={es.get('up')} kind={es.get('kind')} model={es.get('model')} "
            f"context_length={es.get('context_length')} slots={es.get('slots')} quantization={es.get('quantization')}; "
            f"peak since proxy start {fmt(sum(v for _, v in peak)) if peak else 'absent'}"
        )
    missing = [p for p in engines.values() if p not in smi_pids]
    if missing:
        visible = [p for p in smi_pids if os.path.exists(f"/proc/{p}")]
        t.notes.append(
            f"nvidia-smi lists pids {sorted(smi_pids)}, not the engines' pids {missing}"
            + ("" if visible or not smi_pids else " -- none of them exists in /proc: a different pid namespace?")
        )
    other = pick(samples, "enginemeter_gpu_other_processes_memory_used_bytes")
    t.notes.append("unattributed GPU memory: " + (", ".join(f"gpu {lab['gpu']}: {fmt(v)}" for lab, v in other) or "-"))

    return t


def write_fake(path: str, engines: dict[str, int]) -> None:
    """A recorded reading naming the real engine pids (the first engine the big one), for the CPU smoke."""
    procs = [{"pid": pid, "used": 15_370_000_000 if i == 0 else 536_870_912} for i, pid in enumerate(engines.values())]
    procs.append({"pid": 1, "used": 4_194_304})
    used = sum(p["used"] for p in procs) + 120_000_000
    doc = {"devices": [{"index": 0, "name": "NVIDIA H200 (recorded)", "uuid": "GPU-smoke", "total": 150_754_820_096,
                        "used": used, "free": 150_754_820_096 - used, "reserved": 629_145_600, "processes": procs}]}  # fmt: skip
    with open(path, "w") as f:
        json.dump(doc, f)


def fake_smi_dir(bin_dir: str, fake: str) -> str:
    """A directory holding an ``nvidia-smi`` that answers from ``fake`` (put it first on PATH)."""
    os.makedirs(bin_dir, exist_ok=True)
    exe = os.path.join(bin_dir, "nvidia-smi")
    with open(exe, "w") as f:
        f.write(f'#!/bin/sh\nexec "{sys.executable}" "{os.path.abspath(__file__)}" fake-smi --fake "{fake}" "$@"\n')
    os.chmod(exe, 0o755)
    return bin_dir


# --------------------------------------------------------------------------------------------- dry run


def _fake_doc(path: str) -> dict[str, Any]:
    with open(path) as f:
        doc: dict[str, Any] = json.load(f)
    return doc


def fake_smi(a: argparse.Namespace, rest: list[str]) -> int:
    """Answer ``--query-gpu=...`` / ``--query-compute-apps=...`` like nvidia-smi (MiB, csv) from the JSON."""
    doc = _fake_doc(a.fake)
    query = next((r for r in rest if r.startswith("--query-")), "")
    kind, _, fields = query.partition("=")
    header = "noheader" not in " ".join(rest)
    units = "" if "nounits" in " ".join(rest) else " MiB"
    rows: list[dict[str, object]] = []
    for d in doc["devices"]:
        if kind == "--query-gpu":
            rows.append({"index": d["index"], "name": d["name"], "memory.used": f"{d['used'] // MIB}{units}",
                         "memory.total": f"{d['total'] // MIB}{units}"})  # fmt: skip
        elif kind == "--query-compute-apps":
            rows += [{"pid": p["pid"], "used_memory": f"{p['used'] // MIB}{units}"} for p in d["processes"]]
        else:
            print(f"fake nvidia-smi: unsupported arguments {rest}", file=sys.stderr)
            return 2
    names = fields.split(",")
    if header:
        print(", ".join(names))
    for row in rows:
        print(", ".join(str(row[n]) for n in names))
    return 0


def fake_serve(a: argparse.Namespace) -> int:
    """The real proxy app (build_app, uvicorn) whose NVML reader replays ``--fake`` (re-read every sample)."""
    import logging

    import uvicorn

    from proxy.config.configfile import load
    from proxy.gpu import nvml
    from proxy.server import compose

    class FakeReader:
        def devices(self) -> list[nvml.DeviceReading]:
            self.doc = _fake_doc(a.fake)
            return [
                nvml.DeviceReading(
                    d["index"], d["name"], d["uuid"], d["total"], d["used"], d["free"], d.get("reserved"), 0.0
                )
                for d in self.doc["devices"]
            ]

        def processes(self, index: int) -> list[nvml.ProcReading]:
            return [nvml.ProcReading(p["pid"], p["used"]) for p in self.doc["devices"][index]["processes"]]

        def close(self) -> None:
            pass

    # the real proxy with every stage, its NVML reader replaced at the seam
    settings = load(a.config)
    logging.basicConfig(level=logging.INFO)
    app = compose.build_app(settings, nvml=FakeReader)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    cmp_ = sub.add_parser("compare")
    cmp_.add_argument("--proxy", required=True)
    cmp_.add_argument("--engine", action="append", required=True, help="NAME=PID (repeatable)")
    cmp_.add_argument("--tolerance", type=float, default=0.01)
    cmp_.add_argument("--timeout", type=float, default=60)
    cmp_.add_argument("--out")
    cmp_.add_argument("--out-dir")
    fs = sub.add_parser("fake-serve")
    fs.add_argument("--config", required=True)
    fs.add_argument("--fake", required=True)
    fm = sub.add_parser("fake-smi")
    fm.add_argument("--fake", required=True)
    a, rest = p.parse_known_args()
    if a.cmd == "compare":
        engines = {n: int(p) for n, _, p in (e.partition("=") for e in a.engine)}
        t = compare(a.proxy, engines, tolerance=a.tolerance, timeout=a.timeout, out_dir=a.out_dir)
        report = t.render()
        print(report)
        if a.out:
            with open(a.out, "w") as f:
                f.write(report + "\n")
        return 0 if t.passed else 1
    if a.cmd == "fake-serve":
        return fake_serve(a)
    return fake_smi(a, rest)


if __name__ == "__main__":
    sys.exit(main())
