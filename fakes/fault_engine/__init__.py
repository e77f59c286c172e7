"""A fault-injecting look-alike of llama.cpp ``llama-server``, for tests and benchmarks.

Pure asyncio HTTP/1.1, no framework: the bytes, their timing and abrupt closes are exactly what a test asks
for, and one process serves hundreds of concurrent streams on a small machine.

Wire shapes follow llama.cpp (engines.md §1): for ``/v1/chat/completions`` the 200 headers go out at "slot
start", before the first token; the role chunk ``{"role":"assistant","content":null}`` is written together
with the first token; then one event per token; the final write is the finish chunk (``delta:{}``) plus,
with ``stream_options.include_usage``, a usage chunk with ``choices:[]``; ``timings`` sit on the last event;
then ``data: [DONE]``. ``model`` is always the server's own name. ``usage.completion_tokens`` counts the EOS
token when the stream ends with ``finish_reason:"stop"`` (llama.cpp's ``n_decoded`` does), so it is
``tokens + 1`` then. ``/v1/completions`` (``choices[0].text``, usage always on the final event) and the
native ``/completion`` (no ``[DONE]``), ``/tokenize`` and ``/apply-template`` are emulated too, so the SGLang
emulator can sit on top of this fake.

The fake tokenizer is a word splitter: one token per whitespace-led word, BOS id 1 prepended with
``add_special``; chat prompts are rendered with a ChatML template. A prompt of ``n_ctx`` tokens or more gets
llama.cpp's 400 ``exceed_context_size_error``.

Behaviour per request comes from the ``x-fault`` request header, over the server's defaults (CLI flags), as
``key=value`` items or bare flags separated by commas, semicolons or spaces, e.g.
``x-fault: tokens=8, cadence_ms=5, die_after=3``. The knobs are the fields of ``Knobs``. Counts of events
(``die_after`` and friends) count token events, which hold ``multi`` tokens each.

Test hooks: ``GET /_fake/requests`` (the parsed bodies of the last POSTs, oldest first; ``?full=1`` adds
method, path and headers), ``DELETE /_fake/requests``, ``GET /_fake/stats`` (``active``, ``completed``,
``cancelled`` = the client went away first, ``failed`` = a fault ended it, ``rejected`` = answered with an
error status, ``requests``) and ``DELETE /_fake/stats`` (zero the counters but ``active``).

    python -m fakes.fault_engine --port 8081 --tokens 64 --cadence-ms 20 --ttft-ms 50
    server = await serve(FaultEngineConfig(port=0))           # in a running loop
    with run_in_thread(FaultEngineConfig()) as url: ...       # from synchronous code

Modules: ``config`` (settings, knobs, the fixed vocabulary), ``shapes`` (fake tokenizer, llama.cpp bodies and
events), ``http1`` (HTTP/1.1 parsing and framing), ``produce`` (one completion over time, faults included),
``server`` (routes, endpoints, ``serve``/``run_in_thread``), ``cli`` (``python -m``).
"""

from fakes.fault_engine.cli import main
from fakes.fault_engine.config import (
    BOS_ID,
    BOS_TOKEN,
    BUILD_INFO,
    EOS_ID,
    EOS_TOKEN,
    MAX_BODY_BYTES,
    MAX_HEAD_BYTES,
    PIECES,
    SPECIAL_IDS,
    FaultEngineConfig,
    KnobError,
    Knobs,
)
from fakes.fault_engine.server import FaultEngine, RecordedRequest, run_in_thread, serve
from fakes.fault_engine.shapes import apply_chat_template, fake_tokenize

__all__ = [
    "BOS_ID",
    "BOS_TOKEN",
    "BUILD_INFO",
    "EOS_ID",
    "EOS_TOKEN",
    "MAX_BODY_BYTES",
    "MAX_HEAD_BYTES",
    "PIECES",
    "SPECIAL_IDS",
    "FaultEngine",
    "FaultEngineConfig",
    "KnobError",
    "Knobs",
    "RecordedRequest",
    "apply_chat_template",
    "fake_tokenize",
    "main",
    "run_in_thread",
    "serve",
]
