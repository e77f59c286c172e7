"""The bench measures its own client (``proxy.bench.run.client.LoopLag``, issue 47 item 6): a real engine process
streaming at a steady cadence, the bench's event loop blocked mid-stream (what a descheduled client looks like from
inside), and a real buffering burst (the fault engine's ``burst`` knob) with the client undisturbed.

The engine runs above the priority of any load beside the tests (``nice -n -10``, where allowed): a fake engine that is
descheduled catches up on its schedule in a burst of its own — really the engine's — while the claims here are
about the client."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from proxy.bench.run.benchconfig import CellSpec, Target
from proxy.bench.run.client import LoopLag, RequestOutcome, send_one
from proxy.bench.run.memprobe import MemoryProbe
from proxy.bench.run.records import request_record, sample_record
from tests.helpers import ProcessServer

BODY = b'{"model":"m","stream":true,"max_tokens":32,"messages":[{"role":"user","content":"hi"}]}'
CADENCE_MS = 4.0  # 32 events over ~128 ms
#: engines above the load's priority (nice(1) runs the command anyway where it may not raise it)
PRIORITY = ("nice", "-n", "-10")


@pytest.fixture(scope="module")
def engine() -> Iterator[str]:
    args = ("--tokens", "32", "--cadence-ms", str(CADENCE_MS), "--ttft-ms", "1")
    with ProcessServer("fakes.fault_engine", *args, ready_path="/health", wrapper=PRIORITY) as e:  # never blocked
        yield e.url


async def _one(url: str, *, stall_s: float = 0.0, fault: str = "") -> RequestOutcome:
    """One streamed request under a ``LoopLag``; ``stall_s``: the client's loop is blocked that long, 20 ms in."""
    lag = LoopLag()
    headers = {"content-type": "application/json", **({"x-fault": fault} if fault else {})}

    async def stall() -> None:
        await asyncio.sleep(0.02)  # into the stream (the first token comes after ~1 ms)
        time.sleep(stall_s)  # noqa: ASYNC251 - the client descheduled: nothing on its loop runs meanwhile

    async with lag.watching(), httpx.AsyncClient(base_url=url, timeout=30) as client:
        await client.get("/health")  # a connection made before the timed request
        stalling = asyncio.ensure_future(stall()) if stall_s else None
        o = lag.annotate(await send_one(client, BODY, headers))
        if stalling is not None:
            await stalling
    return o


def test_a_stall_of_the_client_mid_stream_is_the_clients_burst_not_the_engines(engine: str) -> None:
    o = asyncio.run(_one(engine, stall_s=0.15))
    assert o.ok and o.timing.burst  # the events piled up while the client could not read: read together
    assert o.client_burst and o.client_lag_s is not None and o.client_lag_s >= 0.1
    rec = request_record(Target("a", engine), o, 0)
    assert rec["burst_cause"] == "client" and rec["client_lag_s"] >= 0.1
    cell = CellSpec("cold", 1, 32, "short", ("concurrency",))
    s = sample_record("a", cell, 0, [o], o.t_start_ns, o.t_done_ns, None, MemoryProbe(None), {}, "a")
    assert (s["bursts"], s["bursts_client"]) == (0, 1) and s["client_lag_max_s"] >= 0.1


def test_a_buffering_burst_with_the_client_undisturbed_is_the_engines(engine: str) -> None:
    o = asyncio.run(_one(engine, fault="burst=1"))
    assert o.ok and o.timing.burst and not o.client_burst
    assert request_record(Target("a", engine), o, 0)["burst_cause"] == "engine"


def test_a_steady_stream_is_no_burst_of_the_engines_however_loaded_the_client(engine: str) -> None:
    for _ in range(5):
        o = asyncio.run(_one(engine))
        assert o.ok and o.client_lag_s is not None
        assert request_record(Target("a", engine), o, 0)["burst_cause"] in (None, "client"), o.timing.gaps_s
