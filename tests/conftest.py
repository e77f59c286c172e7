"""Fixtures for tests that need a real engine. The names are stable: everyone's tests use them.

============================  ==========  ==================================================================
fixture                       scope       value
============================  ==========  ==================================================================
``llama_server_bin``          session     ``Path`` of llama-server (``build_llama_server()``;
                                          ``$LLAMA_SERVER_BIN`` wins)
``tiny_model``                session     ``Path``: 2 layers x 64, qwen2 architecture and vocabulary (152k
                                          tokens, ChatML template), random weights, 45 MB
``tiny_model_spm``            session     ``Path``: same size, llama architecture, llama-spm vocabulary (32k,
                                          adds BOS, Llama-2 style template), 9 MB
``llama_server``              session     running :class:`proxy.embedded.LlamaServer` on ``tiny_model``:
                                          ``-np 2 -c 2048`` (1024 per slot), alias ``"tiny"``, ``--metrics``
``llama_server_factory``      function    ``factory(model=tiny_model, np=1, alias="tiny", extra_args=(),
                                          ctx_size=2048, threads=1, **LlamaServer kwargs)`` -> a started
                                          LlamaServer; every one is stopped at teardown. ``extra_args`` go
                                          last, so ``["-c", "8192"]`` overrides ``ctx_size``.
============================  ==========  ==================================================================

What the tiny models do (see ``proxy/embedded/__init__.py``): greedy decoding never stops early — ``max_tokens=N``
gives exactly N completion tokens, ``finish_reason == "length"`` — and each streamed token arrives as one
event with non-empty text. Greedy output is the same on ``-np 1`` and ``-np 2`` engines. Decode is about
650 tok/s (qwen2 vocab) and 2,500 tok/s (llama-spm) on one CPU thread here; start-up takes under a second.

Building: if a collected test uses any of these fixtures and no binary is cached, llama-server is built
once in ``pytest_collection_finish`` — before any test starts, so per-test timeouts don't cut it short
(about 8 minutes on 2 cores). Its log goes to ``<cache>/build-<version>-<flavour>.log``.

Tiers: every test that uses one of these fixtures (directly or through another fixture) is marked ``engine``
here, and every test listed in :data:`tests.tiers.SLOW` (waiting by design: subprocess CLIs, ``serve --workers``,
timeouts, a live Prometheus) ``slow``; ``pytest -m "not engine and not slow and not perf"`` (``scripts/check``)
runs the rest, never builds llama-server, and ends by naming its tests over the fast tier's per-test budget.

The proxy under test: ``proxy_factory(settings, nvml=None)`` (function scope) serves ``build_app(settings)``
on a real uvicorn socket until the test ends and returns a :class:`tests.helpers.ProxyUnderTest` (url,
registry, gateway, Results); module-scoped set-ups call :func:`tests.helpers.start_proxy` with their own stack.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from proxy.config.settings import Settings
from proxy.embedded import LlamaServer, build_llama_server, cache_root, make_model, server_dir
from tests import helpers, tiers
from tests.helpers import LlamaServerFactory, ProxyFactory, ProxyUnderTest

if TYPE_CHECKING:
    from proxy.gpu.nvml import Opener

TINY_ALIAS = "tiny"
ENGINE_FIXTURES = frozenset(
    {"llama_server_bin", "tiny_model", "tiny_model_spm", "llama_server", "llama_server_factory"}
)


def uses_engine(item: pytest.Item) -> bool:
    return bool(ENGINE_FIXTURES.intersection(getattr(item, "fixturenames", ())))


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if uses_engine(item):
            item.add_marker(pytest.mark.engine)
    tiers.mark_slow(items)


_call_s: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call":
        _call_s[report.nodeid] = report.duration


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """The fast tier's guard: name its tests over the per-test budget (they belong in tests/tiers.py's SLOW)."""
    if "not slow" not in (config.option.markexpr or "") or not (over := tiers.over_budget(_call_s)):
        return
    terminalreporter.section("fast tier: over the per-test budget")
    terminalreporter.write_line(
        f"{len(over)} test(s) over {tiers.FAST_TEST_BUDGET_S} s (quiet two-core figures; a loaded machine runs slower):"
        " one that waits by design belongs in tests/tiers.py's SLOW"
    )
    for line in over:
        terminalreporter.write_line(line)


def pytest_collection_finish(session: pytest.Session) -> None:
    if not any(uses_engine(item) for item in session.items):
        return
    import os

    if os.environ.get("LLAMA_SERVER_BIN") or (server_dir() / "bin" / "llama-server").is_file():
        return
    log_path = cache_root() / f"build-{server_dir().name.removeprefix('llama-server-')}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    reporter: Any = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"building llama-server once (several minutes); log: {log_path}")
    with open(log_path, "a") as log:
        path = build_llama_server(log=log)
    if reporter is not None:
        reporter.write_line(f"built {path}")


@pytest.fixture(scope="session")
def llama_server_bin() -> Path:
    return build_llama_server()


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return make_model(vocab="qwen2")


@pytest.fixture(scope="session")
def tiny_model_spm() -> Path:
    return make_model(vocab="llama-spm")


@pytest.fixture(scope="session")
def wider_model() -> Path:
    """A llama-spm model 4 layers x 256 (40 MB): enough work per token that a KV-cache format, a micro-batch size
    or batching four requests together shows in the decode and the prefill (the tiny model's tokens cost next to
    nothing either way)."""
    return make_model(vocab="llama-spm", n_layer=4, n_embd=256, n_ff=768, n_head=8, n_head_kv=8)


@pytest.fixture(scope="session")
def memory_bound_model() -> Path:
    """``wider_model``'s geometry in F32 (76 MB): more weights than a 32 MB L3 holds, so each decode step streams
    them from memory and four sequences per read raise the tok/s. Measured at c=4 with -t 1 on a 2-core machine
    like CI's (AMD EPYC, 32 MB L3): -np 4 gave 17–27 % more than -np 1 here, and 15–20 % less on the F16 file
    (38 MB: computing, not waiting on memory)."""
    return make_model(vocab="llama-spm", n_layer=4, n_embd=256, n_ff=768, n_head=8, n_head_kv=8, dtype="f32")


@pytest.fixture(scope="session")
def llama_server(
    llama_server_bin: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LlamaServer]:
    log_path = tmp_path_factory.mktemp("llama_server") / "llama-server.log"
    with LlamaServer(
        tiny_model, binary=llama_server_bin, n_parallel=2, ctx_size=2048, alias=TINY_ALIAS, log_path=log_path
    ) as server:
        yield server


@pytest.fixture
def llama_server_factory(llama_server_bin: Path, tiny_model: Path, tmp_path: Path) -> Iterator[LlamaServerFactory]:
    started: list[LlamaServer] = []

    def factory(
        model: Path | None = None,
        np: int = 1,
        alias: str | None = TINY_ALIAS,
        extra_args: Sequence[str] = (),
        ctx_size: int = 2048,
        threads: int = 1,
        **kwargs: Any,
    ) -> LlamaServer:
        server = LlamaServer(
            model or tiny_model,
            binary=llama_server_bin,
            n_parallel=np,
            ctx_size=ctx_size,
            threads=threads,
            alias=alias,
            extra_args=extra_args,
            log_path=kwargs.pop("log_path", tmp_path / f"llama-server-{len(started)}.log"),
            **kwargs,
        )
        started.append(server)
        return server.start()

    yield factory
    for server in started:
        server.stop()


@pytest.fixture
def proxy_factory() -> Iterator[ProxyFactory]:
    with ExitStack() as stack:

        def start(settings: Settings, *, nvml: Opener | None = None, http: str | None = None) -> ProxyUnderTest:
            return helpers.start_proxy(stack, settings, nvml=nvml, http=http)

        yield start
