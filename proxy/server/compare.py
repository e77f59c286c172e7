"""Primary vs shadow: one mirrored pair of Results -> one ``Comparison``, its metrics and its log record.

``compare()`` is pure. A pair is *comparable* when both sides finished ``ok``; only comparable pairs count in
the pair/mismatch/delta/ratio metrics (a failed side says nothing about token counts or speed — its outcome is
already in ``enginemeter_requests_total{role=...}``). Every pair, comparable or not, gets one log record.

What is compared:

- token counts: ``usage.prompt_tokens`` and ``usage.completion_tokens`` as each engine reports them (a side
  that reports none makes that check ``None``, not a mismatch);
- the finish reason of choice 0;
- for greedy requests (temperature 0 on both sides) the output text of choice 0, and where it differs, the
  first differing position (index into the text, in Unicode code points; the shorter length when one is a
  prefix of the other);
- ratios shadow/primary of upstream TTFT (sent upstream -> first token, so the proxy's own work before the
  send does not enter either side), TPOT and decode tok/s;
- cached prompt tokens each side (``usage.prompt_tokens_details.cached_tokens`` / SGLang's top-level
  ``cached_tokens``, else llama.cpp ``timings.cache_n``), so a cache hit can be told from engine speed.

``ComparisonLog`` writes one JSON line per pair to a size-rotated file from its own thread: the event loop
only puts a dict on a bounded queue (and drops it, counted, when the writer cannot keep up).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.server.metrics import Metrics
from proxy.server.result import Result

log = logging.getLogger("enginemeter.compare")

#: bump when a field changes meaning or disappears (adding fields does not bump it)
RECORD_VERSION = 1


@dataclass(frozen=True, slots=True)
class Side:
    """One engine's half of a pair, in the units of the log record."""

    engine: str
    kind: str
    outcome: str
    ttft_s: float | None
    upstream_ttft_s: float | None
    tpot_s: float | None
    decode_tps: float | None
    e2e_s: float | None
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    engine_prompt_ms: float | None
    engine_decode_tps: float | None
    finish_reason: str | None

    @classmethod
    def of(cls, r: Result) -> Side:
        u, et, t = r.usage, r.engine_timings, r.timing
        cached = u.cached_tokens if u is not None else None
        if cached is None and et is not None:
            cached = et.cache_n
        return cls(
            engine=r.engine,
            kind=r.engine_kind,
            outcome=r.outcome,
            ttft_s=t.ttft_s,
            upstream_ttft_s=t.upstream_ttft_s,
            tpot_s=t.tpot_s,
            decode_tps=t.decode_tps,
            e2e_s=t.e2e_s,
            prompt_tokens=u.prompt_tokens if u is not None else None,
            completion_tokens=u.completion_tokens if u is not None else None,
            cached_tokens=cached,
            engine_prompt_ms=et.prompt_ms if et is not None else None,
            engine_decode_tps=et.predicted_per_second if et is not None else None,
            finish_reason=r.finish_reason,
        )


@dataclass(frozen=True, slots=True)
class Comparison:
    request_id: str
    model: str
    endpoint: str
    stream: bool
    greedy: bool
    comparable: bool
    primary: Side
    shadow: Side
    #: None = could not be checked (a side failed or did not report the figure)
    prompt_mismatch: bool | None
    completion_mismatch: bool | None
    finish_mismatch: bool | None
    output_mismatch: bool | None
    prompt_delta: int | None  # shadow - primary
    completion_delta: int | None
    first_diff_pos: int | None
    ratio_ttft: float | None  # shadow / primary
    ratio_tpot: float | None
    ratio_decode_tps: float | None
    ratio_e2e: float | None  # log record only (non-stream pairs have no TTFT/TPOT)


def first_diff(a: str, b: str) -> int | None:
    """Index of the first differing code point; None when equal."""
    if a == b:
        return None
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _ratio(shadow: float | None, primary: float | None) -> float | None:
    if shadow is None or primary is None or primary <= 0:
        return None
    return shadow / primary


def _delta(shadow: int | None, primary: int | None) -> int | None:
    return None if shadow is None or primary is None else shadow - primary


def compare(primary: Result, shadow: Result) -> Comparison:
    p, s = Side.of(primary), Side.of(shadow)
    ok = p.outcome == "ok" and s.outcome == "ok"
    greedy = primary.greedy and shadow.greedy
    prompt_d = _delta(s.prompt_tokens, p.prompt_tokens) if ok else None
    compl_d = _delta(s.completion_tokens, p.completion_tokens) if ok else None
    finish_mm = (p.finish_reason != s.finish_reason) if ok and p.finish_reason and s.finish_reason else None
    output_mm = diff_pos = None
    if ok and greedy and primary.text is not None and shadow.text is not None:
        diff_pos = first_diff(primary.text, shadow.text)
        output_mm = diff_pos is not None
    return Comparison(
        request_id=primary.request_id,
        model=primary.model,
        endpoint=primary.endpoint,
        stream=primary.stream,
        greedy=greedy,
        comparable=ok,
        primary=p,
        shadow=s,
        prompt_mismatch=None if prompt_d is None else prompt_d != 0,
        completion_mismatch=None if compl_d is None else compl_d != 0,
        finish_mismatch=finish_mm,
        output_mismatch=output_mm,
        prompt_delta=prompt_d,
        completion_delta=compl_d,
        first_diff_pos=diff_pos,
        ratio_ttft=_ratio(s.upstream_ttft_s, p.upstream_ttft_s) if ok else None,
        ratio_tpot=_ratio(s.tpot_s, p.tpot_s) if ok else None,
        ratio_decode_tps=_ratio(s.decode_tps, p.decode_tps) if ok else None,
        ratio_e2e=_ratio(s.e2e_s, p.e2e_s) if ok else None,
    )


def observe_comparison(m: Metrics, c: Comparison) -> None:
    """Count one pair. Only comparable pairs (both sides ``ok``) are counted."""
    if not c.comparable:
        return
    pe, se = c.primary.engine, c.shadow.engine
    m.pairs.labels(pe, se).inc()
    for kind, mismatch, delta in (
        ("prompt", c.prompt_mismatch, c.prompt_delta),
        ("completion", c.completion_mismatch, c.completion_delta),
    ):
        if mismatch:
            m.token_mismatch.labels(pe, se, kind).inc()
        if delta is not None:
            m.token_delta.labels(pe, se, kind).observe(delta)
    if c.output_mismatch:
        m.output_mismatch.labels(pe, se).inc()
    if c.finish_mismatch:
        m.finish_mismatch.labels(pe, se).inc()
    for metric, ratio in (("ttft", c.ratio_ttft), ("tpot", c.ratio_tpot), ("decode_tps", c.ratio_decode_tps)):
        if ratio is not None:
            m.ratio.labels(pe, se, metric).observe(ratio)


def _side_record(s: Side) -> dict[str, Any]:
    return {
        "engine": s.engine,
        "kind": s.kind,
        "outcome": s.outcome,
        "ttft_s": s.ttft_s,
        "upstream_ttft_s": s.upstream_ttft_s,
        "tpot_s": s.tpot_s,
        "decode_tps": s.decode_tps,
        "e2e_s": s.e2e_s,
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.completion_tokens,
        "cached_tokens": s.cached_tokens,
        "engine_prompt_ms": s.engine_prompt_ms,
        "engine_decode_tps": s.engine_decode_tps,
        "finish_reason": s.finish_reason,
    }


def to_record(
    c: Comparison,
    *,
    ts: float | None = None,
    prompt: Any = None,
    primary_text: str | None = None,
    shadow_text: str | None = None,
    gpus: Mapping[str, Sequence[int]] | None = None,
) -> dict[str, Any]:
    """The JSONL record (schema in docs/routing.md). Text fields appear only when given.

    ``gpus``: role (``primary``/``shadow``) -> the GPU indices that side's engine holds memory on (the GPU
    monitor's attribution); when given, the record says which and whether the two share one (``contended``:
    mirrored requests then slow each other, and ``enginemeter report --log`` stops at its parity gate)."""
    rec: dict[str, Any] = {
        "v": RECORD_VERSION,
        "ts": time.time() if ts is None else ts,
        "request_id": c.request_id,
        "model": c.model,
        "endpoint": c.endpoint,
        "stream": c.stream,
        "greedy": c.greedy,
        "comparable": c.comparable,
        "primary": _side_record(c.primary),
        "shadow": _side_record(c.shadow),
        "mismatch": {
            "prompt_tokens": c.prompt_mismatch,
            "completion_tokens": c.completion_mismatch,
            "finish_reason": c.finish_mismatch,
            "output": c.output_mismatch,
        },
        "delta": {"prompt_tokens": c.prompt_delta, "completion_tokens": c.completion_delta},
        "first_diff_pos": c.first_diff_pos,
        "ratios": {
            "ttft": c.ratio_ttft,
            "tpot": c.ratio_tpot,
            "decode_tps": c.ratio_decode_tps,
            "e2e": c.ratio_e2e,
        },
    }
    if gpus is not None:
        p, sh = sorted(gpus.get("primary", ())), sorted(gpus.get("shadow", ()))
        rec["gpus"] = {"primary": p, "shadow": sh}
        rec["contended"] = bool(set(p) & set(sh))
    if prompt is not None:
        rec["prompt"] = prompt
    if primary_text is not None:
        rec["primary"]["text"] = primary_text
    if shadow_text is not None:
        rec["shadow"]["text"] = shadow_text
    return rec


@contextlib.contextmanager
def _dir_locked(path: str) -> Iterator[None]:
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


class ComparisonLog:
    """Bounded, rotating JSONL file written by one daemon thread.

    ``write()`` never blocks: it serializes nothing and only ``put_nowait``s on a bounded queue; when the queue
    is full the record is dropped and ``dropped`` grows. Rotation is by size: ``path`` -> ``path.1`` -> ...
    -> ``path.<backups>`` (the oldest is deleted); ``backups=0`` truncates in place.
    """

    _STOP = object()

    def __init__(
        self,
        path: str,
        *,
        max_bytes: int,
        backups: int,
        queue_size: int = 10_000,
        mode: int = 0o600,
        name: str = "enginemeter-compare-log",
    ) -> None:
        self.path = path
        #: permission bits of the log and its rotated files: 0o600 (both logs may hold prompts and answers). A
        #: file that already exists with other bits (an older run's 0644) is set to these when opened
        #: (``_enforce_mode``); one this user cannot chmod is not written to (counted in ``errors``)
        self.mode = mode
        self.max_bytes = max(1, max_bytes)
        self.backups = max(0, backups)
        self.written = 0
        self.dropped = 0
        self.errors = 0
        self._q: queue.Queue[object] = queue.Queue(maxsize=queue_size)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def write(self, record: dict[str, Any]) -> bool:
        try:
            self._q.put_nowait(record)
            return True
        except queue.Full:
            self.dropped += 1
            return False

    def close(self, timeout: float = 5.0) -> None:
        """Flush what is queued and stop the thread (blocking: call it off the event loop)."""
        if not self._thread.is_alive():
            return
        try:
            self._q.put(self._STOP, timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until everything queued so far is on disk (blocking; for tests and shutdown)."""
        done = threading.Event()
        try:
            self._q.put(done, timeout=timeout)
        except queue.Full:
            return False
        return done.wait(timeout)

    # ------------------------------------------------------------------------------ writer thread

    def _rotate(self) -> None:
        if self.backups == 0:
            os.close(os.open(self.path, os.O_WRONLY | os.O_TRUNC | os.O_CREAT, self.mode))
            return
        for i in range(self.backups - 1, 0, -1):
            src = f"{self.path}.{i}"
            if os.path.exists(src):
                os.replace(src, f"{self.path}.{i + 1}")
        os.replace(self.path, f"{self.path}.1")

    def _enforce_mode(self, fd: int, path: str) -> None:
        """The file open as ``fd`` gets ``self.mode``, whatever it had (O_CREAT's mode only applies to new files)."""
        st = os.fstat(fd)
        if st.st_mode & 0o7777 != self.mode:
            os.fchmod(fd, self.mode)  # PermissionError (another user's file): the caller does not write to it
            log.warning("log file %s had mode %o: set to %o", path, st.st_mode & 0o7777, self.mode)

    def _run(self) -> None:
        d = os.path.dirname(self.path)
        if d:
            os.makedirs(d, exist_ok=True)
        # files of an earlier run (the log, its rotated copies) get the mode before anything else is written
        for p in [self.path, *(f"{self.path}.{i}" for i in range(1, self.backups + 1))]:
            try:
                fd = os.open(p, os.O_RDONLY)
            except OSError:
                continue
            try:
                self._enforce_mode(fd, p)
            except OSError:
                log.exception("cannot set the mode of the log file %s", p)
            finally:
                os.close(fd)
        while True:
            item = self._q.get()
            if item is self._STOP:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                line = (json.dumps(item, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
                # `serve --workers N`: every worker appends to this file; a lock on its directory keeps a
                # rotation and another worker's line apart (each line is one O_APPEND write)
                with _dir_locked(d or "."):
                    size = os.path.getsize(self.path) if os.path.exists(self.path) else 0
                    if size and size + len(line) > self.max_bytes:
                        self._rotate()
                    # 0600 by default: with record_text the log holds prompts and answers; only the proxy's user may read it
                    fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, self.mode)
                    with os.fdopen(fd, "ab") as f:
                        self._enforce_mode(fd, self.path)  # a file made by someone else meanwhile, too
                        f.write(line)
                self.written += 1
            except Exception:  # a full disk must not kill the writer; count and go on
                self.errors += 1
                log.exception("writing the log %s failed", self.path)
