"""Generated models: :class:`ModelParams` (everything that decides a model's bytes), the named shapes, and
:func:`make_model`, which writes a random-weight GGUF with a real tokenizer. ``gguf`` and ``numpy`` are
imported inside the functions that write, so importing this module needs only the standard library."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TextIO, TypedDict, Unpack

from proxy.embedded.build import VOCABS, EmbeddedError, Vocab, _run_logged, cache_root, llama_quantize_path, vocab_path
from proxy.embedded.gguf_meta import read_gguf_metadata

if TYPE_CHECKING:
    import numpy as np

DType = Literal["f16", "f32"]

# Model shapes by name. "7b" is Qwen2-7B's geometry (~15 GB in F16 with the qwen2 vocabulary); "mistral7b" is
# Mistral-7B's (~14.5 GB in F16 with a 32k vocabulary; use it with vocab "llama-spm" for the llama architecture).
SHAPES: dict[str, dict[str, int]] = {
    "tiny": {"n_layer": 2, "n_embd": 64, "n_ff": 128, "n_head": 4, "n_head_kv": 2},
    # K-quants (Q2_K, Q4_K_M, ...) need rows divisible by 256: on "tiny" llama-quantize falls back to Q4_0
    "w256": {"n_layer": 2, "n_embd": 256, "n_ff": 512, "n_head": 4, "n_head_kv": 2},
    "7b": {"n_layer": 28, "n_embd": 3584, "n_ff": 18944, "n_head": 28, "n_head_kv": 4},
    "mistral7b": {"n_layer": 32, "n_embd": 4096, "n_ff": 14336, "n_head": 32, "n_head_kv": 8},
}

# A Llama-2 style template for the llama-spm vocabulary (its vocab file has none), so chat endpoints work.
LLAMA2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '<<SYS>>\\n' + message['content'] + '\\n<</SYS>>\\n\\n' }}"
    "{% elif message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + eos_token }}"
    "{% endif %}{% endfor %}"
)


@dataclass(frozen=True)
class ModelParams:
    """Everything that determines a generated model's bytes (the vocab file of the llama.cpp source aside). The
    defaults are the tiny qwen2 model."""

    vocab: str = "qwen2"
    n_layer: int = 2
    n_embd: int = 64
    n_ff: int = 128
    n_head: int = 4
    n_head_kv: int = 2
    n_ctx_train: int = 4096
    seed: int = 0
    dtype: str = "f16"
    vocab_sha256: str | None = None  # an explicit vocab file's digest; None: ggml-vocab-<vocab>.gguf of the source
    #: the output norm's weight, a multiplier of every logit: 1 gives a nearly uniform next-token distribution
    #: (entropy within 0.002 nats of uniform); ~40 at width 64, ~20 at 256 a sharp one (entropy 0.7-3.7 nats),
    #: which a KL divergence between two precisions needs
    logit_scale: float = 1.0
    #: every output row drawn on its own (no 4096-row tiling, so no tied logits between twin tokens)
    untiled_output: bool = False

    @property
    def arch(self) -> str:
        return "qwen2" if self.vocab == "qwen2" else "llama"

    def record(self) -> str:
        """The parameters as JSON (sidecar, GGUF metadata, key); ``vocab_sha256``, ``logit_scale`` and
        ``untiled_output`` only when not their default, so models generated before them keep names and bytes."""
        quiet = {"vocab_sha256": None, "logit_scale": 1.0, "untiled_output": False}
        fields = {k: v for k, v in asdict(self).items() if not (k in quiet and v == quiet[k])}
        return json.dumps(fields, sort_keys=True)

    def key(self) -> str:
        return hashlib.sha256(self.record().encode()).hexdigest()[:12]


class ModelOptions(TypedDict, total=False):
    """The keywords that choose a generated model, taken alike by :func:`model_params` and :func:`make_model`; one
    left out keeps :class:`ModelParams`' default. ``shape``: a key of :data:`SHAPES`, overriding the dimensions."""

    vocab: Vocab
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    n_ctx_train: int
    seed: int
    dtype: DType
    logit_scale: float
    untiled_output: bool
    shape: str | None


def model_params(*, vocab_sha256: str | None = None, **options: Unpack[ModelOptions]) -> ModelParams:
    """Validate ``options`` and fold ``shape`` into one record."""
    given: dict[str, Any] = dict(options)
    shape = given.pop("shape", None)
    if shape is not None:
        if shape not in SHAPES:
            raise ValueError(f"unknown shape {shape!r}; expected one of {sorted(SHAPES)}")
        given.update(SHAPES[shape])
    p = ModelParams(**given, vocab_sha256=vocab_sha256)
    if p.vocab not in VOCABS:
        raise ValueError(f"unknown vocab {p.vocab!r}; expected one of {VOCABS}")
    if p.dtype not in ("f16", "f32"):
        raise ValueError(f"dtype must be f16 or f32, not {p.dtype!r}")
    if not p.logit_scale > 0:
        raise ValueError(f"logit_scale must be positive, not {p.logit_scale!r}")
    if p.n_embd % p.n_head or p.n_head % p.n_head_kv:
        dims = {k: getattr(p, k) for k in SHAPES["tiny"]}
        raise ValueError(f"n_embd must divide by n_head and n_head by n_head_kv: {dims}")
    return p


def default_model_path(params: ModelParams, *, cache_dir: Path | None = None) -> Path:
    """``<cache>/models/enginemeter-<vocab>-<shape|custom>-<hash>.gguf``: one file per parameter set."""
    shape = next((k for k, v in SHAPES.items() if all(getattr(params, f) == n for f, n in v.items())), "custom")
    return cache_root(cache_dir) / "models" / f"enginemeter-{params.vocab}-{shape}-{params.key()}.gguf"


def make_model(
    path: Path | None = None,
    *,
    vocab_file: Path | None = None,
    cache_dir: Path | None = None,
    log: TextIO | None = None,
    **options: Unpack[ModelOptions],
) -> Path:
    """Write a random-weight GGUF with a real tokenizer; return its path. ``options``: :class:`ModelOptions`.

    ``path``: the file to write; an existing directory gets a parameter-keyed file name inside it; ``None``
    means :func:`default_model_path` in the cache. A file whose ``.json`` sidecar records the same parameters
    is reused as is. Architecture ``qwen2`` (q/k/v biases) for the qwen2 vocabulary, ``llama`` for llama-spm.
    ``vocab_file``: copy the ``tokenizer.*`` keys from this GGUF instead of the source's vocab file (e.g. a
    ``--vocab-only`` conversion of Mistral's or Llama's SentencePiece tokenizer); ``vocab`` still picks the
    architecture, and the file's digest joins the parameters. Without a ``tokenizer.chat_template`` in the
    vocab, a Llama-2 ``[INST]`` template is added.
    The same parameters give the same bytes on any machine: weights come from PCG64's raw 64-bit stream,
    which NumPy keeps fixed across versions. Norm weights and biases are F32; matrices are ``dtype``.
    With the tiny default (2 layers x 64) the file is 45 MB (qwen2, mostly vocabulary) or 9 MB (llama-spm)
    and takes about a second. ``shape="7b"`` writes 15.2 GB in 35 s on the H200 machine (one tensor in memory
    at a time), loads with ``-ngl 99`` in 4.4 s and decodes greedily at 150-175 tok/s there.
    See the module docstring for generation length.
    """
    if vocab_file is not None and not Path(vocab_file).is_file():
        raise EmbeddedError(f"vocab file {vocab_file} does not exist")
    params = model_params(**options, vocab_sha256=None if vocab_file is None else _sha256(Path(vocab_file)))
    log = log or sys.stderr
    if path is None:
        path = default_model_path(params, cache_dir=cache_dir)
    elif path.is_dir():
        path = path / default_model_path(params).name
    sidecar = path.with_name(path.name + ".json")
    record = params.record()
    if path.is_file() and sidecar.is_file() and sidecar.read_text() == record:
        return path
    try:
        import gguf  # noqa: F401
        import numpy  # noqa: F401
    except ImportError as exc:
        raise EmbeddedError(f"make_model needs gguf and numpy (pip install 'enginemeter[embedded]'): {exc}") from exc
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        vocab_src = (
            Path(vocab_file) if vocab_file is not None else vocab_path(params.vocab, cache_dir=cache_dir, log=log)
        )
        _write_gguf(tmp, params, vocab_src)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    sidecar.write_text(record)
    size_mb = path.stat().st_size / 1e6
    print(f"embedded: wrote {path} ({size_mb:.0f} MB) in {time.monotonic() - t0:.1f} s", file=log, flush=True)
    return path


def quantize_model(model: Path, qtype: str, *, requantize: bool = False, log: TextIO | None = None) -> Path:
    """``<model stem>-<qtype>.gguf`` beside ``model``, written once by llama.cpp's own ``llama-quantize``
    (:func:`~proxy.embedded.build.llama_quantize_path`); reused while newer than ``model``. ``qtype``: any type
    llama-quantize names (Q8_0, Q4_0, Q4_K_M, Q2_K, ...); K-quants need a width divisible by 256 (shape "w256").
    ``requantize``: ``model`` is itself quantized (``--allow-requantize``)."""
    out = model.with_name(f"{model.name.removesuffix('.gguf')}-{qtype}.gguf")
    if out.is_file() and out.stat().st_mtime >= model.stat().st_mtime:
        return out
    log = log or sys.stderr
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        allow = ["--allow-requantize"] if requantize else []
        _run_logged([str(llama_quantize_path(log=log)), *allow, str(model), str(tmp), qtype], log)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


class _Random:
    """Uniform weights in [-scale, scale) from PCG64's raw stream (version-stable, unlike distributions)."""

    def __init__(self, seed: int) -> None:
        import numpy as np

        self._np = np
        self._gen = np.random.PCG64(seed)

    def uniform(self, shape: tuple[int, ...], scale: float) -> np.ndarray[Any, Any]:
        xp = self._np
        n = 1
        for d in shape:
            n *= d
        bits = self._gen.random_raw(n)
        unit = (bits >> xp.uint64(11)).astype(xp.float64) * (1.0 / (1 << 53))  # 53 random bits -> [0, 1)
        out: np.ndarray[Any, Any] = ((unit * 2.0 - 1.0) * scale).astype(xp.float32).reshape(shape)
        return out


def _plain_text_tokens(tokens: Sequence[str], types: Sequence[int], model: str) -> np.ndarray[Any, Any]:
    """Mask of tokens that decode to printable ASCII on their own (the only ones the output may pick)."""
    import numpy as np

    if model == "gpt2":  # byte-level BPE: token text is bytes mapped through GPT-2's bytes_to_unicode
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
        byte_of = {chr(b): b for b in printable}
        extra = 0
        for b in range(256):
            if b not in printable:
                byte_of[chr(256 + extra)] = b
                extra += 1

        def text(tok: str) -> str | None:
            try:
                return bytes(byte_of[c] for c in tok).decode("ascii")
            except (KeyError, UnicodeDecodeError):
                return None
    else:  # sentencepiece: '▁' is a space; byte-fallback tokens have their own type

        def text(tok: str) -> str | None:
            return tok.replace("▁", " ")

    mask = np.zeros(len(tokens), dtype=bool)
    for i, (tok, typ) in enumerate(zip(tokens, types, strict=True)):
        t = text(tok) if typ == 1 else None  # 1 = NORMAL; not control, user-defined, unused or byte
        mask[i] = t is not None and len(t) > 0 and all(" " <= c <= "~" for c in t)
    return mask


def _write_gguf(path: Path, p: ModelParams, vocab_file: Path) -> None:
    import gguf
    import numpy as np

    meta = read_gguf_metadata(vocab_file)
    missing = [
        k for k in ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type") if k not in meta
    ]
    if missing:
        raise EmbeddedError(f"{vocab_file} is not a vocab: it has no {', '.join(missing)}")
    tokens: list[str] = meta["tokenizer.ggml.tokens"][1]
    types: list[int] = meta["tokenizer.ggml.token_type"][1]
    writer = gguf.GGUFWriter(path, p.arch)
    _add_keys(writer, p, meta, n_vocab=len(tokens))
    allowed = _plain_text_tokens(tokens, types, meta["tokenizer.ggml.model"][1])
    mat_dtype = np.float16 if p.dtype == "f16" else np.float32
    specs = _tensor_specs(p, n_vocab=len(tokens))
    for name, shape, kind in specs:
        dt = np.dtype(np.float32 if kind in ("norm", "onorm", "bias") else mat_dtype)
        nbytes = dt.itemsize
        for d in shape:
            nbytes *= d
        writer.add_tensor_info(name, shape, dt, nbytes)

    rng = _Random(p.seed)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _name, shape, kind in specs:
        writer.write_tensor_data(_tensor(rng, shape, kind, mat_dtype, allowed, p))
    writer.close()


def _add_keys(writer: Any, p: ModelParams, meta: dict[str, Any], *, n_vocab: int) -> None:
    """The model's own keys (its parameters and shape), then the vocab file's ``tokenizer.*`` keys."""
    import gguf

    arch = p.arch
    head_dim = p.n_embd // p.n_head
    writer.add_name(f"enginemeter-{p.vocab}-random")
    writer.add_string("enginemeter.model_params", p.record())
    writer.add_uint32(gguf.Keys.General.FILE_TYPE, 1 if p.dtype == "f16" else 0)  # MOSTLY_F16 / ALL_F32
    writer.add_uint32(f"{arch}.context_length", p.n_ctx_train)
    writer.add_uint32(f"{arch}.embedding_length", p.n_embd)
    writer.add_uint32(f"{arch}.block_count", p.n_layer)
    writer.add_uint32(f"{arch}.feed_forward_length", p.n_ff)
    writer.add_uint32(f"{arch}.attention.head_count", p.n_head)
    writer.add_uint32(f"{arch}.attention.head_count_kv", p.n_head_kv)
    writer.add_uint32(f"{arch}.rope.dimension_count", head_dim)
    writer.add_float32(f"{arch}.rope.freq_base", 1_000_000.0 if arch == "qwen2" else 10_000.0)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)

    for key, (vtype, val, sub) in meta.items():
        if key.startswith("tokenizer."):
            sub_type = gguf.GGUFValueType(sub) if sub is not None else None
            writer.add_key_value(key, val, gguf.GGUFValueType(vtype), sub_type=sub_type)
    if "tokenizer.chat_template" not in meta:
        writer.add_string("tokenizer.chat_template", LLAMA2_CHAT_TEMPLATE)
    writer.add_uint32(f"{arch}.vocab_size", n_vocab)


def _tensor_specs(p: ModelParams, *, n_vocab: int) -> list[tuple[str, tuple[int, ...], str]]:
    """Every tensor in file order: (name, numpy shape (out, in), kind); kind "mat" a random matrix, "out" the
    output projection (rows of tokens the output may not pick zeroed), "norm" ones, "onorm" the output norm
    (``logit_scale``), "bias" small random."""
    n_kv = p.n_head_kv * (p.n_embd // p.n_head)
    specs: list[tuple[str, tuple[int, ...], str]] = [
        ("token_embd.weight", (n_vocab, p.n_embd), "mat"),
        ("output_norm.weight", (p.n_embd,), "onorm"),
        ("output.weight", (n_vocab, p.n_embd), "out"),
    ]
    for i in range(p.n_layer):
        b = f"blk.{i}"
        specs.append((f"{b}.attn_norm.weight", (p.n_embd,), "norm"))
        for proj, rows in (("q", p.n_embd), ("k", n_kv), ("v", n_kv)):
            specs.append((f"{b}.attn_{proj}.weight", (rows, p.n_embd), "mat"))
            if p.arch == "qwen2":
                specs.append((f"{b}.attn_{proj}.bias", (rows,), "bias"))
        specs += [
            (f"{b}.attn_output.weight", (p.n_embd, p.n_embd), "mat"),
            (f"{b}.ffn_norm.weight", (p.n_embd,), "norm"),
            (f"{b}.ffn_gate.weight", (p.n_ff, p.n_embd), "mat"),
            (f"{b}.ffn_up.weight", (p.n_ff, p.n_embd), "mat"),
            (f"{b}.ffn_down.weight", (p.n_embd, p.n_ff), "mat"),
        ]
    return specs


def _tensor(
    rng: _Random, shape: tuple[int, ...], kind: str, mat_dtype: Any, allowed: np.ndarray[Any, Any], p: ModelParams
) -> np.ndarray[Any, Any]:
    import numpy as np

    scale = 0.02 * 3**0.5  # uniform with std 0.02, the usual init
    if kind == "norm":
        return np.ones(shape, dtype=np.float32)
    if kind == "onorm":
        return np.full(shape, p.logit_scale, dtype=np.float32)
    if kind == "out" and p.untiled_output:
        own = rng.uniform(shape, scale).astype(mat_dtype)
        own[~allowed] = 0
        return np.ascontiguousarray(own)
    if kind == "bias":
        return rng.uniform(shape, scale)
    # Tile one random block: fast for 7B sizes. 4096 distinct rows keep the argmax spread over many
    # tokens; rows repeat beyond that, so ties go to the lower id, inside the first 4096 tokens.
    rows, cols = shape
    block = rng.uniform((min(rows, 4096), min(cols, 1024)), scale).astype(mat_dtype)
    full = np.tile(block, (-(-rows // block.shape[0]), -(-cols // block.shape[1])))[:rows, :cols]
    if kind == "out":
        full = np.ascontiguousarray(full)
        full[~allowed] = 0
    return np.ascontiguousarray(full)
