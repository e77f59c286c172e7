"""``--traffic SPEC``: a traffic profile from where the user has it — inline, or the proxy's own record of real traffic.

- ``c1=30,c16=70[,short=90,16k=10]``: shares given inline (``proxy.bench.verdict.weighting.parse_spec``);
- a path: the proxy's **comparison log** (mirrored pairs: their primaries' start and end) or **request log** (every
  attempt: the primaries'); rotated files are read too. The profile is exact: a sweep over the requests' intervals
  gives the time at each number in flight; prompt classes from the engines' prompt-token counts; the median answer;
- ``http://PROXY:8080/metrics`` (or the proxy's base URL): the proxy's ``enginemeter_traffic_seconds_total`` since it
  started (``proxy.server.observe.inflight``: levels 1, 2, 3-4, ..., whole proxy under ``--workers``), the prompt lengths from
  ``enginemeter_request_prompt_tokens`` and the answers from ``..._completion_tokens`` (role ``primary``);
- ``http://PROMETHEUS:9090`` (answers ``/api/v1/status/buildinfo``): the same series' increase over a window
  (``--traffic-window``, default 7d): a week of production, as docs/bench.md shows.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from proxy.bench.verdict.inputs import Traffic
from proxy.bench.verdict.weighting import normalized, parse_spec, prompt_class
from proxy.gpu.scraped import parse_metrics
from proxy.jsonlog import rotated_family
from proxy.levels import LEVELS, representative

WINDOW = "7d"


def traffic_from(spec: str, *, window: str = WINDOW, timeout_s: float = 10.0) -> Traffic:
    """The profile ``spec`` names; a ``ValueError`` says what is wrong with it."""
    if spec.startswith(("http://", "https://")):
        return _from_url(spec, window, timeout_s)
    if Path(spec).exists() or rotated_family(spec):
        return from_records(_records(spec), source=spec)
    return parse_spec(spec)


def _records(path: str) -> list[dict[str, Any]]:
    out = []
    for f in rotated_family(path) or [path]:
        with open(f, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a crash or a rotation
                if isinstance(rec, dict):
                    out.append(rec)
    return out


def _interval(rec: Mapping[str, Any]) -> tuple[float, float, Mapping[str, Any]] | None:
    """(start, end, the primary's side) of one request: a comparison log's pair or a request log's primary."""
    if rec.get("type") == "pair":
        side = rec.get("primary") or {}
        e2e, t0 = side.get("e2e_s"), rec.get("t_start")
        if not isinstance(e2e, int | float):
            return None
        start = float(t0) if isinstance(t0, int | float) else float(rec.get("ts", 0)) - float(e2e)
        return start, start + float(e2e), side
    if rec.get("role") == "primary" and "request_id" in rec and "type" not in rec:
        e2e, ts = rec.get("e2e_s"), rec.get("ts")
        if isinstance(e2e, int | float) and isinstance(ts, int | float):
            return float(ts) - float(e2e), float(ts), rec
    return None


def from_records(recs: Iterable[Mapping[str, Any]], source: str = "records") -> Traffic:
    """The exact profile of requests' intervals: the time at each number in flight (a sweep), the prompt classes
    and the median answer."""
    spans = [x for x in (_interval(r) for r in recs) if x is not None]
    if not spans:
        raise ValueError(
            f"--traffic {source}: no request in it (a comparison log's pairs or a request log's "
            "primaries, with their times)"
        )
    events = sorted([(a, 1) for a, _, _ in spans] + [(b, -1) for _, b, _ in spans])
    at: dict[int, float] = {}
    n, t = 0, events[0][0]
    for when, d in events:
        if n > 0 and when > t:
            at[n] = at.get(n, 0.0) + when - t
        n, t = n + d, when
    busy = sum(at.values())
    span = events[-1][0] - events[0][0]
    if busy <= 0:
        raise ValueError(f"--traffic {source}: its requests took no time")
    prompts = Counter(
        prompt_class(float(s["prompt_tokens"]))
        for _, _, s in spans
        if isinstance(s.get("prompt_tokens"), int) and s["prompt_tokens"] > 0
    )
    outs = [float(s["completion_tokens"]) for _, _, s in spans if isinstance(s.get("completion_tokens"), int)]
    hours = f"{span / 3600:.1f} h" if span >= 3600 else f"{span / 60:.1f} min" if span >= 60 else f"{span:.0f} s"
    return Traffic(
        normalized({float(k): v for k, v in at.items()}),
        normalized(dict(prompts)) if prompts else {},
        source=f"{source}: {len(spans):,} requests over {hours}",
        idle=max(0.0, 1 - busy / span) if span > 0 else None,
        output_tokens=statistics.median(outs) if outs else None,
        requests=len(spans),
        span_s=span,
    )


def from_levels(
    seconds: Mapping[str, float], prompt_le: Mapping[float, float], output_le: Mapping[float, float], source: str
) -> Traffic:
    """A profile from the proxy's level counters (label -> seconds) and its token histograms (upper bound ->
    cumulative count, role primary)."""
    busy = {representative(k): v for k, v in seconds.items() if k != "0" and v > 0}
    if not busy:
        raise ValueError(
            f"--traffic {source}: the proxy has served no generation request yet "
            "(enginemeter_traffic_seconds_total is 0)"
        )
    total = sum(seconds.values())
    return Traffic(
        normalized(busy),
        _classes(prompt_le),
        source=source,
        idle=seconds.get("0", 0.0) / total if total > 0 else None,
        output_tokens=_median(output_le),
        requests=int(max(prompt_le.values(), default=0)) or None,
    )


def _buckets(le: Mapping[float, float]) -> list[tuple[float, float, float]]:
    """(lower bound, upper bound, count) of each histogram bucket from cumulative counts."""
    out, prev, lo = [], 0.0, 0.0
    for bound in sorted(le):
        n = le[bound] - prev
        if n > 0:
            out.append((lo, bound, n))
        prev, lo = le[bound], bound
    return out


def _classes(le: Mapping[float, float]) -> dict[str, float]:
    by: dict[str, float] = {}
    for lo, hi, n in _buckets(le):
        mid = math.sqrt(max(lo, 1.0) * (hi if math.isfinite(hi) else 4 * max(lo, 1.0)))
        by[prompt_class(mid)] = by.get(prompt_class(mid), 0.0) + n
    return normalized(dict(by)) if by else {}


def _median(le: Mapping[float, float]) -> float | None:
    bs = _buckets(le)
    total = sum(n for _, _, n in bs)
    if total <= 0:
        return None
    seen = 0.0
    for lo, hi, n in bs:
        if seen + n >= total / 2:
            if not math.isfinite(hi):
                return lo
            return lo + (hi - lo) * (total / 2 - seen) / n
        seen += n
    return None


def _from_url(url: str, window: str, timeout_s: float) -> Traffic:
    parts = urlsplit(url)
    base = f"{parts.scheme}://{parts.netloc}"
    with httpx.Client(timeout=timeout_s, trust_env=False) as client:
        try:
            if parts.path.rstrip("/").endswith("/metrics"):
                return _from_exposition(client.get(url).text, url)
            if client.get(f"{base}/api/v1/status/buildinfo").status_code == 200:
                return _from_prometheus(client, base, window)
            return _from_exposition(client.get(f"{base}{parts.path.rstrip('/')}/metrics").text, url)
        except httpx.HTTPError as exc:
            raise ValueError(f"--traffic {url}: {type(exc).__name__}: {exc}") from None


def _from_exposition(text: str, url: str) -> Traffic:
    seconds: dict[str, float] = {}
    prompt: dict[float, float] = {}
    output: dict[float, float] = {}
    for name, labels, v in parse_metrics(text):
        if name == "enginemeter_traffic_seconds_total":
            seconds[labels.get("level", "")] = seconds.get(labels.get("level", ""), 0.0) + v
        elif name in ("enginemeter_request_prompt_tokens_bucket", "enginemeter_request_completion_tokens_bucket"):
            if labels.get("role") != "primary":
                continue
            le = float(labels.get("le", "inf").replace("+Inf", "inf"))
            into = prompt if "prompt" in name else output
            into[le] = into.get(le, 0.0) + v
    if not seconds:
        raise ValueError(
            f"--traffic {url}: no enginemeter_traffic_seconds_total there (an enginemeter proxy's "
            "/metrics, or a Prometheus server that scrapes one)"
        )
    return from_levels(seconds, prompt, output, f"the proxy's /metrics at {url} (since it started)")


def _from_prometheus(client: httpx.Client, base: str, window: str) -> Traffic:
    def query(q: str) -> Sequence[Mapping[str, Any]]:
        r = client.get(f"{base}/api/v1/query", params={"query": q})
        doc = r.json()
        if doc.get("status") != "success":
            raise ValueError(f"--traffic {base}: Prometheus refused {q!r}: {doc.get('error')}")
        return list(doc["data"]["result"])

    levels = {
        str(x["metric"].get("level")): float(x["value"][1])
        for x in query(f"sum by (level) (increase(enginemeter_traffic_seconds_total[{window}]))")
    }

    def hist(name: str) -> dict[float, float]:
        rows = query(f'sum by (le) (increase({name}_bucket{{role="primary"}}[{window}]))')
        return {float(str(x["metric"]["le"]).replace("+Inf", "inf")): float(x["value"][1]) for x in rows}

    if not levels:
        raise ValueError(f"--traffic {base}: Prometheus has no enginemeter_traffic_seconds_total over {window}")
    return from_levels(
        levels,
        hist("enginemeter_request_prompt_tokens"),
        hist("enginemeter_request_completion_tokens"),
        f"Prometheus at {base}, the last {window}",
    )


__all__ = ["LEVELS", "WINDOW", "from_levels", "from_records", "traffic_from"]
