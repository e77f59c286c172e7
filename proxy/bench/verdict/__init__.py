"""Results in, decisions out; pure (no I/O but reading a results file, no clock). docs/bench.md.

inputs      the records every source becomes: Cell, Sample, Req, EngineInfo, Reason, Results
data        a bench results file (JSONL, any version) -> ``Data``: the ``Results`` plus what the report shows
provenance  how a run was made, in words: its protocol lines, the command that made it, the report command
merge       several runs' results joined into one, when comparable (same suite, sampling, tokens, GPU)
stats       paired comparison on the same requests: bootstrap interval, effect size, run-to-run variation
comparison  one figure compared: its interval against its band (minimum effect, noise floor, bias)
evidence    one verdict's samples and requests, paired per request: a figure of a cell -> a ``Comparison``
gates/      the checks before any speed is judged: parity, data, memory
regimes     the comparisons -> one answer per regime, and what to run next
conclusion  the regimes' answers -> the decision, its summary and what to run next
decide      ``Results`` -> one ``Verdict`` per candidate: gates first, then the regimes
weighting   a traffic profile (``--traffic``) and the decision for it: the cells weighted by its shares
headline    the one answer every screen prints: its table (figures, ratios, p50/p99), the verdicts read together
switchway   the way to switch from the measurements: rollout (both fit at once) or swap, its outage and timing
checks      checks of the protocol itself (first repeat, order, foreign load)
workload    arrivals, percentiles, goodput: per-cell figures
"""
