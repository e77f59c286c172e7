"""Processes as ``/proc`` tells them: the live members of a process group, and when a process started (what tells a
process from a later one that got its pid)."""

from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")


def _stat_fields(pid: int | str, proc: Path = PROC) -> list[str] | None:
    """``/proc/<pid>/stat``'s fields after ``comm`` (field 3 onwards: state, ppid, pgrp, ...); None if gone."""
    try:
        stat = Path(proc, str(pid), "stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2 :].split()  # "pid (comm) state ...": comm may hold spaces and parentheses


def start_time(pid: int, proc: Path = PROC) -> int | None:
    """When ``pid`` started (clock ticks since boot, ``/proc/<pid>/stat`` field 22); None when no such process is
    alive (gone, or a zombie)."""
    fields = _stat_fields(pid, proc)
    if fields is None or len(fields) < 20 or fields[0] == "Z":
        return None
    return int(fields[19])


def group_members(pgid: int, proc: Path = PROC) -> list[int]:
    """Pids of the live (non-zombie) processes in process group ``pgid``."""
    found = []
    try:
        entries = list(os.scandir(proc))
    except OSError:  # no /proc: ask the kernel whether the group has any member at all
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    for entry in entries:
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(entry.name, proc)
        if fields is not None and len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            found.append(int(entry.name))
    return found
