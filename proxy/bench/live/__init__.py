"""Mirrored live traffic, read from the proxy's comparison log into the verdict's results. docs/bench.md.

log            the log read as what it is: proxy runs, pairs, each pair ended for a cause (rotated files too)
facts          what the log and a running proxy say about the engines: quantization, sampling carried
livesamples    pairs -> the verdict's samples: observed concurrency, its groups, each cut into blocks as repeats
findings       the log's reasons besides speed: pairs lost by cause, engine failures, contention; the live
               verdict per regime in words
livedata       the log -> one ``Live`` per primary engine: the results by observed concurrency, plus the
               anytime-valid verdict per regime (``proxy.sequential``)
trafficsource  ``--traffic SPEC|PATH|URL``: a traffic profile from where the user has it (inline, the proxy's
               logs, its ``/metrics``, a Prometheus server)
"""
