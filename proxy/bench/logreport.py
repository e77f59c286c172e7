"""The proxy's mirror comparison log (JSONL, schema in proxy/compare.py ``to_record`` / docs/routing.md) -> the
bench report's ``Data``, so live mirrored traffic gets the same verdict machinery.

Live traffic has no repeats: consecutive pairs are cut into ``blocks`` equal slices, each slice playing one
"repeat" for the run-to-run spread. Concurrency is whatever the traffic was, so there is one cell
(``cache=live``); throughput and long context are not measured. The proxy normalizes sampling for both sides
of a pair and both get the same request, so sampling and max tokens are equal by construction; prompt-token
parity comes from each pair's ``usage.prompt_tokens``. TTFT is ``upstream_ttft_s`` (sent upstream -> first
token) where present, so the proxy's own work before the send enters neither side.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from proxy.bench.report import Data, read_jsonl
from proxy.bench.verdict import Cell, EngineInfo, Results, Sample

LIVE = Cell("live", 1, 0, "mixed")


def _med(vals: Sequence[Any]) -> float | None:
    v = [float(x) for x in vals if isinstance(x, int | float) and not isinstance(x, bool)]
    return statistics.median(v) if v else None


def load_log(
    path: Path,
    *,
    baseline: str | None = None,
    quantization: Mapping[str, str] | None = None,
    blocks: int = 5,
    min_repeats: int = 3,
    max_noise: float = 0.25,
) -> Data:
    recs = [r for r in read_jsonl(path) if isinstance(r.get("primary"), dict) and isinstance(r.get("shadow"), dict)]
    if not recs:
        raise ValueError(f"{path}: no comparison records (objects with 'primary' and 'shadow')")
    recs.sort(key=lambda r: r.get("ts") or 0)
    kinds: dict[str, str] = {}
    order: list[str] = []
    for r in recs:
        for side in (r["primary"], r["shadow"]):
            name = str(side.get("engine"))
            kinds.setdefault(name, str(side.get("kind")))
            if name not in order:
                order.append(name)
    primary_names = [str(r["primary"].get("engine")) for r in recs]
    bl = baseline or max(set(primary_names), key=primary_names.count)
    if bl not in order:
        raise ValueError(f"baseline {bl!r} is not in the log: {', '.join(order)}")
    order.remove(bl)
    order.insert(0, bl)

    # one list of sides per engine, in pair order, for pairs that involve the baseline
    pairs = [r for r in recs if bl in (r["primary"].get("engine"), r["shadow"].get("engine"))]
    k = max(1, min(blocks, len(pairs)))
    samples: list[Sample] = []
    pt: dict[str, dict[str, int]] = {}
    requests: list[dict[str, Any]] = []
    for other in order[1:]:
        mine = [r for r in pairs if other in (r["primary"].get("engine"), r["shadow"].get("engine"))]
        n = len(mine)
        kk = max(1, min(k, n))
        for b in range(kk):
            chunk = mine[b * n // kk : (b + 1) * n // kk]
            for name in (bl, other):
                sides = [r["primary"] if r["primary"].get("engine") == name else r["shadow"] for r in chunk]
                ok = [s for s in sides if s.get("outcome") == "ok"]
                errs = sorted({str(s.get("outcome")) for s in sides if s.get("outcome") != "ok"})
                samples.append(
                    Sample(
                        engine=name,
                        cell=LIVE,
                        repeat=b,
                        n_ok=len(ok),
                        n_err=len(sides) - len(ok),
                        ttft_s=_med([s.get("upstream_ttft_s", s.get("ttft_s")) for s in ok]),
                        tpot_s=_med([s.get("tpot_s") for s in ok]),
                        decode_tps=_med([s.get("decode_tps") for s in ok]),
                        e2e_s=_med([s.get("e2e_s") for s in ok]),
                        completion_tokens=_med([s.get("completion_tokens") for s in ok]),
                        prompt_tokens=_med([s.get("prompt_tokens") for s in ok]),
                        errors=tuple(f"outcome {e}" for e in errs),
                    )
                )
        for r in mine:
            rid = str(r.get("request_id") or id(r))
            for side in (r["primary"], r["shadow"]):
                if side.get("outcome") == "ok" and isinstance(side.get("prompt_tokens"), int):
                    pt.setdefault(str(side["engine"]), {})[f"usage:{rid}"] = side["prompt_tokens"]
                requests.append({"engine": side.get("engine"), **side})
    if bl == order[0] and len(order) == 1:
        raise ValueError(f"{path}: only one engine in the log")
    quant = dict(quantization or {})
    infos = tuple(EngineInfo(name=n, kind=kinds.get(n), quantization=quant.get(n)) for n in order)
    results = Results(
        engines=infos,
        baseline=bl,
        samples=tuple(samples),
        prompt_tokens=pt,
        min_repeats=min_repeats,
        max_noise=max_noise,
        sampling_normalized=True,
    )
    first, last = recs[0].get("ts"), recs[-1].get("ts")
    span = f"{(last - first) / 60:.1f} min" if isinstance(first, int | float) and isinstance(last, int | float) else "?"
    mism = sum(1 for r in recs if (r.get("mismatch") or {}).get("output"))
    greedy = sum(1 for r in recs if r.get("greedy"))
    protocol = [
        f"source: proxy comparison log {path} — {len(recs)} mirrored pairs over {span}",
        f"live traffic cut into {k} consecutive blocks per engine pair, each block one 'repeat'",
        "TTFT here is upstream TTFT (sent upstream -> first token); concurrency is whatever the traffic was",
        f"greedy pairs: {greedy}; greedy pairs whose output text differs: {mism}",
    ]
    return Data(
        title="enginemeter report: mirrored traffic",
        results=results,
        engines_meta=[{"name": i.name, "kind": i.kind, "model": None, "quantization": i.quantization} for i in infos],
        requests=requests,
        protocol=protocol,
        notes=["throughput and long-context steps need the offline bench (enginemeter bench)"],
    )
