"""Issue 11: prompt-token parity, offline -- the HF tokenizer + chat template (what SGLang and vLLM apply) vs
the ids llama.cpp reported in a capture's parity.json (/apply-template + /tokenize) and its usage.prompt_tokens.

    /tmp/tfenv/bin/python scripts/gpu/parity_hf.py MODEL_DIR CAPTURE_DIR/llamacpp/parity.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from capture import PARITY_CASES


def main() -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(sys.argv[1])
    par = json.loads(Path(sys.argv[2]).read_text())
    bad = 0
    for case, msgs in PARITY_CASES:
        ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        rec = par.get(case, {})
        lids = rec.get("ids")
        same = lids == list(ids)
        bad += not same
        print(f"{case:16s} hf {len(ids):3d}  llama.cpp usage {rec.get('prompt_tokens')}  ids {'==' if same else '!='}")
        if not same and lids is not None:
            print("   hf   ", [tok.convert_ids_to_tokens(i) for i in ids])
            print("   llama", [tok.convert_ids_to_tokens(i) for i in lids])
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
