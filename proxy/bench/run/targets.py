"""What the bench asks each engine directly: probe (kind, model, slots, context per slot, quantization),
prompt-token counts with the engine's own tokenizer, cache flush. Each is answered by the engine's dialect in
``proxy/engines/`` (one module per engine kind); this module only fills the bench's ``Target`` from it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from proxy import engines
from proxy.bench.run.benchconfig import Target
from proxy.embedded.gguf_meta import read_gguf_metadata
from proxy.engines import quant_from_name
from proxy.engines.llamacpp import ftype_name
from proxy.redact import redact_command


def quantization(
    t: Target, props: Mapping[str, Any] | None = None, model_meta: Mapping[str, Any] | None = None
) -> None:
    """Fill ``t.quantization`` (unless declared) from what the engine says: SGLang's ``quantization``/``dtype``,
    llama.cpp's ``model_ftype`` or ``/v1/models`` ``meta.ftype``, the GGUF header of a local model file, and
    last a quantization tag in the model's file name."""
    if t.quantization:
        return
    props = dict(props or {})
    if str(props.get("weights_format") or "").lower() == "gguf":
        # a GGUF load: the file's header (or name, below) says the precision, not a dialect's guess from afar
        props["quantization"] = "gguf"
    meta = model_meta or {}
    for src, v in (("engine info", props.get("quantization")), ("engine info", props.get("model_ftype"))):
        # "gguf" (SGLang and vLLM loading a llama.cpp file) names the format, not the precision: the file says it
        if isinstance(v, str) and v and v != "auto" and v.lower() != "gguf":
            t.quantization, t.quantization_source = v, src
            return
    named = ftype_name(meta.get("ftype"))
    if named:
        t.quantization, t.quantization_source = named, "engine info"
        return
    where = str(t.info.get("model_path") or "")
    if where and Path(where).is_file():
        ftype = _gguf_file_type(Path(where))
        if ftype is not None:
            says = " (the engine says gguf)" if str(props.get("quantization") or "").lower() == "gguf" else ""
            t.quantization, t.quantization_source = ftype_name(ftype), f"GGUF header{says}"
            return
    dtype = props.get("dtype")
    if isinstance(dtype, str) and dtype not in ("", "auto"):
        t.quantization, t.quantization_source = dtype, "engine info (dtype)"
        return
    named = quant_from_name(Path(where).name if where else None, t.model)
    if named:
        t.quantization, t.quantization_source = named, "model name"


def _gguf_file_type(path: Path) -> int | None:
    v = _gguf_meta(path).get("general.file_type")
    return int(v[1]) if v is not None and isinstance(v[1], int) else None


def _gguf_meta(path: Path) -> Mapping[str, Any]:
    try:
        return read_gguf_metadata(path)
    except Exception:  # not a GGUF, unreadable, gguf extras absent: the header says nothing
        return {}


def gguf_name(t: Target) -> None:
    """``general.name`` of a local GGUF the engine loads, into ``t.info`` (a generated model names itself random)."""
    where = str(t.info.get("model_path") or "")
    if where.endswith(".gguf") and Path(where).is_file():
        v = _gguf_meta(Path(where)).get("general.name")
        if v is not None and isinstance(v[1], str):
            t.info["gguf_name"] = v[1]


async def probe(t: Target, timeout: float = 5.0, *, log: Path | None = None) -> None:
    """Kind, served model, slots, context per slot and quantization from the engine's dialect
    (``proxy.engines``); a declared quantization wins, the GGUF header or the model's name is the last resort.
    ``log``: a launched engine's log, whose start-up lines give its KV pool in tokens and bytes (what a memory
    share's excess costs in tokens: ``proxy.bench.verdict.gates.memorygate``)."""
    if not t.url:
        return
    async with httpx.AsyncClient(base_url=t.url, timeout=timeout, trust_env=False) as c:
        p = await engines.probe(c, timeout, kind=t.kind, model=t.model, full=True)
    t.kind, t.model = p.kind, p.model
    if p.error:
        t.info["probe_error"] = redact_command(p.error)
    if p.context_length is not None:
        t.context_per_slot = p.context_length  # the dialects report llama.cpp's per slot
    f = p.facts
    if f is not None:
        t.slots = t.slots or f.slots
        t.info.update(
            {
                k: v
                for k, v in (
                    ("model_path", f.model_path),
                    ("context_length", f.context_length),
                    ("build", f.build),
                    ("kv_pool_tokens", f.kv_pool_tokens),
                )
                if v is not None
            }
        )
    quantization(t, {"quantization": f.quantization, "weights_format": f.weights_format} if f is not None else None)
    gguf_name(t)
    if f is not None and f.weights_format:
        t.info["weights_format"] = f.weights_format
    if f is not None and f.memory_share is not None:
        t.info["memory_share"] = f.memory_share
    if log is not None:
        logged = engines.started(log, t.kind)
        if logged.kv_cache_tokens and logged.kv_cache_bytes:  # one pool, both from the same line
            t.info["kv_pool_tokens"] = t.info.get("kv_pool_tokens") or logged.kv_cache_tokens
            t.info["kv_cache_bytes"] = logged.kv_cache_bytes


async def count_prompt_tokens(
    t: Target, model: str | None, messages: Sequence[Mapping[str, str]]
) -> tuple[int | None, str]:
    """Prompt tokens as the engine would count them for a chat completion, without generating."""
    if not t.url:
        return None, "no engine URL"
    async with httpx.AsyncClient(base_url=t.url, timeout=30, trust_env=False) as c:
        n = await engines.dialect(t.kind).count_prompt_tokens(c, model, messages)
    return n.tokens, n.method


async def flush_cache(t: Target) -> str | None:
    """Empty the engine's prompt cache where its kind can (llama.cpp slot erase, SGLang ``/flush_cache``, vLLM
    ``/reset_prefix_cache``); a note saying what happened."""
    if not t.url:
        return None
    async with httpx.AsyncClient(base_url=t.url, timeout=30, trust_env=False) as c:
        return await engines.dialect(t.kind).flush_cache(c)
