"""The quality phases of one bench run, engine by engine: what ``run`` calls after an engine's timed cells.

``bench --agreement [PROMPTSxTOKENS]`` runs :mod:`~proxy.bench.quality.agreerun` and ``--eval FILE.jsonl``
runs :mod:`~proxy.bench.quality.evalset`, each at concurrency 1, off the timed cells: on resident engines after
every engine's cells, one engine at a time (baseline first); on time-shared runs in each engine's stint, after
its cells and before it stops (the relaunched baseline, the A/A stint, gives the floor: the same model twice).
``run`` hands over plain things (an engine's name, kind, model, clients and the body the run sends it), so this
package never imports ``run``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from proxy.bench.quality.agreerun import AgreementPhase, Engine, parse_size, variants
from proxy.bench.quality.evalset import BodyFor, EvalItem, load_eval, run_eval


@dataclass
class QualityRun:
    """The run's quality phases; :meth:`engine` once per engine, the baseline first."""

    agreement: AgreementPhase | None
    items: list[EvalItem] | None
    body_for: BodyFor
    write: Callable[[dict[str, Any]], None]
    say: Callable[[str], None]

    async def engine(
        self,
        name: str,
        kind: str | None,
        model: str | None,
        url: str | None,
        client: httpx.AsyncClient,
        headers: Mapping[str, str],
        *,
        baseline: bool,
        timeout_s: float = 600.0,
    ) -> None:
        """Both phases on one engine. ``url``: its own (log-probabilities go to the engine, never a proxy);
        ``client``/``headers``: what the timed cells used (the eval goes the same way)."""
        if self.agreement is not None:
            t0 = time.monotonic()
            if url is None:
                self.write(
                    {
                        "type": "quality_note",
                        "engine": name,
                        "phase": "agreement",
                        "note": "left out: no URL of its own",
                    }
                )
            else:
                async with httpx.AsyncClient(base_url=url, timeout=timeout_s, trust_env=False) as own:
                    ok = await self.agreement.run(Engine(name, kind, model, own), baseline=baseline)
                self.say(
                    f"enginemeter bench: {name}: token agreement "
                    f"{'measured' if ok else 'left out'} in {time.monotonic() - t0:.0f} s"
                )
        if self.items is not None:
            t0 = time.monotonic()
            right = await run_eval(self.items, name, client, self.body_for, self.write, headers)
            self.say(
                f"enginemeter bench: {name}: eval {right}/{len(self.items)} right in {time.monotonic() - t0:.0f} s"
            )


def quality_run(
    agreement: str | None,
    eval_file: str | None,
    prompts: Sequence[Sequence[Mapping[str, str]]],
    body_for: BodyFor,
    write: Callable[[dict[str, Any]], None],
    say: Callable[[str], None],
) -> QualityRun | None:
    """The phases a run asked for (None: neither). ``agreement``: ``PROMPTSxTOKENS``; ``prompts``: the suite's."""
    if not agreement and not eval_file:
        return None
    phase = None
    if agreement:
        n, tokens = parse_size(agreement)
        phase = AgreementPhase(variants(prompts, n), tokens, write)
    items = load_eval(eval_file) if eval_file else None
    return QualityRun(phase, items, body_for, write, say)
