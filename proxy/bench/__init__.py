"""Offline A/B bench: same prompts, same sampling, one variable at a time, then a gated switch-or-stay verdict.

The run (I/O):
``config`` (targets, settings, planned cells, request bodies) -> ``engines`` (probe, tokenize, flush: the
engine dialects) -> ``runner`` (preflight, the A/A pass, the run loop; writes JSONL as it goes) using
``client`` (one timed streamed request), ``workload`` (arrivals, percentiles, goodput), ``memory`` (GPU memory
while a cell runs), ``progress`` and ``suite`` (which prompts).

The verdict (pure):
``results`` / ``logreport`` (bench JSONL or the proxy's comparison log -> ``model`` records) -> ``gates``
(parity, data, memory) + ``stats`` (paired bootstrap, noise floor) -> ``verdict`` (stay | switch |
inconclusive, the gate it stopped at, each reason with its numbers) -> ``report`` + ``charts`` (Markdown,
self-contained HTML, SVG, verdict.json). ``cli`` registers ``enginemeter bench`` and ``enginemeter report``.

The live report (``report --log``): ``livelog`` (the log's proxy runs, selection, causes) -> ``logreport``
(+ ``livefacts``: engine facts, sampling carried, greedy agreement) -> the same gates and verdict, plus
``proxy.sequential`` (the anytime-valid verdict per regime) -> ``livereport``.
"""
