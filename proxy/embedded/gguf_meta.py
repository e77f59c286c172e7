"""A GGUF file's metadata, read with the standard library only (tensors not read)."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

from proxy.embedded.build import EmbeddedError

# GGUF metadata value types: (struct format, size) for the fixed-size ones; 8 = string, 9 = array.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def read_gguf_metadata(path: Path) -> dict[str, tuple[int, Any, int | None]]:
    """``key -> (value type, value, array item type)`` of a GGUF file's metadata, tensors not read.

    Written here because ``gguf.GGUFReader`` builds a memmap view per array item: 10 s for the qwen2 vocab
    (152k tokens + 151k merges) against 0.3 s for this.
    """
    data = path.read_bytes() if path.stat().st_size < (1 << 28) else _gguf_head(path)
    if data[:4] != b"GGUF":
        raise EmbeddedError(f"{path} is not a GGUF file")
    _version, _n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
    pos = 24

    def string() -> str:
        nonlocal pos
        (n,) = struct.unpack_from("<Q", data, pos)
        pos += 8 + n
        return data[pos - n : pos].decode("utf-8")

    def value(vtype: int) -> Any:
        nonlocal pos
        if vtype == 8:
            return string()
        fmt = _GGUF_SCALARS[vtype]
        (v,) = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize(fmt)
        return v

    out: dict[str, tuple[int, Any, int | None]] = {}
    for _ in range(n_kv):
        key = string()
        (vtype,) = struct.unpack_from("<I", data, pos)
        pos += 4
        if vtype != 9:
            out[key] = (vtype, value(vtype), None)
            continue
        sub, count = struct.unpack_from("<IQ", data, pos)
        pos += 12
        if sub in _GGUF_SCALARS:
            fmt = f"<{count}{_GGUF_SCALARS[sub]}"
            items: list[Any] = list(struct.unpack_from(fmt, data, pos))
            pos += struct.calcsize(fmt)
        else:
            items = [value(sub) for _ in range(count)]
        out[key] = (vtype, items, sub)
    return out


def _gguf_head(path: Path) -> bytes:
    with open(path, "rb") as fh:  # a big model: its metadata is in the first few tens of MB
        return fh.read(1 << 27)
