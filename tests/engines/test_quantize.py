"""``llama-quantize`` built with the server, and the generator's sharper parameters (issue 46).

The sharper parameters (``logit_scale``, ``untiled_output``) join a model's record only when not their default,
so every model generated before them keeps its name and bytes; with them, the next-token distribution is sharp
enough for a KL divergence to tell two precisions apart. ``w256`` is the width K-quants need."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.embedded import default_model_path, llama_quantize_path, make_model, model_params, quantize_model
from proxy.embedded.gguf_meta import read_gguf_metadata

#: llama.cpp's ``llama_ftype``: what llama-quantize writes into ``general.file_type``
FTYPE = {"F16": 1, "Q4_0": 2, "Q8_0": 7, "Q2_K": 10, "Q4_K_M": 15}


def test_the_sharper_parameters_are_recorded_only_when_set() -> None:
    assert model_params().key() == "bb9e70fc0adb"  # the default tiny model, unchanged
    record = json.loads(model_params().record())
    assert "logit_scale" not in record and "untiled_output" not in record
    sharp = model_params(logit_scale=40.0, untiled_output=True)
    assert json.loads(sharp.record())["logit_scale"] == 40.0 and json.loads(sharp.record())["untiled_output"]
    assert sharp.key() != model_params().key() != model_params(logit_scale=20.0).key()
    w = model_params(shape="w256")
    assert (w.n_embd, w.n_ff) == (256, 512) and "-w256-" in default_model_path(w).name
    with pytest.raises(ValueError, match="logit_scale must be positive"):
        model_params(logit_scale=0.0)


def test_llama_quantize_path_honours_its_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tool = tmp_path / "llama-quantize"
    monkeypatch.setenv("LLAMA_QUANTIZE_BIN", str(tool))
    assert llama_quantize_path() == tool


def _top_logprob(url: str) -> float:
    body = {"prompt": "The lighthouse keeper", "n_predict": 1, "temperature": 0, "n_probs": 1}
    doc: dict[str, Any] = httpx.post(f"{url}/completion", json=body, timeout=30).json()
    return float(doc["completion_probabilities"][0]["top_logprobs"][0]["logprob"])


def test_the_sharp_model_has_a_peaked_next_token_distribution(llama_server_factory: Any, tiny_model: Path) -> None:
    flat = llama_server_factory(model=tiny_model)
    sharp = llama_server_factory(model=make_model(logit_scale=40.0, untiled_output=True))
    assert _top_logprob(flat.url) < -11  # ln(1/152k) = -11.9: nearly uniform
    assert _top_logprob(sharp.url) > -4


@pytest.mark.parametrize(("shape", "qtype"), [(None, "Q4_0"), ("w256", "Q4_K_M"), ("w256", "Q2_K")])
def test_llama_quantize_writes_the_type_asked_and_the_server_loads_it(
    llama_server_bin: Path, llama_server_factory: Any, shape: str | None, qtype: str
) -> None:
    src = make_model(shape=shape, logit_scale=40.0 if shape is None else 20.0, untiled_output=True)
    assert llama_quantize_path().is_file()
    out = quantize_model(src, qtype)
    assert out.name == src.name.removesuffix(".gguf") + f"-{qtype}.gguf"
    assert read_gguf_metadata(src)["general.file_type"][1] == FTYPE["F16"]
    assert read_gguf_metadata(out)["general.file_type"][1] == FTYPE[qtype]
    assert out.stat().st_size < src.stat().st_size
    assert quantize_model(src, qtype) == out  # reused, not rewritten
    server = llama_server_factory(model=out)
    assert _top_logprob(server.url) > -6
