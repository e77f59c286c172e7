"""Token agreement on live traffic's prompts: the prompts the proxy's comparison log recorded (``mirror.record_text``,
opt-in: it logs what users sent), measured on two engines at their URLs the way ``bench --agreement`` measures
the suite's — off the request path, one engine at a time, baseline first.

The mirrored pairs themselves are left as they are: asking the engines for log-probabilities on live requests would
change what users' requests cost (and the primary's answer shape), so the figures are made from the recorded
prompts afterwards, on demand: ``python -m proxy.bench.quality live LOG --baseline A=URL --candidate B=URL``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import httpx

from proxy import engines
from proxy.bench.quality.agreerun import AgreementPhase, Engine, variants


def logged_prompts(paths: Iterable[Path]) -> list[list[dict[str, str]]]:
    """The distinct chat prompts of the ``pair`` records (those with a recorded ``prompt``), in log order."""
    out: list[list[dict[str, str]]] = []
    seen: set[str] = set()
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short
                msgs = rec.get("prompt") if isinstance(rec, dict) and rec.get("type") == "pair" else None
                if not isinstance(msgs, list) or not all(isinstance(m, dict) and "content" in m for m in msgs):
                    continue
                chat = [{"role": str(m.get("role", "user")), "content": str(m["content"])} for m in msgs]
                key = json.dumps(chat, sort_keys=True)
                if key not in seen:
                    seen.add(key)
                    out.append(chat)
    return out


async def measure_live(
    prompts: Sequence[Sequence[dict[str, str]]],
    sides: Sequence[tuple[str, str]],
    tokens: int,
    n: int,
    write: Callable[[dict[str, Any]], None],
    *,
    timeout_s: float = 600.0,
) -> list[bool]:
    """``sides``: (name, URL), the baseline first; each engine's kind and model probed, then measured."""
    phase = AgreementPhase(variants(prompts, n), tokens, write)
    done = []
    for i, (name, url) in enumerate(sides):
        async with httpx.AsyncClient(base_url=url, timeout=timeout_s, trust_env=False) as c:
            p = await engines.probe(c, 10.0)
            done.append(await phase.run(Engine(name, p.kind, p.model, c), baseline=i == 0))
    return done
