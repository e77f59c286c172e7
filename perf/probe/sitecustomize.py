"""Process probes for the bench: ``PYTHONPATH=perf/probe ENGINEMETER_GCPROBE=FILE python ...`` (GC pauses) and
``ENGINEMETER_CPROFILE=FILE`` (a cProfile of the main thread between SIGUSR1 and SIGUSR2).

GC pauses:

Loaded as ``sitecustomize`` (only when this directory is on ``PYTHONPATH``): a ``gc.callbacks`` hook times every
collection with ``perf_counter_ns`` (from ``ENGINEMETER_GCPROBE_SKIP_S`` after start, default 5 s: start-up's
collections are not the steady state's) and, at exit, writes one JSON object to ``FILE.<pid>``: per generation the
number of collections, their total, p50, p99 and longest pause (ms), and the objects they collected; plus the
thresholds, the frozen count and the number of tracked objects at exit. Works on any tree (the current one or a
``--baseline-tree``), so a before/after of a GC change runs in the same rounds (``perf/overhead.py --proxy-env``).

What-if knobs, for comparing GC policies on one tree: ``ENGINEMETER_GCPROBE_THRESHOLD=a,b,c`` sets
``gc.set_threshold`` at start, ``ENGINEMETER_GCPROBE_FREEZE_AFTER_S=S`` calls ``gc.freeze()`` S seconds after
start (from a thread: the proxy's start-up is done by then), ``ENGINEMETER_GCPROBE_UNFREEZE=1`` undoes a freeze
the tree makes itself (``gc.unfreeze()`` each second for the first 30 s).
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import time

_path = os.environ.get("ENGINEMETER_GCPROBE")

if _path:
    _pauses: dict[int, list[int]] = {0: [], 1: [], 2: []}
    _collected = [0, 0, 0]
    _t0 = [0]
    #: collections before this (start-up: imports, probing) are not counted
    _skip_until = time.perf_counter_ns() + int(float(os.environ.get("ENGINEMETER_GCPROBE_SKIP_S", "5")) * 1e9)

    def _cb(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            _t0[0] = time.perf_counter_ns()
        elif _t0[0] >= _skip_until:
            g = info["generation"]
            _pauses[g].append(time.perf_counter_ns() - _t0[0])
            _collected[g] += info["collected"]

    gc.callbacks.append(_cb)

    if os.environ.get("ENGINEMETER_GCPROBE_THRESHOLD"):
        gc.set_threshold(*(int(x) for x in os.environ["ENGINEMETER_GCPROBE_THRESHOLD"].split(",")))
    _after = os.environ.get("ENGINEMETER_GCPROBE_FREEZE_AFTER_S")
    _unfreeze = os.environ.get("ENGINEMETER_GCPROBE_UNFREEZE") == "1"
    if _after or _unfreeze:
        import threading

        def _later() -> None:
            if _after:
                time.sleep(float(_after))
                gc.freeze()
            else:
                for _ in range(30):
                    time.sleep(1.0)
                    gc.unfreeze()

        threading.Thread(target=_later, daemon=True, name="gcprobe").start()

    def _pct(xs: list[int], q: float) -> float:
        if not xs:
            return 0.0
        s = sorted(xs)
        return s[max(0, min(len(s) - 1, round(q / 100 * len(s) + 0.5) - 1))] / 1e6

    def _dump() -> None:
        out = {
            "pid": os.getpid(),
            "threshold": gc.get_threshold(),
            "frozen": gc.get_freeze_count(),
            "tracked_at_exit": len(gc.get_objects()),
            "generations": {
                str(g): {
                    "collections": len(p),
                    "total_ms": sum(p) / 1e6,
                    "p50_ms": _pct(p, 50),
                    "p99_ms": _pct(p, 99),
                    "max_ms": max(p) / 1e6 if p else 0.0,
                    "collected": _collected[g],
                }
                for g, p in _pauses.items()
            },
        }
        with open(f"{_path}.{os.getpid()}", "w") as f:
            json.dump(out, f, indent=1)

    atexit.register(_dump)


_prof_path = os.environ.get("ENGINEMETER_CPROFILE")

if _prof_path:
    # cProfile profiles the thread that enables it; a signal handler runs in the main thread (the event loop's)
    import cProfile
    import signal

    _prof = cProfile.Profile(time.thread_time)  # CPU time: a wall clock counts the time the process was preempted

    def _start(signum: int, frame: object) -> None:
        _prof.enable()

    def _stop(signum: int, frame: object) -> None:
        _prof.disable()
        _prof.dump_stats(f"{_prof_path}.{os.getpid()}")

    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _stop)
