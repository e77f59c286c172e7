"""The model's attention shape and the KV-cache formula (``enginemeter diagnose``, docs/diagnose.md).

    KV bytes = 2 (K and V) x n_layer x n_head_kv x head_dim x context x bytes per element

``n_head_kv`` is the number of KV heads (GQA: below the query heads); ``context`` the tokens the engine
allocated (llama.cpp: the whole ``-c``, each slot's share together, one pool with ``-kvu``); bytes per element
are ggml's block sizes for llama.cpp's cache types (``-ctk``/``-ctv``) and the torch dtypes' for SGLang/vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proxy.engines.llamacpp import CACHE_TYPE_BYTES

_TORCH_BYTES = {"float32": 4.0, "float16": 2.0, "half": 2.0, "bfloat16": 2.0, "fp8_e4m3": 1.0, "fp8_e5m2": 1.0,
                "fp8": 1.0, "auto": 2.0}  # fmt: skip


@dataclass(frozen=True)
class Shape:
    """The attention shape the KV formula needs, and where it came from."""

    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    source: str
    sliding_window: int | None = None
    n_params: int | None = None
    weights_bytes: int | None = None
    file_type: str | None = None


@dataclass(frozen=True)
class KvEstimate:
    bytes: int
    context: int
    context_source: str
    cache_type_k: str
    cache_type_v: str
    formula: str
    slots: int | None = None
    unified: bool | None = None
    per_slot_bytes: int | None = None
    #: what the engine says it allocated, and that over the formula
    reported_bytes: int | None = None
    reported_ratio: float | None = None
    note: str | None = None


def hf_shape(cfg: dict[str, Any], source: str) -> Shape:
    cfg = cfg.get("text_config", cfg)
    n_head = int(cfg["num_attention_heads"])
    head = int(cfg.get("head_dim") or cfg["hidden_size"] // n_head)
    n_head_kv = int(cfg.get("num_key_value_heads") or n_head)
    return Shape(int(cfg["num_hidden_layers"]), n_head, n_head_kv, head, head, source, cfg.get("sliding_window"))


def element_bytes(cache_type: str) -> float | None:
    t = cache_type.lower().removeprefix("torch.")
    return CACHE_TYPE_BYTES.get(t) or _TORCH_BYTES.get(t)


def kv_estimate(
    shape: Shape,
    context: int,
    context_source: str,
    type_k: str = "f16",
    type_v: str = "f16",
    *,
    slots: int | None = None,
    unified: bool | None = None,
    reported: int | None = None,
) -> KvEstimate | None:
    """2 x n_layer x n_head_kv x head_dim x context x bytes per element (K and V may differ in type)."""
    bk, bv = element_bytes(type_k), element_bytes(type_v)
    if bk is None or bv is None:
        return None
    per_token = shape.n_layer * shape.n_head_kv * (shape.head_dim_k * bk + shape.head_dim_v * bv)
    total = round(per_token * context)
    same = type_k == type_v and shape.head_dim_k == shape.head_dim_v
    formula = (
        f"2 x {shape.n_layer} layers x {shape.n_head_kv} KV heads x {shape.head_dim_k} head dim x {context} tokens "
        f"x {bk:g} B ({type_k})"
        if same
        else f"{shape.n_layer} layers x {shape.n_head_kv} KV heads x ({shape.head_dim_k} x {bk:g} B ({type_k}) + "
        f"{shape.head_dim_v} x {bv:g} B ({type_v})) x {context} tokens"
    )
    per_slot = round(total / slots) if slots and not unified else None
    note = None
    if shape.sliding_window:
        note = f"sliding-window attention ({shape.sliding_window} tokens) keeps a smaller cache for those layers"
    ratio = round(reported / total, 4) if reported and total else None
    return KvEstimate(
        total, context, context_source, type_k, type_v, formula, slots, unified, per_slot, reported, ratio, note
    )
