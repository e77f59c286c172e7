"""``enginemeter diagnose URL``: where a running engine's time goes and whether memory is its constraint.

The facts come from ``proxy.diagnosis`` (launch flags, start-up log, endpoints, model header, KV formula, GPU
memory); this module adds a few probe requests for the timing split and prints it all, in the order a person
should read it: launch parameters, then eval (the decode step), prompt eval, queue, and load last; then the model
and memory. ``--json`` prints the same as one JSON object. docs/diagnose.md explains each line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shlex
import statistics
import sys
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from proxy.bench.run.client import RequestOutcome, send_one
from proxy.bench.run.options import UsageError, size_arg
from proxy.bench.run.sweep import slot_values
from proxy.diagnosis import Diagnosis, gather, size
from proxy.engines.startup import without_flags
from proxy.gpu.memory import GpuMemory

DESCRIPTION = """\
Diagnose one running engine (llama.cpp's llama-server first; SGLang and vLLM where they say the same things):
its launch parameters (the process's command line when it runs on this machine, /props, /slots), layers
offloaded, load time, the KV cache from its log and from the formula with the model's own shape, flash
attention and CUDA graphs as its log says, the weights' size against the process's GPU memory (resident or
not), GPU memory free -> "memory is / is not the constraint", and a timing split from a few probe requests:
eval (decode) first, prompt eval next, load last. See docs/diagnose.md."""

EPILOG = """\
examples:
  enginemeter diagnose http://127.0.0.1:8081
  enginemeter diagnose http://127.0.0.1:8081/v1 --memory-budget 72GiB   # an OpenAI SDK base_url works too
  enginemeter diagnose http://127.0.0.1:8081 --log /var/log/llama-server.log --json
  enginemeter diagnose http://127.0.0.1:30000 --probes 0        # SGLang, no probe requests"""

#: filler words for the probe prompt: ~1 token each in the common vocabularies
_WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wizards", "quietly",
          "judge", "boxing", "matches")  # fmt: skip


def add_command(d: argparse.ArgumentParser) -> None:
    d.description, d.epilog = DESCRIPTION, EPILOG
    d.formatter_class = argparse.RawDescriptionHelpFormatter
    d.add_argument(
        "url",
        metavar="URL",
        help="the engine's base URL, http://HOST:PORT (a trailing /v1, as an OpenAI SDK's base_url has it, is dropped)",
    )
    d.add_argument(
        "--memory-budget",
        metavar="SIZE",
        help="GPU memory the engine may use (e.g. 72GiB): memory is judged against it, and the tune command it ends "
        "with carries it",
    )
    d.add_argument("--log", type=Path, metavar="FILE", help="the engine's log (default: found through its process)")
    d.add_argument("--pid", type=int, help="the engine's process id (default: the process listening on URL's port)")
    d.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    d.add_argument("--probes", type=int, default=3, help="probe requests for the timing split (0: none; default 3)")
    d.add_argument("--prompt-words", type=int, default=200, help="probe prompt length in words (default 200)")
    d.add_argument("--max-tokens", type=int, default=32, help="tokens each probe generates (default 32)")
    d.add_argument("--model", help="model name to send (default: the engine's own)")
    d.add_argument("--timeout", type=float, default=120.0, help="per-request timeout, seconds")
    d.set_defaults(func=_diagnose)


def _diagnose(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        args.url = base_url(args.url)
        args.budget = size_arg(args.memory_budget)
        if args.log is not None and not args.log.is_file():
            raise UsageError(f"--log {args.log}: no such file")
    except UsageError as exc:
        print(f"enginemeter diagnose: {exc}", file=sys.stderr)
        return 2
    try:
        d = asyncio.run(run(args))
    except httpx.HTTPError as exc:
        print(f"enginemeter diagnose: cannot reach {args.url}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    if d.kind is None:
        cause = next((n.removeprefix("engine: ") for n in d.notes if n.startswith("engine: ")), "no answer")
        rest = [n for n in d.notes if not n.startswith("engine: ")]
        print(f"enginemeter diagnose: cannot probe {args.url}: {_cause(cause)}", file=sys.stderr)
        for n in rest:
            print(f"  - {n}", file=sys.stderr)
        return 2
    if why := not_an_engine(d):
        print(f"enginemeter diagnose: {args.url} is not an LLM engine: {why}", file=sys.stderr)
        return 2
    t = d.timing or {}
    failed = args.probes > 0 and not t.get("ok")
    if failed:  # the cause first; what could be read without a token still follows
        why = "; ".join(t.get("errors") or ["no answer"])
        print(f"enginemeter diagnose: the probe requests to {args.url} failed: {why}", file=sys.stderr)
    nxt = next_command(d, args.memory_budget)
    if args.json:
        print(json.dumps({**d.to_json(), "next": nxt}, indent=2, default=str))
    else:
        print(render(d) + f"\n\nNext: {nxt}")
    return 1 if failed else 0


def not_an_engine(d: Diagnosis) -> str | None:
    """Why the server at ``d.url`` is no LLM engine (None: it may be one): no engine's own endpoint answered and
    ``GET /v1/models``, which every OpenAI-compatible engine serves, did not answer with a model list."""
    if d.kind != "openai":
        return None
    said = next((n.removeprefix("engine: ") for n in d.notes if n.startswith("engine: ") and "/v1/models" in n), None)
    if said is None:
        return None
    return f"no engine's own endpoint answered, and {said} (an OpenAI-compatible engine lists its models there)"


def base_url(raw: str) -> str:
    """The engine's base URL from what a person has: ``http://h:p``, ``http://h:p/`` or ``http://h:p/v1`` (an
    OpenAI SDK's base_url). A ``UsageError`` says what is wrong, first."""
    url = raw.strip()
    if "://" not in url:
        raise UsageError(f"URL {raw!r} has no scheme: write http://{url.lstrip('/')}")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise UsageError(f"URL {raw!r}: the scheme must be http or https, not {parts.scheme}")
    if not parts.hostname:
        raise UsageError(f"URL {raw!r} names no host")
    try:
        parts.port  # noqa: B018 — a port that is not a number raises here, not deep in httpx
    except ValueError:
        raise UsageError(f"URL {raw!r}: the port is not a number") from None
    path = parts.path.rstrip("/").removesuffix("/v1").rstrip("/")
    return f"{parts.scheme}://{parts.netloc}{path}"


def _cause(error: str) -> str:
    low = error.lower()
    if "connecterror" in low or "connection refused" in low or "all connection attempts failed" in low:
        return f"connection refused — nothing listens there (is the engine running, the port right?) ({error})"
    if "timeout" in low:
        return f"no answer in time ({error})"
    return error


def next_command(d: Diagnosis, budget: str | None) -> str:
    """What to run next: llama.cpp — ``enginemeter tune`` sweeping ``-np`` over this engine's own command line
    (the flags it was started with; ``{port}`` for its port); another engine — a bench against a second one."""
    tail = ["--memory-budget", budget] if budget else []
    if d.kind != "llamacpp":
        return shlex.join(["enginemeter", "bench", "--engine", f"{d.kind}={d.url}", "--engine", "OTHER=URL", *tail]) + (
            "    # OTHER=URL: the engine to compare it with"
        )
    argv = list(d.process.argv)
    if not argv:  # not on this machine: the flags the engine told, the model's path when it says it
        argv = ["llama-server", "-m", d.model_path or "MODEL.gguf"]
        for key, flag in _FLAG_NAMES.items():
            if key in d.flags and key != "parallel":
                argv += [flag, str(d.flags[key])]
    np = slot_values(d.flags.get("parallel") or d.started.slots)
    launch = shlex.join(without_flags(argv, "-np", "--parallel", "--port")) + f" -np {np} --port {{port}}"
    note = "" if d.process.argv else "    # MODEL.gguf: the engine's model file" if not d.model_path else ""
    return shlex.join(["enginemeter", "tune", "--launch", launch, *tail]) + note


async def run(args: argparse.Namespace) -> Diagnosis:
    memory = GpuMemory()
    try:
        d = await gather(args.url, log=args.log, pid=args.pid, memory=memory, budget_bytes=args.budget)
        if d.kind is not None and args.probes > 0:
            d.timing = await probe(d, args.probes, args.prompt_words, args.max_tokens, args.model, args.timeout)
    finally:
        memory.close()
    return d


# ---- the probe requests ----------------------------------------------------------------------------------


def _body(d: Diagnosis, model: str | None, words: int, max_tokens: int) -> bytes:
    nonce = uuid.uuid4().hex[:8]  # a fresh prefix: no prompt-cache hit
    text = f"[{nonce}] " + " ".join(_WORDS[i % len(_WORDS)] for i in range(words))
    body: dict[str, Any] = {
        "model": model or d.model or "default",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if d.kind == "llamacpp":
        body["cache_prompt"] = False
    return json.dumps(body).encode()


async def probe(
    d: Diagnosis, n: int, words: int, max_tokens: int, model: str | None, timeout_s: float
) -> dict[str, Any]:
    """``n`` requests one at a time (eval, prompt eval, queue alone), then slots + 1 at once (the last one
    waits for a slot: the queue a full engine adds)."""
    headers = {"content-type": "application/json"}
    async with httpx.AsyncClient(base_url=d.url, timeout=timeout_s, trust_env=False) as c:
        alone = [await send_one(c, _body(d, model, words, max_tokens), headers) for _ in range(n)]
        burst: list[RequestOutcome] = []
        slots = d.started.slots
        if slots and slots < 16:
            burst = list(
                await asyncio.gather(
                    *(send_one(c, _body(d, model, words, max_tokens), headers) for _ in range(slots + 1))
                )
            )
    ok = [o for o in alone if o.ok]
    out: dict[str, Any] = {
        "requests": n,
        "ok": len(ok),
        "prompt_words": words,
        "max_tokens": max_tokens,
        "errors": sorted({o.error for o in alone if o.error})[:3],
    }
    if not ok:
        return out
    eng = [o.engine for o in ok if o.engine is not None and o.engine.predicted_n]
    if eng:  # llama.cpp's own timings
        eval_ms = [e.predicted_ms / e.predicted_n for e in eng if e.predicted_ms and e.predicted_n]
        pp_ms = [e.prompt_ms / e.prompt_n for e in eng if e.prompt_ms is not None and e.prompt_n]
        out["source"] = "the engine's timings"
    else:  # what the client sees: TPOT, and TTFT over the prompt (a lower bound on the prompt rate)
        eval_ms = [o.timing.tpot_s * 1000 for o in ok if o.timing.tpot_s]
        pp_ms = [
            o.timing.upstream_ttft_s * 1000 / o.usage.prompt_tokens
            for o in ok
            if o.timing.upstream_ttft_s and o.usage is not None and o.usage.prompt_tokens
        ]
        out["source"] = "client-side timing (TPOT; TTFT / prompt tokens)"
    prompt_tokens = [o.usage.prompt_tokens for o in ok if o.usage is not None and o.usage.prompt_tokens]
    if prompt_tokens:
        out["prompt_tokens"] = int(statistics.median(prompt_tokens))
    if eval_ms:
        m = statistics.median(eval_ms)
        out["eval"] = {"ms_per_token": round(m, 3), "tokens_per_second": round(1000 / m, 1)}
    if pp_ms:
        m = statistics.median(pp_ms)
        out["prompt_eval"] = {"ms_per_token": round(m, 4), "tokens_per_second": round(1000 / m, 1)}
    queued = [o.timing.queue_s for o in ok if o.timing.queue_s is not None]
    ttft = [o.timing.ttft_s for o in ok if o.timing.ttft_s is not None]
    out["queue"] = {"alone_ms": round(statistics.median(queued) * 1000, 2) if queued else None}
    if ttft:
        out["ttft_ms"] = round(statistics.median(ttft) * 1000, 2)
    b_ok = [o for o in burst if o.ok]
    if b_ok:
        waits = [w for o in b_ok if (w := o.timing.queue_s) is not None]
        if waits:
            out["queue"].update(concurrent=len(burst), slots=d.started.slots, max_ms=round(max(waits) * 1000, 2))
    return out


# ---- text ------------------------------------------------------------------------------------------------

_FLAG_NAMES = {"ctx_size": "-c", "batch_size": "-b", "ubatch_size": "-ub", "parallel": "-np", "gpu_layers": "-ngl",
               "threads": "-t", "threads_batch": "-tb", "flash_attn": "-fa", "cache_type_k": "-ctk",
               "cache_type_v": "-ctv", "kv_unified": "-kvu", "kv_unified_per_slot": "--kv-unified-per-slot",
               "fit": "-fit", "verbosity": "-lv", "mmap": "--mmap"}  # fmt: skip
#: llama.cpp 11434's defaults (common/common.h, server.cpp) for what the command line leaves out
_DEFAULTS = {"ctx_size": "0 = the model's training context", "batch_size": "2048", "ubatch_size": "512",
             "parallel": "auto = 4 slots, unified KV", "gpu_layers": "auto, fit to free memory",
             "flash_attn": "auto", "cache_type_k": "f16", "cache_type_v": "f16"}  # fmt: skip


def render(d: Diagnosis) -> str:
    """The text ``diagnose`` prints, in the order a person should read it: launch parameters, where the time goes,
    the model and memory, then the log and the notes."""
    kind = {"llamacpp": "llama.cpp", "sglang": "SGLang", "vllm": "vLLM"}.get(d.kind or "", d.kind or "?")
    build = f", build {d.build}" if d.build else ""
    model = f", model {d.model}" if d.model else ""
    out = [f"enginemeter diagnose {d.url}: {kind}{build}{model}"]
    out += ["\nLaunch parameters", *_launch_lines(d)]
    out += ["\nWhere the time goes (eval first, then prompt eval, load last)", *_time_lines(d)]
    out += ["\nModel and memory", *_model_lines(d), *_memory_lines(d)]
    if d.log_path:
        out.append(f"\nlog: {d.log_path}")
    if d.notes:
        out.append("\nNotes")
        out += [f"  - {n}" for n in dict.fromkeys(d.notes)]
    return "\n".join(out)


def _launch_lines(d: Diagnosis) -> list[str]:
    s, out = d.started, []
    if d.process.argv:
        out.append(f"  command      {' '.join(d.process.argv)}")
        out.append(f"               (pid {d.process.pid}, {d.process.how})")
    if d.kind == "llamacpp":
        parts = [f"{_FLAG_NAMES[k]} {v}" for k, v in d.flags.items() if k in _FLAG_NAMES]
        parts += [
            f"{_FLAG_NAMES[k]} {v} (default)" for k, v in _DEFAULTS.items() if k not in d.flags and d.process.argv
        ]
        if parts:
            out.append("  flags        " + "  ".join(parts))
    if s.slots:
        line = f"  slots        {s.slots} x {s.context_per_slot or '?'} tokens of context"
        if s.kv_unified is not None:
            line += "; one KV pool shared by all slots" if s.kv_unified else "; each slot its own share of the KV cache"
        out.append(line)
    return out


def _time_lines(d: Diagnosis) -> list[str]:
    """The probes' split (eval, prompt eval, queue), then the load time from the log."""
    s, t, out = d.started, d.timing or {}, []
    if t.get("ok"):
        src = f"  ({t.get('source')}; median of {t['ok']} requests, {t.get('prompt_tokens', '?')}-token prompt)"
        if "eval" in t:
            e = t["eval"]
            out.append(
                f"  eval         {e['ms_per_token']:.2f} ms/token = {e['tokens_per_second']:.1f} tok/s "
                f"(one request decoding){src}"
            )
        if "prompt_eval" in t:
            pe = t["prompt_eval"]
            out.append(f"  prompt eval  {pe['ms_per_token']:.3f} ms/token = {pe['tokens_per_second']:.0f} tok/s")
        q = t.get("queue", {})
        line = f"  queue        {q.get('alone_ms')} ms alone"
        if "max_ms" in q:
            line += f"; up to {q['max_ms']} ms with {q['concurrent']} requests on {q['slots']} slots"
        out.append(line)
    elif t:
        out.append(f"  probes failed: {'; '.join(t.get('errors') or ['no answer'])}")
    else:
        out.append("  (no probe requests)")
    out.append(
        f"  load         {s.load_s:.2f} s" + _ev(d, "load_s")
        if s.load_s is not None
        else "  load         not in the log"
    )
    return out


def _model_lines(d: Diagnosis) -> list[str]:
    """Layers on the GPU, the model's shape, whether its weights are resident, the KV cache."""
    s, out = d.started, []
    if s.layers_total:
        out.append(f"  layers       {s.layers_offloaded}/{s.layers_total} on the GPU" + _ev(d, "layers_offloaded"))
    if d.shape:
        sh = d.shape
        w = f"{size(sh.weights_bytes)} " if sh.weights_bytes else ""
        params = f", {_params(sh.n_params)} params" if sh.n_params else ""
        out.append(
            f"  model        {w}{sh.file_type or ''}, {sh.n_layer} layers, {sh.n_head} heads, {sh.n_head_kv} KV heads"
            f", head dim {sh.head_dim_k}{params}  ({sh.source})"
        )
    if d.resident:
        out.append(f"  resident     {_yes(d.resident.value)}: {d.resident.why}")
    if d.kv or s.kv_cache_bytes:
        line = "  KV cache     "
        if s.kv_cache_bytes:
            line += f"{size(s.kv_cache_bytes)} as the engine says" + (
                f" ({s.kv_cache_tokens:,} tokens)" if s.kv_cache_tokens else ""
            )
        if d.kv:
            k = d.kv
            line += ("; " if s.kv_cache_bytes else "") + f"{size(k.bytes)} by the formula {k.formula}"
            if k.reported_ratio:
                line += f" (engine / formula = {k.reported_ratio:.3f})"
            if k.per_slot_bytes:
                line += f"; {size(k.per_slot_bytes)} per slot"
            if k.note:
                line += f"; {k.note}"
        out.append(line)
    return out


def _memory_lines(d: Diagnosis) -> list[str]:
    """Flash attention and CUDA graphs as the log says, the GPUs' memory, and whether memory is the constraint."""
    s = d.started
    out = [f"  flash attn   {s.flash_attention or 'not stated in the log'}"]
    graphs = s.cuda_graphs or "not stated in the log"
    if s.graph_capture_s:
        graphs += f" (captured in {s.graph_capture_s:.1f} s" + (f", {size(s.graph_bytes)})" if s.graph_bytes else ")")
    out.append(f"  CUDA graphs  {graphs}")
    if s.memory_fraction:
        out.append(f"  mem fraction {s.memory_fraction:g} of the GPU taken at start")
    if d.gpu and d.gpu.devices:
        for dev in d.gpu.on_engine_gpus():
            out.append(
                f"  GPU {dev.index}        {dev.name}: {size(dev.total_bytes)} total, {size(dev.used_bytes)} used, "
                f"{size(dev.free_bytes)} free"
            )
    if d.memory:
        out.append(f"  memory       {d.memory.why}")
    return out


def _ev(d: Diagnosis, key: str) -> str:
    line = d.started.evidence.get(key)
    return f"  (log: {line.splitlines()[-1].strip()})" if line and not line.startswith("/") else ""


def _params(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def _yes(v: bool | None) -> str:
    return "unknown" if v is None else "yes" if v else "NO"
