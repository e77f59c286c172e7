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
headline    the one answer every screen prints: the verdicts read together, the best switch first
checks      checks of the protocol itself (first repeat, order, foreign load)
workload    arrivals, percentiles, goodput: per-cell figures
"""
