"""What every stage of the proxy writes into, importing no other part of the server:

result        the frozen record of one request on one engine
metrics       the proxy's Prometheus metric objects, built from the families table; one attempt observed
families      the metric families as data: type, name, labels, boundaries, help text (docs/metrics.md)
buckets       the histograms' default boundaries (the settings may replace them) and the fixed ones
context       what one client request carries through every stage (trace headers, its span, its prompt)
tasks         a background loop held for the app's lifetime
loopwatch     the event loop's own health: lag, requests waiting for it, GC pauses
sharedstate   one file under flock, read and written at offsets by every worker (a rollout's state, the traffic)
metricfiles   the --workers metric files written through pwrite (a cut file costs figures, not a SIGBUS)
"""
