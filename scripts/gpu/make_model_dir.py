"""The one model every engine of a GPU run loads, built HERE (needs transformers + sentencepiece).

    /tmp/tfenv/bin/python scripts/gpu/make_model_dir.py MISTRAL_COMMON.whl OUT_DIR [--shape 27b|3b|7b|smoke]

Writes an HF directory: ``config.json`` of a Llama shape (``SHAPES``; 27b: hidden 5120, 58 layers, 40 query
heads of 128, 8 KV heads, ff 25600, vocab 32000, 262,144 positions -- the shape of scripts/gpu/README.md; 7b:
Mistral-7B's, the runs of 2026-12-02/03), the real Mistral-7B v1 SentencePiece tokenizer from the PyPI
``mistral_common`` wheel converted by transformers, and ONE ``[INST]`` chat template -- for SGLang and vLLM
(``--load-format dummy``). scripts/gpu/fetch-wheels.sh then makes the vocab-only GGUF for llama.cpp from the same
directory with llama.cpp's own ``convert_hf_to_gguf.py --vocab-only``; on the GPU machine ``python -m proxy.embedded
model --vocab llama-spm --vocab-file VOCAB.gguf`` writes the random-weight GGUF of that shape with that tokenizer.
"""

from __future__ import annotations

import argparse
import json
import zipfile
from pathlib import Path

# Mistral's own v1 format ([INST] ... [/INST]), with an optional system prompt folded into the first turn.
# The template renders bos_token itself; llama.cpp strips it again when the vocab adds BOS (see README).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '[INST] ' + message['content'] + '\\n\\n' }}"
    "{% elif message['role'] == 'user' %}"
    "{% if loop.index0 > 0 and messages[loop.index0 - 1]['role'] == 'system' %}"
    "{{ message['content'] + ' [/INST]' }}"
    "{% else %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% endif %}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + eos_token }}"
    "{% endif %}{% endfor %}"
)

# the shapes (HF config keys); parameters, bytes and the KV cache per token of 27b: scripts/gpu/README.md
SHAPES: dict[str, dict[str, int | float]] = {
    "27b": {
        "hidden_size": 5120,
        "intermediate_size": 25600,
        "num_hidden_layers": 58,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
    },
    # issue 48, the same weights in every engine: the 27B's family (dense GQA Llama, head 128, 8 KV heads, SwiGLU,
    # vocab 32,000, untied) at 3.02 B parameters -- written, converted and quantized in ~2 min on the GPU machine,
    # where the 27B's 53.6 GB checkpoint + its F16 GGUF would not fit the 64 GiB disk beside the Q4_K_M
    "3b": {
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 28,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
    },
    # the CPU smoke's stand-in of the same family (2 layers x 256)
    "smoke": {
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
    },
    "7b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
    },
}

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "head_dim": 128,
    "vocab_size": 32000,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
    "initializer_range": 0.02,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("wheel", type=Path, help="the mistral_common wheel (its data/tokenizer.model.v1)")
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="27b")
    a = ap.parse_args()
    wheel, out = a.wheel, a.out
    out.mkdir(parents=True, exist_ok=True)
    src = out / "src"
    src.mkdir(exist_ok=True)
    with zipfile.ZipFile(wheel) as z:
        (src / "tokenizer.model").write_bytes(z.read("mistral_common/data/tokenizer.model.v1"))
    (src / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "LlamaTokenizer",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "add_bos_token": True,
                "add_eos_token": False,
                "legacy": True,
                "model_max_length": int(SHAPES[a.shape]["max_position_embeddings"]),
                "clean_up_tokenization_spaces": False,
            },
            indent=1,
        )
    )
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src))
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(out))
    # transformers 5 drops ``legacy`` when saving; without it a reload uses Metaspace prepend_scheme "first"
    # (no "▁" after a special token: "<s>[INST]" -> "[" instead of "▁["), unlike SentencePiece and llama.cpp.
    tc = json.loads((out / "tokenizer_config.json").read_text())
    tc["legacy"] = True
    (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=1) + "\n")
    (out / "tokenizer.model").write_bytes((src / "tokenizer.model").read_bytes())
    for f in src.iterdir():
        f.unlink()
    src.rmdir()
    cfg = {**CONFIG, **SHAPES[a.shape]}
    (out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}) + "\n")
    # the template as a file too, for llama-server --chat-template-file if ever needed
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    tok = AutoTokenizer.from_pretrained(str(out))  # as the engines will load it
    msgs = [{"role": "user", "content": "hi"}]
    ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    print(f"tokenizer: {type(tok).__name__} vocab {len(tok)}; hi -> {text!r} -> {len(ids)} ids {ids}")
    print(sorted(p.name for p in out.iterdir()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
