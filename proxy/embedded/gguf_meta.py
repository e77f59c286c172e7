"""A GGUF file's header, read with the standard library only: its metadata, its tensor table (names, shapes,
types, offsets; the tensor data is never read) and where the data starts, so the weights' size is exact
(file size minus the data offset), and the model's shape for the KV-cache formula (:class:`ModelShape`)."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proxy.embedded.build import EmbeddedError

# GGUF metadata value types: (struct format, size) for the fixed-size ones; 8 = string, 9 = array.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
#: how much of a big file is read first (the header of a 27B Q4_K_M with a 262k vocabulary: ~20 MB), then all
_HEAD_BYTES = 1 << 27
DEFAULT_ALIGNMENT = 32

Metadata = dict[str, tuple[int, Any, int | None]]


@dataclass(frozen=True)
class TensorInfo:
    name: str
    #: GGUF order (fastest-varying dimension first)
    shape: tuple[int, ...]
    ggml_type: int
    #: from the start of the data section
    offset: int


@dataclass(frozen=True)
class GgufHeader:
    path: Path
    version: int
    metadata: Metadata
    tensors: tuple[TensorInfo, ...]
    #: where the tensor data starts, and the file's size: the weights are everything in between and after
    data_offset: int
    file_size: int

    @property
    def weights_bytes(self) -> int:
        return self.file_size - self.data_offset

    def value(self, key: str, default: Any = None) -> Any:
        v = self.metadata.get(key)
        return default if v is None else v[1]

    @property
    def n_params(self) -> int:
        n = 0
        for t in self.tensors:
            size = 1
            for d in t.shape:
                size *= d
            n += size
        return n


@dataclass(frozen=True)
class ModelShape:
    """What the KV cache's size depends on, from ``{arch}.*`` metadata."""

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    #: KV heads per layer (GGUF allows a per-layer array; GQA when below ``n_head``)
    n_head_kv: tuple[int, ...]
    head_dim_k: int
    head_dim_v: int
    context_length: int | None
    #: sliding-window attention (Gemma, Mistral): llama.cpp then keeps a smaller cache for those layers
    sliding_window: int | None
    file_type: int | None

    @property
    def kv_heads(self) -> int:
        """The KV heads when every layer has the same number (else the largest)."""
        return max(self.n_head_kv) if self.n_head_kv else 0


def read_gguf_metadata(path: Path) -> Metadata:
    """``key -> (value type, value, array item type)`` of a GGUF file's metadata, tensors not read.

    Written here because ``gguf.GGUFReader`` builds a memmap view per array item: 10 s for the qwen2 vocab
    (152k tokens + 151k merges) against 0.3 s for this.
    """
    return read_gguf(path).metadata


def read_gguf(path: Path) -> GgufHeader:
    """The header of the GGUF file at ``path``; ``EmbeddedError`` when it is not one."""
    size = path.stat().st_size
    data = path.read_bytes() if size < (1 << 28) else _head(path, _HEAD_BYTES)
    try:
        return _parse(path, data, size)
    except struct.error:
        if len(data) >= size:
            raise EmbeddedError(f"{path}: truncated GGUF header") from None
        return _parse(path, _head(path, size), size)  # a header larger than the first read: read on


def _parse(path: Path, data: bytes, size: int) -> GgufHeader:
    if data[:4] != b"GGUF":
        raise EmbeddedError(f"{path} is not a GGUF file")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
    pos = 24

    def string() -> str:
        nonlocal pos
        (n,) = struct.unpack_from("<Q", data, pos)
        pos += 8 + n
        if pos > len(data):
            raise struct.error("string past the end of the data read")
        return data[pos - n : pos].decode("utf-8")

    def value(vtype: int) -> Any:
        nonlocal pos
        if vtype == 8:
            return string()
        fmt = _GGUF_SCALARS[vtype]
        (v,) = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize(fmt)
        return v

    meta: Metadata = {}
    for _ in range(n_kv):
        key = string()
        (vtype,) = struct.unpack_from("<I", data, pos)
        pos += 4
        if vtype != 9:
            meta[key] = (vtype, value(vtype), None)
            continue
        sub, count = struct.unpack_from("<IQ", data, pos)
        pos += 12
        if sub in _GGUF_SCALARS:
            fmt = f"<{count}{_GGUF_SCALARS[sub]}"
            items: list[Any] = list(struct.unpack_from(fmt, data, pos))
            pos += struct.calcsize(fmt)
        else:
            items = [value(sub) for _ in range(count)]
        meta[key] = (vtype, items, sub)
    tensors = []
    for _ in range(n_tensors):
        name = string()
        (n_dims,) = struct.unpack_from("<I", data, pos)
        shape = struct.unpack_from(f"<{n_dims}Q", data, pos + 4)
        ggml_type, offset = struct.unpack_from("<IQ", data, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        tensors.append(TensorInfo(name, tuple(shape), ggml_type, offset))
    align = meta.get("general.alignment", (4, DEFAULT_ALIGNMENT, None))[1] or DEFAULT_ALIGNMENT
    data_offset = -(-pos // align) * align
    return GgufHeader(path, version, meta, tuple(tensors), data_offset, size)


def model_shape(header: GgufHeader) -> ModelShape:
    """The model's attention shape from its metadata; ``EmbeddedError`` when the file does not say."""
    arch = header.value("general.architecture")
    if not isinstance(arch, str):
        raise EmbeddedError(f"{header.path}: no general.architecture in the GGUF metadata")

    def num(key: str) -> int | None:
        v = header.value(f"{arch}.{key}")
        return int(v) if isinstance(v, int | float) and not isinstance(v, bool) else None

    n_layer, n_embd, n_head = num("block_count"), num("embedding_length"), num("attention.head_count")
    if n_layer is None or n_embd is None or not n_head:
        raise EmbeddedError(f"{header.path}: {arch}.block_count/embedding_length/attention.head_count missing")
    kv = header.value(f"{arch}.attention.head_count_kv", n_head)
    per_layer = tuple(int(x) for x in kv) if isinstance(kv, list) else (int(kv),) * n_layer
    head_k = num("attention.key_length") or n_embd // n_head
    head_v = num("attention.value_length") or head_k
    ftype = header.value("general.file_type")
    return ModelShape(
        arch=arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=per_layer,
        head_dim_k=head_k,
        head_dim_v=head_v,
        context_length=num("context_length"),
        sliding_window=num("attention.sliding_window"),
        file_type=int(ftype) if isinstance(ftype, int) else None,
    )


def _head(path: Path, n: int) -> bytes:
    with open(path, "rb") as fh:
        return fh.read(n)
