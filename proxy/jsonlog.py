"""A bounded, size-rotated JSONL file written by its own thread: the comparison log and the request log.

The event loop only puts a dict on a bounded queue (``write`` never blocks and never serializes); a full queue
drops the record and counts it. ``serve --workers N``: every worker appends to the same file; a lock on its
directory keeps one worker's rotation and another's line apart.

Rotation is by size, ``path`` -> ``path.1`` -> ... -> ``path.<backups>`` (the oldest deleted). A log may give a
``header``: the lines every new file after a rotation starts with (the comparison log: its run's ``run`` and
``engine`` records), so that each file says what it belongs to even after older ones are gone. Readers use
``rotated_family`` (a log's files, oldest first) and ``open_together`` (every file opened under a shared lock on
its directory: no rotation in between can make one be read twice or missed).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

log = logging.getLogger("enginemeter.compare")


@contextlib.contextmanager
def _dir_locked(path: str, how: int = fcntl.LOCK_EX) -> Iterator[None]:
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, how)
        yield
    finally:
        os.close(fd)  # releases the lock


def rotated_family(path: str) -> list[str]:
    """The log ``path`` and its rotated copies that exist, oldest first: ``path.N``, ..., ``path.1``, ``path``
    (whatever ``backups`` wrote them: the directory is listed)."""
    d, name = os.path.split(path)
    try:
        entries = os.listdir(d or ".")
    except OSError:
        entries = []
    numbered = []
    for e in entries:
        stem, dot, n = e.rpartition(".")
        if dot and stem == name and n.isdigit() and int(n) > 0:
            numbered.append((int(n), os.path.join(d, e)))
    family = [p for _, p in sorted(numbered, reverse=True)]
    return [*family, path] if os.path.exists(path) else family


@contextlib.contextmanager
def open_together(paths: Sequence[str]) -> Iterator[list[tuple[str, IO[bytes] | OSError]]]:
    """``paths`` opened for reading, each with the name it had (or the error that stopped it), all while their
    directories are locked shared: a writer (``ComparisonLog``) takes the lock exclusively to rotate, so the files
    are one state of the log, not a rotation's before and after. A log's rotated files are listed again under the
    lock (``rotated_family``: a rotation since they were listed renamed every one of them); a rotated file named
    without its log is read alone. The files stay open, and readable, after the locks go."""
    given = list(dict.fromkeys(paths))
    opened: list[tuple[str, IO[bytes] | OSError]] = []
    with contextlib.ExitStack() as locks:
        for d in sorted({os.path.dirname(p) or "." for p in given}):
            with contextlib.suppress(OSError):  # a directory we cannot lock: read without it
                locks.enter_context(_dir_locked(d, fcntl.LOCK_SH))
        names: list[str] = []
        for p in given:
            stem, dot, n = p.rpartition(".")
            rotated = bool(dot and n.isdigit())
            if rotated and stem in given:
                continue  # one of a log's rotated files, the log named too: listed afresh with it below
            names += [f for f in ([p] if rotated else rotated_family(p) or [p]) if f not in names]
        for p in names:
            try:
                opened.append((p, open(p, "rb")))  # noqa: SIM115 - closed below, after the caller read them
            except OSError as exc:
                opened.append((p, exc))
    try:
        yield opened
    finally:
        for _, f in opened:
            if not isinstance(f, OSError):
                f.close()


class ComparisonLog:
    """Bounded, rotating JSONL file written by one daemon thread.

    ``write()`` never blocks: it serializes nothing and only ``put_nowait``s on a bounded queue; when the queue
    is full the record is dropped and ``dropped`` grows. Rotation is by size: ``path`` -> ``path.1`` -> ...
    -> ``path.<backups>`` (the oldest is deleted); ``backups=0`` truncates in place.
    """

    _STOP = object()

    def __init__(
        self,
        path: str,
        *,
        max_bytes: int,
        backups: int,
        queue_size: int = 10_000,
        mode: int = 0o600,
        name: str = "enginemeter-compare-log",
        header: Callable[[], Sequence[dict[str, Any]]] | None = None,
    ) -> None:
        self.path = path
        #: the records each file after a rotation starts with (module docstring); called on the writer thread
        self.header = header
        #: permission bits of the log and its rotated files: 0o600 (both logs may hold prompts and answers). A
        #: file that already exists with other bits (an older run's 0644) is set to these when opened
        #: (``_enforce_mode``); one this user cannot chmod is not written to (counted in ``errors``)
        self.mode = mode
        self.max_bytes = max(1, max_bytes)
        self.backups = max(0, backups)
        self.written = 0
        self.dropped = 0
        self.errors = 0
        self._q: queue.Queue[object] = queue.Queue(maxsize=queue_size)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def write(self, record: dict[str, Any]) -> bool:
        try:
            self._q.put_nowait(record)
            return True
        except queue.Full:
            self.dropped += 1
            return False

    def close(self, timeout: float = 5.0) -> None:
        """Flush what is queued and stop the thread (blocking: call it off the event loop)."""
        if not self._thread.is_alive():
            return
        try:
            self._q.put(self._STOP, timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until everything queued so far is on disk (blocking; for tests and shutdown)."""
        done = threading.Event()
        try:
            self._q.put(done, timeout=timeout)
        except queue.Full:
            return False
        return done.wait(timeout)

    # ------------------------------------------------------------------------------ writer thread

    def _rotate(self) -> None:
        if self.backups == 0:
            os.close(os.open(self.path, os.O_WRONLY | os.O_TRUNC | os.O_CREAT, self.mode))
            return
        for i in range(self.backups - 1, 0, -1):
            src = f"{self.path}.{i}"
            if os.path.exists(src):
                os.replace(src, f"{self.path}.{i + 1}")
        os.replace(self.path, f"{self.path}.1")

    def _header_lines(self) -> bytes:
        if self.header is None:
            return b""
        try:
            records = self.header()
        except Exception:  # the header is a courtesy to readers: never a reason to lose the line
            log.exception("the header of the log %s failed", self.path)
            return b""
        return b"".join((json.dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n").encode() for r in records)

    def _enforce_mode(self, fd: int, path: str) -> None:
        """The file open as ``fd`` gets ``self.mode``, whatever it had (O_CREAT's mode only applies to new files)."""
        st = os.fstat(fd)
        if st.st_mode & 0o7777 != self.mode:
            os.fchmod(fd, self.mode)  # PermissionError (another user's file): the caller does not write to it
            log.warning("log file %s had mode %o: set to %o", path, st.st_mode & 0o7777, self.mode)

    def _run(self) -> None:
        d = os.path.dirname(self.path)
        if d:
            os.makedirs(d, exist_ok=True)
        # files of an earlier run (the log, its rotated copies) get the mode before anything else is written
        for p in [self.path, *(f"{self.path}.{i}" for i in range(1, self.backups + 1))]:
            try:
                fd = os.open(p, os.O_RDONLY)
            except OSError:
                continue
            try:
                self._enforce_mode(fd, p)
            except OSError:
                log.exception("cannot set the mode of the log file %s", p)
            finally:
                os.close(fd)
        while True:
            item = self._q.get()
            if item is self._STOP:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                line = (json.dumps(item, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
                # `serve --workers N`: every worker appends to this file; a lock on its directory keeps a
                # rotation and another worker's line apart (each line is one O_APPEND write)
                with _dir_locked(d or "."):
                    size = os.path.getsize(self.path) if os.path.exists(self.path) else 0
                    if size and size + len(line) > self.max_bytes:
                        self._rotate()
                        line = self._header_lines() + line
                    # 0600 by default: with record_text the log holds prompts and answers; only the proxy's user may read it
                    fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, self.mode)
                    with os.fdopen(fd, "ab") as f:
                        self._enforce_mode(fd, self.path)  # a file made by someone else meanwhile, too
                        f.write(line)
                self.written += 1
            except Exception:  # a full disk must not kill the writer; count and go on
                self.errors += 1
                log.exception("writing the log %s failed", self.path)
