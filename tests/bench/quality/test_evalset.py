"""``--eval`` files: items read strictly, the three matchers, and the paired statistics of two engines' scores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from proxy.bench.quality.evalset import EvalFileError, EvalItem, load_eval, matches
from proxy.bench.quality.readout import accuracies, mcnemar_exact, paired_diff


def test_items_are_read_with_their_matcher_and_a_bad_line_is_named(tmp_path: Path) -> None:
    f = tmp_path / "e.jsonl"
    lines = [
        {"prompt": "17*3?", "expected": 51, "matcher": "number"},
        {"messages": [{"role": "user", "content": "Capital?"}], "expected": "paris", "matcher": "regex"},
        {"prompt": "Say yes.", "expected": "yes", "max_tokens": 4},
    ]
    f.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    items = load_eval(f)
    assert [i.matcher for i in items] == ["number", "regex", "exact"]
    assert items[0].messages == ({"role": "user", "content": "17*3?"},) and items[0].expected == "51"
    assert items[2].max_tokens == 4
    f.write_text(json.dumps(lines[0]) + "\n" + json.dumps({"prompt": "x", "expected": "y", "matcher": "fuzzy"}))
    with pytest.raises(EvalFileError, match=r"e\.jsonl:2: matcher must be one of exact, regex, number"):
        load_eval(f)
    f.write_text(json.dumps({"prompt": "x", "expected": "(", "matcher": "regex"}))
    with pytest.raises(EvalFileError, match=":1:"):
        load_eval(f)
    f.write_text("")
    with pytest.raises(EvalFileError, match="no items"):
        load_eval(f)


@pytest.mark.parametrize(
    ("matcher", "expected", "answer", "ok"),
    [
        ("exact", "yes", "  yes\n", True),
        ("exact", "yes", "Yes", False),
        ("regex", r"\bparis\b", "It is Paris.", True),
        ("regex", r"\bparis\b", "Parisian", False),
        ("number", "1234", "so the total is $1,234.00", True),
        ("number", "51", "17 * 3 = 51", True),
        ("number", "51", "51 is not 17 * 3 = 52", False),  # the last number counts
        ("number", "0.5", "half: .5", True),
        ("number", "3", "no digits", False),
    ],
)
def test_matchers(matcher: str, expected: str, answer: str, ok: bool) -> None:
    assert matches(EvalItem(({"role": "user", "content": "q"},), expected, matcher), answer) is ok


def test_mcnemar_exact_matches_the_binomial_test() -> None:
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(0, 5) == pytest.approx(2 / 32)
    assert mcnemar_exact(1, 9) == pytest.approx(2 * 11 / 1024)
    assert mcnemar_exact(5, 5) == 1.0


def _records(pairs: list[tuple[bool, bool]]) -> list[dict[str, object]]:
    return [
        {"type": "eval", "engine": e, "item": i, "correct": (b if e == "a" else c)}
        for e in ("a", "b")
        for i, (b, c) in enumerate(pairs)
    ]


def test_the_paired_difference_and_the_accuracy_records() -> None:
    pairs = [(True, True)] * 30 + [(True, False)] * 12 + [(False, True)] * 1 + [(False, False)] * 7
    d = paired_diff(pairs, n_boot=500)
    assert d.value == pytest.approx(-11 / 50)
    assert d.low < d.value < d.high < -0.02
    acc = accuracies(_records(pairs), "a", n_boot=500)["b"]
    assert (acc.items, acc.base_right, acc.cand_right, acc.discordant) == (50, 42, 31, (12, 1))
    assert acc.p_value == pytest.approx(mcnemar_exact(12, 1))
    assert acc.differs is not None and "accuracy -22.0 pt" in acc.differs
    assert "McNemar exact p = 0.00342" in acc.text()


def test_a_difference_whose_interval_reaches_zero_is_within_bounds() -> None:
    pairs = [(True, True)] * 30 + [(True, False)] * 8 + [(False, True)] * 2 + [(False, False)] * 10
    acc = accuracies(_records(pairs), "a", n_boot=500)["b"]
    assert acc.diff.low < acc.diff.value < 0 <= acc.diff.high
    assert acc.differs is None
    assert acc.p_value == pytest.approx(mcnemar_exact(8, 2))
