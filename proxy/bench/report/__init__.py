"""What a person reads: one document of blocks, rendered to Markdown and self-contained HTML, SVG charts and
``verdict.json``, from the verdict's decisions. docs/bench.md.

    blocks          the document model: a list of blocks, rendered twice so both say the same
    document        ``Data`` -> the report: the answer first, then each section in order; writes the files
    verdictsection  the verdict section: per candidate its regimes, traffic or cells, gates, comparisons
    tables          the tables of what was measured: engines, parity, cells, percentiles, cache accounting
    render          the blocks as Markdown and as self-contained HTML
    drawing         the one seam to matplotlib (loaded lazily): plain ticks, a robust axis, the SVG written
    charts          the bench report's charts (SVG, logarithmic latency axes) and the tune chart
    agreement       greedy-output agreement between two engines
    arms            one candidate on the baseline's own weights and on its best format
    timeshared      the time-shared run's section: each launch, its command, load time, memory moments
    tuning          ``enginemeter tune``'s answer: the best setting per regime, the rule
    tunetable       ``enginemeter tune``'s table: one row of figures per setting
    livereport      the live report: the anytime-valid verdict per regime, pairs by cause, sampling, live charts
    switchplan      ``switch-plan.md``: the checklist before a switch, each item checked from the measurements
    rollback        the switch plan's rollback record and the switch's config and commands: rollout or swap
"""
