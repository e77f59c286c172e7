"""Issue 11: the one model of the three-engine comparison, built HERE (needs transformers + sentencepiece).

    /tmp/tfenv/bin/python scripts/gpu/make_model_dir.py MISTRAL_COMMON.whl OUT_DIR

Writes an HF directory (``config.json`` of a Mistral-7B-class Llama shape: hidden 4096, 32 layers, 32 heads,
8 KV heads, ff 14336, vocab 32000; the real Mistral-7B v1 SentencePiece tokenizer from the PyPI
``mistral_common`` wheel, converted by transformers; ONE chat template) for SGLang and vLLM
(``--load-format dummy``). scripts/gpu/vocab_gguf.sh makes the vocab-only GGUF for llama.cpp from the same
directory with llama.cpp's own ``convert_hf_to_gguf.py``, and scripts/gpu/write_gguf.py the 7B GGUF there.
"""

from __future__ import annotations

import json
import sys
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

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 32000,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
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
    wheel, out = Path(sys.argv[1]), Path(sys.argv[2])
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
                "model_max_length": 8192,
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
    cfg = json.loads(json.dumps(CONFIG))
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
