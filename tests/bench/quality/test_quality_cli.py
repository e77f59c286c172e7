"""``python -m proxy.bench.quality RESULTS``: the results as ``bench --out`` writes them and as
``scripts/gpu/collect.sh`` keeps them (``results.jsonl.gz``), or the ``--out`` directory, read the same."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from proxy.bench.quality.__main__ import main as quality_main

METHOD = "teacher-forced along the baseline's greedy path"


def _records() -> list[dict[str, object]]:
    """Two engines, two prompts of three positions: they agree on 5 of 6 top tokens."""
    recs: list[dict[str, object]] = [{"type": "run", "baseline": "a"}]
    for engine, flip in (("a", False), ("b", True)):
        for prompt in range(2):
            scored = [[[7, -0.1], [9, -2.5]], [[8, -0.2], [9, -2.0]], [[5, -0.3], [6, -1.5]]]
            if flip and prompt == 1:
                scored[2] = [[6, -0.4], [5, -1.2]]
            recs.append({"type": "logprobs", "engine": engine, "prompt": prompt, "prompt_tokens": 4,
                         "path": [7, 8, 6 if flip and prompt == 1 else 5], "scored": scored, "k": 2,
                         "method": METHOD})  # fmt: skip
    return recs


def test_plain_gzipped_and_directory_give_the_same_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = "".join(json.dumps(r) + "\n" for r in _records())
    plain = tmp_path / "plain" / "results.jsonl"
    plain.parent.mkdir()
    plain.write_text(lines)
    packed = tmp_path / "packed" / "results.jsonl.gz"
    packed.parent.mkdir()
    packed.write_bytes(gzip.compress(lines.encode()))
    outs = []
    for arg in (plain, packed, packed.parent):
        assert quality_main([str(arg)]) == 0
        outs.append(capsys.readouterr().out)
    assert "token agreement a vs b (2 prompts × 3 positions" in outs[0]
    assert "same top token 83.3 %" in outs[0]
    assert outs[1] == outs[0] and outs[2] == outs[0]
