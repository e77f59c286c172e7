"""``enginemeter`` command line: one module per command; this one only lists them and runs the one asked for.

    serve         the measuring proxy: the demo's embedded engines, one process or ``--workers``
    check_config  ``check-config``: a config file checked the way ``serve --config`` reads it
    bench         engines measured on the same requests, a verdict
    report        the report again, from bench results or the proxy's comparison log
    tune          one llama-server flag swept, each value launched alone
    diagnose      where a running engine's time goes, whether memory is its constraint
    common        what every command shares: the parser whose mistakes are one line, the log format
    reporting     what bench, tune and report share: the run skeleton, --traffic and --weights, the summary
    screen        the first screen they print: a table per workload, the answer once, caveats, within 25 x 120

Every mistake on the command line or in a file ends in one line on stderr naming what is wrong and where, and
exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Collection, Sequence

from proxy import __version__
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

#: every command, in the order ``--help`` lists them: the module that builds and runs it, and its one line
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("proxy.cli.serve", "run the measuring proxy"),
    "check-config": ("proxy.cli.check_config", "validate a config file without starting anything"),
    "bench": ("proxy.cli.bench", "offline A/B bench of engines (resident or launched one at a time), a verdict"),
    "report": ("proxy.cli.report", "build the report from bench results or the proxy's comparison log"),
    "tune": (
        "proxy.cli.tune",
        "sweep one llama-server flag, each value launched alone: keep tuning or compare engines",
    ),
    "diagnose": ("proxy.cli.diagnose", "where a running engine's time goes, whether memory is its constraint"),
}


def build_parser(chosen: Collection[str] | None = None) -> Parser:
    """The ``enginemeter`` parser. Only the ``chosen`` commands' modules are imported and their options built
    (None: every command's); the others are listed by their one line, so ``enginemeter report`` loads no server."""
    parser = Parser(
        prog="enginemeter", description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"enginemeter {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_line) in COMMANDS.items():
        p = sub.add_parser(name, help=help_line)
        if chosen is None or name in chosen:
            importlib.import_module(module).add_command(p)
    return parser


def chosen_command(argv: Sequence[str]) -> str | None:
    """The command ``argv`` names (its first word that is not a flag), or None."""
    return next((a for a in argv if not a.startswith("-")), None)


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
    command = chosen_command(raw)
    parser = build_parser(() if command is None else (command,))
    parser.refuse_unknown_flags(_join_dash_values(raw))  # "did you mean" before any other complaint
    args = parser.parse_args(_join_dash_values(raw))
    args.argv = ["enginemeter", *raw]  # as typed: for the bench's rerun advice
    level = getattr(logging, str(getattr(args, "log_level", "info")).upper(), logging.INFO)
    logging.basicConfig(level=level, format=LOG_FORMAT)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per upstream call is noise
    return int(args.func(args))
