"""``enginemeter bench --config bench.yaml``: the bench's settings in a YAML file, read as strictly as the proxy's
config (``proxy.config.configfile.read_document``: strict types, unknown keys refused with a "did you mean", one line
per problem naming the file and line, ``${NAME}`` from the environment).

Every key is a bench flag with ``_`` for ``-`` and takes the flag's value (lists as YAML lists); a flag given on
the command line wins over the file, and ``--engine``/``--launch`` flags add engines after the file's::

    engines:
      - {name: llama, launch: "llama-server -m /m/q4.gguf -ngl 99 -c 16384 -np 4 --port {port}"}
      - {name: sglang, launch: "python -m sglang.launch_server --model-path /m/hf --port {port}"}
      - {name: vllm, url: "http://127.0.0.1:8000", quantization: FP8}
    memory_budget: 72GiB
    accept_quantization_difference: true
    concurrency: [1, 4, 16]
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, TypeAdapter, model_validator
from pydantic.dataclasses import dataclass

from proxy.config.configfile import read_document
from proxy.config.settings import SettingsError

_STRICT = ConfigDict(extra="forbid")


@dataclass(frozen=True, config=_STRICT)
class EngineEntry:
    """One engine: resident at ``url`` or started by ``launch`` (the command line, verbatim)."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description="the engine's name in the report")
    url: str | None = Field(default=None, description="a running engine (resident)")
    launch: str | None = Field(default=None, description="a command line enginemeter starts, measures and stops")
    quantization: str | None = Field(default=None, description="declared quantization (Q4_K_M, FP8, BF16, ...)")

    @model_validator(mode="after")
    def _one_of(self) -> EngineEntry:
        if (self.url is None) == (self.launch is None):
            raise ValueError("give exactly one of url (a running engine) and launch (a command line)")
        return self


@dataclass(frozen=True, config=_STRICT, kw_only=True)
class BenchFile:
    """The file's keys; each is the bench flag of the same name (``enginemeter bench --help``)."""

    engines: tuple[EngineEntry, ...] = ()
    baseline: str | None = None
    through: str | None = None
    model: str | None = None
    metrics_url: str | None = None
    suite: str | None = None
    concurrency: tuple[int, ...] | None = None
    output_lengths: tuple[int, ...] | None = None
    prompt_lengths: tuple[str, ...] | None = None
    repeats: int | None = Field(default=None, ge=1)
    warmup: int | None = Field(default=None, ge=0)
    cache: Literal["cold", "warm", "both"] | None = None
    no_prompt_cache: bool | None = None
    waves: int | None = Field(default=None, ge=1)
    requests: int | None = Field(default=None, ge=1)
    duration: float | None = Field(default=None, gt=0)
    request_rate: tuple[float, ...] | None = None
    burstiness: float | None = Field(default=None, gt=0)
    goodput: dict[Literal["ttft", "tpot", "e2el"], float] | None = None
    aa: Literal["auto", "off"] | None = None
    min_effect: float | None = Field(default=None, gt=0, lt=100, description="percent")
    fail_on: tuple[Literal["stay", "partial", "inconclusive"], ...] | None = None
    out: str | None = None
    seed: int | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    ignore_eos: bool | None = None
    accept_quantization_difference: bool | None = None
    memory_budget: str | int | None = None
    timeout: float | None = Field(default=None, gt=0)
    launch_timeout: float | None = Field(default=None, gt=0)
    quick: bool | None = None


_ADAPTER: TypeAdapter[BenchFile] = TypeAdapter(BenchFile)


def read_bench_file(path: str | Path) -> BenchFile:
    """The file, validated; ``SettingsError`` with one line per problem."""
    doc, problems = read_document(path, _ADAPTER, BenchFile)
    names = [e.name for e in doc.engines]
    for i, name in enumerate(names):
        if name in names[:i]:
            problems.add(("engines", i, "name"), f"duplicate engine name {name!r}")
    if doc.baseline is not None and names and doc.baseline not in names:
        problems.add(("baseline",), f"unknown engine {doc.baseline!r} (engines: {', '.join(names)})")
    problems.raise_if_any()
    assert isinstance(doc, BenchFile)
    return doc


def goodput_spec(goodput: dict[Any, float] | None) -> str | None:
    """The file's goodput mapping in the flag's ``ttft:MS,tpot:MS`` form."""
    return ",".join(f"{k}:{v:g}" for k, v in goodput.items()) if goodput else None


__all__ = ["BenchFile", "EngineEntry", "SettingsError", "goodput_spec", "read_bench_file"]
