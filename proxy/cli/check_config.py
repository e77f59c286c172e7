"""``enginemeter check-config FILE``: validate a config file the way ``serve --config`` reads it, start nothing."""

from __future__ import annotations

import argparse
import json
import sys

from proxy.config.configfile import parse_file
from proxy.config.settings import SettingsError, json_schema

DESCRIPTION = """\
Validate a config file the way "serve --config" would (types, unknown keys, references between engines,
routes and aliases, ${ENV_VAR} references against the current environment) without starting anything.
Prints one line per problem and exits 2, or prints a summary and exits 0. --schema prints the file's
JSON Schema (also in docs/config.schema.json) for editors."""

EPILOG = """\
examples:
  enginemeter check-config enginemeter.yaml
  SGLANG_KEY=sk-test enginemeter check-config deploy/enginemeter.yaml
  enginemeter check-config --schema > enginemeter.schema.json"""


def add_command(check: argparse.ArgumentParser) -> None:
    check.description, check.epilog = DESCRIPTION, EPILOG
    check.formatter_class = argparse.RawDescriptionHelpFormatter
    check.add_argument("file", nargs="?", metavar="FILE", help="the YAML config file")
    check.add_argument("--schema", action="store_true", help="print the config file's JSON Schema and exit")
    check.set_defaults(func=_check_config)


def _check_config(args: argparse.Namespace) -> int:
    if args.schema:
        print(json.dumps(json_schema(), indent=2))
        return 0
    if not args.file:
        print("enginemeter check-config: give a FILE (or --schema)", file=sys.stderr)
        return 2
    try:
        s = parse_file(args.file)
    except SettingsError as exc:
        for line in exc.problems:
            print(f"enginemeter: {line}", file=sys.stderr)
        return 2
    shadows = sorted({n for r in s.routes for n in r.shadows})
    print(
        f"{args.file}: ok: {len(s.engines)} engine(s) ({', '.join(e.name for e in s.engines)}), "
        f"{len(s.routes)} route(s), {len(s.models)} model alias(es)"
        + (f", mirrored to {', '.join(shadows)}" if shadows else "")
        + f"; listens on {s.host}:{s.port}"
        + ("" if s.engines else "; without engines, serve needs --primary")
    )
    return 0
