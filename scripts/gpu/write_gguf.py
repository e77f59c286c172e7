"""Issue 11: the llama.cpp side of the one model -- a random-weight GGUF whose metadata (llama.* shape keys,
tokenizer.*, chat template) is copied from the vocab-only GGUF that llama.cpp's ``convert_hf_to_gguf.py
--vocab-only`` made from the same HF directory that SGLang and vLLM load.

    python3 scripts/gpu/write_gguf.py VOCAB.gguf OUT.gguf [--layers N --embd N --ff N --heads N --kv-heads N]

Without overrides the shape is the vocab file's (Mistral-7B class: 4096 x 32 layers, 32 heads, 8 KV heads,
ff 14336, vocab 32000): 14.5 GB in F16. Overrides make a tiny model for CPU dry runs.
Weights: one random block tiled over each matrix (fast; the numbers only need to be finite), norms 1.
Needs numpy and the ``gguf`` package; ``proxy.embedded.read_gguf_metadata`` reads the vocab file.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from proxy.embedded import read_gguf_metadata  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("vocab", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--embd", type=int)
    ap.add_argument("--ff", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--kv-heads", type=int)
    ap.add_argument("--ctx", type=int)
    a = ap.parse_args()

    import gguf
    import numpy as np

    t0 = time.monotonic()
    meta = read_gguf_metadata(a.vocab)
    arch = meta["general.architecture"][1]
    assert arch == "llama", arch
    over = {
        f"{arch}.block_count": a.layers,
        f"{arch}.embedding_length": a.embd,
        f"{arch}.feed_forward_length": a.ff,
        f"{arch}.attention.head_count": a.heads,
        f"{arch}.attention.head_count_kv": a.kv_heads,
        f"{arch}.context_length": a.ctx,
    }
    if a.embd and a.heads:
        over[f"{arch}.attention.key_length"] = a.embd // a.heads
        over[f"{arch}.attention.value_length"] = a.embd // a.heads
        over[f"{arch}.rope.dimension_count"] = a.embd // a.heads

    def val(key: str) -> int:
        v = over.get(key)
        return int(v if v is not None else meta[key][1])

    n_layer, n_embd, n_ff = (
        val(f"{arch}.block_count"),
        val(f"{arch}.embedding_length"),
        val(f"{arch}.feed_forward_length"),
    )
    n_head, n_head_kv = val(f"{arch}.attention.head_count"), val(f"{arch}.attention.head_count_kv")
    head_dim = val(f"{arch}.attention.key_length")
    n_vocab = len(meta["tokenizer.ggml.tokens"][1])
    n_kv = n_head_kv * head_dim

    a.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = a.out.with_name(a.out.name + ".tmp")
    w = gguf.GGUFWriter(tmp, arch)
    for key, (vtype, v, sub) in meta.items():
        if key in ("general.architecture", "GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"):
            continue
        if key in over and over[key] is not None:
            v = over[key]
        if key == "general.name":
            v = "enginemeter-m7b-random"
        sub_type = gguf.GGUFValueType(sub) if sub is not None else None
        w.add_key_value(key, v, gguf.GGUFValueType(vtype), sub_type=sub_type)

    specs: list[tuple[str, tuple[int, ...], bool]] = [
        ("token_embd.weight", (n_vocab, n_embd), True),
        ("output_norm.weight", (n_embd,), False),
        ("output.weight", (n_vocab, n_embd), True),
    ]
    for i in range(n_layer):
        b = f"blk.{i}"
        specs += [
            (f"{b}.attn_norm.weight", (n_embd,), False),
            (f"{b}.attn_q.weight", (n_head * head_dim, n_embd), True),
            (f"{b}.attn_k.weight", (n_kv, n_embd), True),
            (f"{b}.attn_v.weight", (n_kv, n_embd), True),
            (f"{b}.attn_output.weight", (n_embd, n_head * head_dim), True),
            (f"{b}.ffn_norm.weight", (n_embd,), False),
            (f"{b}.ffn_gate.weight", (n_ff, n_embd), True),
            (f"{b}.ffn_up.weight", (n_ff, n_embd), True),
            (f"{b}.ffn_down.weight", (n_embd, n_ff), True),
        ]
    for name, shape, mat in specs:
        dt = np.dtype(np.float16 if mat else np.float32)
        n = dt.itemsize
        for d in shape:
            n *= d
        w.add_tensor_info(name, shape, dt, n)

    rng = np.random.default_rng(0)
    scale = 0.02 * 3**0.5
    block = rng.uniform(-scale, scale, size=(4096, 1024)).astype(np.float16)

    def tensor(shape: tuple[int, ...], mat: bool) -> np.ndarray:
        if not mat:
            return np.ones(shape, dtype=np.float32)
        rows, cols = shape
        b = block[: min(rows, 4096), : min(cols, 1024)]
        full = np.tile(b, (-(-rows // b.shape[0]), -(-cols // b.shape[1])))[:rows, :cols]
        return np.ascontiguousarray(full)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _name, shape, mat in specs:
        w.write_tensor_data(tensor(shape, mat))
    w.close()
    tmp.replace(a.out)
    print(
        f"write_gguf: {a.out} {a.out.stat().st_size / 1e9:.2f} GB (layers {n_layer}, embd {n_embd}, ff {n_ff}, "
        f"heads {n_head}/{n_head_kv}, vocab {n_vocab}) in {time.monotonic() - t0:.1f} s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
