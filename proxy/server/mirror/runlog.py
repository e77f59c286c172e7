"""The comparison log's records of one proxy run, besides its pairs: the ``run`` record that opens it, an ``engine``
record whenever an engine's polled facts change, both again at the top of every file a rotation starts (marked
``continued``), so each file says which run and engines its pairs belong to after older files are gone. The
records' shapes are ``proxy.server.mirror.compare``'s; the mirror writes them (``proxy.server.mirror.shadows``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from proxy import __version__
from proxy.config.settings import Settings
from proxy.server.mirror.compare import engine_record, run_record
from proxy.server.request.upstream import Engine

#: what an ``engine`` record carries of the engine-state poller's facts
FACT_FIELDS = ("kind", "model", "model_path", "context_length", "slots", "quantization", "weights_format", "kv_pool_tokens", "build")  # fmt: skip


class RunRecords:
    """``facts_of``: engine -> its latest engine-state poll (an object with ``t_ok`` and ``FACT_FIELDS``; None: not
    polled)."""

    def __init__(
        self,
        settings: Settings,
        engines: Mapping[str, Engine],
        run_id: str,
        started: float,
        facts_of: Callable[[str], Any] | None,
    ) -> None:
        self.settings = settings
        self.engines = engines
        self.run_id = run_id
        self.started = started
        self.facts_of = facts_of
        self._written: dict[str, tuple[Any, ...]] = {}
        #: the last engine record per engine: repeated at the top of each rotated-to file (``header``)
        self._records: dict[str, dict[str, Any]] = {}

    def run(self) -> dict[str, Any]:
        """The ``run`` record: this run's id, where it listens, the pairs its routes mirror, the engines."""
        s = self.settings
        pairs = [(r.primary, sh) for r in s.routes for sh in r.shadows if sh != r.primary]
        pairs += [(x, sh) for r in s.routes for x in (*r.split, *r.fallback) for sh in r.shadows if sh != x]
        for r in s.routes:  # a rollout mirrors both ways between its baseline and its candidate
            if r.rollout is not None:
                pairs += [
                    p for p in ((r.primary, r.rollout.candidate), (r.rollout.candidate, r.primary)) if p not in pairs
                ]
        engines = {n: {"kind": e.kind, "model": e.model} for n, e in self.engines.items()}
        host = f"[{s.host}]" if ":" in s.host else s.host
        return run_record(
            self.run_id,
            listen=f"http://{host}:{s.port}",
            pairs=pairs,
            engines=engines,
            version=__version__,
            ts=self.started,
        )

    def new_facts(self, *names: str) -> list[dict[str, Any]]:
        """An ``engine`` record for each engine whose polled facts are new to this run's log."""
        out: list[dict[str, Any]] = []
        if self.facts_of is None:
            return out
        for name in names:
            st = self.facts_of(name)
            if st is None or getattr(st, "t_ok", None) is None:
                continue
            facts = tuple(getattr(st, f, None) for f in FACT_FIELDS)
            if self._written.get(name) != facts:
                self._written[name] = facts
                rec = self._records[name] = engine_record(self.run_id, name, dict(zip(FACT_FIELDS, facts, strict=True)))
                out.append(rec)
        return out

    def header(self) -> list[dict[str, Any]]:
        """What a file starts with after a rotation (on the log's thread): the run record, marked ``continued`` (the
        run began in an earlier file), and the engine facts written so far."""
        return [{**self.run(), "continued": True}, *dict(self._records).values()]
