"""Record what a running engine answers on the paths the engine dialects use, as a replayable test fixture.

    python scripts/capture_engine.py http://127.0.0.1:30000 tests/fixtures/engines/sglang-0.5.17 --model tiny

Writes ``answers.jsonl`` (one line per request: ``method``, ``path``, ``status``, ``content_type``, ``body`` as
text) and ``meta.json`` (``url``, the time, ``kind``/``version`` if given). ``tests/engines/test_engines.py`` replays
every such folder through the dialects. Standard library only, so it runs on the GPU machine's bare Python.
``GET /health`` on SGLang runs a 1-token generation: capture while the engine is idle.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

GETS = (
    "/props", "/slots", "/health", "/ready", "/server_info", "/get_server_info", "/model_info", "/get_model_info",
    "/v1/models", "/version", "/metrics", "/ping",
)  # fmt: skip
MESSAGES = [{"role": "user", "content": "hi"}]


def fetch(base: str, method: str, path: str, body: object | None) -> dict[str, object]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            status, ctype, raw = r.status, r.headers.get("content-type", ""), r.read()
    except urllib.error.HTTPError as e:
        status, ctype, raw = e.code, e.headers.get("content-type", ""), e.read()
    return {"method": method, "path": path, "status": status, "content_type": ctype,
            "body": raw.decode("utf-8", "replace")}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("url")
    p.add_argument("out", type=Path)
    p.add_argument("--model", default=None, help="served model name for the tokenize calls")
    p.add_argument("--kind", default=None)
    p.add_argument("--version", default=None)
    a = p.parse_args()
    base = a.url.rstrip("/")
    posts = (
        ("/v1/tokenize", {"model": a.model, "messages": MESSAGES}),
        ("/tokenize", {"model": a.model, "messages": MESSAGES, "add_generation_prompt": True}),
        ("/v1/chat/completions/input_tokens", {"model": a.model, "messages": MESSAGES}),
        ("/apply-template", {"messages": MESSAGES}),
    )
    answers = [fetch(base, "GET", path, None) for path in GETS]
    answers += [fetch(base, "POST", path, body) for path, body in posts]
    a.out.mkdir(parents=True, exist_ok=True)
    with open(a.out / "answers.jsonl", "w") as f:
        for ans in answers:
            f.write(json.dumps(ans) + "\n")
    meta = {"url": base, "captured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "kind": a.kind,
            "version": a.version, "model": a.model}  # fmt: skip
    (a.out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    for ans in answers:
        print(ans["status"], ans["method"], ans["path"])


if __name__ == "__main__":
    main()
