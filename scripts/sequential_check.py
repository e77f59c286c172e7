"""How often a live A/A comparison looked at after every pair ever declares a difference (docs/bench.md,
"Live traffic"): the anytime-valid confidence sequence of proxy/sequential.py against a fixed-sample 95 %
interval looked at the same way. Seeded, pure Python; about a minute on 2 cores.

    .venv/bin/python scripts/sequential_check.py [--seeds 1000] [--pairs 1000]
"""

from __future__ import annotations

import argparse
import math
import random
from collections.abc import Callable

from proxy.sequential import ALPHA, MIN_PAIRS, STREAMS, ConfidenceSequence

Draw = Callable[[random.Random], float]

DRAWS: dict[str, Draw] = {
    "normal": lambda r: r.gauss(0.0, 0.2),
    "log(gamma/gamma)": lambda r: math.log(r.gammavariate(2.0, 1.0) / r.gammavariate(2.0, 1.0)),
    "t(3)": lambda r: r.gauss(0, 1) / math.sqrt(sum(r.gauss(0, 1) ** 2 for _ in range(3)) / 3),
}


def cs_rate(draw: Draw, seeds: int, n: int, alpha: float, min_pairs: int, min_effect: float = 0.0) -> float:
    hits = 0
    for seed in range(seeds):
        rng = random.Random(seed)
        cs = ConfidenceSequence(alpha=alpha, min_effect=min_effect, min_pairs=min_pairs)
        for _ in range(n):
            cs.add(draw(rng))
            if cs.decision in ("faster", "slower"):
                hits += 1
                break
    return hits / seeds


def naive_rate(draw: Draw, seeds: int, n: int) -> float:
    hits = 0
    for seed in range(seeds):
        rng = random.Random(seed)
        mean = m2 = 0.0
        for k in range(1, n + 1):
            x = draw(rng)
            d = x - mean
            mean += d / k
            m2 += d * (x - mean)
            if k >= MIN_PAIRS and abs(mean) > 1.96 * math.sqrt(m2 / (k - 1) / k):
                hits += 1
                break
    return hits / seeds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=1000)
    ap.add_argument("--pairs", type=int, default=1000)
    a = ap.parse_args()
    per = ALPHA / len(STREAMS)
    print(f"A/A streams: {a.seeds} seeds x {a.pairs} pairs, looked at after every pair; share that ever declared")
    print(
        f"{'distribution':<18} {'CS a=5%':>9} {'CS a=1.25%':>11} {'... 10 pairs':>13} {'m=5%':>7} {'fixed 95% CI':>13}"
    )
    for name, draw in DRAWS.items():
        print(f"{name:<18} {cs_rate(draw, a.seeds, a.pairs, ALPHA, MIN_PAIRS):>9.3f} "
              f"{cs_rate(draw, a.seeds, a.pairs, per, MIN_PAIRS):>11.4f} {cs_rate(draw, a.seeds, a.pairs, per, 10):>13.4f} "
              f"{cs_rate(draw, a.seeds, a.pairs, per, MIN_PAIRS, 0.05):>7.4f} {naive_rate(draw, a.seeds, a.pairs):>13.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
