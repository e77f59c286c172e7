"""Random weights for an HF directory, written once as one bf16 ``model.safetensors`` (numpy only: the same script
runs on the GPU machine's image and here). Every engine of the same-weights run (issue 48) loads THESE weights:
vLLM and SGLang the checkpoint (``--quantization fp8``: FP8 on the fly), llama.cpp the GGUF that its own
``convert_hf_to_gguf.py`` makes from it (F16, the reference) and ``llama-quantize`` (Q4_K_M, the baseline).

    python3 scripts/gpu/write_weights.py HF_DIR [--seed 48] [--logit-scale 4] [--workers 16]

The shape is HF_DIR/config.json's (a ``LlamaForCausalLM``: scripts/gpu/make_model_dir.py). The values are what a
fresh HF Llama gets (``LlamaPreTrainedModel._init_weights``): every linear and the embedding N(0, initializer_range
0.02), the RMSNorm weights 1 -- drawn per tensor from a seed of its own (``seed``, the tensor's index), so the file
is the same on every machine and every run -- but for the final norm's weight, ``--logit-scale`` (4): a multiplier
of every logit (as ``python -m proxy.embedded model --logit-scale``). HF's init alone gives logits of spread
0.02 x sqrt(hidden) (1.1 at hidden 3072): a next-token distribution of ~9.8 nats over 32,000 tokens, the top token
0.2 % likely, so any two engines "disagree" on a coin toss and agree to a KL of ~1e-6. At 4 the spread is ~4.4:
~3.5 nats, the top token ~30 % likely (Gaussian logits), nearer a trained model's, where the precision's effect on
the top token can show. Written in place through a memory map by WORKERS processes (a 3B shape:
6 GB in seconds on 16 cores); its sha256 is not taken (minutes): the seed, the shape and the header are the
identity, printed and written to HF_DIR/weights.json.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

ALIGN = 8


def tensors(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape as (out, in), init) of a LlamaForCausalLM, in the order HF names them."""
    h, ff, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv, v = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd, cfg["vocab_size"]
    out: list[tuple[str, tuple[int, ...], str]] = [("model.embed_tokens.weight", (v, h), "normal")]
    for i in range(n):
        p = f"model.layers.{i}"
        out += [
            (f"{p}.input_layernorm.weight", (h,), "ones"),
            (f"{p}.self_attn.q_proj.weight", (q, h), "normal"),
            (f"{p}.self_attn.k_proj.weight", (kv, h), "normal"),
            (f"{p}.self_attn.v_proj.weight", (kv, h), "normal"),
            (f"{p}.self_attn.o_proj.weight", (h, q), "normal"),
            (f"{p}.post_attention_layernorm.weight", (h,), "ones"),
            (f"{p}.mlp.gate_proj.weight", (ff, h), "normal"),
            (f"{p}.mlp.up_proj.weight", (ff, h), "normal"),
            (f"{p}.mlp.down_proj.weight", (h, ff), "normal"),
        ]
    out.append(("model.norm.weight", (h,), "scale"))
    if not cfg.get("tie_word_embeddings"):
        out.append(("lm_head.weight", (v, h), "normal"))
    return out


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounded to nearest even, as torch does."""
    u = x.view(np.uint32)
    return ((u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) >> 16).astype(np.uint16)


def fill(path: str, offset: int, shape: tuple[int, ...], init: str, std: float, seed: int, one: float = 1.0) -> float:
    """One tensor into the file's memory map; the seconds it took."""
    t0 = time.perf_counter()
    count = int(np.prod(shape))
    mm = np.memmap(path, dtype=np.uint16, mode="r+", offset=offset, shape=(count,))
    if init in ("ones", "scale"):
        mm[:] = to_bf16(np.full(1, 1.0 if init == "ones" else one, dtype=np.float32))[0]
    else:
        rng = np.random.default_rng(seed)
        step = 1 << 24
        for s in range(0, count, step):
            n = min(step, count - s)
            mm[s : s + n] = to_bf16(rng.standard_normal(n, dtype=np.float32) * np.float32(std))
    mm.flush()
    del mm
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("hf_dir", type=Path)
    ap.add_argument("--seed", type=int, default=48)
    ap.add_argument("--logit-scale", type=float, default=4.0, help="the final norm's weight (default 4)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args()
    cfg = json.loads((a.hf_dir / "config.json").read_text())
    std = float(cfg.get("initializer_range", 0.02))
    specs = tensors(cfg)
    header: dict[str, object] = {"__metadata__": {"format": "pt", "seed": str(a.seed), "init": f"normal(0,{std})"}}
    pos = 0
    for name, shape, _ in specs:
        nbytes = 2 * int(np.prod(shape))
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % ALIGN)
    path = a.hf_dir / "model.safetensors"
    t0 = time.perf_counter()
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        fh.truncate(8 + len(raw) + pos)
    base = 8 + len(raw)
    offsets = [base + int(header[name]["data_offsets"][0]) for name, _, _ in specs]  # type: ignore[index]
    with ProcessPoolExecutor(max(1, a.workers)) as pool:
        list(pool.map(fill, [str(path)] * len(specs), offsets, [s for _, s, _ in specs], [i for _, _, i in specs],
                      [std] * len(specs), [a.seed * 100_003 + k for k in range(len(specs))],
                      [a.logit_scale] * len(specs)))  # fmt: skip
    params = sum(int(np.prod(s)) for _, s, _ in specs)
    doc = {
        "file": path.name,
        "bytes": path.stat().st_size,
        "parameters": params,
        "tensors": len(specs),
        "dtype": "bf16",
        "seed": a.seed,
        "init": f"normal(0, {std}) for every linear and the embedding; RMSNorm weights 1 (HF LlamaPreTrainedModel)"
        f" but the final norm's: {a.logit_scale} (--logit-scale)",
        "logit_scale": a.logit_scale,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    (a.hf_dir / "weights.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
