"""No engine outlives the enginemeter that started it: the parent-death signal each engine is started with, the
record of the engines running now, and the sweep that ends what a killed run left.

Two guards, as the workers of ``serve --workers N`` have (``proxy.server.workers.lifetimes``):

- **Parent-death signal.** Each engine's process asks Linux, between fork and exec, for SIGKILL when the thread
  that started it ends (``prctl(PR_SET_PDEATHSIG)``, ``die_with_starter``): a ``kill -9`` of enginemeter, the OOM
  killer or a crash takes the engine's leading process with it at once. Linux sends it when the *thread* that
  forked ends, so engines are forked from the main thread or, from any other thread, from one long-lived thread
  of this module (``on_long_lived_thread``): a short-lived thread (``asyncio.to_thread``) would kill its engine
  when it returns. A starter that died before the child asked is noticed in the child (its parent changed), which
  then kills itself. SIGKILL, not SIGTERM: an engine whose owner is gone has nobody to answer to, and a loading
  engine may ignore SIGTERM for minutes while it holds GPU memory.
- **Record and sweep.** What an engine started itself (SGLang's and vLLM's workers, a shell's children) is in its
  process group but gets no signal from us. So each engine is recorded while it runs — one file per engine,
  ``$XDG_STATE_HOME/enginemeter/engines/<pid>.json`` (directory 0700, files 0600): its pid and process group,
  its start time (``/proc/<pid>/stat`` field 22, so a reused pid never matches) and its owner's pid and start
  time — and the record is removed when the engine is stopped. Before an engine is started (``sweep``), every
  record whose owner is gone is read: the processes still in that engine's group are killed (SIGTERM, SIGKILL
  after ``SWEEP_GRACE_S``) and the record removed. A record whose owner still runs is another enginemeter's (a
  second ``serve``, a bench beside it): it is left alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

from proxy.procs.members import group_members, start_time

log = logging.getLogger("enginemeter.engines")

#: prctl(2) option: the signal this process gets when the thread that created it exits
PR_SET_PDEATHSIG = 1
#: how long a swept engine's group has between SIGTERM and SIGKILL
SWEEP_GRACE_S = 5.0

T = TypeVar("T")


def state_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where the running engines are recorded: ``$XDG_STATE_HOME/enginemeter/engines`` (``~/.local/state/...``)."""
    env = os.environ if env is None else env
    state = env.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "enginemeter" / "engines"


# ---- the parent-death signal ----------------------------------------------------------------------------


def die_with_starter() -> Callable[[], None] | None:
    """A ``preexec_fn`` that asks Linux for SIGKILL when the starting thread ends (None off Linux or without
    ``prctl``). Everything it needs is looked up here, in the parent: the child only calls ``prctl``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the starter died before the request was made: nobody would send it
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


_jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
_starter: threading.Thread | None = None
_starter_lock = threading.Lock()


def _serve_jobs() -> None:
    while True:
        fn, fut = _jobs.get()
        try:
            fut.set_result(fn())
        except BaseException as exc:  # handed to the caller's thread
            fut.set_exception(exc)


def on_long_lived_thread(fn: Callable[[], T]) -> T:
    """``fn()`` run on a thread that lives as long as the process: the main thread when called from it, else
    this module's own starter thread (the caller waits for the result or the exception)."""
    global _starter
    if threading.current_thread() is threading.main_thread():
        return fn()
    with _starter_lock:
        if _starter is None or not _starter.is_alive():
            _starter = threading.Thread(target=_serve_jobs, name="enginemeter-engine-starter", daemon=True)
            _starter.start()
    fut: Future[T] = Future()
    _jobs.put((fn, fut))
    return fut.result()


# ---- the record -------------------------------------------------------------------------------------------


def record(pid: int, name: str, directory: Path | None = None) -> Path | None:
    """Record engine ``pid`` (it leads its own process group) as run by this process; the record's path, or None
    when it could not be written (logged: the parent-death signal still guards)."""
    directory = directory or state_dir()
    doc = {
        "pid": pid,
        "start": start_time(pid),
        "owner": os.getpid(),
        "owner_start": start_time(os.getpid()),
        "name": name,
    }
    path = directory / f"{pid}.json"
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = directory / f".{pid}.json.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("cannot record engine %s (pid %d) in %s: %s", name, pid, directory, exc)
        return None
    return path


def forget(path: Path | None) -> None:
    """Remove an engine's record (it was stopped)."""
    if path is not None:
        with contextlib.suppress(OSError):
            path.unlink()


def _alive(pid: object, start: object) -> bool:
    return isinstance(pid, int) and start is not None and start_time(pid) == start


def sweep(directory: Path | None = None, grace_s: float = SWEEP_GRACE_S) -> list[int]:
    """End the engines a killed run left (module docstring); the pids killed. Never raises."""
    directory = directory or state_dir()
    try:
        paths = sorted(directory.glob("*.json"))
    except OSError:
        return []
    killed: list[int] = []
    for path in paths:
        try:
            doc = json.loads(path.read_text())
            pid, start = int(doc["pid"]), doc.get("start")
            owner, owner_start = doc.get("owner"), doc.get("owner_start")
        except (OSError, ValueError, KeyError, TypeError):
            forget(path)  # damaged: nothing in it can be matched
            continue
        if _alive(owner, owner_start):
            continue  # another enginemeter's engine, still owned
        leader_is_ours = _alive(pid, start)
        # the leader gone, its pid not reused: what it started may still run in its group
        members = group_members(pid) if leader_is_ours or start_time(pid) is None else []
        if members:
            log.warning(
                "engine %s (pid %d) outlived the enginemeter that started it (pid %s): stopping its %d process(es)",
                doc.get("name"),
                pid,
                owner,
                len(members),
            )
            _end_group(pid, grace_s)
            killed += members
        forget(path)
    return killed


def _end_group(pgid: int, grace_s: float) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)  # a poll interval: the group is shutting down
    if group_members(pgid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.02)  # SIGKILL is delivered; the kernel tears the processes down
