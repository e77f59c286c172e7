"""Issue 11: record what real engines send, raw, for fixtures and for the emulator comparison.

    python3 scripts/gpu/capture.py --out DIR [--engine NAME=URL ...]

Default engines: llamacpp=http://127.0.0.1:8081, sglang=http://127.0.0.1:30000, vllm=http://127.0.0.1:8000
(scripts/gpu/orchestrate.sh). Per engine, under DIR/NAME/:
  endpoints.json        GET status/content-type/body (cut at 64 KiB) of /health /health_generate /ready /ping
                        /version /server_info /get_server_info /model_info /props /slots /load /v1/models
                        /metrics (metrics body in metrics.txt), with the time each took
  stream.sse            raw bytes of a streamed chat completion with stream_options.include_usage
  stream_nousage.sse    the same without include_usage
  nonstream.json        the non-stream body
  completions.sse       a streamed /v1/completions (prompt text) with include_usage
  cached.json           the same ~600-token prompt twice (non-stream): both usages (cached tokens)
  overflow_*.txt        a prompt over the context (stream and non-stream): status, headers, raw body
  overflow_max_tokens_nonstream.txt  a prompt that fits but prompt + max_tokens does not
  bad_model.txt         an unknown model name
  disconnect.json       a stream dropped after 5 chunks: the engine's running-requests gauge before/after,
                        time until it is back to 0
  parity.json           usage.prompt_tokens (and token ids where the engine can tell) for the same messages
  metrics_after.txt     /metrics after all of the above
DIR/summary.json: the engines' versions, prompt-token parity table, disconnect figures.
Uses httpx only (and the standard library).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

DEFAULT = {
    "llamacpp": "http://127.0.0.1:8081",
    "sglang": "http://127.0.0.1:30000",
    "vllm": "http://127.0.0.1:8000",
}
MODEL = "m7b"
GETS = [
    "/health", "/health_generate", "/ready", "/ping", "/version", "/server_info", "/get_server_info",
    "/model_info", "/props", "/slots", "/load", "/v1/models", "/metrics",
]  # fmt: skip
RUNNING = {  # the engine's "requests running now" gauge
    "llamacpp": "llamacpp:requests_processing",
    "sglang": "sglang:num_running_reqs",
    "vllm": "vllm:num_requests_running",
}
PARITY_CASES: list[tuple[str, list[dict[str, str]]]] = [
    ("hi", [{"role": "user", "content": "hi"}]),
    ("sentence", [{"role": "user", "content": "Write a haiku about a GPU that is running three engines at once."}]),
    ("system", [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three prime numbers."},
    ]),
    ("multi_turn", [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And times three?"},
    ]),
    ("chinese", [{"role": "user", "content": "请用一句话解释什么是注意力机制。"}]),
    ("spaces_newlines", [{"role": "user", "content": "  leading spaces\n\nand\ttabs  \n trailing "}]),
    ("code", [{"role": "user", "content": "def f(x):\n    return x ** 2  # square\nprint(f(3))"}]),
    ("special_text", [{"role": "user", "content": "literal <s> and </s> and [INST] in text"}]),
    ("emoji_accents", [{"role": "user", "content": "café naïve 😀 – “quotes”"}]),
]  # fmt: skip
LONG = " ".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog near the river bank." for i in range(40))


def log(msg: str) -> None:
    print(f"[capture {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def save(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, bytes):
        path.write_bytes(data)
    elif isinstance(data, str):
        path.write_text(data)
    else:
        path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")


def raw_exchange(c: httpx.Client, method: str, url: str, body: Any = None, timeout: float = 120) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        with c.stream(method, url, json=body, timeout=timeout) as r:
            raw = b"".join(r.iter_raw())
            return {
                "status": r.status_code,
                "headers": dict(r.headers),
                "body": raw,
                "s": round(time.perf_counter() - t0, 4),
            }
    except httpx.HTTPError as exc:
        return {"status": None, "error": repr(exc), "body": b"", "headers": {}, "s": round(time.perf_counter() - t0, 4)}


def text_record(x: dict[str, Any]) -> str:
    head = f"status: {x['status']}\n" + "".join(f"{k}: {v}\n" for k, v in x.get("headers", {}).items())
    if x.get("error"):
        head += f"error: {x['error']}\n"
    return head + "\n" + x["body"].decode("utf-8", "replace")


def metric_value(text: str, name: str) -> float | None:
    total = None
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            with contextlib.suppress(ValueError):
                total = (total or 0.0) + float(line.rsplit(" ", 1)[1])
    return total


def chat(
    stream: bool, messages: list[dict[str, str]], max_tokens: int, usage: bool = True, **extra: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
        **extra,
    }
    if stream and usage:
        body["stream_options"] = {"include_usage": True}
    return body


def capture_engine(name: str, base: str, out: Path) -> dict[str, Any]:
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"url": base}
    c = httpx.Client(base_url=base, timeout=120, trust_env=False)

    # 1. GET endpoints
    eps: dict[str, Any] = {}
    for p in GETS:
        x = raw_exchange(c, "GET", p, timeout=60)
        ctype = x.get("headers", {}).get("content-type")
        body = x["body"].decode("utf-8", "replace")
        if p == "/metrics":
            raw = x["body"]
            if x.get("headers", {}).get("content-encoding") == "gzip":  # SGLang gzips /metrics: store the text
                raw = gzip.decompress(raw)
            save(d / "metrics.txt", raw.decode("utf-8", "replace"))
            body = f"<{len(x['body'])} bytes: metrics.txt>"
        eps[p] = {
            "status": x["status"],
            "content_type": ctype,
            "s": x["s"],
            "body": body[:65536],
            **({"error": x["error"]} if x.get("error") else {}),
        }
    save(d / "endpoints.json", eps)
    summary["endpoints"] = {p: v["status"] for p, v in eps.items()}
    for p in ("/version", "/server_info", "/props", "/get_server_info"):
        if eps[p]["status"] == 200:
            try:
                doc = json.loads(eps[p]["body"])
            except ValueError:
                continue
            summary.setdefault("version_doc", {})[p] = {
                k: doc.get(k)
                for k in (
                    "version",
                    "build_info",
                    "n_ctx",
                    "total_slots",
                    "max_running_requests",
                    "context_length",
                    "model_path",
                )
                if k in doc
            }
    log(f"{name}: endpoints {summary['endpoints']}")

    # 2. streams and non-stream
    msgs = [{"role": "user", "content": "Write a haiku about GPUs."}]
    x = raw_exchange(c, "POST", "/v1/chat/completions", chat(True, msgs, 24))
    save(d / "stream.sse", x["body"])
    save(d / "stream.headers.json", {"status": x["status"], "headers": x["headers"]})
    x = raw_exchange(c, "POST", "/v1/chat/completions", chat(True, msgs, 8, usage=False))
    save(d / "stream_nousage.sse", x["body"])
    x = raw_exchange(c, "POST", "/v1/chat/completions", chat(False, msgs, 24))
    save(d / "nonstream.json", x["body"])
    save(d / "nonstream.headers.json", {"status": x["status"], "headers": x["headers"]})
    x = raw_exchange(
        c, "POST", "/v1/completions",
        {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "stream": True,
         "stream_options": {"include_usage": True}},
    )  # fmt: skip
    save(d / "completions.sse", x["body"])
    x = raw_exchange(
        c,
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
    )
    save(d / "completions_nonstream.json", x["body"])

    # 3. cached tokens: the same long prompt twice
    long_msgs = [{"role": "user", "content": f"[{name} {time.time()}] {LONG}"}]
    usages = []
    for _ in range(2):
        x = raw_exchange(c, "POST", "/v1/chat/completions", chat(False, long_msgs, 4))
        try:
            usages.append(json.loads(x["body"]).get("usage"))
        except ValueError:
            usages.append({"status": x["status"], "body": x["body"][:2000].decode("utf-8", "replace")})
    x = raw_exchange(c, "POST", "/v1/chat/completions", chat(True, long_msgs, 4))
    save(d / "cached_stream.sse", x["body"])
    save(d / "cached.json", {"first": usages[0], "second": usages[1]})
    summary["cached"] = usages

    # 4. errors
    over = [{"role": "user", "content": "hello " * 9000}]
    for stream in (False, True):
        x = raw_exchange(c, "POST", "/v1/chat/completions", chat(stream, over, 16))
        save(d / f"overflow_{'stream' if stream else 'nonstream'}.txt", text_record(x))
        summary[f"overflow_{'stream' if stream else 'nonstream'}"] = {
            "status": x["status"],
            "body": x["body"][:400].decode("utf-8", "replace"),
        }
    fits = [{"role": "user", "content": "hello " * 3620}]  # ~7250 tokens: fits, but not with max_tokens 1000
    x = raw_exchange(c, "POST", "/v1/chat/completions", chat(False, fits, 1000))
    save(d / "overflow_max_tokens_nonstream.txt", text_record(x))
    summary["overflow_max_tokens"] = {"status": x["status"], "body": x["body"][:400].decode("utf-8", "replace")}
    x = raw_exchange(c, "POST", "/v1/chat/completions", {**chat(False, msgs, 4), "model": "no-such-model"})
    save(d / "bad_model.txt", text_record(x))
    summary["bad_model"] = {"status": x["status"], "body": x["body"][:300].decode("utf-8", "replace")}
    x = raw_exchange(c, "POST", "/v1/chat/completions", {"model": MODEL, "messages": "not a list"})
    save(d / "bad_request.txt", text_record(x))
    summary["bad_request"] = {"status": x["status"], "body": x["body"][:300].decode("utf-8", "replace")}

    # 5. client disconnect: stream, read 5 chunks, drop; watch the running gauge
    gauge = RUNNING[name]
    before = metric_value(c.get("/metrics").text, gauge)
    dis: dict[str, Any] = {"gauge": gauge, "before": before}
    body = chat(True, [{"role": "user", "content": "Tell me a very long story."}], 2000, ignore_eos=True)
    t_drop = None
    with httpx.Client(base_url=base, timeout=60, trust_env=False) as c2:
        with c2.stream("POST", "/v1/chat/completions", json=body) as r:
            for n, _chunk in enumerate(r.iter_raw(), 1):
                if n >= 5:
                    break
            during = metric_value(c.get("/metrics").text, gauge)
            t_drop = time.perf_counter()
    # leaving the with-blocks closed the connection
    series = []
    back = None
    while time.perf_counter() - t_drop < 10:
        v = metric_value(c.get("/metrics").text, gauge)
        dt = time.perf_counter() - t_drop
        series.append([round(dt, 3), v])
        if v is not None and v <= (before or 0):
            back = dt
            break
        time.sleep(0.01)
    dis.update({"during": during, "back_to_before_s": None if back is None else round(back, 3), "series": series[:50]})
    save(d / "disconnect.json", dis)
    summary["disconnect"] = {k: dis[k] for k in ("gauge", "before", "during", "back_to_before_s")}
    log(f"{name}: disconnect {summary['disconnect']}")

    # 6. prompt-token parity (usage.prompt_tokens; token ids where the engine exposes them)
    par = {}
    for case, m in PARITY_CASES:
        rec: dict[str, Any] = {}
        x = raw_exchange(c, "POST", "/v1/chat/completions", chat(False, m, 1))
        try:
            rec["prompt_tokens"] = json.loads(x["body"])["usage"]["prompt_tokens"]
        except (ValueError, KeyError, TypeError):
            rec["error"] = x["body"][:300].decode("utf-8", "replace")
        if name == "llamacpp":
            t = raw_exchange(c, "POST", "/apply-template", {"messages": m})
            try:
                prompt = json.loads(t["body"])["prompt"]
                rec["rendered"] = prompt
                k = raw_exchange(
                    c, "POST", "/tokenize", {"content": prompt, "add_special": True, "parse_special": True}
                )
                rec["ids"] = json.loads(k["body"])["tokens"]
            except (ValueError, KeyError, TypeError) as exc:
                rec["ids_error"] = repr(exc)
        elif name == "vllm":
            k = raw_exchange(c, "POST", "/tokenize", {"model": MODEL, "messages": m, "add_generation_prompt": True})
            try:
                doc = json.loads(k["body"])
                rec["ids"] = doc["tokens"]
            except (ValueError, KeyError, TypeError) as exc:
                rec["ids_error"] = repr(exc) + k["body"][:200].decode("utf-8", "replace")
        elif name == "sglang":
            k = raw_exchange(c, "POST", "/v1/tokenize", {"model": MODEL, "messages": m, "add_generation_prompt": True})
            try:
                doc = json.loads(k["body"])
                rec["ids"] = doc.get("tokens", doc)
            except (ValueError, KeyError, TypeError) as exc:
                rec["ids_error"] = repr(exc) + k["body"][:200].decode("utf-8", "replace")
        par[case] = rec
    save(d / "parity.json", par)
    summary["parity"] = {k: v.get("prompt_tokens") for k, v in par.items()}
    save(d / "metrics_after.txt", c.get("/metrics").text)
    c.close()
    return summary


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--engine", action="append", metavar="NAME=URL")
    a = ap.parse_args()
    engines = dict(e.split("=", 1) for e in a.engine) if a.engine else dict(DEFAULT)
    a.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    # all engines at once (threads): each engine's capture is sequential; they do not share the GPU's time much
    # (tiny requests), and the call is short
    threads = []

    def run(name: str, url: str) -> None:
        try:
            results[name] = capture_engine(name, url, a.out)
        except Exception as exc:  # keep the others going
            results[name] = {"error": repr(exc)}
            log(f"{name}: FAILED {exc!r}")

    for n, u in engines.items():
        t = threading.Thread(target=run, args=(n, u))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    names = [n for n in engines if isinstance(results.get(n), dict) and "parity" in results[n]]
    table = {}
    for case, _m in PARITY_CASES:
        row = {n: results[n]["parity"].get(case) for n in names}
        vals = {v for v in row.values() if v is not None}
        row["equal"] = len(vals) == 1 and len(row) == len(names)
        table[case] = row
    results["parity_table"] = table
    save(a.out / "summary.json", results)
    for case, row in table.items():
        log(f"parity {case}: {row}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
