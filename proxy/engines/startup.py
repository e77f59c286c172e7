"""How an engine is started and what it logs while it starts: the helpers every dialect's command-line and log
readers share, and ``LogFacts``, the record they answer with.

A command line is read as a shell word list (``argv``), flags in any of the spellings engines accept
(``--port 8081``, ``--port=8081``, the last one wins, as in argparse and llama.cpp's parser). A log is read from
the engine's *last* start: a log file that several starts appended to (``proxy.procs.process`` writes a ``+ COMMAND``
line before each) is cut at the last such line.
"""

from __future__ import annotations

import gzip
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePath

#: ANSI colour codes (llama.cpp colours its log on a terminal, SGLang its warnings)
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_UNITS = {"b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 2**10, "mb": 2**20, "gb": 2**30}
#: the most of a log file read (an engine logs its start first; a run's request lines follow)
MAX_LOG_BYTES = 256 * 2**20
#: a Python interpreter's file name: python, python3, python3.12
_PYTHON = re.compile(r"^python(\d+(\.\d+)?)?$")


@dataclass(frozen=True)
class LogFacts:
    """What an engine's start-up log says (None: the log does not say). Sizes in bytes, times in seconds."""

    #: the weights loaded: seconds, and the memory they took (where the engine says; llama.cpp: GPU buffers)
    load_s: float | None = None
    weights_bytes: int | None = None
    #: llama.cpp: weights left in host memory (CPU buffers: layers not offloaded, or the mmap'd file)
    weights_host_bytes: int | None = None
    #: llama.cpp ``offloaded N/M layers to GPU`` (M counts the output layer)
    layers_offloaded: int | None = None
    layers_total: int | None = None
    #: the KV cache: bytes, token capacity (llama.cpp cells x streams; SGLang/vLLM the KV pool), element type
    kv_cache_bytes: int | None = None
    kv_cache_tokens: int | None = None
    kv_cache_type: str | None = None
    #: llama.cpp: total context, slots, context per slot, one KV pool for all slots
    context: int | None = None
    slots: int | None = None
    context_per_slot: int | None = None
    kv_unified: bool | None = None
    #: "enabled", "disabled" or "auto" (llama.cpp), as the log says
    flash_attention: str | None = None
    #: "on" / "off" as the log says; the capture's seconds and memory where it says
    cuda_graphs: str | None = None
    graph_capture_s: float | None = None
    graph_bytes: int | None = None
    #: SGLang ``mem_fraction_static``, vLLM ``gpu_memory_utilization``
    memory_fraction: float | None = None
    #: the GPU(s) the engine reports using (llama.cpp ``CUDA0``), in the engine's own names
    devices: tuple[str, ...] = ()
    #: fact name -> the log line it was read from, so a person can check
    evidence: Mapping[str, str] = field(default_factory=dict)
    #: what the log could not say, and why (e.g. llama.cpp logs its loader only at ``-lv 4``)
    notes: tuple[str, ...] = ()


# ---- command lines -----------------------------------------------------------------------------------------


def flag_value(argv: Sequence[str], *names: str) -> str | None:
    """The value of the last of ``names`` in ``argv`` (``--x V`` or ``--x=V``); None when absent."""
    found: str | None = None
    for i, a in enumerate(argv):
        if a in names:
            found = argv[i + 1] if i + 1 < len(argv) else None
        elif a.startswith("--") and "=" in a and a.split("=", 1)[0] in names:
            found = a.split("=", 1)[1]
    return found


def has_flag(argv: Sequence[str], *names: str) -> bool:
    return any(a in names or (a.startswith("--") and a.split("=", 1)[0] in names) for a in argv)


def without_flags(argv: Sequence[str], *names: str) -> list[str]:
    """``argv`` without ``names`` and their values (``--x V`` or ``--x=V``)."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a in names:
            skip = True
        elif not (a.startswith("--") and "=" in a and a.split("=", 1)[0] in names):
            out.append(a)
    return out


def set_flags(command: str, values: Mapping[str, str]) -> str:
    """``command`` (a shell line) with each flag's value replaced where it is given (``--flag V``, ``--flag=V``), else
    the flag added at the end; the rest of the line as it was, quoting included."""
    for flag, value in values.items():
        pattern = re.compile(rf"(?<!\S)({re.escape(flag)})(=|\s+)\S+")
        new, n = pattern.subn(lambda m: m[1] + m[2] + value, command, count=1)  # noqa: B023  # used at once
        command = new if n else f"{command} {flag} {value}"
    return command


def int_flag(argv: Sequence[str], *names: str) -> int | None:
    v = flag_value(argv, *names)
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None


def program(argv: Sequence[str]) -> str:
    """The program's file name (``/opt/llama/bin/llama-server`` -> ``llama-server``)."""
    return PurePath(argv[0]).name if argv else ""


def python_module(argv: Sequence[str]) -> str | None:
    """``M`` of ``python[3[.x]] [opts] -m M ...``; None when ``argv`` does not run a module."""
    if not argv or not _PYTHON.match(program(argv)):
        return None
    for i, a in enumerate(argv[1:-1], start=1):
        if a == "-m":
            return argv[i + 1]
        if not a.startswith("-"):
            return None  # a script, not a module
    return None


def subcommand(argv: Sequence[str]) -> tuple[str, str | None]:
    """(program, its first argument) — ``vllm serve``, ``sglang serve``."""
    return program(argv), argv[1] if len(argv) > 1 else None


# ---- logs --------------------------------------------------------------------------------------------------


def last_launch(text: str) -> str:
    """The part of a log written by the engine's last start (after the last ``+ COMMAND`` header line)."""
    cut = text.rfind("\n+ ")
    if cut < 0 and text.startswith("+ "):
        cut = 0
    if cut < 0:
        return text
    nl = text.find("\n", cut + 1)
    return text[nl + 1 :] if nl >= 0 else ""


def clean_lines(text: str) -> list[str]:
    return [_ANSI.sub("", line).rstrip() for line in text.splitlines()]


def size_bytes(number: str, unit: str) -> int:
    """``"6.57", "GB"`` -> bytes; SGLang and llama.cpp write GB and MiB for powers of two (their code divides
    by 1024 ** n), so both spellings count as binary units."""
    return round(float(number.replace(",", "")) * _UNITS[unit.lower()])


def read_log(path: Path) -> str:
    """An engine's log file as text, its first ``MAX_LOG_BYTES``; gzipped when its name ends in ``.gz``
    (``scripts/gpu/collect.sh`` keeps long logs so). OSError when it cannot be read."""
    with gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb") as fh:
        return fh.read(MAX_LOG_BYTES).decode(errors="replace")
