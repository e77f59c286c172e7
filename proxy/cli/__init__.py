"""``enginemeter`` command line: one module per command; this one only lists them and runs the one asked for.

- ``serve``: the measuring proxy (``proxy.cli.serve``: the demo's embedded engines, one process or ``--workers``)
- ``check-config``: a config file checked the way ``serve --config`` reads it (``proxy.cli.check_config``)
- ``bench``: engines measured on the same requests, a verdict (``proxy.cli.bench``)
- ``report``: the report again, from bench results or the proxy's comparison log (``proxy.cli.report``)
- ``tune``: one llama-server flag swept, each value launched alone (``proxy.cli.tune``)
- ``diagnose``: where a running engine's time goes, whether memory is its constraint (``proxy.cli.diagnose``)
- ``common``: the parser whose mistakes are one line, the log format, and the bench/tune run skeleton

Every mistake on the command line or in a file ends in one line on stderr naming what is wrong and where, and
exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from proxy import __version__
from proxy.cli import bench, check_config, diagnose, report, serve, tune
from proxy.cli.common import LOG_FORMAT, Parser

DESCRIPTION = """\
enginemeter: an OpenAI-compatible measuring proxy for self-hosted LLM engines (llama.cpp's llama-server,
SGLang, vLLM). It forwards to a primary engine unbuffered, mirrors to a shadow engine, times every stream
chunk, catches token-count mismatches, exports Prometheus metrics, and benches engines to a verdict."""


EPILOG = """\
examples:
  enginemeter serve                                      # demo: embedded llama-server engines (see serve --help)
  enginemeter serve --primary llama=http://127.0.0.1:8081 --shadow sglang=http://127.0.0.1:30000
  enginemeter serve --config enginemeter.yaml
  enginemeter check-config enginemeter.yaml
  enginemeter report --log ~/.local/state/enginemeter/comparisons.jsonl --out report/   # the latest run
  enginemeter bench --engine llama=http://127.0.0.1:8081 --engine sglang=http://127.0.0.1:30000 --quick
  enginemeter bench --launch llama='llama-server -m m.gguf --port {port}' --launch sglang='python -m ...'
  enginemeter tune --launch 'llama-server -m m.gguf -ngl 99 -np {1,2,4,8} --port {port}'
  enginemeter diagnose http://127.0.0.1:8081             # where llama.cpp's time goes, memory or not

Run "enginemeter COMMAND --help" for a command's options. Configuration reference: docs/config.md."""

#: every command, in the order ``--help`` lists them
COMMANDS = (serve, check_config, bench, report, tune, diagnose)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="enginemeter", description=DESCRIPTION, epilog=EPILOG,
                    formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--version", action="version", version=f"enginemeter {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_command(sub)
    return parser


#: flags whose value may start with "-" (``tune --vary -np=1,2,4``): argparse would read such a value as a flag
DASH_VALUE_FLAGS = ("--vary",)


def _join_dash_values(argv: Sequence[str]) -> list[str]:
    """``--vary -np=1,2`` -> ``--vary=-np=1,2``, so argparse takes the value as the flag's."""
    out: list[str] = []
    it = iter(argv)
    for a in it:
        if a in DASH_VALUE_FLAGS:
            nxt = next(it, None)
            out.append(a if nxt is None else f"{a}={nxt}")
        else:
            out.append(a)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(_join_dash_values(raw))
    args.argv = ["enginemeter", *raw]  # as typed: for the bench's rerun advice
    level = getattr(logging, str(getattr(args, "log_level", "info")).upper(), logging.INFO)
    logging.basicConfig(level=level, format=LOG_FORMAT)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per upstream call is noise
    return int(args.func(args))
