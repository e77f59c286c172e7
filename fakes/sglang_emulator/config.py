"""The emulator's settings (its CLI flags) and the SGLang constants its answers carry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

SGLANG_VERSION: Final = "0.5.23"
DEFAULT_MODEL_NAME: Final = "default"  # protocol.py: the request's `model` when it sends none
QUEUE_FULL: Final = "The request queue is full."
FLUSHED: Final = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


@dataclass(frozen=True, slots=True)
class EmulatorConfig:
    backend: str  # base URL of a llama-server (or a fault engine)
    served_model_name: str | None = None  # None: the model path, as SGLang does
    model_path: str | None = None  # None: the backend's /props model_path
    context_length: int | None = None  # None: the backend's per-slot n_ctx
    max_running_requests: int | None = None  # None: the backend's total_slots
    max_queued_requests: int | None = None  # None: no limit (SGLang's default)
    enable_metrics: bool = False
    enable_cache_report: bool = False
    stream_response_default_include_usage: bool = False
    ready_endpoint: bool = True  # False: no /ready (404), as SGLang 0.5.17, whose readiness is /health
    host: str = "127.0.0.1"  # reported by /server_info; run_in_thread binds it
    port: int = 30000
    backend_wait_s: float = 60.0  # how long startup waits for the backend's /health
