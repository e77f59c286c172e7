"""``enginemeter serve``: the measuring proxy, on the engines given (flags, environment, config file) or, with none,
on the demo's embedded llama-server engines; one process, or ``--workers N`` under a supervisor.

``serve`` binds its socket before anything slow happens (the demo's build, engine start-ups) and prints the
"listening on" banner only once uvicorn serves on it. One log format for enginemeter's and uvicorn's loggers.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import io
import logging
import os
import shlex
import signal
import socket
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from proxy import embedded as emb
from proxy.cli.common import LOG_LEVELS
from proxy.config.configfile import load
from proxy.config.fields import DEFAULT_LISTEN, split_listen
from proxy.config.settings import Settings, SettingsError
from proxy.errors import redact_url
from proxy.levels import representative
from proxy.listen import BindError, bind_socket, engine_at_listen_address
from proxy.procs.launch import LaunchSpec
from proxy.server.compose import build_app
from proxy.server.mirror.compare import new_run_id
from proxy.server.request.upstream import detect_kind
from proxy.server.switch.enginehost import EngineHost, launch_specs, with_urls
from proxy.server.workers.guard import SHUTDOWN_TIMEOUT_S, Server, server_config
from proxy.server.workers.lifetimes import remove_stale_directories
from proxy.server.workers.supervisor import default_workers, serve_workers
from proxy.types import EngineKind

DESCRIPTION = """\
Run the measuring proxy. Three ways to say which engines it stands in front of:

  bare           no --primary, no --config (and no ENGINEMETER_PRIMARY/ENGINEMETER_CONFIG): a demo. It builds
                 llama-server from source (about 8 minutes on 2 cores the first time; cached afterwards in
                 ~/.cache/enginemeter), generates a small random-weight model, starts two llama-server engines
                 (np1: -np 1, np2: -np 2) and puts the proxy in front, np2 mirrored as shadow.
  quick form     --primary [NAME=]URL [--shadow [NAME=]URL]: every model name goes to the primary, every
                 request is mirrored to the shadow, pairs are logged to --log for "enginemeter report".
  config file    --config FILE (YAML; reference: docs/config.md; check it with "enginemeter check-config").

Flags win over the environment (ENGINEMETER_*), which wins over the file. The banner ("enginemeter listening
on ...") is printed once the proxy accepts connections."""

EPILOG = """\
examples:
  enginemeter serve
  enginemeter serve --primary http://127.0.0.1:8081                      # engine named after its kind
  enginemeter serve --primary llama=http://127.0.0.1:8081 --shadow sglang=http://127.0.0.1:30000 \\
      --shadow-rate 0.25 --log ./comparisons.jsonl --listen 0.0.0.0:8080
  enginemeter serve --config enginemeter.yaml --log-level debug"""


def _rate(value: str) -> float:
    try:
        rate = float(value)
    except ValueError:
        rate = -1.0
    if not 0.0 <= rate <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number within [0, 1], got {value!r}")
    return rate


def _workers_arg(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of 1 or more, got {value!r}")
    return int(value)


def _seconds_arg(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0.0 <= seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds, 0 or more, got {value!r}")
    return seconds


def _listen_arg(value: str) -> str:
    try:
        split_listen(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def default_log_path(env: Mapping[str, str] | None = None) -> Path:
    """Where the quick form writes its comparison log: ``$XDG_STATE_HOME/enginemeter/comparisons.jsonl``."""
    env = os.environ if env is None else env
    state = env.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "enginemeter" / "comparisons.jsonl"


# --------------------------------------------------------------------------------------------- serve


def _probe_kind(url: str) -> EngineKind | None:
    """Name a bare ``--primary``/``--shadow`` URL after its engine kind; None when it does not answer."""

    async def probe() -> EngineKind | None:
        async with httpx.AsyncClient(base_url=url, timeout=2.0) as client:
            return await detect_kind(client, 2.0)

    try:
        kind = asyncio.run(probe())
    except (httpx.HTTPError, OSError):
        return None
    # "openai" only means nothing self-hosted answered (maybe still loading): leave it to the app's probing
    return None if kind == "openai" else kind


def _serve(args: argparse.Namespace) -> int:
    embedded: list[object] = []
    specs: dict[str, LaunchSpec] = {}
    try:
        if not (args.primary or args.config or _env_configured()):
            if args.shadow:
                raise SettingsError("--shadow: needs --primary (the demo brings its own two engines)")
            settings, sock = _start_embedded(args, embedded)
        else:
            settings = load(
                args.config,
                primary=args.primary,
                shadow=args.shadow,
                shadow_rate=args.shadow_rate,
                listen=args.listen,
                log=args.log,
                probe=_probe_kind,
            )
            settings = settings if args.no_log else _default_log(settings)
            if clash := engine_at_listen_address(settings):
                raise SettingsError(
                    f"listen address {settings.host}:{settings.port} is the address of engine {clash.name!r} "
                    f"({redact_url(clash.url)}): the proxy would send requests to itself; pick another with --listen HOST:PORT"
                )
            specs = _launch_specs(settings)
            settings = with_urls(settings, specs)
            sock = bind_socket(settings.host, settings.port)
    except SettingsError as exc:
        print(f"enginemeter: {exc}", file=sys.stderr)
        _stop(embedded)
        return 2
    except BindError as exc:
        print(f"enginemeter: {exc}", file=sys.stderr)
        _stop(embedded)
        return 1
    # one id for this run, shared by every worker: its records in the comparison log, the banner's report command
    settings = dataclasses.replace(settings, run_id=new_run_id(), port=sock.getsockname()[1])
    workers = args.workers if args.workers is not None else default_workers()
    owned: list[object] = []
    if specs and (status := _launch_engines(settings, specs, workers, owned)) is not None:
        sock.close()
        return status
    if workers > 1:
        return _run_workers(settings, sock, [*embedded, *owned], args.log_level, workers, args.shutdown_timeout)
    return _run(settings, sock, [*embedded, *owned], args.log_level, args.shutdown_timeout)


def _launch_specs(settings: Settings) -> dict[str, LaunchSpec]:
    """Each launched engine's command parsed, its port chosen (``{port}``); a bad command is a ``SettingsError``."""
    try:
        return launch_specs(settings)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None


def _launch_engines(settings: Settings, specs: dict[str, LaunchSpec], workers: int, owned: list[object]) -> int | None:
    """Start the launched engines and the swaps' owners (``proxy.server.switch.enginehost``) in this process,
    the one that outlives every worker; None once they are ready, else the exit status (2: an engine did not
    start; 0: SIGTERM/Ctrl-C while they started). ``owned`` gets the host, to stop at the end."""
    state = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "enginemeter"
    where = f"serve-{settings.host}-{settings.port}".replace(":", "_")
    host = EngineHost(settings, specs, log_dir=state / where, reporters=workers)
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        host.start()
    except (KeyboardInterrupt, _Terminated):
        host.stop()
        return 0
    except Exception as exc:  # LaunchError, or a state file that cannot be opened
        host.stop()
        print(f"enginemeter: {str(exc).splitlines()[0] if str(exc) else exc!r}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)
    owned.append(host)
    return None


def _run_workers(
    settings: Settings,
    sock: socket.socket,
    embedded: Sequence[object],
    log_level: str,
    workers: int,
    shutdown_timeout_s: float,
) -> int:
    """``--workers N``: the supervisor of ``proxy.server.workers.supervisor``, on the address ``sock`` was bound to (each
    worker binds its own socket there with SO_REUSEPORT, which a socket bound without it would refuse)."""
    host, port = sock.getsockname()[:2]
    sock.close()
    return serve_workers(
        dataclasses.replace(settings, host=host, port=port),
        workers,
        app_factory=build_app,
        log_level=log_level,
        shutdown_timeout_s=shutdown_timeout_s,
        on_shutdown=[lambda: _stop(embedded)],
        announce=lambda port: _banner(dataclasses.replace(settings, port=port), embedded, workers),
        # the whole proxy's profile (every worker's requests in flight together), as one process says its own
        on_traffic=_traffic_said,
    )


def _start_embedded(args: argparse.Namespace, embedded: list[object]) -> tuple[Settings, socket.socket]:
    listen = args.listen or os.environ.get("ENGINEMETER_LISTEN") or DEFAULT_LISTEN
    try:
        host, port = split_listen(listen)
    except ValueError as exc:
        raise SettingsError(f"--listen: {exc}") from None
    # bound before the build, so a busy port fails now rather than after minutes
    sock = bind_socket(host, port)
    try:
        workdir = Path(args.workdir).expanduser()
        workdir.mkdir(parents=True, exist_ok=True)
        log = logging.getLogger("enginemeter")
        log.info("no engines configured: starting the embedded demo in %s", workdir)
        if not os.environ.get("LLAMA_SERVER_BIN") and not (emb.server_dir() / "bin" / "llama-server").is_file():
            log.info("building llama-server from source first (about 8 min on 2 cores; cached afterwards)")
        embedded += emb.start_default_engines(workdir, log=_LogLines(logging.getLogger("enginemeter.embedded")))
        named = [f"{e.name}={e.url}" for e in embedded]  # type: ignore[attr-defined]
        settings = load(
            None,
            primary=named[0],
            shadow=named[1] if len(named) > 1 else None,
            shadow_rate=args.shadow_rate,
            listen=listen,
            log=args.log,
            env={},
        )
        return (settings if args.no_log else _default_log(settings)), sock
    except BaseException:
        sock.close()
        raise


class _LogLines(io.StringIO):
    """A text stream whose lines go to a logger: the demo's build and engine output in the one log format."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__()
        self._logger = logger
        self._partial = ""

    def write(self, s: str) -> int:
        *lines, self._partial = (self._partial + s).split("\n")
        for line in lines:
            if line.strip():
                self._logger.info("%s", line.removeprefix("embedded: "))
        return len(s)


def _default_log(s: Settings) -> Settings:
    """The quick form mirrors to its shadow: log the pairs where ``enginemeter report --log`` will look."""
    if s.quick and s.mirror.log_path is None and any(r.shadows for r in s.routes):
        return dataclasses.replace(s, mirror=dataclasses.replace(s.mirror, log_path=str(default_log_path())))
    return s


def _env_configured() -> bool:
    return bool(os.environ.get("ENGINEMETER_PRIMARY") or os.environ.get("ENGINEMETER_CONFIG"))


def _run(
    settings: Settings, sock: socket.socket, embedded: Sequence[object], log_level: str, shutdown_timeout_s: float
) -> int:
    remove_stale_directories()  # a killed `serve --workers` run's metrics directory, its processes all gone
    # the real port when --listen asked for port 0 (the run record says where this proxy listened)
    settings = dataclasses.replace(settings, port=sock.getsockname()[1])
    # uvicorn re-raises SIGTERM/SIGINT after its shutdown, so code after run() may never execute: stop the
    # embedded engines in the app's own shutdown instead (the finally below covers start-up failures)
    app = build_app(settings, on_shutdown=[lambda: _stop(embedded)] if embedded else [])
    # connection limits, graceful-shutdown timeout, one log format: the same in every --workers worker
    config = server_config(app, log_level=log_level, shutdown_timeout_s=shutdown_timeout_s)
    server = Server(config, on_started=lambda: _banner(settings, embedded))
    # after its graceful shutdown uvicorn raises the signal again, under the handler that was there before it:
    # for SIGTERM that was the default one, and the process died of it (status -15) instead of exiting 0
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        server.run(sockets=[sock])
    except (KeyboardInterrupt, _Terminated):
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        sock.close()
        _stop(embedded)
        if server.started:
            _traffic_said(app.state.gateway.traffic)
    return 0 if server.started else 3


def _traffic_said(traffic: Any) -> None:
    """serve's last words: the traffic it carried, as a profile ``--traffic`` takes (the proxy's /metrics is gone);
    under ``--workers`` the supervisor says the whole proxy's (``proxy.server.observe.inflight``)."""
    if traffic is None:
        return
    shares = traffic.health()["traffic"]["busy_shares"]
    if not shares:
        return
    spec = ",".join(f"c{representative(k):g}={v * 100:.0f}" for k, v in shares.items() if round(v * 100) > 0)
    logging.getLogger("enginemeter").info(
        "traffic served: %s; to weigh a bench's answer by it: --traffic %s", traffic.text(), spec
    )


class _Terminated(Exception):
    """SIGTERM, raised again by uvicorn once its shutdown is done: the normal end of ``serve``."""


def _terminated(signum: int, frame: object) -> None:
    raise _Terminated


def _stop(engines: Sequence[object]) -> None:
    for e in engines:
        stop = getattr(e, "stop", None)
        if stop is not None:
            stop()


def report_command(s: Settings, base: str) -> str:
    """The banner's report command: this run's pairs, engine facts and GPU memory from this proxy."""
    cmd = ["enginemeter", "report", "--log", str(s.mirror.log_path)]
    if s.run_id:
        cmd += ["--run", s.run_id]
    return shlex.join([*cmd, "--proxy", base, "--out", "enginemeter-report"])


def _banner(s: Settings, embedded: Sequence[object], workers: int = 1) -> None:
    host = f"[{s.host}]" if ":" in s.host else s.host
    base = f"http://{host}:{s.port}"
    lines = [f"enginemeter listening on {base}" + (f" ({workers} worker processes)" if workers > 1 else "")]
    for e in s.engines:
        lines.append(f"  engine {e.name:<10} {redact_url(e.url)}" + (" (launched by serve)" if e.launch else ""))
    for r in s.routes:
        shadow = f" (shadow: {', '.join(r.shadows)} @ {r.sample_rate:g})" if r.shadows else ""
        swap = f" (swap to {r.swap.candidate}: POST /admin/rollout start|abort)" if r.swap else ""
        lines.append(f"  route {','.join(r.models)} -> {r.primary}{shadow}{swap}")
    model = (
        "tiny" if any(not isinstance(e, EngineHost) for e in embedded) else (s.models[0].alias if s.models else "any")
    )
    lines += [
        f"  OpenAI base_url: {base}/v1",
        f"  metrics:         {base}/metrics",
        f"  health:          {base}/health",
        f"  traffic profile: {base}/metrics (--traffic {base}/metrics weighs a bench answer by it)",
    ]
    if s.mirror.log_path and any(r.shadows for r in s.routes):
        lines.append(f"  comparison log:  {s.mirror.log_path}")
        lines.append(f"  report:          {report_command(s, base)}")
        if s.api_keys and s.health == "key":
            lines.append(
                "                   (with ENGINEMETER_PROXY_KEY set to a client key: /health's detail needs one)"
            )
    lines.append(
        f"  try: curl -N {base}/v1/chat/completions -H 'content-type: application/json' "
        f"""-d '{{"model":"{model}","stream":true,"max_tokens":32,"messages":[{{"role":"user","content":"hello"}}]}}'"""
    )
    if any(not isinstance(e, EngineHost) for e in embedded):
        lines.append("  (embedded llama-server engines stop with Ctrl-C)")
    print("\n".join(lines), flush=True)


def add_command(serve: argparse.ArgumentParser) -> None:
    serve.description, serve.epilog = DESCRIPTION, EPILOG
    serve.formatter_class = argparse.RawDescriptionHelpFormatter
    serve.add_argument(
        "--primary",
        metavar="[NAME=]URL",
        help="quick form: the engine every model name goes to. A bare URL is named after its kind "
        "(llamacpp, sglang, vllm) when it answers, else engine1",
    )
    serve.add_argument(
        "--shadow",
        metavar="[NAME=]URL",
        help="quick form: an engine every request is mirrored to (default name engine2)",
    )
    serve.add_argument(
        "--shadow-rate", type=_rate, metavar="RATE", help="fraction of requests mirrored, within [0, 1] (default 1)"
    )
    logs = serve.add_mutually_exclusive_group()
    logs.add_argument(
        "--log",
        metavar="PATH",
        help="comparison log (JSONL) for 'enginemeter report --log'; quick form default: "
        "$XDG_STATE_HOME/enginemeter/comparisons.jsonl (~/.local/state/...)",
    )
    logs.add_argument("--no-log", action="store_true", help="quick form: mirror without writing the comparison log")
    serve.add_argument(
        "--listen", type=_listen_arg, metavar="HOST:PORT", help=f"bind address (default {DEFAULT_LISTEN})"
    )
    serve.add_argument("--config", metavar="FILE", help="YAML config file (reference: docs/config.md)")
    serve.add_argument(
        "--workdir", default="~/.cache/enginemeter/embedded", help="demo only: engine logs (default %(default)s)"
    )
    serve.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="default %(default)s")
    serve.add_argument(
        "--workers",
        type=_workers_arg,
        default=os.environ.get("ENGINEMETER_WORKERS") or None,
        metavar="N",
        help="worker processes on the one port (SO_REUSEPORT; metrics merged over them; env ENGINEMETER_WORKERS;"
        f" default: half the CPUs, 1 to 8: {default_workers()} here)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=_seconds_arg,
        default=os.environ.get("ENGINEMETER_SHUTDOWN_TIMEOUT") or SHUTDOWN_TIMEOUT_S,
        metavar="SECONDS",
        help="after SIGTERM/Ctrl-C, how long requests in progress (streams too) may take to finish before they are "
        f"cut off (env ENGINEMETER_SHUTDOWN_TIMEOUT; default {SHUTDOWN_TIMEOUT_S:g})",
    )
    serve.set_defaults(func=_serve)
