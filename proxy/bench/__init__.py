"""The bench wing: engines compared on the same explicit requests, one variable at a time, to a decision.

A run flows one way, each layer in its own package (imports go down the arrows, never back):

    run/      plans, launches and sends: a bench run writes ``results.jsonl`` as it goes
    live/     reads the proxy's comparison log (mirrored live traffic) into the same results
    quality/  do the engines answer alike: token agreement and task accuracy (phases ``run`` drives after the cells)
    verdict/  pure: results in, gates and regimes, decisions out (switch | stay | partial | inconclusive)
    report/   reads the decisions, writes what a person sees (Markdown, HTML, SVG charts, verdict.json)

    run -> verdict <- report;  live -> run, verdict (engines as a run's targets);  report -> live (the live sections)
    run -> quality <- verdict, report (quality imports none of them)

And the modules every layer shares:

    suite     the prompts: the built-in suite (English and Chinese, short to 16k) or a user's file
    outdir    a run's --out: one holding a run is refused, the advice names a fresh one

The commands that drive them are ``proxy.cli.bench``, ``report``, ``tune`` and ``diagnose``.
"""
