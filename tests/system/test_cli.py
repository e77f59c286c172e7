"""proxy/cli/serve.py as a user runs it: ``python -m proxy.cli ...`` subprocesses, real files, real sockets."""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from fakes.fault_engine import FaultEngineConfig, Knobs, run_in_thread
from proxy import __version__
from proxy.config.settings import EngineSettings, RouteSettings, Settings, json_schema
from proxy.listen import engine_at_listen_address
from tests.helpers import REPO, LlamaServerFactory, wait_until

LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: ")


def clean_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENGINEMETER_")}
    return {**env, "XDG_STATE_HOME": str(tmp_path / "state"), **extra}


def cli(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy.cli", *args],
        cwd=REPO, env=clean_env(tmp_path, **env), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def one_line_error(run: subprocess.CompletedProcess[str]) -> str:
    """The run failed with status 2 and said why in exactly one line, without a traceback."""
    assert run.returncode == 2, (run.returncode, run.stdout, run.stderr)
    assert "Traceback" not in run.stderr
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.stderr
    return lines[0]


class Serving:
    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.stdout: list[str] = []

    def read_until(self, prefix: str) -> str:
        """Lines of stdout until one starting with ``prefix`` (fails if the process ends first)."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.stdout.append(line)
            if line.startswith(prefix):
                return line
        raise AssertionError(f"exited {self.proc.wait()} before {prefix!r}; stdout: {''.join(self.stdout)}")

    def stop(self) -> tuple[int, str]:
        """Ctrl-C; the exit status and all of stderr."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        out, err = self.proc.communicate(timeout=30)
        self.stdout.append(out)
        return self.proc.returncode, err


@contextmanager
def serving(tmp_path: Path, *args: str, watchdog_s: float = 120, **env: str) -> Iterator[Serving]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "serve", *args], cwd=REPO, env=clean_env(tmp_path, **env),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    watchdog = threading.Timer(watchdog_s, proc.kill)  # a hung start fails the test instead of the session
    watchdog.start()
    try:
        yield Serving(proc)
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # lets the demo stop its engines
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        proc.communicate(timeout=30)


# --------------------------------------------------------------------------------------------- version, help


def test_version_matches_the_package(tmp_path: Path) -> None:
    run = cli(tmp_path, "--version")
    assert run.returncode == 0 and run.stdout == f"enginemeter {__version__}\n"
    assert tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"] == __version__


@pytest.mark.parametrize("command", [[], ["serve"], ["check-config"]])
def test_every_help_describes_and_gives_examples(tmp_path: Path, command: list[str]) -> None:
    run = cli(tmp_path, *command, "--help")
    assert run.returncode == 0, run.stderr
    assert "examples:" in run.stdout and "enginemeter " in run.stdout.split("examples:")[1]
    if command == ["serve"]:
        text = " ".join(run.stdout.split())
        assert "builds llama-server from source (about 8 minutes" in text and "a demo" in text
        assert "{debug,info,warning,error,critical}" in text


# --------------------------------------------------------------------------------------------- mistakes


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["serve", "--log-level", "foo"], "enginemeter serve: argument --log-level: invalid choice: 'foo'"),
        (["serve", "--shadow-rate", "2"], "enginemeter serve: argument --shadow-rate: expected a number within [0, 1]"),
        (["serve", "--listen", "nope"], "enginemeter serve: argument --listen: expected HOST:PORT"),
        (["serve", "--bogus"], "enginemeter: unrecognized arguments: --bogus"),
        (
            ["serve", "--primary", "ftp://x"],
            "enginemeter: --primary: expected a URL like http://host:port, got 'ftp://x'",
        ),
        (["serve", "--shadow", "http://127.0.0.1:1"], "enginemeter: --shadow: needs --primary"),
        (["frobnicate"], "enginemeter: argument COMMAND: invalid choice: 'frobnicate'"),
        ([], "enginemeter: the following arguments are required: COMMAND"),
    ],
)
def test_flag_mistakes_are_one_line_and_status_2(tmp_path: Path, args: list[str], message: str) -> None:
    assert one_line_error(cli(tmp_path, *args)).startswith(message)


ISSUE_MISTAKES = [
    ("timeouts: {read: abc}", "engines[0].timeouts.read: expected a number, got 'abc'"),
    ("max_in_flight", "mirror.max_in_flight: expected an integer, got '3'"),
    ("gpu", "collectors.gpu: expected true or false, got 'no'"),
    ("temprature", "sampling_defaults.temprature: unknown key (did you mean 'temperature'?)"),
    ("alias", "models[0].alias: required key missing"),
    ("${", "engines[0].api_key: environment variable SGLANG_KEY is not set"),
]
ENGINE_LINE = "engines:\n  - {name: a, url: 'http://127.0.0.1:1', timeouts: {read: 30}, api_key: k}\n"
FILES = {
    "timeouts: {read: abc}": ENGINE_LINE.replace("read: 30", "read: abc"),
    "max_in_flight": ENGINE_LINE + "mirror:\n  max_in_flight: '3'\n",
    "gpu": ENGINE_LINE + "collectors: {gpu: 'no'}\n",
    "temprature": ENGINE_LINE + "sampling_defaults: {temprature: 0.5}\n",
    "alias": ENGINE_LINE + "models:\n  - {engines: {a: x}}\n",
    "${": ENGINE_LINE.replace("api_key: k", "api_key: '${SGLANG_KEY}'"),
}


@pytest.mark.parametrize(("case", "message"), ISSUE_MISTAKES)
def test_config_mistakes_are_one_line_naming_file_line_and_key(tmp_path: Path, case: str, message: str) -> None:
    cfg = tmp_path / "enginemeter.yaml"
    cfg.write_text(FILES[case])
    line = one_line_error(cli(tmp_path, "serve", "--config", str(cfg)))
    assert re.fullmatch(rf"enginemeter: {re.escape(str(cfg))}:\d+: {re.escape(message)}.*", line), line
    # check-config says the same, and the variable, once set, is read
    assert one_line_error(cli(tmp_path, "check-config", str(cfg))) == line
    if case == "${":
        ok = cli(tmp_path, "check-config", str(cfg), SGLANG_KEY="sk-1")
        assert ok.returncode == 0 and ok.stdout.startswith(f"{cfg}: ok: 1 engine(s) (a)"), ok.stderr


def test_check_config_lists_every_problem_and_prints_the_schema(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(ENGINE_LINE + "mirror: {max_in_flight: '3'}\ncollectors:\n  gpu: 'no'\n")
    run = cli(tmp_path, "check-config", str(cfg))
    assert run.returncode == 2
    assert run.stderr.splitlines() == [
        f"enginemeter: {cfg}:3: mirror.max_in_flight: expected an integer, got '3'",
        f"enginemeter: {cfg}:5: collectors.gpu: expected true or false, got 'no'",
    ]
    schema = cli(tmp_path, "check-config", "--schema")
    assert schema.returncode == 0 and json.loads(schema.stdout) == json_schema()


# --------------------------------------------------------------------------------------------- serve


def test_banner_only_once_the_socket_serves_and_one_log_format(tmp_path: Path) -> None:
    with (
        run_in_thread(FaultEngineConfig(knobs=Knobs(tokens=2))) as engine,
        serving(tmp_path, "--primary", f"llama={engine}", "--listen", "127.0.0.1:0") as s,
    ):
        banner = s.read_until("enginemeter listening on ")
        base = banner.split()[-1]
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", base) and not base.endswith(":0")  # the bound port
        # straight after the banner, with no retry: the proxy must already accept and answer
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200
        rc, err = s.stop()
    assert rc == 0
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines and all(LOG_LINE.match(ln) for ln in lines), err  # uvicorn's lines in our format too
    assert any(" uvicorn.error: " in ln for ln in lines) and any(" enginemeter" in ln for ln in lines)


def test_busy_port_is_one_line_and_no_banner(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = cli(tmp_path, "serve", "--primary", "a=http://127.0.0.1:1", "--listen", f"127.0.0.1:{port}")
    assert run.returncode == 1 and "listening on" not in run.stdout
    assert run.stderr.splitlines() == [
        f"enginemeter: cannot listen on 127.0.0.1:{port}: address already in use "
        "(is another enginemeter or an engine using it? pick another with --listen)"
    ]


@pytest.mark.parametrize(("engine_host", "listen_host"), [("127.0.0.1", "127.0.0.1"), ("localhost", "0.0.0.0")])
def test_listen_on_an_engines_address_is_refused(tmp_path: Path, engine_host: str, listen_host: str) -> None:
    with run_in_thread(FaultEngineConfig()) as engine:
        port = int(engine.rsplit(":", 1)[1])
        url = f"http://{engine_host}:{port}"
        run = cli(tmp_path, "serve", "--primary", url, "--listen", f"{listen_host}:{port}")
    line = one_line_error(run)
    assert line == (
        f"enginemeter: listen address {listen_host}:{port} is the address of engine 'llamacpp' ({url}): "
        "the proxy would send requests to itself; pick another with --listen HOST:PORT"
    )
    assert "listening on" not in run.stdout


def test_engine_at_listen_address() -> None:
    def at(url: str, host: str, port: int) -> bool:
        s = Settings(
            engines=(EngineSettings(name="e", url=url),), routes=(RouteSettings(primary="e"),), host=host, port=port
        )
        return engine_at_listen_address(s) is not None

    assert at("http://127.0.0.1:8081", "127.0.0.1", 8081)
    assert at("http://localhost:8081/", "127.0.0.1", 8081)
    assert at("http://[::1]:8081", "::", 8081)
    assert at("http://127.0.0.1:80", "0.0.0.0", 80) and at("http://127.0.0.1", "0.0.0.0", 80)
    assert not at("http://127.0.0.1:8081", "127.0.0.1", 8080)
    assert not at("http://10.1.2.3:8081", "127.0.0.1", 8081)  # another machine
    assert not at("https://127.0.0.1", "127.0.0.1", 80)


def pairs_of(log: Path, run: str, n: int) -> bool:
    """The log holds ``n`` pair records of ``run``."""
    lines = log.read_text().splitlines() if log.exists() else []
    return sum(1 for line in lines if (r := json.loads(line)).get("run") == run and r["type"] == "pair") == n


def run_as_printed(tmp_path: Path, command: str) -> subprocess.CompletedProcess[str]:
    """A command line the banner printed, run as a user would paste it (the installed ``enginemeter``)."""
    argv = shlex.split(command)
    assert argv[0] == "enginemeter"
    return subprocess.run([str(Path(sys.executable).parent / "enginemeter"), *argv[1:]], cwd=tmp_path,
                          env=clean_env(tmp_path), capture_output=True, text=True, timeout=300, check=False)  # fmt: skip


def test_the_banners_report_command_works_as_printed_and_reports_its_own_run(
    tmp_path: Path, llama_server_factory: LlamaServerFactory
) -> None:
    """Two proxy runs of the quick form write one default log; each banner's report command, pasted while its
    proxy runs, reports that run's pairs only; a plain ``report --log`` reads the latest, ``--run`` each one."""
    a, b = llama_server_factory(np=1), llama_server_factory(np=1)
    body = {"model": "anything", "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    runs: list[str] = []
    for n in (7, 4):
        with serving(tmp_path, "--primary", a.url, "--shadow", b.url, "--listen", "127.0.0.1:0", "--workers", "1") as s:
            base = s.read_until("enginemeter listening on ").split()[-1]
            assert s.read_until("  engine ").split() == ["engine", "llamacpp-1", a.url]  # named by kind
            log = Path(s.read_until("  comparison log:").split(":", 1)[1].strip())
            assert log == tmp_path / "state" / "enginemeter" / "comparisons.jsonl"
            command = s.read_until("  report:").split(":", 1)[1].strip()
            argv = shlex.split(command)
            runs.append(argv[argv.index("--run") + 1])
            assert argv[argv.index("--proxy") + 1] == base and argv[argv.index("--log") + 1] == str(log)
            for _ in range(n):
                assert httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).status_code == 200
            wait_until(functools.partial(pairs_of, log, runs[-1], n), timeout=30)
            report = run_as_printed(tmp_path, command)
            assert report.returncode == 0, report.stderr
            head = next(line for line in report.stdout.splitlines() if line.startswith("workload"))
            assert head.split()[-2:] == ["llamacpp-1", "llamacpp-2"], report.stdout  # the names the quick form gave
            md = (tmp_path / "enginemeter-report" / "report.md").read_text()
            assert f"{n} pairs mirrored from llamacpp-1 to llamacpp-2" in md and f"proxy run(s): {runs[-1]}" in md
            assert "quantization equal: llamacpp-1 F16 (engine info) vs llamacpp-2 F16 (engine info)" in md
            assert s.stop()[0] == 0
    assert runs[0] != runs[1]
    latest = cli(tmp_path, "report", "--log", str(log), "--out", str(tmp_path / "latest"))
    assert latest.returncode == 0, latest.stderr
    assert f"the latest proxy run only: {runs[1]}" in latest.stdout and runs[0] in latest.stdout
    assert "4 pairs mirrored" in (tmp_path / "latest" / "report.md").read_text()
    for rid, n in zip(runs, (7, 4), strict=True):
        one = cli(tmp_path, "report", "--log", str(log), "--run", rid[:17], "--out", str(tmp_path / rid))
        assert one.returncode == 0, one.stderr
        assert f"{n} pairs mirrored" in (tmp_path / rid / "report.md").read_text()
    both = cli(tmp_path, "report", "--log", str(log), "--run", "all", "--out", str(tmp_path / "all"))
    assert both.returncode == 0 and "11 pairs mirrored" in (tmp_path / "all" / "report.md").read_text()


def test_no_report_command_without_a_shadow(tmp_path: Path) -> None:
    with (
        run_in_thread(FaultEngineConfig()) as a,
        serving(tmp_path, "--primary", f"a={a}", "--listen", "127.0.0.1:0") as s,
    ):
        s.read_until("  route * -> a")
        s.read_until("  try: ")
        assert not any("report" in line or "comparison log" in line for line in s.stdout)
        assert s.stop()[0] == 0


def test_no_log_mirrors_without_a_comparison_log(tmp_path: Path) -> None:
    with (
        run_in_thread(FaultEngineConfig()) as a,
        run_in_thread(FaultEngineConfig()) as b,
        serving(tmp_path, "--primary", f"a={a}", "--shadow", f"b={b}", "--no-log", "--listen", "127.0.0.1:0") as s,
    ):
        s.read_until("  route * -> a (shadow: b @ 1)")
        s.read_until("  try: ")
        assert not any("comparison log" in line for line in s.stdout)
        assert s.stop()[0] == 0
    assert not (tmp_path / "state").exists()


def test_bare_serve_is_the_demo_and_ctrl_c_stops_its_engines(
    tmp_path: Path, llama_server_bin: Path, tiny_model: Path
) -> None:
    """No --primary, no config: two real llama-server engines (np1, np2) behind the proxy, np2 mirrored."""
    workdir = str(tmp_path / "w")
    with serving(
        tmp_path,
        "--listen",
        "127.0.0.1:0",
        "--workdir",
        workdir,
        watchdog_s=180,
        LLAMA_SERVER_BIN=str(llama_server_bin),
    ) as s:
        base = s.read_until("enginemeter listening on ").split()[-1]
        engines = [s.read_until("  engine ").split()[1:] for _ in range(2)]
        assert [name for name, _ in engines] == ["np1", "np2"]
        assert s.read_until("  route ").split() == ["route", "*", "->", "np1", "(shadow:", "np2", "@", "1)"]
        log = Path(s.read_until("  comparison log:").split(":", 1)[1].strip())
        body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        assert httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).status_code == 200
        wait_until(lambda: log.exists() and log.read_text().count("\n") >= 1, timeout=60)
        rc, err = s.stop()
    assert rc == 0, err
    assert all(LOG_LINE.match(ln) for ln in err.splitlines() if ln.strip()), err
    assert "no engines configured" in err and "llama-server from source" not in err  # the binary is there: no build
    for _, url in engines:  # the engines went with the proxy
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health", timeout=5)


# --------------------------------------------------------------------------------------------- issue 20


@pytest.mark.parametrize("keys", ["", " ", ",", " , ", "sk-a,,sk-b", "sk-a, "])
def test_blank_api_keys_from_the_environment_are_refused_at_start(tmp_path: Path, keys: str) -> None:
    """A blank ENGINEMETER_API_KEYS used to override the file's keys with none: authentication off."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("api_keys: [sk-file]\nengines:\n  - {name: a, url: 'http://127.0.0.1:1'}\n")
    line = one_line_error(cli(tmp_path, "serve", "--config", str(cfg), "--listen", "127.0.0.1:0", ENGINEMETER_API_KEYS=keys))  # fmt: skip
    assert line.startswith("enginemeter: ENGINEMETER_API_KEYS ") and "blank" in line, line
    assert one_line_error(cli(tmp_path, "check-config", str(cfg).replace("c.yaml", "none.yaml"))).endswith("cannot read: No such file or directory")  # fmt: skip


SECRET = "S3CRET-PW"


@pytest.mark.parametrize(
    ("how", "args", "env", "file"),
    [
        ("engine url", [], {}, "engines:\n  - {name: a, url: 'htp://user:S3CRET-PW@10.0.0.5:8081'}\n"),
        ("url without a scheme", [], {}, "engines:\n  - {name: a, url: 'user:S3CRET-PW@10.0.0.5:8081'}\n"),
        (
            "tracing endpoint",
            [],
            {},
            "engines:\n  - {name: a, url: 'http://127.0.0.1:1'}\ntracing: {endpoint: 'otlp://u:S3CRET-PW@collector'}\n",
        ),
        ("a numeric api_key", [], {}, "engines:\n  - {name: a, url: 'http://127.0.0.1:1', api_key: 98765}\n"),
        ("a numeric admin_key", [], {}, "admin_key: 98765\nengines:\n  - {name: a, url: 'http://127.0.0.1:1'}\n"),
        ("--primary", ["--primary", "htp://user:S3CRET-PW@10.0.0.5:8081"], {}, None),
        ("ENGINEMETER_PRIMARY", [], {"ENGINEMETER_PRIMARY": "htp://user:S3CRET-PW@10.0.0.5"}, None),
    ],
)
def test_config_errors_never_print_secrets(
    tmp_path: Path, how: str, args: list[str], env: dict[str, str], file: str | None
) -> None:
    if file is not None:
        cfg = tmp_path / "c.yaml"
        cfg.write_text(file)
        args = ["--config", str(cfg)]
    line = one_line_error(cli(tmp_path, "serve", *args, **env))
    assert SECRET not in line and "98765" not in line, line
    assert "***" in line or "not shown" in line, line
    if file is not None:
        checked = cli(tmp_path, "check-config", str(tmp_path / "c.yaml"))
        assert checked.returncode == 2 and SECRET not in checked.stderr and "98765" not in checked.stderr


@pytest.mark.parametrize("workers", ["1", "2"])
def test_the_shutdown_timeout_cuts_off_a_stream_held_open(tmp_path: Path, workers: str) -> None:
    """SIGTERM with a stream in progress: the stream gets --shutdown-timeout to finish, then is cut and the
    process exits 0 (it used to wait for the stream's end: 19.5 s in the probe)."""
    assert "ENGINEMETER_SHUTDOWN_TIMEOUT; default 30)" in " ".join(cli(tmp_path, "serve", "--help").stdout.split())
    knobs = Knobs(tokens=3000, cadence_ms=20)  # a minute of stream
    with (
        run_in_thread(FaultEngineConfig(knobs=knobs)) as engine,
        serving(
            tmp_path,
            "--primary",
            f"e={engine}",
            "--listen",
            "127.0.0.1:0",
            "--workers",
            workers,
            "--shutdown-timeout",
            "1.5",
        ) as s,  # fmt: skip
    ):
        base = re.search(r"http://\S+", s.read_until("enginemeter listening on "))
        assert base is not None
        got: list[bytes] = []
        first = threading.Event()

        def stream() -> None:
            body = {"model": "m", "max_tokens": 3000, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
            try:
                with httpx.stream("POST", f"{base.group(0)}/v1/chat/completions", json=body, timeout=60) as r:
                    for chunk in r.iter_raw():
                        got.append(chunk)
                        first.set()
            except httpx.HTTPError:
                got.append(b"(cut)")

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(30)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        rc = s.proc.wait(timeout=30)
        took = time.monotonic() - t0
        t.join(timeout=10)
    assert rc == 0
    assert 1.0 < took < 10, took  # the timeout (1.5 s) plus shutting down, never the stream's minute
    assert b"data: [DONE]" not in b"".join(got)
