#!/usr/bin/env python3
"""Write a random-weight GGUF with a real tokenizer; prints its path. See ``python3 -m proxy.embedded model -h``.

Examples: ``scripts/make-model.py`` (tiny qwen2 model in the cache), ``scripts/make-model.py /data --shape 7b``.
A Mistral-7B-shaped llama model with Mistral's tokenizer: ``scripts/make-model.py /data --shape mistral7b
--vocab llama-spm --vocab-file mistral-vocab.gguf`` (from ``convert_hf_to_gguf.py --vocab-only``).
Sharp next-token distributions (for token agreement, docs/bench.md#token-agreement): ``scripts/make-model.py
--logit-scale 40 --untiled-output``; K-quants need width 256: ``--shape w256 --logit-scale 20 --untiled-output``,
then ``python3 -m proxy.embedded quantize MODEL Q4_K_M`` (llama.cpp's own llama-quantize, built with the server).
Needs the ``gguf`` and ``numpy`` packages.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from proxy.embedded.commands import main

if __name__ == "__main__":
    sys.exit(main(["model", *sys.argv[1:]]))
