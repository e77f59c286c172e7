"""What every command shares: the parser whose mistakes are one line, and the log format. Standard library only:
``proxy.cli`` imports it for every command, the ones that load no bench or server included."""

from __future__ import annotations

import argparse
from typing import NoReturn

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line (``enginemeter serve: argument --log-level: ...``), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")
