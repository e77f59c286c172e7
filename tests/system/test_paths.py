"""What the prose says of the tree holds: every repo path the docs and the tests' docstrings name exists, the
README's layout is the package's, ``proxy/errors.py`` draws every error class where it hangs, and the bench's map
draws the imports its layers make.

Pages read: ``README.md``, ``docs/*.md``, every other ``README.md`` (a captured run's notes under ``docs/``, and
``perf/``'s, ``scripts/gpu/``'s, the engine fixtures': written by hand, they name the scripts and modules that made
a run) and every docstring under ``tests/``. Not the rest of ``docs/``: ``docs/perf-runs/`` and a run's
``report.md``, ``switch-plan.md``, ``raw/`` and logs are what a program wrote at a commit, kept byte for byte; they
name that commit's tree, and rewriting them would falsify the record.

A path is a word starting ``proxy/``, ``tests/``, ``docs/``, ``scripts/``, ``fakes/``, ``perf/``, ``grafana/`` or
``deploy/`` that is not the tail of a longer path or word (``uvicorn/tests/…`` is uvicorn's), read up to a space,
quote, bracket, comma, ``;`` or ``|``. A trailing ``.`` or ``:`` is punctuation; a path broken at a ``-`` that ends
a line goes on with the next line's first word. Its suffix says what else to check: ``::test_x`` (the file defines
``test_x``; a ``[param]`` ends the path), ``:name`` (the file defines ``name``), ``:12`` (the file only),
``#anchor`` (the page has a heading of that anchor, as GitHub spells it). Skipped, as naming no one file: a path
holding a placeholder (an ellipsis, ``<run>``, ``*``, ``{a,b}``) and a container image at its version
(``grafana/grafana:11.6.0``). A Markdown link's target is a path from its page's folder, as GitHub reads it.
``HISTORY`` holds the removed files the docs cite with the commit that had them; each must be gone from the tree.
"""

from __future__ import annotations

import ast
import builtins
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.helpers import REPO
from tests.system.test_structure import import_graph

ROOTS = ("proxy", "tests", "docs", "scripts", "fakes", "perf", "grafana", "deploy")
#: a repo path in prose, with its suffix; a ``-`` ending a line continues the path on the next one
CHAR = r"[^\s`'\"()\[\],;|]"  # what a path may hold: all but space, quotes, brackets, comma, ``;`` and ``|``
PATH = re.compile(rf"(?<![\w./\-])(?<!\]\()((?:{'|'.join(ROOTS)})/(?:{CHAR}*-\n\s*)*{CHAR}*)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
PLACEHOLDER = re.compile(r"…|\.\.\.|[<>*{}]")
#: removed files the docs cite as history, with the commit that removed them: never to be recreated unseen
HISTORY = {
    "scripts/gpu-check.sh": "e1c0b59",
    "scripts/gpu-e2e.sh": "e1c0b59",
    "scripts/gpu_check.py": "e1c0b59",
    "scripts/gpu_e2e.py": "e1c0b59",
    "scripts/gpu/bench.py": "e4e66dc",
    "scripts/gpu/write_gguf.py": "e4e66dc",
}


def pages(root: Path) -> list[Path]:
    """The prose pages: ``README.md``, ``docs/*.md`` and every ``README.md`` outside captured output."""
    readmes = [
        p
        for d in sorted(root.iterdir())
        if d.is_dir() and not d.name.startswith(".") and not d.name.endswith(".egg-info")
        for p in sorted(d.rglob("README.md"))
        if "raw" not in p.relative_to(root).parts and "perf-runs" not in p.relative_to(root).parts
    ]
    return [root / "README.md", *sorted((root / "docs").glob("*.md")), *readmes]


def docstrings(root: Path) -> Iterator[tuple[str, int, str]]:
    """(file, line, text) of every docstring under ``tests/``: the module's, each class's and function's."""
    for p in sorted((root / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc:
                    yield str(p.relative_to(root)), node.body[0].lineno, doc


def named_paths(text: str) -> Iterator[tuple[int, str]]:
    """(line within ``text``, path with its suffix) of every repo path the text names, joined where it breaks."""
    for m in PATH.finditer(text):
        yield text.count("\n", 0, m.start()), re.sub(r"\n\s*", "", m.group(1)).rstrip(".:")


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings (lower case, punctuation dropped, spaces as ``-``, ``-1`` on a
    repeat); lines inside fenced blocks are not headings."""
    out: set[str] = set()
    fenced = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} +(.*?) *#*$", line)):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
            n = 0
            while (slug if n == 0 else f"{slug}-{n}") in out:
                n += 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def defines(path: Path, name: str) -> bool:
    """Whether a Python file defines ``name`` (a function, class or assigned name, at any depth); any other file
    only has to hold the word."""
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".py":
        return re.search(rf"\b{re.escape(name)}\b", text) is not None
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name == name:
            return True
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id == name:
            return True
    return False


def wrong_path(root: Path, base: Path, named: str) -> str | None:
    """Why ``named`` (a path from ``base``, with its suffix) names nothing in the tree, or None when it does."""
    if PLACEHOLDER.search(named):
        return None
    named, _, anchor = named.partition("#")
    named = named.rstrip(".:")
    name = ""
    if "::" in named:
        named, _, name = named.partition("::")
        name = name.rpartition("::")[2]  # a test in a class: ``file::TestX::test_y``
    elif ":" in named:
        named, _, name = named.partition(":")
        if re.fullmatch(r"\d+(\.\d+)+", name):
            return None  # a container image at its version, not a file
        name = "" if name.isdigit() else name
    target = (base / named).resolve()
    if not target.is_relative_to(root.resolve()):
        return "outside the repository"
    if named.rstrip("/") in HISTORY:
        return None
    if not target.exists():
        return "no such file"
    if name and not (target.is_file() and defines(target, name)):
        return f"no {name} in it"
    if anchor and target.suffix == ".md" and anchor not in anchors(target):
        return f"no heading #{anchor}"
    return None


def stale_paths(root: Path) -> list[str]:
    """``where: path (why)`` for every path the prose names that the tree does not have."""
    found = []
    for page in pages(root):
        text = page.read_text(encoding="utf-8")
        where = str(page.relative_to(root))
        for line, named in named_paths(text):
            if why := wrong_path(root, root, named):
                found.append(f"{where}:{line + 1}: {named} ({why})")
        for m in LINK.finditer(text):
            target = m.group(1)
            if "://" in target or target.startswith("mailto:"):
                continue
            if target.startswith("#"):
                target = where + target
                base = root
            else:
                base = page.parent
            if why := wrong_path(root, base, target):
                found.append(f"{where}:{text.count(chr(10), 0, m.start()) + 1}: link {m.group(1)} ({why})")
    for where, first, doc in docstrings(root):
        for line, named in named_paths(doc):
            if why := wrong_path(root, root, named):
                found.append(f"{where}:{first + line}: {named} ({why})")
    return found


def test_the_path_reader_reads_paths_with_their_suffixes() -> None:
    text = (
        "See `proxy/a.py`, proxy/b/ and tests/c.py::test_d[x]; uvicorn/tests/utils.py is not ours, docs/e.md#f.\n"
        "A path broken at a dash: docs/gpu-results/h200-\n    graphs (and proxy/…/x.py, a placeholder)."
    )
    assert [p for _, p in named_paths(text)] == [
        "proxy/a.py",
        "proxy/b/",
        "tests/c.py::test_d",
        "docs/e.md#f",
        "docs/gpu-results/h200-graphs",
        "proxy/…/x.py",
    ]


def test_a_stale_path_of_each_kind_is_found(tmp_path: Path) -> None:
    for d in ("proxy", "docs", "tests"):
        (tmp_path / d).mkdir()
    (tmp_path / "proxy" / "a.py").write_text("def f():\n    pass\n")
    (tmp_path / "docs" / "b.md").write_text(
        "# B\n\n## The part (`proxy/a.py`)\n```\n# not a heading\n```\n"
        "[up](../proxy/a.py), [self](#b) hold; [gone](#gone), [side](c.md), [out](../../x.md) do not.\n"
    )
    (tmp_path / "README.md").write_text(
        "proxy/a.py:f, proxy/a.py:12, docs/b.md#the-part-proxyapy, [b](docs/b.md#b) and proxy/*.py hold.\n"
        "proxy/gone.py, proxy/a.py:g, docs/b.md#not-a-heading, [x](docs/x.md) do not.\n"
    )
    (tmp_path / "tests" / "test_c.py").write_text('"""Tests of proxy/a.py::f and of proxy/old.py."""\n')
    assert stale_paths(tmp_path) == [
        "README.md:2: proxy/gone.py (no such file)",
        "README.md:2: proxy/a.py:g (no g in it)",
        "README.md:2: docs/b.md#not-a-heading (no heading #not-a-heading)",
        "README.md:2: link docs/x.md (no such file)",
        "docs/b.md:7: link #gone (no heading #gone)",
        "docs/b.md:7: link c.md (no such file)",
        "docs/b.md:7: link ../../x.md (outside the repository)",
        "tests/test_c.py:1: proxy/old.py (no such file)",
    ]


def test_every_path_the_prose_names_exists() -> None:
    assert stale_paths(REPO) == []


def test_history_names_only_files_that_are_gone() -> None:
    assert [p for p in HISTORY if (REPO / p).exists()] == []


@dataclass
class Entry:
    """One line of the README's layout tree: the paths in its name column, what it says they hold."""

    paths: list[str]
    text: str


def layout(readme: Path) -> list[Entry]:
    """The entries of the README's ``## Layout`` tree: two spaces of indent per level, names (a folder ends in
    ``/``) up to two spaces, then what they hold, continued on lines indented past the name column."""
    section = re.search(r"^## Layout\n(.*?)(?=^## |\Z)", readme.read_text(encoding="utf-8"), re.S | re.M)
    block = re.search(r"^```[^\n]*\n(.*?)^```", section.group(1) if section else "", re.S | re.M)
    assert block, f"{readme.name}: no code block under ## Layout"
    out: list[Entry] = []
    folders: list[str] = []
    for line in block.group(1).splitlines():
        indent = len(line) - len(line.lstrip(" "))
        if indent > 8:
            out[-1].text += " " + line.strip()
            continue
        head, _, text = line.strip().partition("  ")
        depth = indent // 2
        parent = folders[depth - 1] if depth else ""
        paths = [parent + n for n in re.split(r"[ ,]+", head) if n]
        dirs = [p for p in paths if p.endswith("/")]
        folders[depth:] = dirs[-1:]
        out.append(Entry(paths, text.strip()))
    return out


#: a file or folder named in an entry's words: ``x.py``, ``x.sh``, ``x/``, ``x/y/``, ``x/y.md``
WORD_PATH = re.compile(r"(?<![\w./\-])((?:[\w-]+/)+(?:[\w.-]+\.(?:py|sh|md))?|[\w-]+\.(?:py|sh))(?![\w/])")


def module_list(text: str) -> list[str]:
    """The names in each parenthesized list of two or more bare names: in a package's entry, its modules."""
    out = []
    for group in re.findall(r"\(([^()]*)\)", text):
        names = [n.strip() for n in re.split(r"[,;]", group)]
        if len(names) > 1 and all(re.fullmatch(r"[a-z_][a-z0-9_]*", n) for n in names):
            out += names
    return out


def wrong_layout(root: Path) -> list[str]:
    """What the layout names that is not in the tree, and the packages it leaves out: each package of ``proxy/``
    down to a wing's sub-packages (``proxy/server/record/``) has an entry. An entry's words are checked where they
    name files: ``x.py``, ``x.sh``, ``x/`` and ``x/y.md`` from the entry's folder (or the root), and in a package's
    entry a parenthesized list of two or more bare names, which are its modules or sub-packages."""
    entries = layout(root / "README.md")
    wrong = []
    for e in entries:
        dirs = [p for p in e.paths if p.endswith("/")]
        near = [*(dirs or [e.paths[0].rpartition("/")[0] + "/"]), ""]
        wrong += [
            f"{p}: not in the tree"
            for p in e.paths
            if p.endswith("/") != (root / p).is_dir() or not (root / p).exists()
        ]
        wrong += [
            f"{e.paths[0]}: {w} is not in it"
            for w in WORD_PATH.findall(e.text)
            if not any((root / f / w).exists() for f in near)
        ]
        wrong += [
            f"{d}: {n} is not in it"
            for d in dirs
            if (root / d / "__init__.py").exists()
            for n in module_list(e.text)
            if not (root / d / f"{n}.py").exists() and not (root / d / n / "__init__.py").exists()
        ]
    named = {p for e in entries for p in e.paths}
    packages = sorted(
        f"{i.parent.relative_to(root)}/"
        for i in (root / "proxy").rglob("__init__.py")
        if len(i.relative_to(root).parts) <= 4
    )
    return wrong + [f"{p}: left out" for p in packages if p not in named]


def test_the_layout_reader_reads_the_tree(tmp_path: Path) -> None:
    for d in ("proxy/a", "proxy/b", "proxy/a/deep/deeper", "tests/core"):
        (tmp_path / d).mkdir(parents=True)
        (tmp_path / d / "__init__.py").write_text("")
    for f in ("proxy/x.py", "proxy/a/one.py", "proxy/a/two.py", "proxy/b/old.py"):
        (tmp_path / f).write_text("")
    (tmp_path / "README.md").write_text(
        "## Layout\n\nText.\n\n```\nproxy/     the package\n  x.py gone.py     the base\n"
        "  a/       a room (one, two)\n                with one.py, old.py\n"
        "tests/     like the package: core/, server/\n```\n\n## Next\n"
    )
    assert [(e.paths, e.text) for e in layout(tmp_path / "README.md")] == [
        (["proxy/"], "the package"),
        (["proxy/x.py", "proxy/gone.py"], "the base"),
        (["proxy/a/"], "a room (one, two) with one.py, old.py"),
        (["tests/"], "like the package: core/, server/"),
    ]
    assert wrong_layout(tmp_path) == [
        "proxy/gone.py: not in the tree",
        "proxy/a/: old.py is not in it",
        "tests/: server/ is not in it",
        "proxy/b/: left out",
    ]


def test_the_readme_layout_is_the_tree() -> None:
    assert wrong_layout(REPO) == []


def error_tree(doc: str) -> dict[str, str | None]:
    """Class -> its parent, as a docstring draws the tree (roots indented four spaces, children under ``├──`` or
    ``└──`` four columns deeper per level)."""
    drawn: dict[str, str | None] = {}
    stack: list[str] = []
    for line in doc.splitlines():
        m = re.match(r"    ([│ ]*)(?:[├└]── )?([A-Z]\w*)(?:\s|$)", line)
        if not m:
            continue
        depth = (len(m.group(1)) // 4 + 1) if "── " in line[: m.start(2)] else 0
        stack[depth:] = [m.group(2)]
        drawn[m.group(2)] = stack[depth - 1] if depth else None
    return drawn


def error_classes(root: Path, tops: tuple[str, ...]) -> dict[str, str | None]:
    """Every class defined under ``root`` that descends from one of ``tops`` (by its bases' names) -> its base
    (None for a top)."""
    bases: dict[str, str] = {}
    for p in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and node.bases:
                b = node.bases[0]
                bases[node.name] = b.attr if isinstance(b, ast.Attribute) else b.id if isinstance(b, ast.Name) else ""

    def top(name: str) -> str | None:
        seen = set()
        while name not in tops and name in bases and name not in seen:
            seen.add(name)
            name = bases[name]
        return name if name in tops else None

    return {n: (None if n in tops else bases[n]) for n in sorted(set(bases) | set(tops)) if top(n)}


def wrong_error_tree(root: Path, tops: tuple[str, ...] = ("ProxyError", "TransportError")) -> list[str]:
    """Each error class of ``proxy/`` missing from ``proxy/errors.py``'s tree or drawn under another base, and each
    class drawn that nothing defines (the built-ins it names aside)."""
    drawn = error_tree(ast.get_docstring(ast.parse((root / "proxy" / "errors.py").read_text()), clean=False) or "")
    defined = error_classes(root / "proxy", tops)
    wrong = [f"{c}: drawn under {drawn[c]}, a {b}" for c, b in defined.items() if c in drawn and drawn[c] != b]
    wrong += [f"{c} ({b}): not drawn" for c, b in defined.items() if c not in drawn]
    return wrong + [f"{c}: drawn, not defined" for c in drawn if c not in defined and not hasattr(builtins, c)]


def test_the_tree_reader_reads_depth_from_the_connectors(tmp_path: Path) -> None:
    doc = (
        "Intro.\n\n    A            root\n    ├── B        one\n    │   └── C    deeper\n    └── D\n    E   built-in\n"
    )
    assert error_tree(doc) == {"A": None, "B": "A", "C": "B", "D": "A", "E": None}
    (tmp_path / "proxy").mkdir()
    (tmp_path / "proxy" / "errors.py").write_text(
        f'"""{doc.replace("E   built-in", "TimeoutError")}"""\n'
        "class A(Exception): ...\nclass B(A): ...\nclass C(A): ...\nclass D(A): ...\n"
    )
    (tmp_path / "proxy" / "other.py").write_text("from proxy import errors\nclass F(errors.D): ...\n")
    assert wrong_error_tree(tmp_path, ("A",)) == ["C: drawn under B, a A", "F (D): not drawn"]


def test_the_error_tree_draws_every_error_class_under_its_base() -> None:
    assert wrong_error_tree(REPO) == []


BENCH_LAYERS = ("run", "live", "verdict", "report")


def drawn_imports(doc: str, layers: tuple[str, ...]) -> set[tuple[str, str]]:
    """(importer, imported) as a map's arrows draw them: ``a -> b`` (a imports b), ``b <- c`` (c imports b),
    ``a -> b, c`` (both); a parenthesis is a note, and a segment naming anything but ``layers`` is prose."""
    out = set()
    for line in doc.splitlines():
        for segment in re.sub(r"\([^)]*\)", "", line).split(";"):
            parts = re.split(r"\s*(->|<-)\s*", segment.strip())
            sides = [[n.strip() for n in side.split(",")] for side in parts[::2]]
            if len(parts) < 3 or not all(n in layers for side in sides for n in side):
                continue
            for left, arrow, right in zip(sides, parts[1::2], sides[1:], strict=False):
                out |= {(a, b) if arrow == "->" else (b, a) for a in left for b in right}
    return out


def layer_imports(root: Path, package: str, layers: tuple[str, ...]) -> set[tuple[str, str]]:
    """(importer, imported) between the sub-packages ``layers`` of ``package``, from the structure test's graph."""

    def layer(module: str) -> str | None:
        rest = module.removeprefix(package + ".").split(".")[0]
        return rest if module.startswith(package + ".") and rest in layers else None

    graph = import_graph(root / "proxy")
    return {(a, b) for m, deps in graph.items() for d in deps if (a := layer(m)) and (b := layer(d)) and a != b}


def test_the_arrow_reader_reads_both_directions() -> None:
    doc = "Prose: a -> b.\n\n    run -> verdict <- report;  live -> run, verdict (a note);  x -> run\n"
    assert drawn_imports(doc, BENCH_LAYERS) == {
        ("run", "verdict"),
        ("report", "verdict"),
        ("live", "run"),
        ("live", "verdict"),
    }


def test_the_bench_map_draws_the_imports_between_its_layers() -> None:
    doc = ast.get_docstring(ast.parse((REPO / "proxy" / "bench" / "__init__.py").read_text())) or ""
    assert drawn_imports(doc, BENCH_LAYERS) == layer_imports(REPO, "proxy.bench", BENCH_LAYERS)
