"""Any other OpenAI-compatible server (a hosted API, a router, an engine we have no dialect for).

- detect: the catch-all, chosen when no other dialect recognizes the engine.
- health and state: ``GET /v1/models`` (served id; ``max_model_len`` where the server adds it).
- tokens, cache: none (prompt tokens come from ``usage`` after the fact).
- errors: OpenAI's nested shape; a flat ``{"object":"error",..}`` is nested as for SGLang.
"""

from __future__ import annotations

from proxy.engines.base import Dialect


class OpenAI(Dialect):
    kind = "openai"
    health_path = "/v1/models"


DIALECT = OpenAI()
