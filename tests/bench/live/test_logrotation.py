"""``report --log FILE`` reads every rotated file of the proxy's comparison log (proxy/jsonlog.py's rotation,
proxy/bench/live/log.py's reading): a real ``serve --workers 2`` writing a log that rotates, the banner's report
command run as printed; the writer's own threads rotating while a reader reads."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from proxy.bench.live.log import expand, read_log, select
from proxy.jsonlog import ComparisonLog, open_together, rotated_family
from tests.helpers import REPO, ProcessServer, wait_until

BODY = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


def pairs_in(log: Path) -> int:
    return sum(f.read_bytes().count(b'"type":"pair"') for f in map(Path, rotated_family(str(log))))


@contextmanager
def serving(tmp_path: Path, config: Path) -> Iterator[tuple[subprocess.Popen[str], list[str]]]:
    """``serve --config`` with 2 workers; its stdout lines so far (the banner)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "serve", "--config", str(config), "--listen", "127.0.0.1:0",
         "--workers", "2", "--log-level", "warning"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("ENGINEMETER_")},
    )  # fmt: skip
    watchdog = threading.Timer(240, proc.kill)
    watchdog.start()
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("  try:"):
                break
        yield proc, lines
    finally:
        watchdog.cancel()
        proc.terminate()
        proc.communicate(timeout=60)


def run_as_printed(cwd: Path, command: str) -> subprocess.CompletedProcess[str]:
    argv = shlex.split(command)
    assert argv[0] == "enginemeter"
    return subprocess.run([str(Path(sys.executable).parent / "enginemeter"), *argv[1:]], cwd=cwd, capture_output=True,
                          text=True, timeout=300, check=False)  # fmt: skip


def decisions(out: Path) -> list[tuple[str, str, str]]:
    doc = json.loads((out / "verdict.json").read_text())
    return [(v["baseline"], v["candidate"], v["decision"]) for v in doc["verdicts"]]


def test_200_mirrored_requests_through_rotated_logs_give_200_pairs_from_the_banners_command(tmp_path: Path) -> None:
    """Issue 35: ``serve --workers 2``, ``mirror.log_max_bytes: 30000``, 200 mirrored requests, then the banner's
    ``report`` command: 4 pairs and INCONCLUSIVE (the rest, engine records included, were in rotated files); the
    verdict changed with a log setting."""
    log = tmp_path / "cmp.jsonl"
    with (
        ProcessServer("fakes.fault_engine", "--tokens", "4", ready_path="/health") as a,
        ProcessServer("fakes.fault_engine", "--tokens", "4", ready_path="/health") as b,
    ):
        config = tmp_path / "enginemeter.yaml"
        config.write_text(
            "engines:\n"
            f"  - {{name: a, url: '{a.url}', kind: llamacpp}}\n"
            f"  - {{name: b, url: '{b.url}', kind: llamacpp}}\n"
            "routes:\n  - {primary: a, shadows: [b]}\n"
            f"mirror: {{log_path: '{log}', log_max_bytes: 30000, log_backups: 50}}\n"
            "collectors: {gpu: false}\n"
        )
        with serving(tmp_path, config) as (_, banner):
            base = next(line for line in banner if line.startswith("enginemeter listening on")).split()[3]
            command = next(line for line in banner if line.startswith("  report:")).split(":", 1)[1].strip()
            assert shlex.split(command)[shlex.split(command).index("--log") + 1] == str(log)

            def one(_: int) -> int:
                return httpx.post(f"{base}/v1/chat/completions", json=BODY, headers={"connection": "close"}).status_code

            with ThreadPoolExecutor(8) as pool:
                assert set(pool.map(one, range(200))) == {200}
            wait_until(lambda: pairs_in(log) == 200, timeout=60, message="200 pairs in the log's files")
            files = rotated_family(str(log))
            assert len(files) >= 5, files  # it did rotate, several times
            # every file after the first starts with the run's header: which run and engines its pairs belong to
            for f in files[:-1]:
                first = json.loads(Path(f).read_text().splitlines()[0])
                assert first["type"] == "run" and (first.get("continued") or f == files[0]), (f, first)
            report = run_as_printed(tmp_path, command)
            assert report.returncode == 0, report.stderr
            assert f"note: comparison log: {len(files)} files read, oldest first" in report.stdout
            assert ": 200 pairs" in report.stdout and "warning:" not in report.stderr, report.stdout + report.stderr
            md = (tmp_path / "enginemeter-report" / "report.md").read_text()
            assert "200 pairs mirrored from a to b" in md
            # the glob form reads the same files and decides the same
            glob = subprocess.run(
                [str(Path(sys.executable).parent / "enginemeter"), "report", "--log", f"{log}*", "--out",
                 str(tmp_path / "glob")], capture_output=True, text=True, timeout=300, check=False,
            )  # fmt: skip
            assert glob.returncode == 0, glob.stderr
            assert decisions(tmp_path / "glob") == decisions(tmp_path / "enginemeter-report")
    # the oldest files rotated away (what log_backups does once it is exceeded): the report says so, and still
    # knows the run and its engines from the header of the oldest file left
    for f in files[:3]:
        os.unlink(f)
    out = subprocess.run(
        [str(Path(sys.executable).parent / "enginemeter"), "report", "--log", str(log), "--out", str(tmp_path / "cut")],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    held = sum(Path(f).read_bytes().count(b'"type":"pair"') for f in files[3:])
    assert 0 < held < 200 and f": {held} pairs" in out.stdout
    assert f"began before the oldest file read ({files[3]})" in out.stderr, out.stderr
    assert "its workers compared 200 pairs" in out.stderr  # from the end records the workers wrote at shutdown
    assert "warning:" in (tmp_path / "cut" / "report.md").read_text()


def _records(path: Path, n: int, run: str = "r1") -> None:
    lines = [{"type": "run", "run": run, "ts": 1.0, "pairs": [["a", "b"]]}]
    side = {"outcome": "ok", "e2e_s": 0.1}
    lines += [{"type": "pair", "run": run, "ts": 2.0 + i, "primary": {**side, "engine": "a"},
               "shadow": {**side, "engine": "b"}} for i in range(n)]  # fmt: skip
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_a_plain_path_brings_its_rotated_files_oldest_first_and_gaps_are_warned(tmp_path: Path) -> None:
    log = tmp_path / "c.jsonl"
    for name in ("c.jsonl.3", "c.jsonl.1", "c.jsonl", "c.jsonl.10x", "other.jsonl.1"):
        (tmp_path / name).write_text("")
    assert expand([str(log)]) == [tmp_path / "c.jsonl.3", tmp_path / "c.jsonl.1", log]
    _records(tmp_path / "c.jsonl.3", 2)
    (tmp_path / "c.jsonl.1").write_text("")
    _records(log, 3, run="r2")
    sel = select(read_log(expand([str(log)])), run="all")
    assert sel.read.startswith("3 files read, oldest first") and sel.read.endswith(": 5 pairs")
    assert any("c.jsonl.2 missing between those read" in w for w in sel.warnings), sel.warnings
    # one rotated file named alone: the rest of its log is named, not silently left out
    alone = select(read_log(expand([str(tmp_path / "c.jsonl.3")])))
    assert any(f"c.jsonl.3 is one rotated file of {log}" in w for w in alone.warnings), alone.warnings


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its mode")
def test_a_file_that_cannot_be_read_is_warned_and_the_rest_read(tmp_path: Path) -> None:
    log = tmp_path / "c.jsonl"
    _records(tmp_path / "c.jsonl.1", 2)
    _records(log, 3)
    (tmp_path / "c.jsonl.1").chmod(0)
    sel = select(read_log(expand([str(log)])))
    assert any("could not read" in w and "c.jsonl.1" in w for w in sel.warnings)
    assert sum(map(len, sel.pairs.values())) == 3


def test_reading_while_the_writer_rotates_never_reads_a_line_twice_or_misses_one(tmp_path: Path) -> None:
    """The reader opens a log's files under the shared lock the writer rotates under: each read is one state of the
    log. Without it a rotation between two opens read a file twice or missed one (checked here by sequence
    numbers: every read holds one unbroken run of them)."""
    path = tmp_path / "seq.jsonl"
    log = ComparisonLog(str(path), max_bytes=2000, backups=1000)
    stop = threading.Event()

    def write() -> None:
        i = 0
        while not stop.is_set():
            for _ in range(50):
                log.write({"n": i, "pad": "x" * 40})
                i += 1
            log.flush()

    writer = threading.Thread(target=write)
    writer.start()
    try:
        reads = 0
        while reads < 100 or len(rotated_family(str(path))) < 20:
            with open_together([str(path)]) as opened:
                numbers = [json.loads(line)["n"] for _, f in opened if not isinstance(f, OSError) for line in f]
            reads += 1
            assert numbers == list(range(len(numbers))), [n for i, n in enumerate(numbers) if n != i][:5]
    finally:
        stop.set()
        writer.join()
        log.close()
    assert reads >= 100 and len(rotated_family(str(path))) >= 20  # it rotated under the reads
