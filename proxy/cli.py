"""``enginemeter`` command line: serve (the proxy), bench and report (offline A/B).

``enginemeter serve`` with neither ``--primary`` nor a config brings up the embedded default: two real
llama-server engines on a generated small model (one variable changed: ``-np 1`` vs ``-np 2``), the proxy in
front, the second engine mirrored as shadow — and says where to look.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from proxy.server.workers import default_workers
from proxy.settings import Settings, SettingsError, load


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from proxy.server import build_app

    embedded = []
    try:
        if not (args.primary or args.config or _env_configured()):
            from proxy import embedded as emb

            workdir = Path(args.workdir).expanduser()
            workdir.mkdir(parents=True, exist_ok=True)
            print(f"enginemeter: no engines configured; starting the embedded default in {workdir}", flush=True)
            print("enginemeter: (first run builds llama-server from source: ~7 min on 2 cores)", flush=True)
            embedded = emb.start_default_engines(workdir)
            args.primary = embedded[0].url
            args.shadow = args.shadow or (embedded[1].url if len(embedded) > 1 else None)
        settings = load(
            args.config, primary=args.primary, shadow=args.shadow, shadow_rate=args.shadow_rate, listen=args.listen
        )
    except SettingsError as exc:
        print(f"enginemeter: configuration error: {exc}", file=sys.stderr)
        _stop(embedded)
        return 2
    workers = args.workers if args.workers is not None else default_workers()
    if workers > 1:
        from dataclasses import replace

        from proxy.server.workers import serve_workers

        return serve_workers(
            settings,
            workers,
            log_level=args.log_level,
            on_shutdown=[lambda: _stop(embedded)],
            announce=lambda port: _banner(replace(settings, port=port), embedded, workers),
        )
    _banner(settings, embedded)
    # uvicorn re-raises SIGTERM/SIGINT after its shutdown, so code after run() may never execute: stop the
    # embedded engines in the app's own shutdown instead (the finally below covers start-up failures)
    app = build_app(settings, on_shutdown=[lambda: _stop(embedded)] if embedded else [])
    try:
        uvicorn.run(app, host=settings.host, port=settings.port, log_level=args.log_level, access_log=False)
    finally:
        _stop(embedded)
    return 0


def _env_configured() -> bool:
    import os

    return bool(os.environ.get("ENGINEMETER_PRIMARY") or os.environ.get("ENGINEMETER_CONFIG"))


def _stop(engines: Sequence[object]) -> None:
    for e in engines:
        stop = getattr(e, "stop", None)
        if stop is not None:
            stop()


def _banner(s: Settings, embedded: Sequence[object], workers: int = 1) -> None:
    base = f"http://{s.host}:{s.port}"
    lines = [f"enginemeter listening on {base}" + (f" ({workers} workers)" if workers > 1 else "")]
    for e in s.engines:
        lines.append(f"  engine {e.name:<10} {e.url}")
    for r in s.routes:
        shadow = f" (shadow: {', '.join(r.shadows)} @ {r.sample_rate:g})" if r.shadows else ""
        lines.append(f"  route {','.join(r.models)} -> {r.primary}{shadow}")
    lines += [
        f"  OpenAI base_url: {base}/v1",
        f"  metrics:         {base}/metrics",
        f"  health:          {base}/health",
        f"  try: curl -N {base}/v1/chat/completions -H 'content-type: application/json' "
        """-d '{"model":"tiny","stream":true,"max_tokens":32,"messages":[{"role":"user","content":"hello"}]}'""",
    ]
    if embedded:
        lines.append("  (embedded llama-server engines stop with Ctrl-C)")
    print("\n".join(lines), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="enginemeter", description=__doc__.split("\n\n")[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the measuring proxy")
    serve.add_argument("--primary", help="primary engine base URL (quick form: every model routes here)")
    serve.add_argument("--shadow", help="shadow engine base URL: every request is mirrored there")
    serve.add_argument("--shadow-rate", type=float, default=None, help="fraction of requests mirrored (default 1.0)")
    serve.add_argument("--listen", help="HOST:PORT (default 127.0.0.1:8080)")
    serve.add_argument("--config", help="YAML config file (see README: Configuration)")
    serve.add_argument("--workdir", default="~/.cache/enginemeter/embedded", help="embedded default's files")
    serve.add_argument("--log-level", default="info")
    serve.add_argument(
        "--workers",
        type=int,
        default=int(os.environ["ENGINEMETER_WORKERS"]) if os.environ.get("ENGINEMETER_WORKERS") else None,
        help="worker processes on one port (SO_REUSEPORT; default: half the CPUs, 1 to 8; env ENGINEMETER_WORKERS)",
    )
    serve.set_defaults(func=_serve)

    try:
        from proxy.bench.cli import add_commands
    except ImportError:
        pass
    else:
        add_commands(sub)

    args = parser.parse_args(argv)
    level = getattr(logging, str(getattr(args, "log_level", "info")).upper(), logging.INFO)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per upstream call is noise
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
