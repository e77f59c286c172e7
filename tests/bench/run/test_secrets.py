"""No secret in anything the bench writes (issue 47 item 3): a resident engine behind a URL with a password and a
launched one whose command carries ``--api-key``, ``--hf-token`` and an ``HF_TOKEN=`` prefix — real engine
processes, a real bench — and then every file the run wrote, and everything it printed, is searched for them."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

from proxy.cli import main
from proxy.redact import redact_argv, redact_command, redact_url
from tests.bench.run.test_bench import SMALL, recs
from tests.helpers import ProcessServer

SECRETS = ("S3CRET-PW", "KEY-4711", "hf_tokensecret", "hf_envsecret")
#: the files that hold the engines' commands or errors: owner-only, like the logs
PRIVATE = ("results.jsonl", "report.md", "report.html", "switch-plan.md", "verdict.json", "engines/b.log")


def test_a_bench_with_a_url_password_and_launch_keys_writes_and_prints_none_of_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a launched engine that takes the secret flags as they come (the fake ignores its arguments after $2)
    fake = f'exec {shlex.quote(sys.executable)} -m fakes.fault_engine --tokens 8 --cadence-ms 1 --port "$2"'
    launch = (f"HF_TOKEN=hf_envsecret sh -c {shlex.quote(fake)} sh --port {{port}} --api-key KEY-4711 "
              "--hf-token hf_tokensecret")  # fmt: skip
    with ProcessServer("fakes.fault_engine", "--tokens", "8", "--cadence-ms", "1", ready_path="/health") as a:
        url = a.url.replace("http://", "http://user:S3CRET-PW@")
        out = tmp_path / "out"
        args = ["bench", "--engine", f"a={url}", "--launch", f"b={launch}", *SMALL, "--aa", "off"]
        rc = main([*args, "--concurrency", "1", "--prompt-lengths", "short", "--out", str(out)])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    written = [p for p in out.rglob("*") if p.is_file()]
    assert {"results.jsonl", "report.md", "switch-plan.md", "verdict.json", "b.log"} <= {p.name for p in written}
    for p in written:
        text = p.read_bytes().decode("utf-8", "replace")
        assert not [s for s in SECRETS if s in text], p
    assert not [s for s in SECRETS if s in printed.out + printed.err]
    for name in PRIVATE:
        assert (out / name).stat().st_mode & 0o777 == 0o600, name
    # masked, not dropped: the records still say what ran and where
    ((run,),) = [recs(out / "results.jsonl", "run")]
    assert "a=http://user:***@127.0.0.1:" in " ".join(run["argv"])
    (b,) = [s for s in recs(out / "results.jsonl", "stint") if s["engine"] == "b"]
    assert "--api-key *** --hf-token ***" in b["launch"]["command"] and "HF_TOKEN=*** " in b["launch"]["command"]
    assert "+ HF_TOKEN=*** sh -c" in (out / "engines" / "b.log").read_text()
    plan = (out / "switch-plan.md").read_text()
    # the rollback record: the masked command, and where the real one lives instead of the key
    assert "--api-key *** --hf-token ***" in plan and "the real values are in the command you gave the bench" in plan


@pytest.mark.parametrize(
    ("given", "shown"),
    [
        ("llama-server -m m.gguf --api-key K1 --port 8080", "llama-server -m m.gguf --api-key *** --port 8080"),
        ("llama-server -hft hf_1 --api-key-file /etc/key", "llama-server -hft *** --api-key-file /etc/key"),
        ("HF_TOKEN=hf_2 OPENAI_API_KEY=sk-3 vllm serve m", "HF_TOKEN=*** OPENAI_API_KEY=*** vllm serve m"),
        ("vllm serve m --hf-token --port 8000", "vllm serve m --hf-token --port 8000"),  # bare: the cached login
        ("sglang serve --api-key='a b' --admin-api-key=Z", "sglang serve --api-key='***' --admin-api-key=***"),
        ("x --max-tokens 5 --tokenizer t --ssl-keyfile-password p", "x --max-tokens 5 --tokenizer t --ssl-keyfile-password ***"),
        ('curl -H "Authorization: Bearer sk-9" http://u:pw@h:1/v1', 'curl -H "Authorization: Bearer ***" http://u:***@h:1/v1'),
    ],
)  # fmt: skip
def test_the_secrets_of_the_three_engines_command_lines_are_masked_once_and_for_all(given: str, shown: str) -> None:
    assert redact_command(given) == shown
    assert redact_command(shown) == shown  # idempotent
    assert shlex.split(shown)[-1] == shlex.split(given)[-1] or "***" in shlex.split(shown)[-1]


def test_a_split_command_masks_the_word_after_a_secret_flag() -> None:
    argv = ["enginemeter", "bench", "--api-key", "K", "--engine", "a=http://u:p@h:1", "HF_TOKEN=x", "--hf-token", "-v"]
    assert redact_argv(argv) == [
        "enginemeter", "bench", "--api-key", "***", "--engine", "a=http://u:***@h:1", "HF_TOKEN=***", "--hf-token", "-v"
    ]  # fmt: skip
    assert redact_url("http://user:pw@host:1/x") == "http://user:***@host:1/x"
