"""What the proxy reports beside the traffic it serves:

tracing       the opt-in OpenTelemetry traces
requestlog    the opt-in per-request log
enginestate   what each engine says of its configuration and load, polled
livediagnosis  the live diagnosis of every llama.cpp engine on this machine
inflight      time at each number of requests in flight: the profile ``--traffic`` weighs a decision by
"""
