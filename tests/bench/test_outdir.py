"""``--out`` never destroys a run: ``bench`` (and ``tune``, sharing ``proxy.bench.outdir``) refuses a directory that
holds one, changing nothing in it; ``--force`` writes over it; ``report`` refuses only another run's results; every
rerun the tool advises names a fresh directory. End to end on a real llama-server."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from proxy.bench.outdir import fresh, next_name, refusal
from proxy.bench.verdict.regimes import rerun
from proxy.cli import main

SMALL = ["--quick", "--no-progress", "--warmup", "0", "--aa", "off", "--concurrency", "1", "--prompt-lengths",
         "short", "--repeats", "2"]  # fmt: skip


def snapshot(d: Path) -> dict[str, tuple[int, bytes]]:
    return {str(p.relative_to(d)): (p.stat().st_mtime_ns, p.read_bytes()) for p in d.rglob("*") if p.is_file()}


def test_a_rerun_into_a_run_is_refused_and_changes_nothing(
    llama_server_factory: Callable[..., Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = llama_server_factory(np=1, ctx_size=2048).url
    out = tmp_path / "bench-out"
    bench = ["bench", "--engine", f"a={url}", *SMALL, "--out", str(out)]
    assert main(bench) == 0
    before = snapshot(out)
    assert {"results.jsonl", "report.md", "report.html", "verdict.json"} <= set(before)
    capsys.readouterr()

    assert main(bench) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("enginemeter bench: ") and "already holds a run" in err
    assert f"--out {tmp_path / 'bench-out-2'}" in err and "--force" in err
    assert snapshot(out) == before  # not one byte, not one mtime

    assert main(["tune", "--launch", "llama-server -m M -np {1,2} --port {port}", "--out", str(out)]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert snapshot(out) == before

    # report: rebuilding the run's own report in place is fine; another run's results beside it are not
    other = tmp_path / "other"
    assert main(["report", "--results", str(out), "--out", str(other)]) == 0
    assert main(["report", "--results", str(out), "--out", str(other)]) == 0  # a report where a report was
    assert main(["report", "--results", str(out), "--out", str(out)]) == 0
    capsys.readouterr()
    (other / "results.jsonl").write_bytes((out / "results.jsonl").read_bytes())
    kept = snapshot(other)
    assert main(["report", "--results", str(out), "--out", str(other)]) == 2
    assert "already holds a run (results.jsonl)" in capsys.readouterr().err
    assert snapshot(other) == kept

    assert main([*bench, "--force"]) == 0
    after = snapshot(out)
    assert after["results.jsonl"] != before["results.jsonl"]


def test_advice_names_a_fresh_directory(tmp_path: Path) -> None:
    assert next_name("bench-out") == "bench-out-2"
    assert next_name("runs/x-2/") == "runs/x-3"
    (tmp_path / "r-2").mkdir()
    assert fresh(tmp_path / "r") == tmp_path / "r-3"
    assert refusal(tmp_path / "r-2", force=False) is None  # empty: free to write into
    assert rerun("enginemeter bench --engine a=u --out runs/one --repeats 3", "--repeats 8") == (
        "enginemeter bench --engine a=u --repeats 8 --out runs/one-2"
    )
    assert rerun("enginemeter tune --launch 'x -np {1,2}'", "--repeats 8").endswith("--repeats 8 --out tune-out-2")
    assert rerun("enginemeter bench --out=b-7", "--repeats 4").endswith("--out b-8")
