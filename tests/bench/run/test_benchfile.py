"""``bench --config FILE``: read as strictly as the proxy's config (``proxy.bench.run.benchfile``). Pure."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.bench.run.benchfile import read_bench_file
from proxy.cli import main
from proxy.config.settings import SettingsError


def test_a_bench_file_with_launched_and_resident_engines(tmp_path: Path) -> None:
    f = tmp_path / "bench.yaml"
    f.write_text("engines:\n"
                 "  - {name: llama, launch: 'llama-server -m /m/q4.gguf --port {port}'}\n"
                 "  - {name: sglang, url: 'http://127.0.0.1:30000', quantization: FP8}\n"
                 "memory_budget: 72GiB\naccept_quantization_difference: true\nconcurrency: [1, 4]\n")  # fmt: skip
    doc = read_bench_file(f)
    assert [(e.name, e.launch, e.url) for e in doc.engines] == [
        ("llama", "llama-server -m /m/q4.gguf --port {port}", None), ("sglang", None, "http://127.0.0.1:30000")]  # fmt: skip
    assert doc.concurrency == (1, 4) and doc.accept_quantization_difference is True


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("concurency: [1, 2]\n", "bench.yaml:1: concurency: unknown key (did you mean 'concurrency'?)"),
        ("repeats: three\n", "bench.yaml:1: repeats: expected an integer, got 'three'"),
        ("engines:\n  - {name: a, url: 'http://x', launch: 'llama-server'}\n",
         "bench.yaml:2: engines[0]: give exactly one of url (a running engine) and launch (a command line)"),
        ("engines:\n  - {name: a, url: 'http://x'}\n  - {name: a, url: 'http://y'}\n",
         "bench.yaml:3: engines[1].name: duplicate engine name 'a'"),
        ("engines:\n  - {name: a, url: 'http://x'}\nbaseline: b\n", "bench.yaml:3: baseline: unknown engine 'b'"),
        ("cache: lukewarm\n", "bench.yaml:1: cache: expected one of 'cold', 'warm' or 'both', got 'lukewarm'"),
    ],
)  # fmt: skip
def test_each_mistake_is_one_line_with_its_file_and_line(tmp_path: Path, text: str, problem: str) -> None:
    f = tmp_path / "bench.yaml"
    f.write_text(text)
    with pytest.raises(SettingsError) as info:
        read_bench_file(f)
    assert str(info.value).startswith(str(tmp_path / problem)), str(info.value)


def test_bench_refuses_a_bad_file_with_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "bench.yaml"
    f.write_text("repeats: 0\n")
    assert main(["bench", "--config", str(f), "--engine", "a=http://127.0.0.1:9", "--out", str(tmp_path)]) == 2
    assert "bench.yaml:1: repeats:" in capsys.readouterr().err
