"""The lifetimes of ``serve --workers N``'s processes: no worker outlives its supervisor, and the multiprocess
directory is removed once nobody uses it.

No worker outlives its supervisor, however the supervisor ends (SIGKILL, the OOM killer, a crash): each worker
asks Linux for SIGTERM when its parent dies (``prctl(PR_SET_PDEATHSIG)``, ``die_with_parent``) and watches
``getppid()`` besides (``watch_parent``: every ``PARENT_POLL_S``; the only guard off Linux). Either starts the
worker's graceful shutdown: it stops listening at once (the port is free for the next ``serve``), lets the
requests in progress finish within the shutdown timeout and exits. A worker whose supervisor died before it
could ask exits at start.

The multiprocess directory the supervisor makes (``enginemeter-metrics-*`` in the temporary directory) holds
``owner.lock``, locked shared by the supervisor and every worker for their lives (``hold_directory``); a
directory whose lock nobody holds any longer is left over from a run whose processes are all gone, and the next
``serve`` removes it (``remove_stale_directories``). A directory named by ``PROMETHEUS_MULTIPROC_DIR`` is wiped
at start as before, once no other run holds its lock (``claim_directory`` waits for the workers of an earlier
run to finish, at most ``shutdown_timeout_s`` and a margin; then ``serve`` exits 1: two runs writing one
directory would add up each other's figures).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass

log = logging.getLogger("enginemeter.workers")

#: a worker checks this often whether its supervisor is still its parent (besides the parent-death signal)
PARENT_POLL_S = 0.5
#: the multiprocess directories the supervisor makes, and the lock file in each that says someone still uses it
DIR_PREFIX = "enginemeter-metrics-"
LOCK_FILE = "owner.lock"


#: prctl(2) option: the signal this process gets when the thread that created it exits
PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent dies (``prctl(PR_SET_PDEATHSIG)``); False where
    that is not available. Linux sends it when the *thread* that started this process ends: the supervisor
    starts every worker from its main thread."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def watch_parent(parent: int, on_gone: Callable[[], None], interval_s: float = PARENT_POLL_S) -> threading.Thread:
    """A daemon thread that calls ``on_gone`` once ``parent`` is no longer this process's parent (it died: the
    process was re-parented to init or a subreaper)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)  # the polling period, not a synchronisation
        log.warning("the supervisor (pid %d) is gone: this worker stops listening and exits", parent)
        on_gone()

    t = threading.Thread(target=watch, name="enginemeter-parent-watch", daemon=True)
    t.start()
    return t


def hold_directory(directory: str | Path) -> int:
    """A shared lock on ``directory``'s ``owner.lock``, held until this process closes the returned fd (or dies):
    while any process holds it, the directory is in use."""
    fd = os.open(Path(directory) / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def _lock_free(directory: Path) -> int | None:
    """An exclusive lock on ``directory``'s ``owner.lock`` if nobody holds it (the fd, to close), else None."""
    try:
        fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise
        return None
    return fd


def make_directory() -> tuple[str, int]:
    """A new multiprocess directory, already locked by this process (the fd): made under another name and renamed,
    so that no other ``serve`` ever sees it unlocked and takes it for a left-over."""
    staging = tempfile.mkdtemp(prefix=".enginemeter-new-")
    fd = hold_directory(staging)
    final = os.path.join(os.path.dirname(staging), DIR_PREFIX + os.path.basename(staging).rsplit("-", 1)[-1])
    os.rename(staging, final)
    return final, fd


def remove_stale_directories(parent: str | Path | None = None) -> list[Path]:
    """Remove the multiprocess directories of earlier runs whose supervisor and workers are all gone (a supervisor
    that was killed could not remove its own); the ones removed. A directory without a lock file (an older
    version's) is left alone: nothing tells whether it is still in use."""
    removed = []
    for d in sorted(Path(parent or tempfile.gettempdir()).glob(DIR_PREFIX + "*")):
        try:
            if not d.is_dir() or d.is_symlink() or d.stat().st_uid != os.getuid() or not (d / LOCK_FILE).exists():
                continue
        except OSError:
            continue
        fd = _lock_free(d)
        if fd is None:
            continue
        try:
            shutil.rmtree(d, ignore_errors=True)
        finally:
            os.close(fd)
        log.info("removed %s: left by a run whose processes are all gone", d)
        removed.append(d)
    return removed


def claim_directory(directory: str, wait_s: float) -> int:
    """``PROMETHEUS_MULTIPROC_DIR``: wait until no other run holds it (the workers of a killed supervisor finish
    their requests first, at most ``wait_s``), wipe the figures of the earlier run and hold it shared; the fd.
    Raises ``RuntimeError`` if another run still holds it after ``wait_s``."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + wait_s
    said = False
    while (fd := _lock_free(path)) is None:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"PROMETHEUS_MULTIPROC_DIR {directory} is in use by another enginemeter run (its processes hold "
                f"{LOCK_FILE}): two runs in one directory add up each other's figures; give each its own"
            )
        if not said:
            log.warning(
                "PROMETHEUS_MULTIPROC_DIR %s is in use by another run's processes: waiting up to %.0f s "
                "for them to exit",
                directory,
                wait_s,
            )
            said = True
        time.sleep(0.1)  # the polling period of a lock wait, not a synchronisation
    for f in path.glob("*.db"):  # the figures of an earlier run would add up with ours
        f.unlink()
    fcntl.flock(fd, fcntl.LOCK_SH)  # from exclusive to shared: our workers take it shared too
    return fd
