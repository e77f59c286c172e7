"""The switch plan's rollback record and rollout: what starts each engine again exactly as measured (its launch
command verbatim, the model file, its quantization, the port, the sampling), and the enginemeter config that moves
the traffic step by step and rolls back by itself (docs/routing.md#rollout), with the commands that run, watch and
abort it. Pure: the report's ``Data`` and a verdict in, Markdown and YAML lines out.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from proxy.bench.verdict.data import Data
from proxy.bench.verdict.decide import Verdict
from proxy.config.fields import DEFAULT_LISTEN
from proxy.config.settings import DEFAULT_SAMPLING
from proxy.config.switching import RolloutSettings
from proxy.engines.startup import flag_value, subcommand

KEY = "ENGINEMETER_ADMIN_KEY"
COMPARISONS = "enginemeter-comparisons.jsonl"
CONFIG = "enginemeter-rollout.yaml"


# ---- the rollback record ---------------------------------------------------------------------------------


def _meta(d: Data, name: str) -> dict[str, Any]:
    return next((e for e in d.engines_meta if e.get("name") == name), {})


def launch_command(d: Data, name: str) -> str | None:
    la = next((s.get("launch") or {} for s in d.stints if s.get("engine") == name and s.get("launch")), {})
    cmd = la.get("command") or _meta(d, name).get("launch")
    return str(cmd) if cmd else None


def model_file(command: str) -> str | None:
    """The model a launch command loads: ``-m``/``--model``/``--model-path``, or ``vllm serve MODEL``."""
    try:
        argv = shlex.split(command)
    except ValueError:
        return None
    while argv and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]):
        argv.pop(0)
    found = flag_value(argv, "-m", "--model", "--model-path")
    if found is None and subcommand(argv) == ("vllm", "serve") and len(argv) > 2 and not argv[2].startswith("-"):
        found = argv[2]
    return found


def _port(url: str | None) -> int | None:
    try:
        return urlsplit(url).port if url else None
    except ValueError:
        return None


def _engine_record(d: Data, n: str) -> list[str]:
    meta, cmd = _meta(d, n), launch_command(d, n)
    info = next((e for e in d.results.engines if e.name == n), None)
    url, port, served = meta.get("url"), _port(meta.get("url")), meta.get("model")
    model = (model_file(cmd) if cmd else None) or (meta.get("info") or {}).get("model_path")
    q = (info.quantization if info else None) or meta.get("quantization")
    src = (info.quantization_source if info else None) or meta.get("quantization_source")
    sent = {
        k: x
        for k, x in (meta.get("body_example") or {}).items()
        if k not in ("model", "stream", "stream_options", "messages")
    }
    got = dict(info.sampling) if info else {}
    la = next((s.get("launch") or {} for s in d.stints if s.get("engine") == n and s.get("launch")), {})
    role = "baseline" if n == d.results.baseline else "candidate"
    out = [f"### {n} ({role})", ""]
    if cmd:
        out += ["Launch command, verbatim:", "", "```sh", cmd, "```", ""]
    else:
        out += [
            f"Launch command: **not recorded** — {n} was resident (already running, not launched by "
            "enginemeter). Write the command that started it into the script; what the bench learned of it "
            "follows.",
            "",
        ]
    placeholder = bool(cmd and "{port}" in cmd)
    out += [
        (f"- model file: `{model}`" if model else "- model file: unknown (neither a command nor the engine says)")
        + (f"; served as `{served}`" if served and served != model else ""),
        f"- quantization: {q or 'unknown (declare it: --quantization NAME=Q)'}" + (f" ({src})" if q and src else ""),
        "- port: "
        + (
            f"`{{port}}` in the command, a free one at each launch ({port} in this run)"
            if placeholder
            else str(port or "unknown")
        )
        + (f" — `{url}`" if url else ""),
        f"- slots: {meta.get('slots') or 'unknown'}; context per slot: "
        + (f"{meta['context_per_slot']} tokens" if meta.get("context_per_slot") else "unknown"),
        "- sampling the bench sent: "
        + (", ".join(f"{k}={json.dumps(x)}" for k, x in sorted(sent.items())) or "not recorded"),
        "- sampling the engine got (after the per-kind mapping): "
        + (", ".join(f"{k}={x}" for k, x in sorted(got.items())) or "not recorded")
        + (f"; dropped: {', '.join(info.dropped)}" if info and info.dropped else ""),
        *([f"- log of the launch: `{la['log']}`"] if la.get("log") else []),
        "",
    ]
    return out


def rollback_record(d: Data, names: Sequence[str]) -> list[str]:
    out = [
        "## Rollback record",
        "",
        "What starts each engine again exactly as measured. Keep both commands in a version-controlled script "
        "(`{port}`: the port the config's url names), so that going back is one change.",
        "",
    ]
    for n in names:
        out += _engine_record(d, n)
    out += [
        "Sampling in service: what the clients send; what they omit, the proxy fills in from `sampling_defaults` "
        "(default llama.cpp's own: "
        + ", ".join(f"{k} {x}" for k, x in DEFAULT_SAMPLING.items())
        + "), so the candidate samples as llama.cpp did for every client that relied on the defaults.",
        "",
    ]
    return out


# ---- the rollout -----------------------------------------------------------------------------------------


def _env_name(engine: str) -> str:
    return "URL_" + re.sub(r"[^A-Za-z0-9]", "_", engine).upper()


def _engine_yaml(d: Data, name: str, role: str) -> list[str]:
    meta, cmd = _meta(d, name), launch_command(d, name)
    url = meta.get("url")
    note = (
        "launched with --port {port}: its port in this run; put the port of your script here"
        if url and cmd and "{port}" in cmd
        else "as measured"
        if url
        else f"the URL your proxy config gives it (export {_env_name(name)}=http://HOST:PORT)"
    )
    out = [
        f"  - name: {json.dumps(name)}    # {role}",
        f"    url: {json.dumps(url or '${' + _env_name(name) + '}')}    # {note}",
    ]
    if meta.get("kind"):
        out.append(f"    kind: {meta['kind']}")
    return out


def rollout_yaml(d: Data, v: Verdict, listen: str = DEFAULT_LISTEN) -> str:
    """The enginemeter config that moves the route from the baseline to ``v.candidate`` step by step."""
    ro = RolloutSettings(candidate=v.candidate, error_budget=d.results.max_error_rate)
    lines = [
        f"# enginemeter config: the guarded switch {v.baseline} -> {v.candidate} (docs/routing.md#rollout)",
        f"listen: {json.dumps(listen)}",
        f"admin_key: ${{{KEY}}}    # GET/POST /admin/rollout need it",
        "engines:",
        *_engine_yaml(d, v.baseline, "the baseline: serves what the candidate does not"),
        *_engine_yaml(d, v.candidate, "the candidate"),
        "routes:",
        '  - models: ["*"]',
        f"    primary: {json.dumps(v.baseline)}",
        "    sample_rate: 1.0    # every request mirrored to the other engine: the pairs each step is judged on",
        "    rollout:",
        f"      candidate: {json.dumps(v.candidate)}",
        f"      steps: {json.dumps(list(ro.steps))}    # the candidate's share; 0 = shadow only",
        f"      gate: {ro.gate}",
        f"      min_pairs: {ro.min_pairs}",
        f"      min_requests: {ro.min_requests}",
        f"      min_dwell_s: {ro.min_dwell_s:g}",
        f"      error_budget: {ro.error_budget:g}    # the bench's --max-error-rate",
        "mirror:",
        f"  log_path: {COMPARISONS}    # the pairs, for enginemeter report --log",
        f"  min_effect: {d.results.min_effect:g}    # the bench's --min-effect: slower beyond it rolls back",
    ]
    return "\n".join(lines) + "\n"


def rollout_section(d: Data, v: Verdict, listen: str) -> list[str]:
    host = listen if "://" in listen else f"http://{listen.replace('0.0.0.0', '127.0.0.1')}"
    auth = f'-H "authorization: Bearer ${KEY}"'
    abort = f'curl -s {auth} {host}/admin/rollout -d \'{{"action": "abort"}}\''
    return [
        f"## Rollout: {v.baseline} → {v.candidate}",
        "",
        f"Save as `{CONFIG}`; the traffic moves to {v.candidate} step by step (shadow only first) and goes back "
        "to the baseline by itself when a step finds it slower or failing:",
        "",
        "```yaml",
        rollout_yaml(d, v, listen).rstrip("\n"),
        "```",
        "",
        "Check it, start it, watch it:",
        "",
        "```sh",
        f"export {KEY}=...    # a secret of your choosing",
        f"enginemeter check-config {CONFIG}",
        f"enginemeter serve --config {CONFIG}",
        f"curl -s {auth} {host}/admin/rollout    # step, share, pairs, the verdict per stream, events",
        f"curl -s {host}/metrics | grep '^enginemeter_rollout_'",
        f"enginemeter report --log {COMPARISONS} --proxy {host} --out rollout-report    # the live report",
        "```",
        "",
        "**Roll back** — the one command, at any step and after `complete` (the share goes to 0: the baseline "
        "serves everything):",
        "",
        "```sh",
        abort,
        "```",
        "",
        "Without the admin endpoint: `state: aborted` in the rollout block and a restart. Once the rollout is "
        f"`complete`, make {v.candidate} the route's `primary` (the rollout removed) when convenient; "
        f"{v.baseline}'s command stays in the script.",
        "",
    ]
