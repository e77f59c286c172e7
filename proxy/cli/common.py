"""What every command shares: the parser whose mistakes are one line, and the log format. Standard library only:
``proxy.cli`` imports it for every command, the ones that load no bench or server included."""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Iterator
from typing import NoReturn

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line (``enginemeter serve: argument --log-level: ...``), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}{self.did_you_mean(message)} (see {self.prog} --help)\n")

    def did_you_mean(self, message: str) -> str:
        """For a mistyped flag of any command ("unrecognized arguments: --lanch"): the nearest flag its parser
        (or a sub-command's) has, "" when none is near."""
        _, sep, rest = message.partition("unrecognized arguments: ")
        typed = next((a.split("=", 1)[0] for a in rest.split() if a.startswith("--")), None)
        if not sep or typed is None:
            return ""
        close = difflib.get_close_matches(typed, sorted(set(_flags(self))), n=1, cutoff=0.6)
        return f" (did you mean {close[0]}?)" if close else ""

    def refuse_unknown_flags(self, argv: list[str]) -> None:
        """A ``--flag`` no parser here knows and one of theirs is near: the one line with its "did you mean", exit 2
        — before argparse would complain first of a required flag the typo was meant to be."""
        known = set(_flags(self))
        for a in argv:
            flag = a.split("=", 1)[0]
            if flag.startswith("--") and len(flag) > 2 and flag not in known:
                hint = self.did_you_mean(f"unrecognized arguments: {flag}")
                if hint:
                    self.error(f"unrecognized arguments: {flag}")


def _flags(p: argparse.ArgumentParser) -> Iterator[str]:
    for a in p._actions:  # argparse keeps them there; no public accessor
        yield from (o for o in a.option_strings if o.startswith("--"))
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                yield from _flags(sub)
