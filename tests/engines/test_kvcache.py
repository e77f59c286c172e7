"""The KV-cache formula (``proxy/engines/kvcache.py``): the worked 27B example of docs/diagnose.md, GQA, mixed cache types,
per-slot shares. The formula against real llama-server logs is tests/core/test_diagnose.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from proxy.engines.kvcache import Shape, element_bytes, hf_shape, kv_estimate

DOC = Path(__file__).resolve().parents[2] / "docs" / "diagnose.md"
GQA_27B = Shape(n_layer=62, n_head=32, n_head_kv=8, head_dim_k=128, head_dim_v=128, source="27B GQA")


@pytest.mark.parametrize(
    ("ctx", "np", "cache", "total"),
    [(8192, 1, "f16", 2_080_374_784), (32768, 4, "f16", 8_321_499_136), (131072, 4, "f16", 33_285_996_544),
     (131072, 4, "q8_0", 17_683_185_664)],
)  # fmt: skip
def test_the_worked_27b_example_of_the_docs(ctx: int, np: int, cache: str, total: int) -> None:
    k = kv_estimate(GQA_27B, ctx, "-c", cache, cache, slots=np, unified=False)
    assert k is not None and k.bytes == total and k.per_slot_bytes == total // np
    assert f"{total:,} B" in DOC.read_text()  # the doc's table and output say the same


def test_gqa_counts_kv_heads_and_k_and_v_may_differ() -> None:
    mha = Shape(4, 8, 8, 32, 32, "mha")
    gqa = Shape(4, 8, 2, 32, 32, "gqa")
    a, b = kv_estimate(mha, 1024, "c"), kv_estimate(gqa, 1024, "c")
    assert a is not None and b is not None and a.bytes == 4 * b.bytes
    mixed = kv_estimate(gqa, 1024, "c", "q8_0", "f16")
    assert mixed is not None and mixed.bytes == round(4 * 2 * (32 * 34 / 32 + 32 * 2) * 1024)
    assert "q8_0" in mixed.formula and "f16" in mixed.formula
    unified = kv_estimate(gqa, 4096, "c", slots=4, unified=True)
    assert unified is not None and unified.per_slot_bytes is None  # one pool: no fixed share
    assert kv_estimate(gqa, 1024, "c", "q3_weird") is None
    assert element_bytes("torch.bfloat16") == 2.0


def test_an_hf_config_gives_the_shape() -> None:
    cfg = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
    s = hf_shape(cfg, "config.json")
    assert (s.n_layer, s.n_head_kv, s.head_dim_k) == (32, 8, 128)
    k = kv_estimate(s, 8, "c")
    assert k is not None and re.search(r"\b8 KV heads\b", k.formula)
