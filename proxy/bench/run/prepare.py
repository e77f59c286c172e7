"""What every bench run does before it measures, resident or time-shared: the preflight (every engine probed and sent
one tiny request; ``PreflightError`` otherwise), the A/A pass's second name, the HTTP client and headers per engine,
the prompts' token counts, and the ``run`` and ``engine`` records that open the results file; and the quality
phases it runs after (``quality_for``: ``--agreement``, ``--eval``; ``proxy.bench.quality``)."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import httpx

from proxy.bench.quality.phases import QualityRun, quality_run
from proxy.bench.run.benchconfig import (
    PIN_HEADER,
    BenchConfig,
    Target,
    build_body,
    canonical_sampling,
    effective_sampling,
    sampling,
)
from proxy.bench.run.client import send_one
from proxy.bench.run.measure import real_engines
from proxy.bench.run.schedule import Plan, prompt_digests
from proxy.bench.run.targets import count_prompt_tokens
from proxy.bench.suite import Prompt
from proxy.gpu.device import gpu_facts
from proxy.redact import redact_argv, redact_command, redact_optional

#: 4: time-shared runs (``engine`` and ``launch`` records), each request's output text (hash and head), what
#: makes two runs comparable (``comparable``: suite digest, sampling, max tokens, GPU model and driver)
RESULTS_VERSION = 4


class PreflightError(RuntimeError):
    """An engine did not answer the probe or the one tiny request: the bench stops before it starts."""

    def __init__(self, engine: str, url: str | None, cause: str) -> None:
        url = redact_optional(url)
        super().__init__(f"engine {engine} ({url or 'via proxy'}): {cause}")
        self.engine, self.url, self.cause = engine, url, cause


def setup_aa(cfg: BenchConfig) -> Target | None:
    """The A/A pass of the baseline: an engine listed again under another name (same URL) beside a candidate,
    else — unless ``aa == "off"`` — a second pass of the baseline itself. Two names for one engine and nothing
    else is an A/A run: the second name is the candidate, judged against the second pass."""
    base = next(t for t in cfg.engines if t.name == cfg.baseline)
    others = [t for t in cfg.engines if t is not base]
    for t in others if len(others) > 1 else ():  # with one other engine, that one is the candidate: A vs A
        if t.url and t.url == base.url and not cfg.through and not t.launch:
            t.aa_of = base.name
            return t
    if cfg.aa == "off":
        return None
    twin = replace(base, name=f"{base.name}-aa", aa_of=base.name, pin=base.pin or base.name, info=dict(base.info))
    cfg.engines.append(twin)
    return twin


async def engine_info_via_proxy(cfg: BenchConfig) -> None:
    """Through the proxy: what it knows about each pinned engine (``/health`` ``engine_state``: kind,
    quantization, context per slot, slots) fills what probing the engine directly did not."""
    try:
        async with httpx.AsyncClient(timeout=5, trust_env=False) as c:
            doc = (await c.get(f"{cfg.through}/health")).json()
    except (httpx.HTTPError, ValueError) as exc:
        raise PreflightError("proxy", cfg.through, f"{type(exc).__name__}: {exc}"[:200]) from None
    states = ((doc.get("engine_state") or {}).get("engines") or {}) if isinstance(doc, dict) else {}
    for t in cfg.engines:
        st = states.get(t.pin or t.name)
        if not isinstance(st, dict):
            continue
        if t.kind is None and st.get("kind") in ("llamacpp", "sglang", "vllm", "openai"):
            t.kind = st["kind"]
        if not t.quantization and isinstance(st.get("quantization"), str):
            t.quantization, t.quantization_source = st["quantization"], "proxy engine info"
        t.context_per_slot = t.context_per_slot or st.get("context_length")
        t.slots = t.slots or st.get("slots")
        t.model = t.model or st.get("model")


async def preflight(
    cfg: BenchConfig,
    engines: Sequence[Target],
    clients: Mapping[str, httpx.AsyncClient],
    headers: Mapping[str, dict[str, str]],
) -> None:
    """Probe results checked, then one tiny request per engine (concurrently): the first failure raises."""
    for t in engines:
        if t.info.get("probe_error"):
            raise PreflightError(t.name, t.url, f"probe failed: {t.info['probe_error']}")

    async def one(t: Target) -> None:
        body = build_body(cfg, t, ({"role": "user", "content": "Say hi."},), 2, cold=False)
        o = await send_one(clients[t.name], json.dumps(body).encode(), headers[t.name])
        if not o.ok:
            raise PreflightError(t.name, t.url or cfg.through, f"test request failed: {o.error}")

    await asyncio.gather(*(one(t) for t in real_engines(engines)))


def client_for(cfg: BenchConfig, t: Target) -> httpx.AsyncClient:
    base_url = cfg.through or t.url
    if not base_url:
        raise ValueError(f"engine {t.name}: no URL and no --through")
    n = max(cfg.concurrency) + 2
    return httpx.AsyncClient(
        base_url=base_url,
        timeout=httpx.Timeout(cfg.timeout_s, connect=5),
        limits=httpx.Limits(max_connections=n, max_keepalive_connections=n),
        trust_env=False,
    )


def headers_for(cfg: BenchConfig, t: Target) -> dict[str, str]:
    return {"content-type": "application/json", **({PIN_HEADER: t.pin or t.name} if cfg.through else {})}


def engine_record(cfg: BenchConfig, t: Target, max_tokens_all: list[int]) -> dict[str, Any]:
    body = build_body(cfg, t, ({"role": "user", "content": "x"},), cfg.max_tokens, cold=False)
    eff, known = effective_sampling(cfg, t)
    dropped: list[str] | None = known
    if cfg.through and t.kind is None:  # the proxy maps it for a kind we do not know here
        eff, dropped = canonical_sampling(body), None
    return {
        "name": t.name,
        "url": redact_optional(t.url),
        "kind": t.kind,
        "model": t.model,
        "quantization": t.quantization,
        "quantization_source": t.quantization_source,
        "slots": t.slots,
        "context_per_slot": t.context_per_slot,
        "aa_of": t.aa_of,
        "launch": redact_optional(t.launch),
        "info": t.info,
        "sampling": eff,
        "dropped": dropped,
        "body_example": {k: v for k, v in body.items() if k != "messages"},
        "max_tokens": max_tokens_all,
    }


def shared_llamacpp_servers(cfg: BenchConfig) -> list[str]:
    """Names of llama.cpp targets that share their URL with another target (an A/A twin listed by name)."""
    by_url: dict[str, list[str]] = {}
    for t in cfg.engines:
        if t.url and t.kind == "llamacpp":
            by_url.setdefault(t.url.rstrip("/"), []).append(t.name)
    return [n for names in by_url.values() if len(names) > 1 for n in names]


async def count_tokens(cfg: BenchConfig, engines: Sequence[Target], prompts: Sequence[Prompt]) -> list[dict[str, Any]]:
    """Prompt tokens with each engine's own tokenizer, before anything is generated (``prompt_tokens`` records)."""
    out: list[dict[str, Any]] = []
    for p in prompts:
        counts = await asyncio.gather(*(count_prompt_tokens(t, cfg.model or t.model, p.messages) for t in engines))
        for t, (n, method) in zip(engines, counts, strict=True):
            out.append(
                {
                    "type": "prompt_tokens",
                    "engine": t.name,
                    "prompt": p.id,
                    "length": p.length,
                    "lang": p.lang,
                    "tokens": n,
                    "method": method,
                }
            )
    return out


def run_record(
    cfg: BenchConfig, run_id: str, t_start: float, pl: Plan, engines: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    cfg_rec = _masked({k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items() if k != "engines"})
    cfg_rec["argv"] = redact_argv(cfg.argv)  # a secret flag's value is the word after it
    sent = {k: v for k, v in sampling(cfg, cfg.max_tokens).items() if k != "max_tokens"}
    return {
        "type": "run",
        "version": RESULTS_VERSION,
        "run_id": run_id,
        "started": t_start,
        "config": cfg_rec,
        "engines": list(engines),
        "baseline": cfg.baseline,
        "through": redact_optional(cfg.through),
        "base": {"concurrency": 1, "max_tokens": cfg.max_tokens, "prompt_len": cfg.base_prompt_len},
        "cells": [asdict(c) for c in pl.cells],
        "prompts": [{"id": p.id, "lang": p.lang, "length": p.length} for p in pl.prompts],
        "memory_budget_bytes": cfg.memory_budget_bytes,
        "goodput": cfg.goodput,
        "python": sys.version.split()[0],
        "argv": cfg_rec["argv"] or None,
        "min_effect": cfg.min_effect,
        "max_error_rate": cfg.max_error_rate,
        "time_shared": cfg.time_shared,
        "protocol": {
            "cell_warmup": "one wave per cell and engine server",
            "order": "one engine at a time" if cfg.time_shared else "williams",
            "cold_prefixes": "seeded" if pl.seeded else "random per run",
        },
        # what a later run must share for ``report --results A B`` to join the two (proxy.bench.verdict.merge)
        "comparable": {
            "suite": cfg.suite,
            "prompts": prompt_digests(pl.prompts),
            "sampling": sent,
            "max_tokens": cfg.max_tokens,
            "prompt_len": cfg.base_prompt_len,
            "gpu": gpu_facts(),
        },
    }


def _masked(v: Any) -> Any:
    """``v`` (the run's settings as JSON) with every string's secrets masked (``proxy.redact``): the command line,
    ``--through``, ``--metrics-url``, tune's command."""
    if isinstance(v, str):
        return redact_command(v)
    if isinstance(v, Mapping):
        return {k: _masked(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_masked(x) for x in v]
    return v


def quality_for(
    cfg: BenchConfig, prompts: Sequence[Prompt], write: Callable[[dict[str, Any]], None], say: Callable[[str], None]
) -> QualityRun | None:
    """The run's quality phases (None without ``--agreement`` and ``--eval``). The eval sends each engine the body
    the timed cells send it (the same sampling, mapped per kind), not streamed and free to stop at EOS."""

    def body_for(name: str, messages: Sequence[Mapping[str, str]], max_tokens: int) -> tuple[str, dict[str, Any]]:
        t = next(x for x in cfg.engines if x.name == name)
        body = build_body(cfg, t, messages, max_tokens, cold=False)
        for k in ("stream_options", "ignore_eos"):
            body.pop(k, None)
        return "/v1/chat/completions", {**body, "stream": False}

    return quality_run(cfg.agreement, cfg.eval_file, [p.messages for p in prompts], body_for, write, say)


async def quality_engine(
    q: QualityRun | None, cfg: BenchConfig, t: Target, client: httpx.AsyncClient, headers: Mapping[str, str]
) -> None:
    """Both quality phases on one engine (the baseline first); the resident A/A pass (the same server) is skipped."""
    base = next(x for x in cfg.engines if x.name == cfg.baseline)
    if q is None or (t.aa_of and t.url == base.url and not cfg.time_shared):
        return
    model = cfg.model or t.model
    await q.engine(
        t.name, t.kind, model, t.url, client, headers, baseline=t.name == cfg.baseline, timeout_s=cfg.timeout_s
    )
