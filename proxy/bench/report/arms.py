"""Arms: one candidate engine measured twice against the baseline — on the baseline's own weights file and on
the weights it runs best (a different precision, a *discounted* verdict). Pure.

The same-weights arm is the clean test of the engine: SGLang loads a llama.cpp GGUF itself (``--model-path
M.gguf``, with the HF tokenizer beside it; it then says ``quantization: gguf``, and the file's own header tells
which). vLLM loads a GGUF only through its GGUF plugin (since 0.24). The discounted arm answers what a switch
would really run, precision change included. Candidates of one engine kind form arms when one of them has the
baseline's weights (the same file by its command line or model path, or the same quantization) and another a
different precision. The report shows both; their combined answer is given only when they agree — arms that
disagree mean the precision, not the engine, decides, and no combined answer is given.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.bench.report.blocks import Block
from proxy.engines import quant_key
from proxy.engines.startup import flag_value, program

_MODEL_FLAGS = ("-m", "--model", "--model-path")


def model_file(meta: Mapping[str, Any]) -> str | None:
    """The weights an engine loads: its launch command's model flag (vLLM: ``vllm serve PATH``), else the
    model path the engine reported."""
    cmd = meta.get("launch")
    if isinstance(cmd, str):
        try:
            argv = shlex.split(cmd)
        except ValueError:
            argv = []
        while argv and "=" in argv[0] and not argv[0].startswith("-"):
            argv.pop(0)  # leading NAME=VALUE environment words
        path = flag_value(argv, *_MODEL_FLAGS)
        if path is None and program(argv) == "vllm" and len(argv) > 2 and argv[1] == "serve":
            path = argv[2]
        if path:
            return path
    info = meta.get("info") or {}
    p = info.get("model_path")
    return str(p) if p else None


def weights(base: Mapping[str, Any], cand: Mapping[str, Any]) -> str:
    """How the candidate's weights relate to the baseline's: same file | same quantization | different precision
    | unknown."""
    fb, fc = model_file(base), model_file(cand)
    if fb and fc and fb == fc:
        return "same file"
    qb, qc = base.get("quantization"), cand.get("quantization")
    if not qb or not qc:
        return "unknown"
    return "same quantization" if quant_key(qb) == quant_key(qc) else "different precision"


@dataclass(frozen=True)
class Arms:
    kind: str
    #: (candidate, weights, decision, discounted)
    members: tuple[tuple[str, str, str, bool], ...]
    combined: str | None
    text: str

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "combined": self.combined,
            "text": self.text,
            "arms": [{"candidate": c, "weights": w, "decision": d, "discounted": x} for c, w, d, x in self.members],
        }


def arms(engines_meta: Sequence[Mapping[str, Any]], baseline: str, verdicts: Sequence[Any]) -> list[Arms]:
    """The arms among the verdicts (``Verdict`` objects: candidate, decision, discounted)."""
    meta = {m["name"]: m for m in engines_meta}
    base = meta.get(baseline)
    if base is None:
        return []
    by_kind: dict[str, list[tuple[str, str, str, bool]]] = {}
    for v in verdicts:
        m = meta.get(v.candidate)
        if m is None:
            continue
        by_kind.setdefault(str(m.get("kind")), []).append(
            (v.candidate, weights(base, m), v.decision, bool(v.discounted))
        )
    out = []
    for kind, members in by_kind.items():
        same = [x for x in members if x[1] in ("same file", "same quantization")]
        other = [x for x in members if x[1] == "different precision"]
        if not same or not other:
            continue
        decisions = {d for _, _, d, _ in members}
        arm = "; ".join(f"{c} ({w}{', discounted' if x else ''}): {d.upper()}" for c, w, d, x in members)
        if len(decisions) == 1:
            (d,) = decisions
            text = (
                f"{kind}: both arms say {d.upper()} — {arm}; the same-weights arm shows it is the engine, the "
                "other what a switch with its own weights gives"
            )
            out.append(Arms(kind, tuple(members), d, text))
        else:
            text = (
                f"{kind}: the arms disagree — {arm}: no combined answer; the precision, not only the engine, "
                "decides here — the same-weights arm is the clean test of the engine"
            )
            out.append(Arms(kind, tuple(members), None, text))
    return out


def notes(engines_meta: Sequence[Mapping[str, Any]]) -> list[str]:
    """What the report says about engines loading GGUF files."""
    out = []
    for m in engines_meta:
        f = model_file(m) or ""
        if f.endswith(".gguf") and m.get("kind") == "vllm":
            out.append(
                f"{m['name']}: vLLM loads a GGUF file only with its GGUF plugin (since vLLM 0.24); without it "
                "the launch fails"
            )
    return out


def arms_blocks(a: Sequence[Arms], engines_meta: Sequence[Mapping[str, Any]]) -> list[Block]:
    if not a and not notes(engines_meta):
        return []
    out = [Block("h2", "Arms: the same weights and the engine's own")]
    items = [x.text for x in a] + notes(engines_meta)
    out.append(Block("ul", items=items))
    return out
