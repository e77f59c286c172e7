"""Offline A/B bench: same prompts, same sampling, one variable at a time, then a switch-or-stay verdict.

Stages, one module each:
``suite`` (which prompts) -> ``runner`` (send them, time them, write JSONL as it goes) ->
``verdict`` (pure: results -> stay | switch | inconclusive, each reason with its numbers) ->
``report`` (Markdown + self-contained HTML + PNG charts). ``logreport`` feeds the proxy's mirror
comparison log into the same report.
"""
