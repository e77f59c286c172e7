"""Hold launched engines while commands run against them: enginemeter's own launcher (``proxy.procs.launch``) starts
each engine in its own process group from its command line, waits until it is ready by its kind's signal, and
reads GPU memory before, loaded and idle, and after stop -- the same launch the bench makes.

    python3 scripts/gpu/session.py --out DIR --launch NAME='COMMAND' [--launch ...] -- 'SHELL COMMAND' [...]

The engines start in the order given (each ready before the next starts); then each shell command runs in turn
(``bash -c``, in DIR's parent's working directory), with ``{url:NAME}``, ``{pid:NAME}`` and ``{log:NAME}`` filled
in; then the engines stop, in reverse order. Engine logs: DIR/engines/NAME.log. DIR/session.json: every launch
(``Launched.record()``: command verbatim, ready_s, memory moments, memory_returned) and every command (exit
status, seconds). Exit status: 2 when a launch failed (its cause and the log's last lines printed), else 1 when
a command failed, else 0. The GPU harness runs ``enginemeter diagnose`` and scripts/gpu/live.py this way.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from proxy.procs.launch import Launched, Launcher, parse_launch_arg
from proxy.procs.process import LaunchError

_FIELD = re.compile(r"\{(url|pid|log):([A-Za-z0-9_.-]+)\}")


def fill(command: str, engines: dict[str, Launched]) -> str:
    def one(m: re.Match[str]) -> str:
        eng = engines.get(m[2])
        if eng is None:
            raise SystemExit(f"session: {m[0]} names no launched engine (have: {', '.join(engines) or 'none'})")
        return {"url": eng.url, "pid": str(eng.pid), "log": str(eng.log_path)}[m[1]]

    return _FIELD.sub(one, command)


async def session(out: Path, launches: list[str], commands: list[str], ready_timeout_s: float) -> tuple[int, Any]:
    """(exit status, the session's record); ``out`` exists."""
    launcher = Launcher(out, ready_timeout_s=ready_timeout_s)
    doc: dict[str, Any] = {"launches": [], "commands": []}
    rc = 0
    async with contextlib.AsyncExitStack() as stack:
        engines: dict[str, Launched] = {}
        try:
            for arg in launches:
                spec = parse_launch_arg(arg)
                print(f"session: launching {spec.name}: {spec.command}", file=sys.stderr, flush=True)
                engines[spec.name] = await stack.enter_async_context(launcher.running(spec))
                print(f"session: {spec.name} ready after {engines[spec.name].ready_s:.1f} s at "
                      f"{engines[spec.name].url}", file=sys.stderr, flush=True)  # fmt: skip
        except (LaunchError, ValueError) as exc:
            print(f"session: launch failed: {exc}", file=sys.stderr)
            doc["launch_failed"] = str(exc)
            rc = 2
        if rc == 0:
            for command in commands:
                filled = fill(command, engines)
                print(f"session: + {filled}", file=sys.stderr, flush=True)
                t0 = time.monotonic()
                proc = await asyncio.create_subprocess_exec("bash", "-c", filled)
                status = await proc.wait()
                doc["commands"].append({"command": filled, "returncode": status,
                                        "seconds": round(time.monotonic() - t0, 1)})  # fmt: skip
                if status != 0:
                    print(f"session: exit status {status}: {filled}", file=sys.stderr, flush=True)
                    rc = 1
        doc["_engines"] = engines
    # the engines are stopped (and their memory checked) when the stack closes: record them after
    doc["launches"] = [e.record() for e in doc.pop("_engines").values()]
    return rc, doc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--launch", action="append", default=[], metavar="NAME='COMMAND'")
    ap.add_argument("--launch-timeout", type=float, default=600.0)
    ap.add_argument("commands", nargs="*", help="shell commands, after --")
    a = ap.parse_args()
    if not a.launch:
        ap.error("give at least one --launch NAME='COMMAND'")
    a.out.mkdir(parents=True, exist_ok=True)
    rc, doc = asyncio.run(session(a.out, a.launch, a.commands, a.launch_timeout))
    (a.out / "session.json").write_text(json.dumps(doc, indent=1) + "\n")
    return int(rc)


if __name__ == "__main__":
    raise SystemExit(main())
