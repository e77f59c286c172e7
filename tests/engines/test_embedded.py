"""proxy/embedded/ against the real thing: generated GGUFs loaded by a real llama-server."""

from __future__ import annotations

import hashlib
import io
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.embedded import (
    EmbeddedError,
    LlamaServer,
    build_llama_server,
    default_model_path,
    make_model,
    model_params,
    read_gguf_metadata,
    start_default_engines,
    vocab_path,
)
from tests.helpers import REPO, LlamaServerFactory

MSGS = [{"role": "user", "content": "Write a story about a cat."}]
GREEDY = {"temperature": 0, "seed": 0}


def chat(url: str, **body: Any) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": MSGS, **GREEDY, **body}, timeout=60)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def tokenize(url: str, text: str) -> list[int]:
    r = httpx.post(f"{url}/tokenize", json={"content": text, "add_special": True}, timeout=10)
    assert r.status_code == 200, r.text
    tokens: list[int] = r.json()["tokens"]
    return tokens


def refuses_connections(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


# ------------------------------------------------------------------------------------ model generation


def test_import_needs_neither_gguf_nor_numpy(tmp_path: Path) -> None:
    code = (
        "import sys; from pathlib import Path; sys.modules['gguf'] = None; sys.modules['numpy'] = None\n"
        "import proxy.embedded as e\n"
        "print(e.default_model_path(e.model_params(shape='7b')).name)\n"
        "try:\n    e.make_model(Path(sys.argv[1]))\nexcept e.EmbeddedError as exc:\n    print('refused:', exc)\n"
    )
    argv = [sys.executable, "-c", code, str(tmp_path / "m.gguf")]
    r = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("enginemeter-qwen2-7b-")
    assert "refused: make_model needs gguf and numpy" in r.stdout


def test_same_parameters_same_bytes_other_seed_other_bytes(tmp_path: Path) -> None:
    a = make_model(tmp_path / "a.gguf", vocab="llama-spm", seed=0)
    b = make_model(tmp_path / "b.gguf", vocab="llama-spm", seed=0)
    c = make_model(tmp_path / "c.gguf", vocab="llama-spm", seed=1)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    assert a.stat().st_size == c.stat().st_size


def test_a_generated_file_is_reused_only_for_the_same_parameters(tmp_path: Path) -> None:
    path = make_model(tmp_path, vocab="llama-spm")  # a directory: parameter-keyed name inside
    assert path.parent == tmp_path
    assert path.name.startswith("enginemeter-llama-spm-tiny-")
    first = path.stat().st_mtime_ns
    assert make_model(tmp_path, vocab="llama-spm") == path
    assert path.stat().st_mtime_ns == first  # reused, not rewritten
    other = make_model(path, vocab="llama-spm", n_layer=1)  # same file, other parameters: rewritten
    assert other == path
    assert read_gguf_metadata(path)["llama.block_count"][1] == 1


def test_metadata_carries_architecture_and_tokenizer(tiny_model: Path, tiny_model_spm: Path) -> None:
    q = read_gguf_metadata(tiny_model)
    s = read_gguf_metadata(tiny_model_spm)
    assert q["general.architecture"][1] == "qwen2"
    assert s["general.architecture"][1] == "llama"
    assert len(q["tokenizer.ggml.tokens"][1]) == 151936
    assert len(s["tokenizer.ggml.tokens"][1]) == 32000
    assert q["tokenizer.ggml.model"][1] == "gpt2"
    assert s["tokenizer.ggml.model"][1] == "llama"
    assert "<|im_start|>" in q["tokenizer.chat_template"][1]
    assert "[INST]" in s["tokenizer.chat_template"][1]
    assert json.loads(q["enginemeter.model_params"][1])["n_embd"] == 64


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n_embd": 60, "n_head": 7}, "divide"),
        ({"n_head": 4, "n_head_kv": 3}, "divide"),
        ({"shape": "13b"}, "unknown shape"),
        ({"vocab": "gpt4"}, "unknown vocab"),
        ({"dtype": "q4_0"}, "dtype"),
    ],
)
def test_bad_model_parameters_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        model_params(**kwargs)


def test_7b_shape_parameters() -> None:
    p = model_params(shape="7b")
    assert (p.n_layer, p.n_embd, p.n_ff, p.n_head, p.n_head_kv, p.dtype) == (28, 3584, 18944, 28, 4, "f16")


def test_mistral7b_shape_is_the_llama_architecture_with_grouped_kv_heads() -> None:
    p = model_params(shape="mistral7b", vocab="llama-spm")
    assert (p.n_layer, p.n_embd, p.n_ff, p.n_head, p.n_head_kv) == (32, 4096, 14336, 32, 8)
    assert p.arch == "llama"
    assert default_model_path(p).name.startswith("enginemeter-llama-spm-mistral7b-")


def test_model_keys_without_a_vocab_file_did_not_change() -> None:
    # cached models and their sidecars written before vocab_file existed stay valid
    assert model_params().key() == "bb9e70fc0adb"
    assert model_params(vocab="llama-spm").key() == "d5072ac4674b"
    assert "vocab_sha256" not in model_params().record()


def write_vocab(path: Path, tokens: list[str], chat_template: str | None = None) -> Path:
    """A vocab-only GGUF like ``convert_hf_to_gguf.py --vocab-only`` writes for a SentencePiece tokenizer."""
    import gguf

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types([2, 3, 3] + [1] * (len(tokens) - 3))  # unknown, control (<s>, </s>), normal
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return path


def test_a_vocab_file_gives_its_tokenizer_to_the_model(tmp_path: Path) -> None:
    tokens = ["<unk>", "<s>", "</s>", *(f"\u2581w{i}" for i in range(61))]
    vocab = write_vocab(tmp_path / "v.gguf", tokens)
    path = make_model(tmp_path / "m.gguf", vocab="llama-spm", vocab_file=vocab)
    meta = read_gguf_metadata(path)
    assert meta["general.architecture"][1] == "llama"
    assert meta["tokenizer.ggml.tokens"][1] == tokens
    assert meta["tokenizer.ggml.token_type"][1][:4] == [2, 3, 3, 1]
    assert meta["tokenizer.ggml.bos_token_id"][1] == 1
    assert meta["llama.vocab_size"][1] == len(tokens)
    assert "[INST]" in meta["tokenizer.chat_template"][1]  # none in the vocab: the Llama-2 template
    params = json.loads(meta["enginemeter.model_params"][1])
    assert params["vocab_sha256"] == hashlib.sha256(vocab.read_bytes()).hexdigest()

    # another vocab file: the same path is rewritten, its template kept; the cache name differs from the source's
    other = write_vocab(tmp_path / "w.gguf", [*tokens, "\u2581extra"], chat_template="{{ messages[0]['content'] }}")
    assert make_model(path, vocab="llama-spm", vocab_file=other) == path
    meta = read_gguf_metadata(path)
    assert len(meta["tokenizer.ggml.tokens"][1]) == len(tokens) + 1
    assert meta["tokenizer.chat_template"][1] == "{{ messages[0]['content'] }}"
    named = make_model(tmp_path, vocab="llama-spm", vocab_file=other)
    assert named.name != default_model_path(model_params(vocab="llama-spm")).name

    # the CLI takes it too
    argv = [sys.executable, "-m", "proxy.embedded", "model", str(tmp_path / "cli.gguf"), "--vocab", "llama-spm"]
    r = subprocess.run([*argv, "--vocab-file", str(vocab)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert read_gguf_metadata(Path(r.stdout.strip()))["tokenizer.ggml.tokens"][1] == tokens


def test_a_vocab_file_must_exist_and_hold_a_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(EmbeddedError, match="does not exist"):
        make_model(tmp_path / "m.gguf", vocab_file=tmp_path / "missing.gguf")
    import gguf

    writer = gguf.GGUFWriter(tmp_path / "bare.gguf", "llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    with pytest.raises(EmbeddedError, match=r"not a vocab: it has no tokenizer\.ggml\.model"):
        make_model(tmp_path / "m.gguf", vocab_file=tmp_path / "bare.gguf")
    assert not (tmp_path / "m.gguf").exists()


# ------------------------------------------------------------------------------------ in llama-server


@pytest.mark.parametrize(("model_fixture", "n_vocab"), [("tiny_model", 151936), ("tiny_model_spm", 32000)])
def test_generated_model_loads_and_greedy_gives_exactly_the_tokens_asked(
    request: pytest.FixtureRequest, llama_server_factory: LlamaServerFactory, model_fixture: str, n_vocab: int
) -> None:
    engine = llama_server_factory(model=request.getfixturevalue(model_fixture))
    meta = httpx.get(f"{engine.url}/v1/models").json()["data"][0]
    assert meta["id"] == "tiny"
    assert meta["meta"]["n_vocab"] == n_vocab
    out = chat(engine.url, max_tokens=32)
    assert out["usage"]["completion_tokens"] == 32
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["choices"][0]["message"]["content"]
    assert out["timings"]["predicted_n"] == 32


def test_a_model_from_an_explicit_vocab_file_loads_and_decodes(
    llama_server_factory: LlamaServerFactory, tmp_path: Path
) -> None:
    vocab = vocab_path("llama-spm")  # a vocab-only GGUF, as convert_hf_to_gguf.py --vocab-only writes one
    model = make_model(tmp_path / "m.gguf", vocab="llama-spm", vocab_file=vocab, n_layer=1)
    engine = llama_server_factory(model=model)
    assert httpx.get(f"{engine.url}/v1/models").json()["data"][0]["meta"]["n_vocab"] == 32000
    out = chat(engine.url, max_tokens=16)
    assert out["usage"]["completion_tokens"] == 16
    assert out["choices"][0]["finish_reason"] == "length"


def test_greedy_is_not_cut_short_over_a_long_generation(llama_server: LlamaServer) -> None:
    for prompt in ("hello", "1 2 3", "Bonjour, ça va ?"):
        out = chat(llama_server.url, messages=[{"role": "user", "content": prompt}], max_tokens=256)
        assert out["usage"]["completion_tokens"] == 256, prompt
        assert out["choices"][0]["finish_reason"] == "length"


def test_every_streamed_token_is_one_event_with_text(llama_server: LlamaServer) -> None:
    body = {"messages": MSGS, **GREEDY, "max_tokens": 64, "stream": True, "stream_options": {"include_usage": True}}
    contents: list[str] = []
    usage: dict[str, Any] = {}
    with httpx.stream("POST", f"{llama_server.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line.removeprefix("data: "))
            if event["choices"] and event["choices"][0]["delta"].get("content"):
                contents.append(event["choices"][0]["delta"]["content"])
            usage = event.get("usage") or usage
    assert usage["completion_tokens"] == 64
    assert len(contents) == 64
    assert all(c.isascii() and c for c in contents)


def test_the_two_vocabularies_tokenize_one_prompt_differently(
    llama_server: LlamaServer, llama_server_factory: LlamaServerFactory, tiny_model_spm: Path
) -> None:
    spm = llama_server_factory(model=tiny_model_spm)
    text = "Hello world, how are you today?"
    q, s = tokenize(llama_server.url, text), tokenize(spm.url, text)
    assert s[0] == 1  # llama-spm adds BOS
    assert q[0] != 151643  # qwen2 does not
    assert len(q) != len(s), (q, s)


def test_session_server_shape(llama_server: LlamaServer) -> None:
    props = httpx.get(f"{llama_server.url}/props").json()
    assert props["total_slots"] == 2
    slots = httpx.get(f"{llama_server.url}/slots").json()
    assert [s["n_ctx"] for s in slots] == [1024, 1024]  # -c is split across -np slots
    metrics = httpx.get(f"{llama_server.url}/metrics")
    assert metrics.status_code == 200
    assert "llamacpp:prompt_tokens_total" in metrics.text


def test_extra_args_come_last_and_override(llama_server_factory: LlamaServerFactory) -> None:
    engine = llama_server_factory(np=1, extra_args=["-c", "256"])
    assert engine.argv[-2:] == ["-c", "256"]
    assert [s["n_ctx"] for s in httpx.get(f"{engine.url}/slots").json()] == [256]


# ------------------------------------------------------------------------------------ lifecycle


def test_llama_server_reports_health_then_stops_cleanly(
    llama_server_bin: Path, tiny_model_spm: Path, tmp_path: Path
) -> None:
    server = LlamaServer(tiny_model_spm, binary=llama_server_bin, log_path=tmp_path / "s.log")
    with server:
        assert server.is_running()
        assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
        assert server.ready_s is not None
        assert server.ready_s < 30
        pid, port = server.pid, server.port
    assert server.returncode == 0  # SIGTERM: llama-server shuts down gracefully
    assert not server.is_running()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # gone and reaped
    assert refuses_connections(port)
    assert server.stop() == 0  # idempotent
    assert "+ " + str(llama_server_bin) in (tmp_path / "s.log").read_text()


def test_an_engine_that_cannot_start_fails_fast_with_its_log(llama_server_bin: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    server = LlamaServer(bad, binary=llama_server_bin, log_path=tmp_path / "bad.log", ready_timeout_s=60)
    t0 = time.monotonic()
    with pytest.raises(EmbeddedError, match="exited with") as info:
        server.start()
    assert time.monotonic() - t0 < 30  # noticed when it died, not at the deadline
    assert str(tmp_path / "bad.log") in str(info.value)
    assert not server.is_running()


def test_missing_model_is_refused_before_spawning(llama_server_bin: Path, tmp_path: Path) -> None:
    with pytest.raises(EmbeddedError, match="does not exist"):
        LlamaServer(tmp_path / "nope.gguf", binary=llama_server_bin).start()


def test_default_engines_differ_only_in_slots(tmp_path: Path, llama_server_bin: Path) -> None:
    log = io.StringIO()
    engines = start_default_engines(tmp_path, log=log)
    try:
        assert [f"engine {e.name} at {e.url}" in log.getvalue() for e in engines] == [True, True]
        assert [e.n_parallel for e in engines] == [1, 2]
        slots = [httpx.get(f"{e.url}/slots").json() for e in engines]
        assert [[s["n_ctx"] for s in x] for x in slots] == [[2048], [2048, 2048]]  # same context per slot
        outs = [chat(e.url, model="tiny", max_tokens=32)["choices"][0]["message"]["content"] for e in engines]
        assert outs[0] == outs[1]  # same model, greedy: a clean primary/shadow pair agrees
        assert all((tmp_path / f"engine-{i}-np{i + 1}.log").is_file() for i in range(2))
    finally:
        for e in engines:
            e.stop()
    assert all(e.returncode == 0 for e in engines)


# ------------------------------------------------------------------------------------ build / CLI


def test_build_script_prints_the_binary_the_fixture_uses(llama_server_bin: Path) -> None:
    r = subprocess.run(
        ["bash", str(REPO / "scripts" / "build-llama-server.sh")], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()) == llama_server_bin


def test_llama_server_bin_env_wins_and_is_checked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, llama_server_bin: Path
) -> None:
    monkeypatch.setenv("LLAMA_SERVER_BIN", str(llama_server_bin))
    assert build_llama_server(cache_dir=tmp_path / "empty") == llama_server_bin
    monkeypatch.setenv("LLAMA_SERVER_BIN", str(tmp_path / "missing"))
    with pytest.raises(EmbeddedError, match="not an executable"):
        build_llama_server(cache_dir=tmp_path / "empty")
