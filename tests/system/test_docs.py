"""The docs run as written: every code block marked ``<!-- docs-test ... -->`` (the line before its fence) in
``README.md`` and ``docs/*.md`` is run, as a fresh clone would run it, against real llama-server processes on the
generated tiny model.

A page's marked blocks run in order in one shell, as a person follows the page (the recipe's ``$LLAMA`` and
``$M`` carry into the commands after it). A marked block: a transcript block (lines ``$ command``, continuation lines after a trailing
``\\``; the output lines are left alone) runs its ``$`` lines, any other block all of its lines. It runs in an
empty directory holding only ``scripts/`` and ``.venv/`` (links to this checkout's), with the test's
environment on ``PATH`` (``enginemeter``, ``python``) and ``LLAMA_SERVER_BIN`` set, so
``scripts/build-llama-server.sh`` answers at once: the setup lines a person types once (``scripts/bootstrap.sh``,
``. .venv/bin/activate``) are the test's own environment and are skipped. To put a command under test, mark its
block; a block needing a GPU or another engine stays unmarked and says what to substitute.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

MARK = "<!-- docs-test"
SETUP = ("scripts/bootstrap.sh", ". .venv/bin/activate", "source .venv/bin/activate")
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def commands(body: list[str]) -> list[str]:
    """The shell lines of a block: a transcript's ``$`` commands (with their continuations), else every line."""
    if not any(line.startswith("$ ") for line in body):
        return [line for line in body if not line.strip().startswith(SETUP)]
    out: list[str] = []
    more = False
    for line in body:
        if line.startswith("$ ") or more:
            out.append(line.removeprefix("$ "))
            more = line.rstrip().endswith("\\")
    return [line for line in out if not line.strip().startswith(SETUP)]


def marked_pages() -> list[tuple[str, list[str], list[str]]]:
    """(page, the shell lines of its marked blocks in order, the output lines the page shows for them) of every
    page with a marked block."""
    found = []
    for path in DOCS:
        script: list[str] = []
        prints: list[str] = []
        lines = path.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            if not line.startswith(MARK):
                continue
            fence = i + 1
            assert fence < len(lines) and lines[fence].startswith("```"), (
                f"{path.name}:{i + 1}: no block after the mark"
            )
            end = next(j for j in range(fence + 1, len(lines)) if lines[j].startswith("```"))
            script += [f"# {path.name}:{fence + 1}", *commands(lines[fence + 1 : end])]
            prints += printed(lines, end + 1)
        if script:
            found.append((str(path.relative_to(REPO)), script, prints))
    return found


def printed(lines: list[str], after: int) -> list[str]:
    """The output a page shows for a marked block: the plain fence right after it, introduced by a line "prints"."""
    nxt = [j for j in range(after, min(after + 4, len(lines))) if lines[j].strip()]
    if len(nxt) < 2 or lines[nxt[0]].strip() != "prints" or lines[nxt[1]] != "```":
        return []
    end = next(j for j in range(nxt[1] + 1, len(lines)) if lines[j].startswith("```"))
    return lines[nxt[1] + 1 : end]


PAGES = marked_pages()


def test_the_readme_the_tune_page_and_the_bench_page_have_marked_blocks() -> None:
    where = {name for name, _, _ in PAGES}
    assert {"README.md", "docs/tune.md", "docs/bench.md"} <= where
    assert commands(["$ a \\", "  b", "output", "$ c"]) == ["a \\", "  b", "c"]


@pytest.mark.parametrize(("name", "lines", "shown"), PAGES, ids=[name for name, _, _ in PAGES])
def test_the_marked_blocks_of_a_page_run_as_written(name: str, lines: list[str], shown: list[str],
                                                    llama_server_bin: Path, tiny_model: Path, tmp_path: Path) -> None:  # fmt: skip
    (tmp_path / "scripts").symlink_to(REPO / "scripts")
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    env = {**os.environ, "LLAMA_SERVER_BIN": str(llama_server_bin),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}  # fmt: skip
    script = "set -euo pipefail\n" + "\n".join(lines) + "\n"
    r = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, f"{name}: exit {r.returncode}\n{script}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    if shown:  # a page that shows what its commands print: they print it
        missing = [line for line in shown if line not in r.stdout.splitlines()]
        assert not missing, f"{name}: shown but not printed: {missing}\n{r.stdout[-2000:]}"
    else:
        assert "report:" in r.stdout or "report.md" in r.stdout, r.stdout[-2000:]
