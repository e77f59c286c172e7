"""What a bench run is: its targets, its settings, the cells it plans and the body every engine gets. Pure.

- ``plan`` makes single-variable sweeps around a base point (concurrency 1, base max_tokens, base prompt
  length); a cell shared by two sweeps runs once. With ``request_rates`` the concurrency sweep becomes a
  request-rate sweep (open-loop arrivals, at most ``max(concurrency)`` in flight).
- ``build_body``: every engine gets the same explicit sampling, mapped per engine kind by ``proxy.normalize``
  (the proxy's own mapping); what the mapping *dropped* for a kind is kept (``effective_sampling``) so the
  parity gate compares what each engine really got.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proxy.normalize import normalize_request
from proxy.types import EngineKind

PIN_HEADER = "x-enginemeter-engine"


@dataclass
class Target:
    name: str
    url: str | None  # the engine's own URL (tokenize, flush_cache, probing); None when only reachable via proxy
    kind: EngineKind | None = None
    model: str | None = None
    quantization: str | None = None
    quantization_source: str | None = None
    slots: int | None = None
    #: the longest request one slot takes (llama.cpp per-slot n_ctx; SGLang/vLLM max_model_len)
    context_per_slot: int | None = None
    info: dict[str, Any] = field(default_factory=dict)
    #: this target is a second pass of (or the same engine listed again as) the named engine: the A/A noise floor
    aa_of: str | None = None
    #: the engine name pinned through the proxy (a second pass pins its engine, not its own name)
    pin: str | None = None
    #: a launched engine: its command line, verbatim (``--launch NAME='COMMAND'``); None: resident at ``url``
    launch: str | None = None


@dataclass
class BenchConfig:
    engines: list[Target]
    through: str | None = None
    suite: str = "builtin"
    concurrency: tuple[int, ...] = (1, 2, 4, 8)
    output_lengths: tuple[int, ...] = (32, 128)
    prompt_lengths: tuple[str, ...] = ("short", "medium", "long")
    repeats: int = 3
    warmup: int = 2
    cache: str = "both"  # cold | warm | both
    out: Path = Path("bench-out")
    model: str | None = None
    seed: int = 1234
    max_tokens: int = 128  # the base point of the output-length sweep
    waves: int = 2  # requests per cell repeat = concurrency * waves (unless requests/duration_s)
    requests: int | None = None  # requests per cell repeat
    duration_s: float | None = None  # or: send for this long per cell repeat
    request_rates: tuple[float, ...] = ()  # open-loop arrivals (requests/s); empty: closed loop
    burstiness: float = 1.0  # gamma shape of the inter-arrival times; 1 = Poisson
    goodput: dict[str, float] = field(default_factory=dict)  # SLOs in ms: ttft, tpot, e2el
    aa: str = "auto"  # auto | off: the A/A pass of the baseline
    baseline: str | None = None
    metrics_url: str | None = None
    no_prompt_cache: bool = False  # send cache_prompt:false to llama.cpp in the cold phase
    ignore_eos: bool = True
    timeout_s: float = 600.0
    memory_budget_bytes: int | None = None
    quick: bool = False
    progress: bool = True
    #: practical significance for the verdict (``--min-effect``), recorded so a replay judges alike
    min_effect: float = 0.05
    #: engine-side failures the verdict states and leaves out (``--max-error-rate``); above it, inconclusive
    max_error_rate: float = 0.02
    #: the command line as given (for the rerun advice)
    argv: list[str] = field(default_factory=list)
    #: a declared quantization difference passes the parity gate with a caveat; the verdict is *discounted*
    accept_quantization_difference: bool = False
    #: launched engines: seconds from launch to ready before the launch fails
    launch_timeout_s: float = 900.0
    #: parity checks a deliberate change explains (``enginemeter tune``: the swept flag changes the context per slot)
    expected_differences: tuple[str, ...] = ()
    #: ``enginemeter tune``: the swept flag, its values and the variants' names
    tune: dict[str, Any] | None = None
    #: ``--agreement PROMPTSxTOKENS``: the token-agreement phase after the timed cells (``proxy.bench.quality``)
    agreement: str | None = None
    #: ``--eval FILE.jsonl``: the task-accuracy phase after the timed cells
    eval_file: str | None = None

    @property
    def time_shared(self) -> bool:
        """Launched engines run one at a time, each the whole suite alone (``proxy.bench.run.timeshare``)."""
        return any(t.launch for t in self.engines)

    @property
    def base_prompt_len(self) -> str:
        return "medium" if "medium" in self.prompt_lengths else self.prompt_lengths[0]


@dataclass(frozen=True, slots=True)
class CellSpec:
    cache: str
    concurrency: int
    max_tokens: int
    prompt_len: str
    sweeps: tuple[str, ...]
    rate: float | None = None  # requests/s (open loop); None: closed loop

    def key(self) -> dict[str, Any]:
        k: dict[str, Any] = {
            "cache": self.cache,
            "concurrency": self.concurrency,
            "max_tokens": self.max_tokens,
            "prompt_len": self.prompt_len,
        }
        if self.rate is not None:
            k["rate"] = self.rate
        return k

    def requests(self, cfg: BenchConfig) -> int:
        """Requests per repeat; with ``duration_s`` the most that may be sent (the clock stops it earlier)."""
        if cfg.requests:
            return cfg.requests
        if cfg.duration_s and self.rate:
            return max(1, int(cfg.duration_s * self.rate * 2) + 8)
        if cfg.duration_s:
            return self.concurrency * 200  # closed loop for a duration: the clock stops it long before
        return self.concurrency * cfg.waves


def plan(cfg: BenchConfig) -> list[CellSpec]:
    """Single-variable sweeps around the base point; a cell shared by two sweeps runs once."""
    base_pl = cfg.base_prompt_len
    cells: dict[tuple[str, int, int, str, float | None], list[str]] = {}
    caches = ("cold", "warm") if cfg.cache == "both" else (cfg.cache,)
    for cache in caches:
        if cfg.request_rates:
            cap = max(cfg.concurrency)
            for r in cfg.request_rates:
                cells.setdefault((cache, cap, cfg.max_tokens, base_pl, r), []).append("rate")
        else:
            for c in cfg.concurrency:
                cells.setdefault((cache, c, cfg.max_tokens, base_pl, None), []).append("concurrency")
        for mt in cfg.output_lengths:
            cells.setdefault((cache, 1, mt, base_pl, None), []).append("output")
        for pl in cfg.prompt_lengths:
            cells.setdefault((cache, 1, cfg.max_tokens, pl, None), []).append("prompt")
    return [CellSpec(k[0], k[1], k[2], k[3], tuple(v), k[4]) for k, v in cells.items()]


# ---- request bodies -----------------------------------------------------------------------------


def sampling(cfg: BenchConfig, max_tokens: int) -> dict[str, Any]:
    """The explicit sampling every engine gets (before the per-kind mapping)."""
    s: dict[str, Any] = {
        "temperature": 0,
        "top_p": 1.0,
        "top_k": 0,  # off; mapped to -1 for SGLang/vLLM by proxy.normalize
        "min_p": 0.0,
        "repetition_penalty": 1.0,  # off; the one value both penalty semantics share
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "seed": cfg.seed,
        "max_tokens": max_tokens,
    }
    if cfg.ignore_eos:
        s["ignore_eos"] = True
    return s


SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "ignore_eos",
)


def canonical_sampling(body: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling an engine actually got, spelled the same for every kind (for the parity check)."""
    out: dict[str, Any] = {}
    for k in SAMPLING_KEYS:
        if k in body:
            out[k] = body[k]
    if isinstance(out.get("top_k"), int | float) and out["top_k"] <= 0:
        out["top_k"] = "off"
    pen = body.get("repetition_penalty", body.get("repeat_penalty"))
    if pen is not None:
        out["repetition_penalty"] = pen
    for k, v in list(out.items()):
        if isinstance(v, float) and v.is_integer():
            out[k] = int(v)
    return out


def _client_body(
    cfg: BenchConfig, t: Target, messages: Sequence[Mapping[str, str]], max_tokens: int, *, cold: bool
) -> dict[str, Any]:
    client: dict[str, Any] = {
        "model": cfg.model or t.model or "default",
        "messages": [dict(m) for m in messages],
        "stream": True,
        "stream_options": {"include_usage": True},
        **sampling(cfg, max_tokens),
    }
    if cold and cfg.no_prompt_cache and (t.kind == "llamacpp" or cfg.through):
        client["cache_prompt"] = False
    return client


def build_body(
    cfg: BenchConfig, t: Target, messages: Sequence[Mapping[str, str]], max_tokens: int, *, cold: bool
) -> dict[str, Any]:
    client = _client_body(cfg, t, messages, max_tokens, cold=cold)
    if cfg.through:
        return client  # the proxy maps it per kind (and drops what the engine cannot take)
    kind: EngineKind = t.kind or "openai"
    return normalize_request(client, endpoint="chat", kind=kind, served_model=cfg.model or t.model, defaults={}).body


def effective_sampling(cfg: BenchConfig, t: Target) -> tuple[dict[str, Any], list[str]]:
    """(canonical sampling the engine gets, the sampling params the per-kind mapping dropped for it).

    Through the proxy the body goes as is and the proxy maps it with the same ``proxy.normalize`` for the
    engine's kind, so the same function tells what it drops (when the kind is known)."""
    client = _client_body(cfg, t, ({"role": "user", "content": "x"},), cfg.max_tokens, cold=False)
    kind: EngineKind = t.kind or "openai"
    norm = normalize_request(client, endpoint="chat", kind=kind, served_model=cfg.model or t.model, defaults={})
    dropped = sorted({c.param for c in norm.changes if c.action == "dropped"})
    return canonical_sampling(norm.body), dropped
