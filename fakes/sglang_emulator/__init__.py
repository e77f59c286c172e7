"""An SGLang HTTP front end whose tokens come from a real llama.cpp ``llama-server`` (or a fault engine).

SGLang needs CUDA torch, so tests and benchmarks here talk to this emulator instead: SGLang's wire behaviour on
top of real generation by the backend's native ``/completion`` stream, which reports why generation stopped
(EOS, stop word, limit) so ``matched_stop`` can be filled in. Two versions (``--sglang-version``):

- **0.5.17** (the default): as a real 0.5.17 answered on an H200 (issue 11; tests/fixtures/engines/sglang-0.5.17/,
  replayed against the emulator by tests/engines/test_emulator_fidelity.py): no ``/ready`` (404), ``/ping`` 200,
  ``/server_info`` = the server args as given (``max_running_requests: null`` unless set) + ``status``,
  ``max_total_num_tokens``, ``max_req_input_len``, ``internal_states[0].effective_max_running_requests_per_dp``
  and ``memory_usage``; usage without ``completion_tokens_details``; ``"tool_calls": null`` in a whole message;
  prompt + ``max_tokens`` over the context refused with 400; FastAPI's validation text; ``cached_tokens`` from a
  radix-cache stand-in; scheduler gauges published at prefill and every 40 decode steps, not live.
- **0.5.23**: as its source reads (engines.md §2: ``serving_chat.py``, ``serving_completions.py``, ``sse_utils.py``,
  ``protocol.py``, ``http_server.py``, ``tokenizer_manager.py``, ``scheduler.py``, ``metrics_collector.py``):
  ``/ready`` 200, ``completion_tokens_details: null``, ``/model_info`` with ``served_model_name`` and friends,
  ``request_time_per_output_token_seconds`` and ``num_aborted_requests_total``. ``/server_info`` keeps 0.5.17's
  shape in both modes (0.5.23's was never captured) with its own ``version``.

Native endpoints (both versions, from the 0.5.17 source: ``http_server.py``, ``tokenizer_manager.py``,
``scheduler_components/logprob_result_processor.py``, ``serving_tokenize.py``): ``/generate`` from ``input_ids``
(or ``text``), not streamed, with ``output_ids`` and, when ``return_logprob``, ``meta_info``'s
``input_token_logprobs`` / ``input_top_logprobs`` from ``logprob_start_len`` on (entry 0 ``null``) and
``output_token_logprobs`` / ``output_top_logprobs`` as ``[logprob, id, null]``; ``/v1/detokenize`` (and
``/detokenize``) ``{"text"}``, ``skip_special_tokens`` true by default; ``/v1/tokenize`` a chat prompt as the
template renders it, a plain one with ``add_special_tokens`` (true by default).

What no setting reproduces: real SGLang's ``/health`` takes ~1 s when idle (``health_idle_s``, default 0 so tests
stay fast), its full 69 metric families (the emulator serves a subset under the same names), generated text.

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

Test hooks: an ``x-fault`` request header is passed on to the backend, so a ``fakes.fault_engine``
backend can shape timing and failures; ``GET /_emulator/state`` gives the live in-flight, running and waiting
counts (the gauges only show what was last published).

    python -m fakes.sglang_emulator --port 30000 --backend http://127.0.0.1:8080 --served-model-name m
    python -m fakes.sglang_emulator ... --sglang-version 0.5.23            # with /ready
    app = create_app(EmulatorConfig(backend=...))                  # Starlette, lifespan probes the backend
    with run_in_thread(EmulatorConfig(backend=...)) as url: ...    # uvicorn on a free port in a thread

Modules: ``config`` (settings, constants), ``protocol`` (error body, request validation, response chunks),
``engine`` (backend stream -> engine outputs, live state), ``serving`` (the OpenAI endpoints), ``native``
(``/generate`` with log-probabilities, ``/v1/detokenize``), ``metrics``
(SGLang's Prometheus names), ``app`` (routes, lifespan, ``run_in_thread``), ``cli`` (``python -m``).
"""

from fakes.sglang_emulator.app import create_app, run_in_thread
from fakes.sglang_emulator.cli import main
from fakes.sglang_emulator.config import EmulatorConfig
from fakes.sglang_emulator.engine import SGLangEmulator

__all__ = ["EmulatorConfig", "SGLangEmulator", "create_app", "main", "run_in_thread"]
