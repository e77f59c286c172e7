"""The settings ``enginemeter tune`` sweeps: one flag with a list of values, everything else fixed.

``--launch 'llama-server -m M -ngl 99 -np {1,2,4,8}'`` (one ``{a,b,...}`` list in the command) or ``--launch
'llama-server -m M -ngl 99' --vary -np=1,2,4,8`` (the flag's value replaced, or the flag added): one launch command
per value (``variants``), and for a slot flag the concurrency sweep up to the largest slot count (``slot_sweep``).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from proxy.bench.run.options import UsageError

SLOT_FLAGS = ("-np", "--parallel")
_BRACES = re.compile(r"\{([^{}]*,[^{}]*)\}")

#: the slot counts ``diagnose`` suggests sweeping when the engine's own is not known
SWEEP = "{1,2,4,8}"


def slot_values(current: int | str | None) -> str:
    """The ``-np`` values ``diagnose`` suggests tune sweeps (a ``{a,b,...}`` list): the engine's own first (tune's
    baseline: the setting it runs now), then half, twice and four times it -- a ``-np 16`` launch sweeps
    ``{16,8,32,64}`` (on the 27B run on an H100, ``-np 64`` served 25 % more than 16 under load; a sweep of 1-8
    would never have shown it)."""
    try:
        n = int(current or 0)
    except ValueError:
        return SWEEP
    if n <= 1:
        return SWEEP
    return "{" + ",".join(str(v) for v in (n, n // 2, 2 * n, 4 * n)) + "}"


@dataclass(frozen=True)
class Variant:
    name: str
    value: str
    command: str


def _replace_flag(command: str, flag: str, value: str) -> str:
    pat = re.compile(rf"(?<!\S){re.escape(flag)}(\s+|=)(\S+)")
    if pat.search(command):
        return pat.sub(lambda m: f"{flag}{m.group(1)}{shlex.quote(value)}", command, count=1)
    return f"{command} {flag} {shlex.quote(value)}"


def variants(command: str, vary: str | None, name: str | None = None) -> tuple[str, list[Variant]]:
    """(the flag, one variant per value) from ``{a,b}`` in the command or ``--vary FLAG=A,B``."""
    lists = [m for m in _BRACES.finditer(command) if m.group(0) != "{port}"]
    if vary and lists:
        raise UsageError("give the values either in the command ({1,2,4}) or with --vary, not both")
    if vary:
        flag, sep, vals = vary.partition("=")
        if not sep or not flag.startswith("-") or not vals:
            raise UsageError(f"--vary takes FLAG=V1,V2,... (e.g. -np=1,2,4), got {vary!r}")
        values = [v.strip() for v in vals.split(",") if v.strip()]
        commands = [_replace_flag(command, flag, v) for v in values]
    else:
        if len(lists) != 1:
            raise UsageError(
                "tune sweeps one flag: put exactly one {a,b,...} list in the command (-np {1,2,4}), or "
                "use --vary FLAG=A,B"
                if not lists
                else f"tune sweeps one flag: the command has {len(lists)} {{...}} lists"
            )
        m = lists[0]
        before = command[: m.start()]
        flag = before.rstrip().rstrip("=").split()[-1] if before.strip() else ""
        if not flag.startswith("-"):
            raise UsageError(f"cannot tell which flag {m.group(0)} belongs to: write it as FLAG {m.group(0)}")
        values = [v.strip() for v in m.group(1).split(",") if v.strip()]
        commands = [command[: m.start()] + v + command[m.end() :] for v in values]
    if len(values) < 2 or len(set(values)) != len(values):
        raise UsageError(f"tune needs at least two different values of {flag}, got {', '.join(values) or 'none'}")
    stem = re.sub(r"[^A-Za-z0-9]+", "", flag.lstrip("-")) or "v"
    names = [
        f"{name}-{stem}{re.sub(r'[^A-Za-z0-9_.-]+', '_', v)}"
        if name
        else f"{stem}{re.sub(r'[^A-Za-z0-9_.-]+', '_', v)}"
        for v in values
    ]
    return flag, [Variant(n, v, c) for n, v, c in zip(names, values, commands, strict=True)]


def slot_sweep(values: list[str]) -> tuple[int, ...] | None:
    """1, 2, 4, ... up to the largest slot count (each value included)."""
    try:
        top = max(int(v) for v in values)
    except ValueError:
        return None
    levels = {1, *(int(v) for v in values)}
    c = 1
    while c < top:
        levels.add(c)
        c *= 2
    return tuple(sorted(x for x in levels if x <= top))
