"""enginemeter: an OpenAI-compatible measuring proxy for self-hosted LLM engines.

Three wings over one shared base (each wing's ``__init__`` maps its own modules):

    server/       the proxy server: relay, routing, mirror, metrics, pass-through, workers (``enginemeter serve``)
    bench/        the offline and live comparisons: run -> verdict <- report, live (``bench``, ``report``, ``tune``)
    cli/          the command line: one module per command
    gpu/          GPU reading behind one NVML seam: devices, attribution, memory now and over time
    engines/      the engine dialects: one module per engine kind
    embedded/     the demo's own llama-server, built from source, and generated models
    config/       the one frozen ``Settings`` type, the YAML file that makes it, its cross-checks and schema
    procs/        engines as processes: started from their command lines, ready, stopped, their memory moments

The base, used by every wing:

    types         the small closed sets (engine kinds, roles, endpoints, request outcomes)
    redact        secrets never shown: URL passwords and command-line keys masked, private (0600) files
    errors        the proxy's error tree, the transport tree, the OpenAI-style envelope
    normalize     a client body -> each engine's body (model name, sampling made explicit), the changes counted
    sse           the incremental SSE framer: bytes -> events
    stream        one stream-event reader (token, finish reason, usage) shared by relay, bench and perf
    timing        stream timestamps -> TTFT, gaps, TPOT, decode rate; usage and the engines' own timings
    sequential    anytime-valid confidence sequences: the live verdict per regime
    judge         the one rule: an interval against a band -> win, loss, tie or unresolved
    notation      how every number is written (speed ratios, bands, figures with units), on every screen
    levels        the bounded levels of requests in flight a traffic profile is counted in
    jsonlog       the size-rotated JSONL files the server writes (comparison, request log) and the bench reads
    diagnosis     what a running llama-server says about itself: flags, log, model header, KV, memory
    listen        binding the proxy's socket before anything slow happens
"""

__version__ = "0.1.0"
