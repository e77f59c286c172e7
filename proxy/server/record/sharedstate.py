"""A rollout's state shared by every process of the proxy (``proxy.server.switch.rollout``): a file that each
process reads and writes through its own descriptor (``os.pread``/``os.pwrite``), written under an ``flock``, and
a JSON copy written at each transition. ``LockedMap`` is the file and its lock alone, which the whole proxy's
traffic count shares too (``proxy.server.observe.inflight``).

**Damage costs figures, never a process.** The file is never memory-mapped: a mapped file that someone truncates
(``truncate -s 0``), or whose sparse page cannot be allocated on a full disk, kills the process that touches it
with SIGBUS. Read through ``pread`` a cut file reads short (``damaged``: the caller re-lays it or ignores it); a
write on a full disk raises ``OSError`` (the caller logs it and carries on). Every file is created 0600.

Layout of ``<state_file>.shm``: a 64-byte header (magic, which slot is current, an 8-byte generation), then two
slots of (length, JSON). A write fills the slot that is not current, makes it current, then bumps the
generation, so a process killed mid-write leaves the current slot whole; a reader without the lock that sees
the generation move by two or more while it copied a slot copies again. The request path reads the generation
only (8 bytes, one ``pread``: about a microsecond, once a request, never per chunk).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

#: the shared file: header (magic, active slot, generation), then two slots of (length, JSON)
MAGIC = b"EMR1"
_ACTIVE = 4
_GEN = 8
HEADER_BYTES = 64
SLOT_BYTES = 64 * 1024
MAP_BYTES = HEADER_BYTES + 2 * SLOT_BYTES
#: shared files hold routing state and traffic: the owner's alone, like the logs
FILE_MODE = 0o600


class LockedMap:
    """A file of ``size`` bytes every process of the proxy reads and writes at offsets, its descriptor also the
    lock (``flock``; the kernel frees it if the holder dies). The first process to open it lays it out under the
    lock: a file of another size is emptied to ``size`` zero bytes, then ``init(self, fresh)`` runs, still under
    the lock (``fresh``: this open laid it out) — one layout, whichever process comes first. ``relay`` does the
    same later, when the file was found cut or garbled."""

    def __init__(
        self, path: str | os.PathLike[str], size: int, init: Callable[[LockedMap, bool], None] | None = None
    ) -> None:
        self.size = size
        self._init = init
        self._threads = threading.RLock()  # ``locked()``: this process's threads, one at a time
        self._depth = 0
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
        try:
            with contextlib.suppress(OSError):  # an earlier version's 0644 file; not ours to chmod: leave it
                os.fchmod(self._fd, FILE_MODE)
            with self.locked():
                self.relay(only_if_damaged=True)
        except BaseException:
            os.close(self._fd)
            raise

    def damaged(self) -> bool:
        """True when the file is not ``size`` bytes long (truncated, grown, replaced in place)."""
        return os.fstat(self._fd).st_size != self.size

    def relay(self, *, only_if_damaged: bool = False) -> bool:
        """Under ``locked()``: the file emptied to ``size`` zero bytes and ``init`` run (True), or, with
        ``only_if_damaged``, nothing when its size is right (``init(self, False)`` still runs, to check the
        content). ``OSError`` when the disk refuses."""
        fresh = not only_if_damaged or self.damaged()
        if fresh:
            os.ftruncate(self._fd, 0)  # not ours, cut, or another layout: start empty
            os.ftruncate(self._fd, self.size)
        if self._init is not None:
            self._init(self, fresh)
        return fresh

    def pread(self, n: int, at: int) -> bytes:
        """``n`` bytes at ``at``; fewer when the file was cut."""
        return os.pread(self._fd, n, at)

    def pwrite(self, data: bytes, at: int) -> None:
        """``data`` at ``at``; ``OSError`` (ENOSPC, ...) when the disk refuses, or when it took only a part."""
        if os.pwrite(self._fd, data, at) != len(data):
            raise OSError(f"short write to a shared file ({len(data)} bytes at {at})")

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Held for one read-modify-write (microseconds to tens of them), against every other process *and* every
        other thread of this one: ``flock`` alone excludes other open files only, so two threads of one process
        (the event loop and a report writer, say) would both get it at once through the shared descriptor.
        Re-entrant in one thread (the lock is taken on the way in, given back on the way out)."""
        with self._threads:
            self._depth += 1
            try:
                if self._depth == 1:
                    fcntl.flock(self._fd, fcntl.LOCK_EX)
                try:
                    yield
                finally:
                    if self._depth == 1:
                        fcntl.flock(self._fd, fcntl.LOCK_UN)
            finally:
                self._depth -= 1

    def close(self) -> None:
        os.close(self._fd)


class StateFile(LockedMap):
    """``<path>.shm`` (its descriptor is also the lock) and the JSON copy at ``path``, both 0600."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        super().__init__(f"{path}.shm", MAP_BYTES)

    def gen(self) -> bytes:
        """The 8-byte generation; shorter (``b""``) when the file was cut."""
        return self.pread(8, _GEN)

    def _slot(self) -> bytes | None:
        head = self.pread(HEADER_BYTES, 0)
        if len(head) < HEADER_BYTES or head[:4] != MAGIC or head[_ACTIVE] > 1:
            return None
        at = HEADER_BYTES + head[_ACTIVE] * SLOT_BYTES
        raw = self.pread(4, at)
        if len(raw) < 4:
            return None
        (n,) = struct.unpack("<I", raw)
        if n > SLOT_BYTES - 4:
            raise ValueError(f"a slot of {n} bytes (at most {SLOT_BYTES - 4})")
        data = self.pread(n, at + 4)
        if len(data) < n:
            return None
        return data

    def read(self) -> tuple[bytes, dict[str, Any] | None]:
        """(generation, document) without the lock: copied again if two writes overlapped the copy. The document
        is None when the file holds none (never written, cut, not ours); ``ValueError`` when its slot is not a JSON
        document (garbled)."""
        raw: bytes | None = None
        g1 = b""
        for _ in range(100):
            g1 = self.gen()
            raw = self._slot()
            g2 = self.gen()
            if len(g1) < 8 or len(g2) < 8:
                return g1, None
            if (int.from_bytes(g2, "little") - int.from_bytes(g1, "little")) % 2**64 < 2:
                break
        # the copy is at least as new as g1 (labelled g1, a write that overlapped it is read again next time)
        if raw is None:
            return g1, None
        try:
            doc = json.loads(raw)
        except RecursionError:
            raise ValueError("a document nested too deeply") from None
        return g1, doc if isinstance(doc, dict) else None

    def read_copy(self) -> dict[str, Any] | None:
        """The JSON copy (the map is gone or was not ours): None when there is none; ``ValueError`` when it is
        not a JSON object (cut, NUL-filled, edited into something else)."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            doc = json.loads(raw)
        except RecursionError:
            raise ValueError("nested too deeply") from None
        if not isinstance(doc, dict):
            raise ValueError(f"not a JSON object ({type(doc).__name__})")
        return doc

    def write(self, doc: dict[str, Any], *, durable: bool = False) -> bytes:
        """Under ``locked()``: the document into the spare slot, current, generation + 1 (returned). A cut file is
        laid out again first. ``durable`` (a transition): synced to disk and the JSON copy replaced. ``OSError``
        when the disk refuses (full, read-only)."""
        data = json.dumps(doc, separators=(",", ":")).encode()
        while len(data) > SLOT_BYTES - 4 and doc["events"]:
            doc["events"] = doc["events"][len(doc["events"]) // 2 :]
            data = json.dumps(doc, separators=(",", ":")).encode()
        self.relay(only_if_damaged=True)
        head = self.pread(HEADER_BYTES, 0)
        ours = len(head) == HEADER_BYTES and head[:4] == MAGIC and head[_ACTIVE] <= 1
        spare = 1 - head[_ACTIVE] if ours else 0
        at = HEADER_BYTES + spare * SLOT_BYTES
        self.pwrite(struct.pack("<I", len(data)) + data, at)
        old = int.from_bytes(head[_GEN : _GEN + 8], "little") if ours else 0
        gen = ((old + 1) % 2**64).to_bytes(8, "little")
        self.pwrite(MAGIC + bytes([spare]) + b"\0\0\0" + gen, 0)
        if durable:
            os.fsync(self._fd)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
            try:
                with open(fd, "wb") as f:
                    f.write(json.dumps(doc, indent=1).encode())
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    tmp.unlink()
                raise
        return gen
