"""The closed sets every wing shares. Each is a ``Literal`` for the type checker and a tuple for code that
enumerates it (metric priming, validation); the tuple is derived from the ``Literal``, so they cannot drift.
Metric labels take their values from these sets only.
"""

from __future__ import annotations

from typing import Literal, get_args

#: the kinds of engine enginemeter knows (one module each in ``proxy/engines/``)
EngineKind = Literal["llamacpp", "sglang", "vllm", "openai"]
#: generation endpoints the proxy times, normalizes and mirrors
Endpoint = Literal["chat", "completions"]
#: every other route the proxy passes through to an engine unchanged (``proxy/server/passthrough.py``): counted
#: and timed end to end, never normalized or mirrored
PassthroughEndpoint = Literal[
    "embeddings",  # /v1/embeddings
    "responses",  # /v1/responses and below
    "rerank",  # /v1/rerank, /v1/score
    "audio",  # /v1/audio/*
    "tokenize",  # /tokenize, /v1/tokenize
    "detokenize",  # /detokenize, /v1/detokenize
    "other",  # any other /v1/* path
]
#: the ``endpoint`` label of a request: a generation endpoint or a pass-through one
EndpointLabel = Literal[Endpoint, PassthroughEndpoint]
#: the part an attempt plays in its request
Role = Literal["primary", "shadow"]
#: how an attempt ended; every attempt ends in exactly one
Outcome = Literal[
    "ok",  # stream finished with [DONE] / a finish reason, or a 2xx non-stream body
    "engine_error",  # the engine answered with an error status or an in-band error event
    "client_disconnect",  # the client went away before the end; the upstream was cancelled
    "connect_error",  # the engine refused the connection (502)
    "timeout",  # the engine did not answer in time (504, or in-band after the first byte)
    "upstream_broken",  # the engine's stream broke off or was malformed after the first byte
    "rejected",  # the proxy refused the request (bad JSON, too large, unauthorized, unknown model)
]

ENGINE_KINDS: tuple[EngineKind, ...] = get_args(EngineKind)
ENDPOINTS: tuple[Endpoint, ...] = get_args(Endpoint)
PASSTHROUGH_ENDPOINTS: tuple[PassthroughEndpoint, ...] = get_args(PassthroughEndpoint)
ENDPOINT_LABELS: tuple[EndpointLabel, ...] = (*ENDPOINTS, *PASSTHROUGH_ENDPOINTS)
ROLES: tuple[Role, ...] = get_args(Role)
OUTCOMES: tuple[Outcome, ...] = get_args(Outcome)
