"""tests/tiers.py's table names real tests, and its marking reaches them (the fast tier's definition can't rot)."""

from __future__ import annotations

import re

import pytest

from tests.helpers import REPO
from tests.tiers import KEEP_FAST, SLOW, is_slow, over_budget


@pytest.mark.parametrize("module", sorted(SLOW))
def test_every_listed_test_exists(module: str) -> None:
    source = (REPO / module).read_text(encoding="utf-8")
    listed = SLOW[module]
    names = [] if isinstance(listed, str) else sorted(listed)
    names += [k.split("::")[1] for k in KEEP_FAST if k.startswith(f"{module}::")]
    missing = [n for n in names if not re.search(rf"^(async )?def {n}\(", source, re.MULTILINE)]
    assert missing == [], f"{module}: no such test (renamed? update tests/tiers.py)"


def test_a_listed_function_or_module_is_slow_and_nothing_else() -> None:
    assert is_slow("tests/system/test_workers.py::test_anything[1]")  # a whole module
    assert not is_slow(
        "tests/system/test_workers.py::test_default_workers_is_within_one_and_eight"
    )  # but its unit test
    assert is_slow("tests/system/test_cli.py::test_config_errors_never_print_secrets[engine url-args0]")
    assert not is_slow("tests/system/test_cli.py::test_version_matches_the_package")  # the entry point's smoke test
    assert not is_slow("tests/system/test_cli.py::test_engine_at_listen_address")
    assert not is_slow("tests/core/test_sse.py::test_anything")


def test_the_guard_names_the_tests_over_budget_slowest_first() -> None:
    assert over_budget({"a::fast": 0.2, "b::slow": 2.0, "c::slower": 9.0}) == ["  9.0 s  c::slower", "  2.0 s  b::slow"]
