"""An SGLang 0.5.23 HTTP front end whose tokens come from a real llama.cpp ``llama-server``.

SGLang needs CUDA torch, so tests and benchmarks here talk to this emulator instead: SGLang's wire behaviour
(engines.md §2, checked against the 0.5.23 wheel's ``serving_chat.py``, ``serving_completions.py``,
``sse_utils.py``, ``protocol.py``, ``http_server.py``, ``tokenizer_manager.py``, ``scheduler.py`` and
``metrics_collector.py``) on top of real generation by the backend's native ``/completion`` stream, which
reports why generation stopped (EOS, stop word, limit) so ``matched_stop`` can be filled in.

Invariants kept from SGLang:
- HTTP headers go out only once the first token exists (the "kick-start"); validation failures, a too-long
  prompt and a ``:`` model name that is not the served name are therefore plain 400s even for streams.
- Chat stream: role chunk ``{"reasoning_content":null,"role":"assistant","content":""}`` right before the first
  content chunk, content chunks ``{"reasoning_content":null,"content":...}``, every choice carries
  ``logprobs``, ``finish_reason`` and ``matched_stop``, then a separate finish chunk, a usage chunk with
  ``choices:[]`` when asked for, and ``data: [DONE]`` always, also after an error chunk. No
  ``system_fingerprint``; ``id`` is a uuid4 hex; ``model`` echoes the request's.
- Errors are flat ``{"object":"error","message","type","param","code"}``. A full queue
  (``--max-queued-requests``) is a 503 for non-stream requests, and for streams an HTTP 200 whose first event
  is the error.
- Requests are not queued here; a request counts as waiting while more than ``max_running_requests`` (the
  backend's slot count by default) are in flight, and SGLang's rule ``waiting + 1 > max_queued_requests``
  rejects it. In-flight requests end when generation ends or the client goes away (which also stops the
  backend request).

Test hook: an ``x-fault`` request header is passed on to the backend, so a ``fakes.fault_engine``
backend can shape timing and failures.

    python -m fakes.sglang_emulator --port 30000 --backend http://127.0.0.1:8080 --served-model-name m
    app = create_app(EmulatorConfig(backend=...))                  # Starlette, lifespan probes the backend
    with run_in_thread(EmulatorConfig(backend=...)) as url: ...    # uvicorn on a free port in a thread

Modules: ``config`` (settings, constants), ``protocol`` (error body, request validation, response chunks),
``engine`` (backend stream -> engine outputs, live state), ``serving`` (the OpenAI endpoints), ``metrics``
(SGLang's Prometheus names), ``app`` (routes, lifespan, ``run_in_thread``), ``cli`` (``python -m``).
"""

from fakes.sglang_emulator.app import create_app, run_in_thread
from fakes.sglang_emulator.cli import main
from fakes.sglang_emulator.config import EmulatorConfig
from fakes.sglang_emulator.engine import SGLangEmulator

__all__ = ["EmulatorConfig", "SGLangEmulator", "create_app", "main", "run_in_thread"]
