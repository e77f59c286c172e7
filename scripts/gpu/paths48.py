"""The same checkpoint in two engines, across two runs: each engine's own greedy path and its first next-token
distribution (the prompt alone: no teacher-forcing, so runs made apart compare) from the agreement records of
``bench --agreement`` (``results.jsonl[.gz]``, ``type: logprobs``). Issue 48: vLLM on the card and llama.cpp on
a CPU read the one random checkpoint (``write_weights.py --seed 48``); this says whether they read it the same.

    PYTHONPATH=. python3 scripts/gpu/paths48.py RESULTS_A RESULTS_B [--engines NAME ...]

Per pair of engines over the prompts both scored (matched by index; their prompt token counts must agree):
where their greedy paths part (median and how many never part within the shorter path), whether the first
token's top pick is the same, and the largest |difference| of the top pick's log-probability.
"""

from __future__ import annotations

import argparse
import statistics
from itertools import combinations
from pathlib import Path

from proxy.bench.outdir import read_jsonl, results_file


def records(path: Path) -> dict[str, dict[int, dict]]:
    """engine -> prompt index -> its logprobs record."""
    out: dict[str, dict[int, dict]] = {}
    for r in read_jsonl(results_file(path)):
        if r.get("type") == "logprobs" and r.get("path"):
            out.setdefault(r["engine"], {})[int(r["prompt"])] = r
    return out


def parts_at(a: list[int], b: list[int]) -> int | None:
    """The first index where two greedy paths differ; None when the shorter is a prefix of the longer."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def compare(name_a: str, ra: dict[int, dict], name_b: str, rb: dict[int, dict]) -> str:
    common = sorted(p for p in ra.keys() & rb.keys() if ra[p]["prompt_tokens"] == rb[p]["prompt_tokens"])
    if not common:
        return f"{name_a} vs {name_b}: no prompt scored by both with the same prompt tokens"
    n = min(min(len(ra[p]["path"]), len(rb[p]["path"])) for p in common)
    parts = [parts_at(ra[p]["path"][:n], rb[p]["path"][:n]) for p in common]
    tops = [(ra[p]["scored"][0][0], rb[p]["scored"][0][0]) for p in common]  # each prompt's [id, logprob] twice
    same = [abs(x[1] - y[1]) for x, y in tops if x[0] == y[0]]
    same_first, top_dlp = len(same), max(same, default=float("nan"))
    median = statistics.median(n if x is None else x for x in parts)
    never = sum(x is None for x in parts)
    return (
        f"{name_a} vs {name_b} ({len(common)} prompts, paths compared over {n} tokens): greedy paths part at token "
        f"{median:g} (median; {never} of {len(common)} never part); first token's top pick the same on "
        f"{same_first}/{len(common)}, its log-probability within {top_dlp:.3f}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs=2, type=Path, help="two results.jsonl[.gz] with agreement records")
    ap.add_argument("--engines", nargs="*", help="only these engines (default: every engine of both)")
    a = ap.parse_args()
    engines: dict[str, dict[int, dict]] = {}
    for path in a.results:
        for name, recs in records(path).items():
            engines.setdefault(name, recs)
    names = [e for e in (a.engines or sorted(engines)) if e in engines]
    for x, y in combinations(names, 2):
        print(compare(x, engines[x], y, engines[y]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
