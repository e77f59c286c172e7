"""The package's shape, held by its own imports: no import cycle anywhere in ``proxy/`` (an import inside a function
or under ``TYPE_CHECKING`` counts: it only hides the cycle), the bench wing's layers (``run`` -> ``verdict`` <-
``report``, ``live`` -> ``verdict``), the GPU package below the server and NVML read only through its seam, no
module over 450 lines, every module named in its package's map, and no aiohttp."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MAX_LINES = 450


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``root`` (a package's ``__init__`` is the package)."""
    out = {}
    for p in sorted(root.rglob("*.py")):
        parts = p.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of ``root``'s package it imports, from every import statement in it."""
    mods = modules(root)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                while t not in mods and "." in t:
                    t = t.rpartition(".")[0]
                if t in mods and t != name:
                    deps.add(t)
        graph[name] = deps
    return graph


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(graph.get(w, ()))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_the_cycle_finder_finds_a_cycle_hidden_in_a_function_and_under_type_checking(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg.b import g\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n")
    (pkg / "sub" / "c.py").write_text("from ..a import f\nfrom . import d\n")
    (pkg / "sub" / "d.py").write_text("import pkg.sub.c\n")
    assert sorted(cycles(import_graph(pkg))) == [["pkg.a", "pkg.b"], ["pkg.sub.c", "pkg.sub.d"]]


def test_proxy_has_no_import_cycle() -> None:
    assert cycles(import_graph(REPO / "proxy")) == []


#: the server's top: the app, its ASGI shell, its own routes and the composition root (above every sub-package)
SERVER_TOP = tuple(f"proxy.server.{m}" for m in ("app", "asgi", "admin", "access", "passthrough", "compose"))

#: package -> the packages it must never import (the layers: imports go down, never back up)
LAYERS = {
    "proxy.bench.verdict": ("proxy.bench.run", "proxy.bench.live", "proxy.bench.report", "proxy.cli", "proxy.server"),
    "proxy.bench.run": ("proxy.bench.live", "proxy.bench.report", "proxy.cli", "proxy.server"),
    # quality: below run (which drives its phases), beside verdict (which reads its figures)
    "proxy.bench.quality": (
        "proxy.bench.run",
        "proxy.bench.verdict",
        "proxy.bench.live",
        "proxy.bench.report",
        "proxy.cli",
        "proxy.server",
    ),
    "proxy.bench.live": ("proxy.bench.report", "proxy.cli", "proxy.server"),
    "proxy.bench.report": ("proxy.bench.run", "proxy.cli", "proxy.server"),
    "proxy.gpu": ("proxy.server", "proxy.bench", "proxy.cli"),
    "proxy.server": ("proxy.bench", "proxy.cli"),
    "proxy.engines": ("proxy.server", "proxy.bench", "proxy.cli", "proxy.gpu"),
    # the server wing: record <- request <- mirror <- switch; observe and workers over mirror; the app on top
    "proxy.server.record": (
        "proxy.server.request",
        "proxy.server.mirror",
        "proxy.server.switch",
        "proxy.server.observe",
        "proxy.server.workers",
        *SERVER_TOP,
    ),
    "proxy.server.request": (
        "proxy.server.mirror",
        "proxy.server.switch",
        "proxy.server.observe",
        "proxy.server.workers",
        *SERVER_TOP,
    ),
    "proxy.server.mirror": ("proxy.server.switch", "proxy.server.observe", "proxy.server.workers", *SERVER_TOP),
    "proxy.server.switch": ("proxy.server.observe", "proxy.server.workers", *SERVER_TOP),
    "proxy.server.observe": ("proxy.server.switch", "proxy.server.workers", *SERVER_TOP),
    "proxy.server.workers": SERVER_TOP,
}


def test_every_layer_imports_only_below_itself() -> None:
    graph = import_graph(REPO / "proxy")
    wrong = [
        f"{m} imports {d}"
        for m, deps in graph.items()
        for layer, banned in LAYERS.items()
        if m == layer or m.startswith(layer + ".")
        for d in deps
        if any(d == b or d.startswith(b + ".") for b in banned)
    ]
    assert wrong == []


@pytest.mark.parametrize("tree", ["perf", "grafana", "fakes", "scripts"])
def test_no_module_is_over_450_lines(tree: Path) -> None:
    long = {
        str(p.relative_to(REPO)): n
        for p in (REPO / tree).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


MAX_FUNCTION_LINES = 80
#: ``# fmt: skip`` is for data tables (metric help texts, column specs), not for packing logic onto a line
MAX_FMT_SKIPS = 80
FMT_SKIP = re.compile(r"\s*# fmt: skip$", re.M)


@pytest.fixture(scope="module")
def formatted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of ``proxy/`` with every ``# fmt: skip`` removed, formatted by the project's own ``ruff format``: the
    lines the size limits count (a marker packing logic onto one line cannot hide a module's real size)."""
    root = tmp_path_factory.mktemp("formatted")
    shutil.copy(REPO / "pyproject.toml", root)
    for p in (REPO / "proxy").rglob("*.py"):
        out = root / p.relative_to(REPO)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(FMT_SKIP.sub("", p.read_text()))
    ruff = Path(sys.executable).with_name("ruff")
    subprocess.run([str(ruff), "format", "-q", "proxy"], cwd=root, check=True, timeout=120)
    return root


def test_no_module_is_over_450_lines_as_ruff_formats_it(formatted: Path) -> None:
    long = {
        str(p.relative_to(formatted)): n
        for p in (formatted / "proxy").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_no_function_is_over_80_lines_as_ruff_formats_it(formatted: Path) -> None:
    long = {}
    for p in (formatted / "proxy").rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{p.relative_to(formatted)}:{node.name}"] = n
    assert long == {}


def test_fmt_skip_is_kept_for_data_tables() -> None:
    counts = {
        str(p.relative_to(REPO)): n
        for p in (REPO / "proxy").rglob("*.py")
        if (n := len(FMT_SKIP.findall(p.read_text())))
    }
    assert sum(counts.values()) < MAX_FMT_SKIPS, counts


#: a map line: a module's name (a sub-package's with a slash), two spaces or more, what it holds
MAP_LINE = re.compile(r"^ *([a-z_][a-z0-9_]*/?) {2,}\S")


def map_names(init: Path) -> list[str]:
    """The names an ``__init__`` docstring's map lists, in its order (repeats kept, so a test can see them)."""
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    return [m.group(1) for line in doc.splitlines() if (m := MAP_LINE.match(line))]


def test_the_map_reader_reads_only_map_lines(tmp_path: Path) -> None:
    init = tmp_path / "__init__.py"
    doc = "A package that names traffic in prose.\n\n    a      the first\n    sub/   a package\n"
    doc += "                 a continuation naming b\n  - b: not a map line\n"
    init.write_text(f'"""{doc}"""\n')
    assert map_names(init) == ["a", "sub/"]


def test_every_package_map_has_one_line_per_module() -> None:
    """Each ``__init__`` docstring is its package's map: one line per module and sub-package, starting with its name."""
    wrong = {}
    for init in sorted((REPO / "proxy").rglob("__init__.py")):
        names = map_names(init)
        have = sorted(
            [p.stem for p in init.parent.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
            + [f"{d.name}/" for d in init.parent.iterdir() if (d / "__init__.py").exists()]
        )
        if sorted(names) != have:
            wrong[str(init.relative_to(REPO))] = {"listed": sorted(names), "modules": have}
    assert wrong == {}


def test_no_two_modules_share_a_name() -> None:
    """A module's name says one concept in the whole package: no two modules share it, nor a module and a package
    (``proxy/cli/`` excepted: a command's module is named after the command, ``cli/bench.py`` drives ``bench/``)."""
    seen: dict[str, list[str]] = {}
    for p in (REPO / "proxy").rglob("*.py"):
        if p.name not in ("__init__.py", "__main__.py"):
            seen.setdefault(p.stem, []).append(str(p.relative_to(REPO)))
    for d in (REPO / "proxy").rglob("__init__.py"):
        if d.parent != REPO / "proxy":
            seen.setdefault(d.parent.name, []).append(str(d.parent.relative_to(REPO)) + "/")
    clash = {k: v for k, v in seen.items() if len(v) > 1 and len([x for x in v if not x.startswith("proxy/cli/")]) > 1}
    assert clash == {}


def test_no_package_has_more_than_15_modules_at_its_top_level() -> None:
    crowded = {
        str(d.relative_to(REPO)): n
        for d in [REPO / "proxy", *(i.parent for i in (REPO / "proxy").rglob("__init__.py"))]
        if (n := len([p for p in d.glob("*.py") if p.name not in ("__init__.py", "__main__.py")])) > 15
    }
    assert crowded == {}


def test_the_package_does_not_depend_on_aiohttp() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.lower().startswith("aiohttp")]
    users = [m for m, p in modules(REPO / "proxy").items() if "aiohttp" in import_names(p)]
    assert users == []


def test_only_the_nvml_seam_imports_pynvml() -> None:
    """GPU reading goes through ``proxy.gpu.nvml``'s reader, which the tests replay; nothing else calls NVML."""
    users = [m for m, p in modules(REPO / "proxy").items() if "pynvml" in import_names(p)]
    assert users == ["proxy.gpu.nvml"]


def import_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize(
    "argv", [["--help"], ["report", "--help"], ["tune", "--help"], ["diagnose", "--help"], ["bench", "--help"]]
)
def test_a_command_loads_only_itself(argv: list[str]) -> None:
    """Like vLLM's CLI, ``enginemeter COMMAND`` imports that command's module alone: the offline commands load no
    web server (starlette, uvicorn) and nothing of ``proxy.server``; checked in a fresh interpreter."""
    code = (
        "import sys\nfrom proxy.cli import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
        "print(sorted({m.partition('.')[0] if not m.startswith('proxy.') else '.'.join(m.split('.')[:2])"
        " for m in sys.modules} & {'starlette', 'uvicorn', 'proxy.server'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "[]"


def test_importing_the_report_command_loads_no_server() -> None:
    code = (
        "import sys, proxy.cli.report\nprint([m for m in ('starlette', 'uvicorn', 'proxy.server') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr
