"""The emulator's settings (its CLI flags) and the SGLang constants its answers carry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

#: the SGLang versions whose wire the emulator speaks: 0.5.17 as captured from a real server on the H200
#: (tests/fixtures/engines/sglang-0.5.17/), 0.5.23 as its source reads (shared/reference/engines.md §2)
SGLANG_VERSIONS: Final = ("0.5.17", "0.5.23")
DEFAULT_VERSION: Final = "0.5.17"
#: SGLang's server warm-up request (http_server._execute_server_warmup): its tokens sit in the radix cache
WARMUP_TEXT: Final = "The capital city of France is"
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
    mem_fraction_static: float | None = None  # None: the captured server's 0.192 (SGLang picks it from the GPU)
    quantization: str | None = None  # --quantization (fp8, ...): /server_info's quantization; None: the template's
    load_format: str | None = None  # --load-format (dummy, ...): /server_info's; None: auto (gguf for a GGUF file)
    dtype: str | None = None  # --dtype: /server_info's; None: auto
    enable_metrics: bool = False
    enable_cache_report: bool = False
    stream_response_default_include_usage: bool = False
    version: str = DEFAULT_VERSION  # one of SGLANG_VERSIONS: /server_info's version and the shapes that differ
    ready_endpoint: bool | None = None  # None: as the version has it (0.5.17: no /ready, 404; 0.5.23: 200)
    health_idle_s: float = 0.0  # /health's time when idle: real 0.5.17 took ~1.0 s (it polls once a second)
    decode_log_interval: int = 40  # scheduler gauges are published every this many decode steps (and at prefill)
    idle_metrics_s: float = 30.0  # ... and when idle, at most this often (SGLang's check_memory: 30 s)
    host: str = "127.0.0.1"  # reported by /server_info; run_in_thread binds it
    port: int = 30000
    backend_wait_s: float = 60.0  # how long startup waits for the backend's /health

    def __post_init__(self) -> None:
        if self.version not in SGLANG_VERSIONS:
            raise ValueError(f"SGLang version {self.version!r} is not emulated; one of {', '.join(SGLANG_VERSIONS)}")

    @property
    def has_ready(self) -> bool:
        return self.version != "0.5.17" if self.ready_endpoint is None else self.ready_endpoint

    @property
    def v0517(self) -> bool:
        """The 0.5.17 shapes: no ``completion_tokens_details``, the full server-args ``/server_info``."""
        return self.version == "0.5.17"
