"""The records the verdict reads, whatever produced them (bench JSONL of either version, the proxy's log)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from proxy.bench.quality.readout import Quality
from proxy.engines.quant import random_among
from proxy.levels import by_level
from proxy.sequential import MIN_EFFECT as SEQ_MIN_EFFECT

#: depends: resolved regimes disagree (the answer per workload, and --traffic to weigh it); partial: a regime the
#: decision needs was not measured (neither switch nor stay); not yet: live traffic the anytime-valid verdict has
#: not decided
Decision = Literal["stay", "switch", "depends", "partial", "not yet", "inconclusive"]
#: flagged: the cell cannot decide (an engine was busy with requests the bench did not send)
Assessment = Literal["ok", "inconclusive", "win", "loss", "tie", "unresolved", "flagged", "stay", "note"]
#: the default --min-effect, the same for the bench and for live traffic
MIN_EFFECT = SEQ_MIN_EFFECT
#: the default --max-error-rate: engine-side failures up to this share are stated, not disqualifying (bench and live)
MAX_ERROR_RATE = 0.02

#: the gates, in order
STEPS: tuple[str, ...] = ("parity", "data", "memory", "decode", "throughput", "long-context")
#: outcomes that fail their gate (parity, data, memory); speed outcomes are weighed per regime instead
FAILS: frozenset[str] = frozenset({"inconclusive", "stay"})


@dataclass(frozen=True, slots=True)
class Cell:
    """One point of a sweep. ``cache`` is cold|warm|live; ``prompt_len`` a length class or ``mixed``.

    Live cells are groups of mirrored pairs by observed concurrency: ``concurrency``..``concurrency_max`` (0: no
    upper bound); their ``max_tokens`` is the one the group's requests asked for, 0 when they asked for several."""

    cache: str
    concurrency: int
    max_tokens: int
    prompt_len: str
    rate: float | None = None
    #: live cells only (out of the repr, which tests seed their random figures with)
    concurrency_max: int | None = field(default=None, repr=False)

    def label(self) -> str:
        if self.cache == "live":
            lo, hi = self.concurrency, self.concurrency_max if self.concurrency_max is not None else self.concurrency
            return "live, observed " + (f"c={lo}" if hi == lo else f"c≥{lo}" if hi == 0 else f"c={lo}–{hi}")
        rate = f", rate={self.rate:g}/s" if self.rate is not None else ""
        return f"{self.cache}, c={self.concurrency}{rate}, max_tokens={self.max_tokens}, prompt={self.prompt_len}"


@dataclass(frozen=True, slots=True)
class Sample:
    """One repeat of one cell on one engine: medians over its requests plus the cell's aggregates."""

    engine: str
    cell: Cell
    repeat: int
    n_ok: int
    n_err: int
    ttft_s: float | None = None
    tpot_s: float | None = None
    decode_tps: float | None = None
    e2e_s: float | None = None
    completion_tokens: float | None = None  # mean per request
    prompt_tokens: float | None = None  # mean per request (engine usage)
    output_tps: float | None = None  # all output tokens of the repeat / its wall time
    gpu_mem_peak_bytes: int | None = None
    errors: tuple[str, ...] = ()
    gpu_mem_source: str | None = None
    gpus: tuple[int, ...] = ()
    gpu_mem_total_bytes: int | None = None
    goodput_rps: float | None = None
    percentiles: Mapping[str, float | None] = field(default_factory=dict)  # ttft_p50_s ... itl_p99_s
    #: requests whose token events came in one read (their decode rate: the engine's own timings), and of them
    #: those without engine timings (no decode rate at all)
    bursts: int = 0
    bursts_unrated: int = 0
    #: bursts the bench's own client caused (it stalled where the events piled up: ``proxy.bench.run.client``), not
    #: counted above; of them those without engine timings; the client's longest stall in the repeat (s)
    bursts_client: int = 0
    bursts_client_unrated: int = 0
    client_lag_max_s: float | None = None


@dataclass(frozen=True, slots=True)
class Req:
    """One measured request: the unit of the paired comparison (same cell, repeat and index on each engine)."""

    engine: str
    cell: Cell
    repeat: int
    index: int
    ok: bool
    ttft_s: float | None = None
    tpot_s: float | None = None
    decode_tps: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class EngineInfo:
    name: str
    kind: str | None = None
    model: str | None = None
    quantization: str | None = None
    #: the sampling each engine actually got, canonical (top_k "off", one penalty name)
    sampling: Mapping[str, object] = field(default_factory=dict)
    max_tokens: tuple[int, ...] = ()
    #: sampling params the per-kind mapping dropped for this engine (None: not recorded)
    dropped: tuple[str, ...] | None = ()
    context_per_slot: int | None = None
    slots: int | None = None
    aa_of: str | None = None
    quantization_source: str | None = None
    #: the engine's KV pool in tokens, all requests together (SGLang reports it); None: not reported
    kv_pool_tokens: int | None = None
    #: the same pool's size in bytes, when the engine said it; None: not reported
    kv_cache_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class Reason:
    step: str  # one of STEPS
    outcome: Assessment
    text: str
    check: str = ""  # within a gate: prompt tokens, sampling, context, quantization, ...
    decisive: bool = True  # False: shown after the verdict stopped at an earlier gate


@dataclass(frozen=True, slots=True)
class LiveFinding:
    """One regime of mirrored traffic as the anytime-valid live verdict (``proxy.sequential``) has it."""

    finding: str  # not yet | faster | slower | tie (the candidate, the mirror's shadow, against the primary)
    text: str
    pairs: int
    metric: str = ""


#: a profile with more concurrency levels than this is written by the proxy's levels (1, 2, 3-4, 5-8, ...)
GROUP_ABOVE = 8


@dataclass(frozen=True)
class Traffic:
    """Where traffic spends its time: concurrency -> share of busy time (sums to 1); prompt class -> share of
    requests (empty: the short-prompt cells stand for all of it). ``proxy.bench.verdict.weighting`` weighs by it."""

    concurrency: Mapping[float, float]
    prompts: Mapping[str, float] = field(default_factory=dict)
    #: where the profile came from, in words ("inline: c1=30,c16=70", "comparison log x.jsonl: 1,204 requests")
    source: str = "inline"
    #: share of the observed time with nothing in flight (not weighted: no request feels it); None: unknown
    idle: float | None = None
    #: the median completion tokens of the traffic's requests, when known
    output_tokens: float | None = None
    requests: int | None = None
    span_s: float | None = None

    def text(self) -> str:
        def c(x: float) -> str:
            return f"{x:g}" if x < 10 else f"{x:.0f}"

        if len(self.concurrency) > GROUP_ABOVE:  # a recorded profile (every count in flight): the proxy's levels
            shares = list(by_level(self.concurrency).items())
        else:
            shares = [(c(k), v) for k, v in sorted(self.concurrency.items())]
        conc = ", ".join(f"c={k} {v:.0%}" for k, v in shares if round(v * 100) > 0)
        out = f"{conc} of the busy time"
        if self.prompts:
            out += "; prompts " + ", ".join(f"{p} {v:.0%}" for p, v in self.prompts.items() if v > 0)
        if self.output_tokens is not None:
            out += f"; answers of {self.output_tokens:.0f} tokens (median)"
        return out

    def to_json(self) -> dict[str, object]:
        return {
            "source": self.source,
            "concurrency": {f"{k:g}": v for k, v in sorted(self.concurrency.items())},
            "prompts": dict(self.prompts),
            "idle": self.idle,
            "output_tokens": self.output_tokens,
            "requests": self.requests,
            "span_s": self.span_s,
        }


@dataclass(frozen=True, slots=True)
class Results:
    engines: tuple[EngineInfo, ...]
    baseline: str
    samples: tuple[Sample, ...]
    #: engine -> prompt key -> prompt tokens (tokenizer measurement and/or per-request usage)
    prompt_tokens: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    base_max_tokens: int | None = None
    base_prompt_len: str | None = None
    memory_budget_bytes: int | None = None
    min_repeats: int = 3
    #: practical significance: no difference smaller than this is a win or a loss, and a tie is "within ±this"
    #: at least (``--min-effect``; docs/bench.md)
    min_effect: float = MIN_EFFECT
    #: engine-side failures up to this share of an engine's requests are stated and left out of the figures;
    #: above it the data gate stops (``--max-error-rate``, as the live verdict's)
    max_error_rate: float = MAX_ERROR_RATE
    #: no noise floor is narrower than this, whatever the A/A pass measured
    min_floor: float = 0.01
    requests: tuple[Req, ...] = ()
    shared_prefix: bool = False
    #: mirrored live traffic (max tokens equal by construction; cells are observed concurrency)
    live: bool = False
    #: reasons the source adds to the parity gate (live: contention on a shared GPU)
    extra_parity: tuple[Reason, ...] = ()
    #: (engine, cell) -> why that cell cannot decide (an engine busy with requests the bench did not send)
    flags: Mapping[tuple[str, Cell], str] = field(default_factory=dict)
    #: the command that made the results (for the rerun advice); None when unknown
    command: str | None = None
    #: ``enginemeter report`` reading these same results (their files, the baseline, the flags that change the
    #: verdict; no ``--out``): advice that only reweighs them (``--traffic``) names it; None when unknown
    report_command: str | None = None
    #: launched engines whose GPU memory is a setting: engine -> (flag, share of the GPU) from its command line
    memory_share: Mapping[str, tuple[str, float]] = field(default_factory=dict)
    #: ``--accept-quantization-difference``: a declared precision difference passes parity with a caveat and
    #: the verdict is *discounted* (``Verdict.discounted`` says by what)
    accept_quantization_difference: bool = False
    #: parity checks a deliberate change explains (``enginemeter tune``: ``context`` when the swept flag sets it)
    expected: frozenset[str] = frozenset()
    #: engines measured with the GPU to themselves (time-shared, no other GPU process when launched): their GPU's
    #: installed memory is theirs to fill
    alone: frozenset[str] = frozenset()
    #: the engines ran one at a time (launched), not side by side
    time_shared: bool = False
    #: the traffic to decide for (``--traffic``); None: the answer per workload
    traffic: Traffic | None = None
    #: mirrored traffic: candidate -> regime step -> what the anytime-valid live verdict found
    live_findings: Mapping[str, Mapping[str, LiveFinding]] = field(default_factory=dict)
    #: engine -> why its weights are known to be random (dummy loads, generated models, ``--weights random``):
    #: outputs say nothing about correctness, and greedy agreement cannot be judged
    random_weights: Mapping[str, str] = field(default_factory=dict)
    #: candidate -> its token agreement and task accuracy against the baseline (``bench --agreement``, ``--eval``;
    #: ``proxy.bench.quality``): what the discount says was measured, and the bound a faster one may cross
    quality: Mapping[str, Quality] = field(default_factory=dict)

    def random_of(self, *engines: str) -> dict[str, str]:
        """Which of ``engines`` run random weights, and why, in the order given (``proxy.engines.quant``)."""
        return random_among(self.random_weights, *engines)
