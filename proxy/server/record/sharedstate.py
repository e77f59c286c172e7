"""A rollout's state shared by every process of the proxy (``proxy.server.switch.rollout``): a memory-mapped file that
each process maps, written under an ``flock``, and a JSON copy written at each transition. ``LockedMap`` is the
mapped file and its lock alone, which the whole proxy's traffic count shares too (``proxy.server.observe.inflight``).

Layout of ``<state_file>.shm``: a 64-byte header (magic, which slot is current, an 8-byte generation), then two
slots of (length, JSON). A write fills the slot that is not current, makes it current, then bumps the
generation, so a process killed mid-write leaves the current slot whole; a reader without the lock that sees
the generation move by two or more while it copied a slot copies again. The request path compares the
generation only (8 bytes).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

#: the shared map: header (magic, active slot, generation), then two slots of (length, JSON)
MAGIC = b"EMR1"
_ACTIVE = 4
_GEN = 8
HEADER_BYTES = 64
SLOT_BYTES = 64 * 1024
MAP_BYTES = HEADER_BYTES + 2 * SLOT_BYTES


class LockedMap:
    """A file of ``size`` bytes every process of the proxy maps, its descriptor also the lock (``flock``; the
    kernel frees it if the holder dies). The first process to open it lays it out under the lock: a file of another
    size is emptied to ``size`` zero bytes, then ``init(mm, fresh)`` runs, still under the lock (``fresh``: this
    open laid it out) — one layout, whichever process comes first."""

    def __init__(
        self, path: str | os.PathLike[str], size: int, init: Callable[[mmap.mmap, bool], None] | None = None
    ) -> None:
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            with self.locked():
                fresh = os.fstat(self._fd).st_size != size
                if fresh:
                    os.ftruncate(self._fd, 0)  # not ours, or another layout: start empty
                    os.ftruncate(self._fd, size)
                self._mm = mmap.mmap(self._fd, size)
                if init is not None:
                    init(self._mm, fresh)
        except BaseException:
            os.close(self._fd)
            raise

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        # held for one read-modify-write (microseconds to tens of them)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        self._mm.close()
        os.close(self._fd)


class StateFile(LockedMap):
    """``<path>.shm`` mapped (its descriptor is also the lock) and the JSON copy at ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        super().__init__(f"{path}.shm", MAP_BYTES)

    def gen(self) -> bytes:
        return self._mm[_GEN : _GEN + 8]

    def _slot(self) -> bytes | None:
        mm = self._mm
        if mm[:4] != MAGIC:
            return None
        active = mm[_ACTIVE]
        at = HEADER_BYTES + active * SLOT_BYTES
        (n,) = struct.unpack_from("<I", mm, at)
        return mm[at + 4 : at + 4 + min(n, SLOT_BYTES - 4)]

    def read(self) -> tuple[bytes, dict[str, Any] | None]:
        """(generation, document) without the lock: copied again if two writes overlapped the copy."""
        for _ in range(100):
            g1 = self.gen()
            raw = self._slot()
            g2 = self.gen()
            if (int.from_bytes(g2, "little") - int.from_bytes(g1, "little")) % 2**64 < 2:
                break
        # the copy is at least as new as g1 (labelled g1, a write that overlapped it is read again next time)
        if raw is None:
            return g1, None
        doc = json.loads(raw)
        return g1, doc if isinstance(doc, dict) else None

    def read_copy(self) -> dict[str, Any] | None:
        """The JSON copy (the map is gone or was not ours)."""
        try:
            doc = json.loads(self.path.read_bytes())
        except FileNotFoundError:
            return None
        return doc if isinstance(doc, dict) else None

    def write(self, doc: dict[str, Any], *, durable: bool = False) -> bytes:
        """Under ``locked()``: the document into the spare slot, current, generation + 1 (returned). ``durable``
        (a transition): the map flushed to disk and the JSON copy replaced."""
        data = json.dumps(doc, separators=(",", ":")).encode()
        while len(data) > SLOT_BYTES - 4 and doc["events"]:
            doc["events"] = doc["events"][len(doc["events"]) // 2 :]
            data = json.dumps(doc, separators=(",", ":")).encode()
        mm = self._mm
        spare = 1 - mm[_ACTIVE] if mm[:4] == MAGIC else 0
        at = HEADER_BYTES + spare * SLOT_BYTES
        mm[at : at + 4 + len(data)] = struct.pack("<I", len(data)) + data
        mm[:4] = MAGIC
        mm[_ACTIVE] = spare
        gen = ((int.from_bytes(self.gen(), "little") + 1) % 2**64).to_bytes(8, "little")
        mm[_GEN : _GEN + 8] = gen
        if durable:
            mm.flush()
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            with open(tmp, "wb") as f:
                f.write(json.dumps(doc, indent=1).encode())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        return gen
