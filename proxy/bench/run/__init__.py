"""A bench run: planned once, sent to every engine (resident side by side, or launched one at a time), every result
written to ``results.jsonl`` as it finishes. docs/bench.md.

    options      the bench and tune flags -> one ``BenchConfig`` (preset, then the bench file, then the flags)
    benchfile    ``--config bench.yaml``: the same settings in a file, read strictly
    benchconfig  what a run is: targets, settings, planned cells, the body every engine gets
    sweep        ``tune``'s settings: one flag's values -> one launch command each
    schedule     what every engine is sent, planned once: prompts that fit, cells, requests and arrivals
    targets      what the bench asks each engine: probe, prompt-token counts, cache flush (the dialects)
    prepare      before measuring: preflight, the A/A pass, clients, token counts, the opening records
    runner       the run: resident engines side by side, or hands over to ``timeshare``
    timeshare    launched engines one at a time on the GPU: baseline, candidates, the baseline again (A/A)
    measure      the suite on a set of engines: warm-ups, cache phases, every cell repeated
    client       one timed streamed request, and the JSONL writer
    records      the ``request`` and ``sample`` records
    memprobe     GPU memory while a cell repeat runs, per engine where anything can tell
    busy         foreign load: requests an engine runs that the bench did not send
    progress     the one-line progress bar
"""
