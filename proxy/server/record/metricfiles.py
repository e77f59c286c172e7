"""The multiprocess metric files of ``serve --workers N``, written so that damage costs figures, never a process.

prometheus_client keeps each process's values in ``<type>_<pid>.db`` in the metrics directory through a
memory-mapped file (``MmapedDict``): ``truncate -s 0`` of that file, or a page the disk cannot allocate, kills the
process at its next metric update with SIGBUS. ``PwriteDict`` keeps the same file format (the merge reads it
unchanged) but holds the values in memory and writes each change with ``os.pwrite`` at once, or — inside ``batch``
(a finished attempt's few dozen values; never per chunk) — the changed span of each file in one write at its end. A cut file reads short, a full disk raises ``OSError`` (logged once, the
figures kept in memory and written again with the next change), and every ``CHECK_EVERY`` flushes the whole file
is written again (a cut one made whole). ``install`` makes prometheus_client use it in this
process; ``SafeMultiProcessCollector`` merges the directory leaving out a file that cannot be read (garbage, a
huge length), logged once per file, instead of failing the whole scrape.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import struct
import threading
from collections.abc import Iterator
from typing import ClassVar

import prometheus_client.values
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.multiprocess import MultiProcessCollector

log = logging.getLogger("enginemeter.metrics")

_USED = struct.Struct("i")
_TWO_DOUBLES = struct.Struct("dd")
#: the file's size is checked (one ``fstat``) once per this many writes
CHECK_EVERY = 256


class PwriteDict:
    """prometheus_client's ``MmapedDict`` interface and file format (a 4-byte used length, 4 bytes of padding, then
    per key: its length, the key padded to 8 bytes, the value and timestamp as two doubles), in memory and written
    through ``pwrite``. Not thread safe (prometheus_client holds a lock around it)."""

    def __init__(self, filename: str, read_mode: bool = False) -> None:
        self._fname = filename
        self._fd = os.open(filename, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._positions: dict[str, int] = {}
        self._image = bytearray(_USED.pack(8) + b"\0" * 4)
        self._writes = 0
        self._refused = 0
        #: the span of values changed and not yet written (inside a ``batch``)
        self._lo, self._hi = 1 << 62, 0
        try:
            data = os.pread(self._fd, 1 << 26, 0)
            for key, _, _, pos in MmapedDict.read_all_values_from_file(filename):  # type: ignore[no-untyped-call]
                self._positions[key] = pos
            used = _USED.unpack_from(data, 0)[0] if len(data) >= 8 else 8
            if self._positions:
                self._image = bytearray(data[:used])
        except (ValueError, RuntimeError, struct.error, UnicodeDecodeError, OSError):
            self._positions.clear()  # garbage: start again (this process's figures in it are lost)
        self._write(bytes(self._image), 0)

    def _write(self, data: bytes, at: int) -> None:
        try:
            os.pwrite(self._fd, data, at)
        except OSError as exc:  # a full or read-only disk: the value stays in memory, written with the next change
            self._refused += 1
            if self._refused == 1:
                log.error("metric file %s cannot be written (%s): its figures lag until it can", self._fname, exc)

    def _init_value(self, key: str) -> None:
        encoded = key.encode("utf-8")
        padded = encoded + b" " * (8 - (len(encoded) + 4) % 8)
        entry = struct.pack(f"i{len(padded)}sdd", len(encoded), padded, 0.0, 0.0)
        at = len(self._image)
        self._image += entry
        self._positions[key] = len(self._image) - 16
        self._write(entry, at)
        _USED.pack_into(self._image, 0, len(self._image))
        self._write(bytes(self._image[:4]), 0)

    def read_value(self, key: str) -> tuple[float, float]:
        if key not in self._positions:
            self._init_value(key)
        value, timestamp = _TWO_DOUBLES.unpack_from(self._image, self._positions[key])
        return value, timestamp

    def write_value(self, key: str, value: float, timestamp: float) -> None:
        if key not in self._positions:
            self._init_value(key)
        pos = self._positions[key]
        self._image[pos : pos + 16] = _TWO_DOUBLES.pack(value, timestamp)
        if pos < self._lo:
            self._lo = pos
        if pos + 16 > self._hi:
            self._hi = pos + 16
        if _batch.depth:
            _batch.dirty.add(self)
        else:
            self.flush()

    def flush(self) -> None:
        """The values changed since the last flush, written in one ``pwrite``. Every ``CHECK_EVERY`` flushes the
        whole image is written (a cut file made whole again)."""
        lo, hi = self._lo, self._hi
        self._lo, self._hi = 1 << 62, 0
        self._writes += 1
        if self._writes % CHECK_EVERY == 0 or self._refused:
            self._check()
        elif lo < hi:
            self._write(bytes(self._image[lo:hi]), lo)

    def _check(self) -> None:
        try:
            if os.fstat(self._fd).st_size < len(self._image):
                log.error("metric file %s was cut: written again from this process's figures", self._fname)
        except OSError:
            pass
        self._refused = 0
        self._write(bytes(self._image), 0)

    def read_all_values(self) -> Iterator[tuple[str, float, float]]:
        for key, pos in self._positions.items():
            value, timestamp = _TWO_DOUBLES.unpack_from(self._image, pos)
            yield key, value, timestamp

    def close(self) -> None:
        if self._fd >= 0:
            self.flush()
            os.close(self._fd)
            self._fd = -1


class _Batch(threading.local):
    depth = 0

    def __init__(self) -> None:
        self.dirty: set[PwriteDict] = set()


_batch = _Batch()


@contextlib.contextmanager
def batch() -> Iterator[None]:
    """The metric writes of this thread inside, written once at its end: one ``pwrite`` per file touched rather
    than one per value (a finished attempt updates a few dozen). Writes are as synchronous as outside it: done when
    the block ends."""
    _batch.depth += 1
    try:
        yield
    finally:
        _batch.depth -= 1
        if not _batch.depth and _batch.dirty:
            dirty, _batch.dirty = _batch.dirty, set()
            for d in dirty:
                d.flush()


def install() -> None:
    """prometheus_client's multiprocess values in this process through ``PwriteDict`` (before any metric exists)."""
    prometheus_client.values.MmapedDict = PwriteDict  # type: ignore[attr-defined,assignment]


class SafeMultiProcessCollector(MultiProcessCollector):
    """``MultiProcessCollector`` that leaves out a file it cannot read (cut mid-entry, garbage, a huge length)."""

    _warned: ClassVar[set[str]] = set()

    def collect(self):  # type: ignore[no-untyped-def]
        files = glob.glob(os.path.join(self._path, "*.db"))
        good = []
        for f in files:
            try:
                list(MmapedDict.read_all_values_from_file(f))  # type: ignore[no-untyped-call]
            except FileNotFoundError:
                continue
            except Exception as exc:  # any garbage: this file's figures are left out
                if f not in self._warned:
                    self._warned.add(f)
                    log.error("metric file %s is damaged (%s): left out of the scrape", f, exc)
                continue
            good.append(f)
        return self.merge(good, accumulate=True)  # type: ignore[no-untyped-call]
