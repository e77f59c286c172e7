"""What the bench asks each engine directly: probe (kind, model, slots, context per slot, quantization),
prompt-token counts with the engine's own tokenizer, cache flush — and quantization spelled one way.

These four (``probe``, ``count_prompt_tokens``, ``flush_cache``, ``quantization``) are the bench's view of the
engine dialects; their bodies move to ``proxy/engines/`` (one module per engine kind) with the same names and
signatures. ``quant_key`` is the one quantization normalization the verdict uses.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from proxy.bench.client import CHAT_PATH
from proxy.bench.config import Target
from proxy.server.upstream import detect_kind

_QUANT = re.compile(
    r"(?i)(?<![a-z0-9])(i?q[1-8](?:_[a-z0-9]+)*|f16|bf16|f32|fp16|fp8|fp32|int8|int4|awq|gptq|mxfp4|nvfp4)(?![a-z0-9])"
)
#: llama.cpp's ``llama_ftype`` (GGUF ``general.file_type``, ``/v1/models`` ``meta.ftype``) by number
FTYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
          12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
          32: "BF16"}  # fmt: skip
_ALIASES = {"float16": "f16", "half": "f16", "fp16": "f16", "mostly_f16": "f16", "torch.float16": "f16",
            "bfloat16": "bf16", "mostly_bf16": "bf16", "torch.bfloat16": "bf16", "float32": "f32", "fp32": "f32",
            "float": "f32", "all_f32": "f32", "mostly_q8_0": "q8_0", "mostly_q4_k_m": "q4_k_m"}  # fmt: skip


def quant_key(q: str | None) -> str | None:
    """One spelling per quantization: F16 = FP16 = float16 = half -> ``f16``; BF16 stays ``bf16`` (a different
    format: same size, other rounding); ``Q4_K_M`` -> ``q4_k_m``."""
    if q is None or not str(q).strip():
        return None
    k = str(q).strip().lower().replace(" - ", "_").replace(" ", "_").replace("-", "_")
    return _ALIASES.get(k, k)


def quantization(
    t: Target, props: Mapping[str, Any] | None = None, model_meta: Mapping[str, Any] | None = None
) -> None:
    """Fill ``t.quantization`` (unless declared) from what the engine says: SGLang's ``quantization``/``dtype``,
    llama.cpp's ``model_ftype`` or ``/v1/models`` ``meta.ftype``, the GGUF header of a local model file, and
    last a quantization tag in the model's file name."""
    if t.quantization:
        return
    props = props or {}
    meta = model_meta or {}
    for src, v in (("engine info", props.get("quantization")), ("engine info", props.get("model_ftype"))):
        if isinstance(v, str) and v and v != "auto":
            t.quantization, t.quantization_source = v, src
            return
    ft = meta.get("ftype")
    if isinstance(ft, int) and not isinstance(ft, bool):
        t.quantization, t.quantization_source = FTYPES.get(ft, f"ftype{ft}"), "engine info"
        return
    if isinstance(ft, str) and ft:
        t.quantization, t.quantization_source = ft, "engine info"
        return
    where = str(t.info.get("model_path") or "")
    if where and Path(where).is_file():
        ftype = _gguf_file_type(Path(where))
        if ftype is not None:
            t.quantization, t.quantization_source = FTYPES.get(ftype, f"ftype{ftype}"), "GGUF header"
            return
    dtype = props.get("dtype")
    if isinstance(dtype, str) and dtype not in ("", "auto"):
        t.quantization, t.quantization_source = dtype, "engine info (dtype)"
        return
    m = _QUANT.search(Path(where).name if where else "") or _QUANT.search(t.model or "")
    if m:
        t.quantization, t.quantization_source = m.group(1).upper(), "model name"


def _gguf_file_type(path: Path) -> int | None:
    try:
        from proxy.embedded import read_gguf_metadata

        meta = read_gguf_metadata(path)
    except Exception:  # not a GGUF, unreadable, gguf extras absent: the header says nothing
        return None
    v = meta.get("general.file_type")
    return int(v[1]) if v is not None and isinstance(v[1], int) else None


async def probe(t: Target, timeout: float = 5.0) -> None:
    if not t.url:
        return
    async with httpx.AsyncClient(base_url=t.url, timeout=timeout, trust_env=False) as c:
        try:
            if t.kind is None:
                t.kind = await detect_kind(c, timeout)
            r = await c.get("/v1/models")
            card: dict[str, Any] = {}
            if r.status_code == 200:
                data = r.json().get("data") or []
                if data and isinstance(data[0], dict):
                    card = data[0]
                    if t.model is None:
                        t.model = str(card.get("id"))
            meta = card.get("meta") if isinstance(card.get("meta"), dict) else {}
            if isinstance(card.get("max_model_len"), int):
                t.context_per_slot = card["max_model_len"]
            props: dict[str, Any] = {}
            if t.kind == "llamacpp":
                r = await c.get("/props")
                if r.status_code == 200:
                    props = r.json()
                    t.slots = props.get("total_slots") if isinstance(props.get("total_slots"), int) else None
                    t.info["model_path"] = str(props.get("model_path") or "")
                    n_ctx = (props.get("default_generation_settings") or {}).get("n_ctx")
                    t.info["n_ctx"] = n_ctx
                    if isinstance(n_ctx, int):
                        t.context_per_slot = n_ctx
            elif t.kind == "sglang":
                r = await c.get("/server_info")
                if r.status_code == 200:
                    props = r.json()
                    t.info["dtype"] = props.get("dtype")
                    t.info["model_path"] = str(props.get("model_path") or "")
                    if isinstance(props.get("context_length"), int) and t.context_per_slot is None:
                        t.context_per_slot = props["context_length"]
                    mrr = props.get("max_running_requests")
                    t.slots = mrr if isinstance(mrr, int) else t.slots
            quantization(t, props, meta)
        except (httpx.HTTPError, ValueError) as exc:
            t.info["probe_error"] = f"{type(exc).__name__}: {exc}"[:200]


async def count_prompt_tokens(
    t: Target, model: str | None, messages: Sequence[Mapping[str, str]]
) -> tuple[int | None, str]:
    """Prompt tokens as the engine would count them for a chat completion, without generating."""
    if not t.url:
        return None, "no engine URL"
    msgs = [dict(m) for m in messages]
    async with httpx.AsyncClient(base_url=t.url, timeout=30, trust_env=False) as c:
        try:
            if t.kind == "llamacpp":
                r = await c.post(f"{CHAT_PATH}/input_tokens", json={"model": model, "messages": msgs})
                if r.status_code == 200 and isinstance(r.json().get("input_tokens"), int):
                    return int(r.json()["input_tokens"]), "input_tokens"
                r = await c.post("/apply-template", json={"messages": msgs})
                r.raise_for_status()
                prompt = r.json()["prompt"]
                r = await c.post("/tokenize", json={"content": prompt, "add_special": True, "parse_special": True})
                r.raise_for_status()
                return len(r.json()["tokens"]), "apply-template+tokenize"
            if t.kind == "sglang":
                r = await c.post("/v1/tokenize", json={"model": model, "messages": msgs})
                if r.status_code == 200:
                    doc = r.json()
                    n = doc.get("count", len(doc.get("tokens") or []))
                    return int(n), "v1/tokenize"
                return None, f"v1/tokenize HTTP {r.status_code}"
            if t.kind == "vllm":
                r = await c.post("/tokenize", json={"model": model, "messages": msgs, "add_generation_prompt": True})
                if r.status_code == 200:
                    return int(r.json()["count"]), "tokenize"
                return None, f"tokenize HTTP {r.status_code}"
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            return None, f"{type(exc).__name__}: {exc}"[:120]
    return None, f"no tokenizer endpoint for kind {t.kind}"


async def flush_cache(t: Target) -> str | None:
    if t.kind != "sglang" or not t.url:
        return None
    async with httpx.AsyncClient(base_url=t.url, timeout=30, trust_env=False) as c:
        try:
            r = await c.post("/flush_cache")
            return f"flush_cache HTTP {r.status_code}"
        except httpx.HTTPError as exc:
            return f"flush_cache failed: {type(exc).__name__}"
