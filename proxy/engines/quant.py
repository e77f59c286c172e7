"""Quantization names, made comparable across engines.

Engines and people name the same number format differently: llama.cpp ``/props`` says ``F16`` or
``Q4_K - Medium`` (``llama_model_ftype_name``; ``(guessed)`` when the GGUF does not say), GGUF file names say
``Q4_K_M``, SGLang reports ``quantization`` (``fp8``, ``awq``) or its ``dtype`` (``bfloat16``, ``half``), vLLM
and torch say ``torch.float16``. ``quant_key`` maps each to one lower-case key: ``f16`` for F16 / FP16 /
float16 / half, ``bf16`` for BF16 / bfloat16, ``f32`` for F32 / FP32 / float32, ``q4_k_m`` for ``Q4_K_M`` and
``Q4_K - Medium``, ``iq2_xxs`` for ``IQ2_XXS - 2.0625 bpw``; other names lower-cased, spaces and dashes as
``_``. Two engines run the same format exactly when their keys are equal.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from typing import Any

_ALIASES = {
    "f16": "f16", "fp16": "f16", "float16": "f16", "half": "f16",
    "bf16": "bf16", "bfloat16": "bf16",
    "f32": "f32", "fp32": "f32", "float32": "f32", "float": "f32",
}  # fmt: skip
_SIZES = {"small": "s", "medium": "m", "large": "l", "xs": "xs", "xxs": "xxs"}
#: a quantization named inside a model or file name (``qwen2.5-7b-instruct-q4_k_m.gguf``, ``Llama-3-8B-AWQ``)
_IN_NAME = re.compile(
    r"(?i)(?<![a-z0-9])(i?q[1-8](?:_[a-z0-9]+)*|f16|bf16|f32|fp16|fp8|fp32|int8|int4|awq|gptq|mxfp4|nvfp4)(?![a-z0-9])"
)


def quant_key(q: str | None) -> str | None:
    """One comparable key per number format (see the module docstring); None for None or an empty name."""
    if q is None:
        return None
    s = q.strip().lower().removesuffix("(guessed)").strip()
    s = s.removeprefix("torch.").removeprefix("mostly_").removeprefix("mostly ").removeprefix("all ")
    base, sep, tail = s.partition(" - ")
    if sep:
        size = _SIZES.get(tail.strip())
        s = f"{base.strip()}_{size}" if size else base.strip()  # "2.0625 bpw", "1.69 bpw ternary": no new info
    s = s.removesuffix(" moe").strip()
    s = re.sub(r"[\s\-]+", "_", s)
    return _ALIASES.get(s, s) or None


def quant_from_name(*names: str | None) -> str | None:
    """The first quantization named in ``names`` (a model path's file name, a served model id), upper-cased."""
    for name in names:
        m = _IN_NAME.search(name or "")
        if m:
            return m.group(1).upper()
    return None


def random_weights(launch: str | None, info: Mapping[str, Any]) -> str | None:
    """Why an engine's weights are random, when they are: a dummy load (SGLang and vLLM ``--load-format dummy``,
    or the engine saying so), or a GGUF enginemeter generated (``general.name`` ``enginemeter-<vocab>-random``,
    ``proxy.embedded.make_model``); None: not known to be random. Outputs of random weights say nothing about
    correctness, and two engines' greedy outputs cannot be judged against each other."""
    if launch:
        try:
            argv = shlex.split(launch)
        except ValueError:
            argv = launch.split()
        for i, a in enumerate(argv):
            if (a == "--load-format" and i + 1 < len(argv) and argv[i + 1] == "dummy") or a == "--load-format=dummy":
                return "--load-format dummy"
    if str(info.get("weights_format") or "").lower() == "dummy" or str(info.get("load_format") or "") == "dummy":
        return "a dummy load (the engine says so)"
    name = str(info.get("gguf_name") or "")
    if name.startswith("enginemeter-") and name.endswith("-random"):
        return f"a generated GGUF ({name})"
    return None


#: why two engines' greedy outputs say nothing when either runs random weights
RANDOM_WHY = (
    "their outputs say nothing about correctness, and two engines' greedy outputs part wherever their kernels "
    "round differently"
)


def random_among(random: Mapping[str, str], *engines: str) -> dict[str, str]:
    """Which of ``engines`` run random weights, and why (``random``: engine -> why, as ``random_weights`` says), in
    the order given: the one rule every screen applies to a comparison."""
    return {e: random[e] for e in dict.fromkeys(engines) if e in random}


def random_who(mine: Mapping[str, str]) -> str:
    """``a runs random weights (why)``, ``a and b run random weights (a: why; b: why)``: ``mine`` from
    ``random_among``, never empty."""
    who = " and ".join(mine)
    if len(mine) == 1:
        return f"{who} runs random weights ({next(iter(mine.values()))})"
    return f"{who} run random weights (" + "; ".join(f"{e}: {w}" for e, w in mine.items()) + ")"
