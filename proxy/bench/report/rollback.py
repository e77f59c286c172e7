"""The switch plan's rollback record and the switch itself: what starts each engine again exactly as measured (its
launch command verbatim, the model file, its quantization, the port, the sampling), and the enginemeter config that
switches and goes back by itself — the mirrored rollout, step by step (docs/routing.md#rollout), or the swap on one
GPU, its bounds sized from the measurements (docs/routing.md) — with the commands that run, watch and abort it. The
way is ``proxy.bench.verdict.switchway``'s. Pure: the report's ``Data`` and a verdict in, Markdown and YAML lines out.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from proxy.bench.verdict import switchway
from proxy.bench.verdict.data import Data
from proxy.bench.verdict.decide import Verdict
from proxy.bench.verdict.gates.memorygate import Resize, resize
from proxy.config.fields import DEFAULT_LISTEN
from proxy.config.settings import DEFAULT_SAMPLING
from proxy.config.switching import RolloutSettings, SwapSettings
from proxy.engines.startup import flag_value, set_flags, subcommand
from proxy.redact import MASK

KEY = "ENGINEMETER_ADMIN_KEY"
COMPARISONS = "enginemeter-comparisons.jsonl"
CONFIG = "enginemeter-rollout.yaml"
SWAP_CONFIG = "enginemeter-swap.yaml"


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
        secret = MASK in cmd  # proxy.redact masked a key, a token or a URL password where the bench recorded it
        head = (
            f"Launch command, its secrets masked (`{MASK}`): the real values are in the command you gave the bench "
            "(`--launch`, the bench file, your shell history), never in its output:"
            if secret
            else "Launch command, verbatim:"
        )
        out += [head, "", "```sh", cmd, "```", ""]
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


def _config_head(what: str, listen: str, engines: Sequence[str], primary: str) -> list[str]:
    """A switch config's first lines, the same for a rollout and a swap: what it does, where it listens, the admin
    key, the two engines, and the one route of every model with the baseline as its primary."""
    return [
        f"# enginemeter config: {what}",
        f"listen: {json.dumps(listen)}",
        f"admin_key: ${{{KEY}}}    # GET/POST /admin/rollout need it",
        "engines:",
        *engines,
        "routes:",
        '  - models: ["*"]',
        f"    primary: {json.dumps(primary)}",
    ]


def rollout_yaml(d: Data, v: Verdict, listen: str = DEFAULT_LISTEN) -> str:
    """The enginemeter config that moves the route from the baseline to ``v.candidate`` step by step, at the steps
    that finish at the traffic's rate (``switchway.steps``)."""
    ro = RolloutSettings(candidate=v.candidate, error_budget=d.results.max_error_rate)
    shares = [x.share for x in switchway.steps(switchway.rate(d).per_s, ro)]
    lines = [
        *_config_head(
            f"the guarded switch {v.baseline} -> {v.candidate} (docs/routing.md#rollout)",
            listen,
            [
                *_engine_yaml(d, v.baseline, "the baseline: serves what the candidate does not"),
                *_engine_yaml(d, v.candidate, "the candidate"),
            ],
            v.baseline,
        ),
        "    sample_rate: 1.0    # every request mirrored to the other engine: the pairs each step is judged on",
        "    rollout:",
        f"      candidate: {json.dumps(v.candidate)}",
        f"      steps: {json.dumps(shares)}    # the candidate's share; 0 = shadow only",
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
    host, auth = _host(listen), f'-H "authorization: Bearer ${KEY}"'
    abort = _admin(auth, host, "abort")
    return [
        f"## Rollout: {v.baseline} → {v.candidate}",
        "",
        *switchway.way_lines(d, v.baseline, v.candidate),
        *switchway.steps_lines(d, v.candidate),
        f"Save as `{CONFIG}`; the traffic moves to {v.candidate} step by step (shadow only first) and goes back "
        "to the baseline by itself when a step finds it slower or failing:",
        "",
        *_config_and_check(CONFIG, rollout_yaml(d, v, listen)),
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


# ---- the way: rollout or swap ----------------------------------------------------------------------------


def _config_and_check(path: str, yaml: str) -> list[str]:
    """The config to save at ``path``, then the shell block's first lines: the admin key, the config checked."""
    return [
        "```yaml",
        yaml.rstrip("\n"),
        "```",
        "",
        "Check it, start it, watch it:",
        "",
        "```sh",
        f"export {KEY}=...    # a secret of your choosing",
        f"enginemeter check-config {path}",
    ]


def _host(listen: str) -> str:
    return listen if "://" in listen else f"http://{listen.replace('0.0.0.0', '127.0.0.1')}"


def _admin(auth: str, host: str, action: str) -> str:
    return f'curl -s {auth} {host}/admin/rollout -d \'{{"action": "{action}"}}\''


def _launch_yaml(d: Data, name: str, role: str, z: Resize | None = None) -> list[str]:
    """``z``: the memory gate's setting that makes the engine fit, applied to its command."""
    meta, cmd = _meta(d, name), launch_command(d, name)
    env = "LAUNCH_" + _env_name(name).removeprefix("URL_")
    how = "verbatim, as measured"
    if cmd and z is not None:
        cmd, how = set_flags(cmd, z.flags()), f"as measured but {z.words()} (the memory row's: not measured so)"
    line = (
        f"    launch: {json.dumps(cmd.replace('${', '$${'))}    # {how}; {{port}}: serve gives it one"
        if cmd
        else f'    launch: "${{{env}}}"    # not recorded ({name} was resident): export {env}="the command, --port {{port}}"'
    )
    out = [f"  - name: {json.dumps(name)}    # {role}", line]
    if meta.get("kind"):
        out.append(f"    kind: {meta['kind']}")
    return out


def swap_yaml(d: Data, v: Verdict, listen: str = DEFAULT_LISTEN) -> str:
    """The enginemeter config that swaps the route from the baseline to ``v.candidate`` on one GPU, its bounds
    sized from the measurements (``switchway.bounds``)."""
    out, r = switchway.outage(d, v.candidate), switchway.rate(d)
    b = switchway.bounds(d, v.baseline, out, r)
    sw = SwapSettings(candidate=v.candidate, error_budget=d.results.max_error_rate)
    measured = (
        f"{v.candidate}'s measured load {out.ready_s:.1f} s + warm-up {out.warmup_s or 0:.1f} s, "
        f"×{switchway.WAIT_FACTOR:g} + {switchway.WAIT_MARGIN_S:g} s"
        if b.queue_max_wait_s is not None
        else f"the default: {v.candidate}'s load time was not measured"
    )
    sized = [
        ("queue_max_requests", b.queue_max_requests, sw.queue_max_requests,
         "twice what arrives during the wait at the recorded rate", "the default: no traffic recorded"),
        ("queue_max_wait_s", b.queue_max_wait_s, sw.queue_max_wait_s, measured, measured),
        ("drain_timeout_s", b.drain_timeout_s, sw.drain_timeout_s,
         f"twice {v.baseline}'s longest request in the bench, {sw.drain_timeout_s:g} s at least", "the default"),
        ("ready_timeout_s", b.ready_timeout_s, sw.ready_timeout_s, f"twice {v.candidate}'s measured load, 900 s at least",
         "the default"),
    ]  # fmt: skip
    lines = [
        *_config_head(
            f"the swap {v.baseline} -> {v.candidate} on one GPU (docs/routing.md#swap)",
            listen,
            [
                *_launch_yaml(d, v.baseline, "the baseline: serve launches it at start"),
                *_launch_yaml(
                    d,
                    v.candidate,
                    "the candidate: launched by the swap, once the baseline's memory is back",
                    resize(d.results, v.baseline, v.candidate),
                ),
            ],
            v.baseline,
        ),
        "    swap:",
        f"      candidate: {json.dumps(v.candidate)}",
        "      state: ready    # the baseline serves; POST /admin/rollout start swaps (or: running, swap at start)",
        *(
            f"      {k}: {x if x is not None else dflt:g}    # {why if x is not None else no}"
            for k, x, dflt, why, no in sized
        ),
        f"      warmup_requests: {sw.warmup_requests}",
        f"      min_requests: {sw.min_requests}    # per exercised regime, before the watch can pass",
        f"      min_dwell_s: {sw.min_dwell_s:g}",
        f"      error_budget: {sw.error_budget:g}    # the bench's --max-error-rate",
        "mirror:",
        f"  min_effect: {d.results.min_effect:g}    # the bench's --min-effect: slower beyond it swaps back",
    ]
    return "\n".join(lines) + "\n"


def _random_caveat(d: Data, v: Verdict) -> str:
    """Random weights load faster than real ones: the measured load time leaves out reading the weights."""
    random = d.results.random_of(v.baseline, v.candidate)
    if not random:
        return ""
    return (
        "Random weights: "
        + ", ".join(f"{n} ({why})" for n, why in random.items())
        + ": put the command that loads your model's weights in the config, and expect the outage longer by the "
        "time it takes to read them. "
    )


def _unfit(d: Data, v: Verdict) -> list[str]:
    """The candidate alone over the budget as launched: the swap cannot help; its command must change first (the
    config does it when the memory gate found the setting that fits)."""
    gate = next((x for x in v.reasons if x.step == "memory"), None)
    if gate is None or (gate.outcome, gate.check) in (("ok", "memory"), ("note", "memory")):
        return []  # fits, or not judged
    z = resize(d.results, v.baseline, v.candidate)
    fix = (
        f"the config below launches it with {z.words()} (the checklist's memory row), a setting not measured as "
        f"such: the swap's start and watch test it, and a start that fails swaps back to {v.baseline} by itself."
        if z is not None
        else "change its command as the checklist's memory row says, then put that command in the config."
    )
    return [f"**Before it runs on your card**: {v.candidate} alone does not fit the budget as launched; {fix}", ""]


def swap_section(d: Data, v: Verdict, listen: str) -> list[str]:
    out, r = switchway.outage(d, v.candidate), switchway.rate(d)
    back = switchway.outage(d, v.baseline)
    b = switchway.bounds(d, v.baseline, out, r)
    sw = SwapSettings(candidate=v.candidate)
    host, auth = _host(listen), f'-H "authorization: Bearer ${KEY}"'
    expected = (
        f"**Expected outage: about {out.seconds:.0f} s** — {v.candidate}'s launch → ready "
        f"{out.ready_s:.1f} s in this bench run + its first {out.warmup_requests} warm-up requests "
        f"{out.warmup_s or 0:.1f} s (plus {v.baseline}'s stop and its memory coming back, which the bench does not "
        "time). "
        if out.seconds is not None
        else f"**Expected outage: not measured** — {v.candidate} was not launched by this bench (no load time): "
        f"time its start by hand, or bench it with `--launch`. "
    )
    wait = b.queue_max_wait_s or sw.queue_max_wait_s
    twice = (
        " (twice the measured start: a first launch on a machine, its compile and kernel caches cold, may take that)"
        if b.queue_max_wait_s is not None
        else ""
    )
    return [
        f"## Swap: {v.baseline} → {v.candidate}",
        "",
        *switchway.way_lines(d, v.baseline, v.candidate),
        expected
        + _random_caveat(d, v)
        + f"Requests arriving meanwhile wait, up to {b.queue_max_requests or sw.queue_max_requests} of them and "
        f"{wait:g} s each{twice}, and the candidate answers them; past that bound a client gets a 503 with "
        "Retry-After (give clients a timeout above it). "
        + (
            f"Swapping back costs {v.baseline}'s load: {back.seconds:.0f} s measured."
            if back.seconds is not None
            else ""
        ),
        "",
        f"**The watch** at {r.text()}: {v.candidate} serves at least {sw.min_requests} requests in each regime the "
        f"traffic exercises and {sw.min_dwell_s:g} s: about {switchway.span(switchway.watch_s(r.per_s, sw))}; then "
        "the swap is complete.",
        "",
        *_unfit(d, v),
        f"Save as `{SWAP_CONFIG}`:",
        "",
        *_config_and_check(SWAP_CONFIG, swap_yaml(d, v, listen)),
        f"# stop the {v.baseline} you run now: serve launches it from the config (one GPU holds one of them)",
        f"enginemeter serve --config {SWAP_CONFIG}    # launches {v.baseline}; {v.candidate} waits for the swap",
        _admin(auth, host, "start") + "    # the swap: drain, stop, launch, warm, watch",
        f"curl -s {auth} {host}/admin/rollout    # phase, requests held, the outage measured, the watch",
        f"curl -s {host}/health",
        "```",
        "",
        f"**Roll back** — the one command, during the watch and after `complete` ({v.baseline} is launched again "
        f"in {v.candidate}'s place):",
        "",
        "```sh",
        _admin(auth, host, "abort"),
        "```",
        "",
        "Without the admin endpoint: `state: aborted` in the swap block and a restart.",
        "",
    ]
