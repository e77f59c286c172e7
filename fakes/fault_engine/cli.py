"""``python -m fakes.fault_engine``: flags to a :class:`FaultEngineConfig` (``--fault`` in x-fault syntax),
serve until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import signal

from fakes.fault_engine.config import FaultEngineConfig, KnobError, Knobs
from fakes.fault_engine.server import FaultEngine

DESCRIPTION = "A fault-injecting look-alike of llama.cpp ``llama-server``, for tests and benchmarks."


def _parse_args(argv: list[str] | None) -> FaultEngineConfig:
    p = argparse.ArgumentParser(prog="python -m fakes.fault_engine", description=DESCRIPTION)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--model", default="fault-engine", help="the name every response reports")
    p.add_argument("--n-ctx", type=int, default=4096)
    p.add_argument("--slots", type=int, default=4, help="total_slots in /props and /slots")
    p.add_argument("--record-limit", type=int, default=256)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--cadence-ms", type=float, default=20.0)
    p.add_argument("--ttft-ms", type=float, default=50.0)
    p.add_argument("--queue-ms", type=float, default=0.0)
    p.add_argument("--multi", type=int, default=1)
    p.add_argument("--ping", action="store_true")
    p.add_argument("--reuse-port", action="store_true", help="SO_REUSEPORT: more engine processes on this port")
    p.add_argument("--fault", default="", help="default knobs in x-fault syntax, e.g. 'die_after=5'")
    args = p.parse_args(argv)
    knobs = Knobs(
        tokens=args.tokens,
        cadence_ms=args.cadence_ms,
        ttft_ms=args.ttft_ms,
        queue_ms=args.queue_ms,
        multi=args.multi,
        ping=args.ping,
    )
    try:
        knobs = knobs.merged(args.fault)
    except KnobError as exc:
        p.error(str(exc))
    return FaultEngineConfig(
        host=args.host,
        port=args.port,
        reuse_port=args.reuse_port,
        model=args.model,
        n_ctx=args.n_ctx,
        total_slots=args.slots,
        record_limit=args.record_limit,
        knobs=knobs,
    )


async def _main_async(config: FaultEngineConfig) -> None:
    engine = FaultEngine(config)
    await engine.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"READY {engine.url}", flush=True)
    await stop.wait()
    await engine.aclose()


def main(argv: list[str] | None = None) -> None:
    asyncio.run(_main_async(_parse_args(argv)))
