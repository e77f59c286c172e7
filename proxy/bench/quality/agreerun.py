"""The agreement phase: every engine's greedy path and its top-k log-probabilities along the baseline's path.

Run after the timed cells, at concurrency 1 (log-probability requests change an engine's work, and concurrency
changes its numerics), one engine at a time, baseline first, so a time-shared run can run it on each engine
while that engine is up. Method (docs/bench.md#token-agreement): **teacher-forced along the baseline's greedy
path**, every engine (the baseline included) scored by the same mechanism, with the same ``k`` — so the
same engine twice gives KL 0 and 100 % the same top token:

1. the baseline renders and tokenizes each prompt (its chat template); a candidate whose own tokenizer makes
   other ids of a prompt is scored on the baseline's ids when they name the same tokens, said in a note: the
   baseline's ids read back, in the candidate's own vocabulary, as the very prompt it made (the same text split
   into other tokens: Hugging Face's and llama.cpp's SentencePiece split runs of spaces otherwise), or its plain
   texts do (one vocabulary, another chat template); and left out otherwise ("tokenizers differ": the ids would
   name other tokens);
2. each engine continues the baseline's ids greedily by ``n`` tokens: where its path parts from the
   baseline's is the "first part" figure;
3. each engine is teacher-forced along the baseline's path: its top-``k`` at every position.

Records (``results.jsonl``): ``logprobs`` per engine and prompt (``path``: its greedy ids; ``scored``: ``[[id,
logprob], ...]`` per position of the baseline's path; ``k``; ``method``), ``quality_note`` for an engine
left out and why. :mod:`proxy.bench.quality.readout` turns them into figures.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from proxy.engines import logprobs

METHOD = "teacher-forced along the baseline's greedy path"
DEFAULT_PROMPTS = 32
DEFAULT_TOKENS = 64
#: vLLM's default ``--max-logprobs``: the k every engine can give
DEFAULT_K = 20

Messages = Sequence[Mapping[str, str]]


@dataclass
class Engine:
    """What the phase needs of one engine: its name, kind, served model and a client at its own URL."""

    name: str
    kind: str | None
    model: str | None
    client: httpx.AsyncClient


def parse_size(spec: str) -> tuple[int, int]:
    """``"32x64"`` -> (32 prompts, 64 tokens each)."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", spec)
    if not m or int(m[1]) < 1 or int(m[2]) < 1:
        raise ValueError(f"expected PROMPTSxTOKENS (e.g. 32x64), not {spec!r}")
    return int(m[1]), int(m[2])


def _fractions() -> Iterator[float]:
    """1/2, 1/3, 2/3, 1/4, 3/4, 1/5, ...: every fraction once, coarse first."""
    for d in range(2, 64):
        for n in range(1, d):
            if math.gcd(n, d) == 1:
                yield n / d


def _cut(text: str, share: float) -> str:
    """The first ``share`` of ``text``, ended at the last space before that point when there is one."""
    end = max(1, int(len(text) * share))
    space = text.rfind(" ", 0, end)
    return text[: space if space > 0 else end]


def variants(prompts: Sequence[Messages], n: int) -> list[list[dict[str, str]]]:
    """``n`` prompts from the suite's: each as is first, then (when more are asked for than the suite holds) its
    last message cut to its first 1/2, 1/3, 2/3, 1/4, ... — distinct contexts, drawn round-robin, deterministic.
    Fewer than ``n`` only when the suite's prompts are too short to give that many."""
    out: list[list[dict[str, str]]] = []
    seen: set[str] = set()

    def add(msgs: list[dict[str, str]]) -> None:
        key = repr(msgs)
        if key not in seen and len(out) < n:
            seen.add(key)
            out.append(msgs)

    for p in prompts:
        add([dict(m) for m in p])
    for share in _fractions():
        if len(out) >= n:
            break
        for p in prompts:
            add([*(dict(m) for m in p[:-1]), {**dict(p[-1]), "content": _cut(str(p[-1].get("content", "")), share)}])
    return out


@dataclass
class AgreementPhase:
    """One run's agreement phase; :meth:`run` once per engine, the baseline first."""

    prompts: list[list[dict[str, str]]]
    tokens: int
    write: Callable[[dict[str, Any]], None]
    k: int = DEFAULT_K
    base_ids: list[list[int]] = field(default_factory=list)
    base_paths: list[list[int]] = field(default_factory=list)
    base_text_ids: list[list[int]] = field(default_factory=list)

    async def run(self, eng: Engine, *, baseline: bool) -> bool:
        """Measure ``eng``; False (and a ``quality_note``) when it was left out."""
        if eng.kind not in logprobs.SCORABLE:
            return self._note(eng, f"kind {eng.kind or 'unknown'} gives no token ids or log-probabilities")
        if not baseline and not self.base_paths:
            return self._note(eng, "the baseline was not measured")
        try:
            ids = [await logprobs.tokenize(eng.client, eng.kind, p, eng.model) for p in self.prompts]
            if baseline:
                self.base_ids = ids
                texts = [str(p[-1].get("content", "")) for p in self.prompts]
                self.base_text_ids = [await logprobs.tokenize_text(eng.client, eng.kind, t, eng.model) for t in texts]
            elif ids != self.base_ids and not await self._same_vocabulary(eng, ids):
                differ = sum(a != b for a, b in zip(ids, self.base_ids, strict=True))
                return self._note(eng, f"tokenizers differ ({differ} of {len(ids)} prompts tokenize otherwise)")
            for i, prompt in enumerate(self.base_ids):
                path = await logprobs.generate(eng.client, eng.kind, prompt, self.tokens, eng.model)
                if baseline:
                    self.base_paths.append(path)
                along = self.base_paths[i]
                scored = await logprobs.score(eng.client, eng.kind, prompt, along, self.k, eng.model)
                self.write(
                    {
                        "type": "logprobs",
                        "engine": eng.name,
                        "prompt": i,
                        "prompt_tokens": len(prompt),
                        "path": path,
                        "scored": [[[t, round(lp, 6)] for t, lp in pos.items()] for pos in scored],
                        "k": self.k,
                        "method": METHOD,
                    }
                )
        except (httpx.HTTPError, logprobs.LogprobError, ValueError, KeyError) as exc:
            if baseline:
                self.base_paths = []
            return self._note(eng, f"{type(exc).__name__}: {exc}"[:300])
        return True

    async def _same_vocabulary(self, eng: Engine, ids: list[list[int]]) -> bool:
        """The candidate's ids differ from the baseline's: are the baseline's the same tokens? Each prompt whose ids
        differ either spells the same text in the candidate's own vocabulary (another split of the same text), or
        the plain texts do (another chat template); otherwise the vocabularies differ."""
        differ = [i for i, (a, b) in enumerate(zip(ids, self.base_ids, strict=True)) if a != b]
        split = [i for i in differ if await self._spell_alike(eng, self.base_ids[i], ids[i])]
        rendered = len(differ) - len(split)
        if rendered:
            texts = [str(p[-1].get("content", "")) for p in self.prompts]
            mine = [await logprobs.tokenize_text(eng.client, str(eng.kind), t, eng.model) for t in texts]
            for m, b in zip(mine, self.base_text_ids, strict=True):
                if not await self._spell_alike(eng, b, m):
                    return False
        why = []
        if rendered:
            why.append(f"its chat template renders {rendered} of {len(ids)} prompts otherwise (the same vocabulary)")
        if split:
            why.append(
                f"its tokenizer splits {len(split)} of {len(ids)} prompts into other tokens of the same text (the "
                "baseline's ids read back as its own prompt)"
            )
        self._note(eng, "; ".join(why) + ": scored on the baseline's ids", left_out=False)
        return True

    @staticmethod
    async def _spell_alike(eng: Engine, base: list[int], own: list[int]) -> bool:
        """The baseline's ids and the candidate's ``own`` read back as one text in the candidate's vocabulary (its
        own decoder for both). Its own ids decode, or the error is the engine's; the baseline's may not (an id
        past its vocabulary: llama.cpp answers HTTP 500), which means they name other tokens."""
        if base == own:
            return True
        kind = str(eng.kind)
        text = await logprobs.detokenize(eng.client, kind, own, eng.model)
        try:
            return text == await logprobs.detokenize(eng.client, kind, base, eng.model)
        except logprobs.LogprobError:
            return False

    def _note(self, eng: Engine, why: str, *, left_out: bool = True) -> bool:
        """A ``quality_note`` record; False (``left_out``: the engine is not measured, the note says so)."""
        note = f"left out: {why}" if left_out else why
        self.write({"type": "quality_note", "engine": eng.name, "phase": "agreement", "note": note})
        return False
