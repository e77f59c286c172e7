"""What a person reads: one document of blocks, rendered to Markdown and self-contained HTML, SVG charts and
``verdict.json``, from the verdict's decisions. docs/bench.md.

    blocks      the document model: a list of blocks, rendered twice so both say the same
    document    ``Data`` -> the report: the answer first, verdict, parity, tables, percentiles; writes the files
    render      the blocks as Markdown and as self-contained HTML
    charts      the charts (SVG, logarithmic latency axes)
    agreement   greedy-output agreement between two engines
    arms        one candidate on the baseline's own weights and on its best format
    timeshared  the time-shared run's section: each launch, its command, load time, memory moments
    tuning      ``enginemeter tune``'s answer: the table, the best setting per regime, the rule
    livereport  the live report: the anytime-valid verdict per regime, pairs by cause, sampling carried
    switchplan  ``switch-plan.md``: the checklist before a switch, checked; the rollback record; the rollout config
"""
