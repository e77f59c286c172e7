"""The overhead bench's rounds: each target's figures pooled over rounds against direct (``summarize``), the
interleaved order of the targets (``rotations``) and the driver that sends a round to the load generators."""

from __future__ import annotations

import argparse
import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from perf.procs import cpu_split, rss_mib

MS = 1_000_000


@dataclass
class Target:
    name: str
    port: int
    pids: list[int]  # whose CPU/RSS we account (empty: direct)
    shadow: str | None = None  # mirror mode
    rounds: list[dict[str, Any]] = field(default_factory=list)
    cpu_s: float = 0.0
    #: the part of ``cpu_s`` spent in the kernel (system time: the syscalls and the TCP stack on loopback)
    cpu_sys_s: float = 0.0


def pct(xs: list[int] | list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = max(0, min(len(s) - 1, round(q / 100 * len(s) + 0.5) - 1))
    return float(s[k])


def pooled(t: Target, key: str) -> list[int]:
    return [x for r in t.rounds for x in r[key]]


def summarize(t: Target, direct: Target, pace_ns: float) -> dict[str, Any]:
    """Every figure of one target; ``pace_ns``: the engine's gap between chunks (a stall is a gap over twice it)."""
    ttft, dttft = pooled(t, "ttft_ns"), pooled(direct, "ttft_ns")
    gaps, dgaps = pooled(t, "gaps_ns"), pooled(direct, "gaps_ns")
    tokens = sum(r["tokens"] for r in t.rounds)
    tput = tokens / (sum(r["wall_ns"] for r in t.rounds) / 1e9)
    dtput = sum(r["tokens"] for r in direct.rounds) / (sum(r["wall_ns"] for r in direct.rounds) / 1e9)

    def per_round(key: str, q: float) -> list[float]:
        return [(pct(a[key], q) - pct(b[key], q)) / MS for a, b in zip(t.rounds, direct.rounds, strict=False)]

    streams = [st for r in t.rounds for st in r["streams"]]
    out: dict[str, Any] = {
        "target": t.name,
        "streams_ok": len(ttft),
        "streams_started": len(streams),
        # the published board's terms: no gap over 2x the engine's pace (and delivered whole), delivered whole
        "never_stalled": sum(1 for g, d in streams if d and g <= 2 * pace_ns) / len(streams)
        if streams
        else float("nan"),
        "delivered": sum(d for _, d in streams) / len(streams) if streams else float("nan"),
        "pace_ms": pace_ns / MS,
        "errors": sum(r["errors"] for r in t.rounds),
        "first_error": next((r["first_error"] for r in t.rounds if r["first_error"]), None),
        "ttft_p50_ms": pct(ttft, 50) / MS,
        "ttft_p99_ms": pct(ttft, 99) / MS,
        "gap_p50_ms": pct(gaps, 50) / MS,
        "gap_p99_ms": pct(gaps, 99) / MS,
        "chunks_per_s": tput,
        "tokens": tokens,
    }
    if t is not direct:
        out |= {
            "added_ttft_p50_ms": (pct(ttft, 50) - pct(dttft, 50)) / MS,
            "added_ttft_p99_ms": (pct(ttft, 99) - pct(dttft, 99)) / MS,
            "added_gap_p50_ms": (pct(gaps, 50) - pct(dgaps, 50)) / MS,
            "added_gap_p99_ms": (pct(gaps, 99) - pct(dgaps, 99)) / MS,
            "spread_ttft_p50_ms": _range(per_round("ttft_ns", 50)),
            "spread_ttft_p99_ms": _range(per_round("ttft_ns", 99)),
            "spread_gap_p99_ms": _range(per_round("gaps_ns", 99)),
            "spread_gap_p50_ms": _range(per_round("gaps_ns", 50)),
            "throughput_ratio": tput / dtput,
            "cpu_s_per_1k_chunks": t.cpu_s / tokens * 1000 if tokens else float("nan"),
            "cpu_sys_s_per_1k_chunks": t.cpu_sys_s / tokens * 1000 if tokens else float("nan"),
        }
        if t.pids:
            cur, peak = rss_mib(t.pids)
            out |= {"rss_mib": cur, "rss_peak_mib": peak}
    return out


def _range(xs: list[float]) -> tuple[float, float]:
    return (min(xs), max(xs)) if xs else (float("nan"), float("nan"))


def rotations(names: list[str]) -> Iterator[list[str]]:
    i = 0
    while True:
        yield names[i % len(names) :] + names[: i % len(names)]
        i += 1


class Driver:
    """Sends each round to the load generators (``--loadgen-procs``: the streams split between them) and merges
    what they measured (``perf_counter_ns`` is CLOCK_MONOTONIC: one clock for every process)."""

    def __init__(self, args: argparse.Namespace, loadgens: list[subprocess.Popen[str]]) -> None:
        self.args = args
        self.loadgens = loadgens
        self.body = {
            "model": "bench",
            "stream": True,
            "max_tokens": args.tokens,
            "messages": [{"role": "user", "content": "Count to a hundred, please."}],
        }

    def run_round(self, t: Target, streams: int) -> dict[str, Any]:
        cmd = {"host": "127.0.0.1", "port": t.port, "streams": streams, "path": "/v1/chat/completions"}
        period_s = (self.args.ttft_ms + self.args.tokens * self.args.cadence_ms) / 1000
        cmd |= {"body": self.body, "ramp_ms": self.args.ramp_ms, "arrival": self.args.arrival}
        cmd |= {"period_s": period_s, "duration_s": self.args.duration_s or 2 * period_s}
        # the fake engine sends exactly --tokens token events; llama-server may stop early (EOS): [DONE] suffices
        cmd["expect_tokens"] = self.args.tokens if self.args.engine == "fake" else 0
        k = len(self.loadgens)
        shares = [streams // k + (1 if i < streams % k else 0) for i in range(k)]
        u0, s0 = cpu_split(t.pids)
        busy = [(lg, n) for lg, n in zip(self.loadgens, shares, strict=True) if n]
        for lg, n in busy:
            assert lg.stdin is not None
            lg.stdin.write(json.dumps(cmd | {"streams": n}) + "\n")
            lg.stdin.flush()
        parts: list[dict[str, Any]] = []
        for lg, _ in busy:
            assert lg.stdout is not None
            line = lg.stdout.readline()
            if not line:
                raise RuntimeError(f"a load generator exited ({lg.poll()})")
            parts.append(json.loads(line))
        u1, s1 = cpu_split(t.pids)
        t.cpu_s += (u1 - u0) + (s1 - s0)
        t.cpu_sys_s += s1 - s0
        if len(parts) == 1:
            return parts[0]
        errors = [p["first_error"] for p in parts if p["first_error"]]
        t0s = [p["t0_ns"] for p in parts if p["t0_ns"]]
        t1 = max(p["t1_ns"] for p in parts)
        return {
            "ttft_ns": [x for p in parts for x in p["ttft_ns"]],
            "gaps_ns": [x for p in parts for x in p["gaps_ns"]],
            "streams": [x for p in parts for x in p["streams"]],
            "tokens": sum(p["tokens"] for p in parts),
            "wall_ns": t1 - min(t0s) if t0s else 0,
            "t0_ns": min(t0s) if t0s else 0,
            "t1_ns": t1,
            "errors": sum(p["errors"] for p in parts),
            "first_error": errors[0] if errors else None,
        }
