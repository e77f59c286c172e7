"""Shadow mirroring through the real proxy (uvicorn, real sockets).

- real llama-server pairs: same model with different settings (greedy outputs match, nothing counted as a
  mismatch), different tokenizers (prompt-token mismatch counted), the SGLang emulator as shadow;
- isolation: shadows 10x slower, refusing connections and hanging leave the primary's client-visible TTFT
  and stream as they are with mirroring off (measured in the same test); the fault engines run as separate
  processes so their work does not share the test process's GIL with the proxy;
- the bounds: dropped when full, not cancelled by the client's disconnect, bounded by ``mirror.timeout``;
- /admin/mirror switches mirroring and its rate at run time; /health shows the state.
"""

from __future__ import annotations

import asyncio
import functools
import json
import statistics
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import CollectorRegistry

from fakes.fault_engine import FaultEngineConfig, Knobs, run_in_thread
from fakes.sglang_emulator import EmulatorConfig
from fakes.sglang_emulator import run_in_thread as run_emulator
from proxy.config.settings import EngineSettings, MirrorSettings, RouteSettings, Settings, Timeouts
from proxy.embedded import LlamaServer
from proxy.procs.process import free_port
from tests.helpers import LlamaServerFactory, ProcessServer, ProxyFactory, ProxyUnderTest, wait_until

MSGS = [{"role": "user", "content": "Tell me a short story about a lighthouse keeper."}]
ADMIN = {"authorization": "Bearer admin-secret"}


def admin(p: ProxyUnderTest, **body: Any) -> dict[str, Any]:
    r = httpx.post(f"{p.url}/admin/mirror", json=body, headers=ADMIN, timeout=10)
    assert r.status_code == 200, r.text
    doc: dict[str, Any] = r.json()
    return doc


@contextmanager
def fault_process(*args: str) -> Iterator[str]:
    """``python -m fakes.fault_engine`` as its own process; yields its base URL."""
    with ProcessServer("fakes.fault_engine", *args, ready_path="/health") as server:
        yield server.url


def engine(name: str, url: str, **kw: Any) -> EngineSettings:
    return EngineSettings(name=name, url=url, timeouts=Timeouts(connect=2, read=30), **kw)


def mirrored(primary: EngineSettings, *shadows: EngineSettings, **mirror: Any) -> Settings:
    return Settings(
        engines=(primary, *shadows),
        routes=(RouteSettings(models=("*",), primary=primary.name, shadows=tuple(s.name for s in shadows)),),
        admin_key="admin-secret",
        mirror=replace(MirrorSettings(), **mirror),
    )


@dataclass
class Timed:
    ttft_s: float
    total_s: float
    text: str


def timed_stream(p: ProxyUnderTest, *, max_tokens: int = 64, path: str = "/v1/chat/completions") -> Timed:
    """One streaming request on the proxy's kept-alive client: client-side time to the first content event and
    to the end of the stream."""
    body: dict[str, Any] = {"model": "m", "messages": MSGS, "stream": True, "max_tokens": max_tokens}
    t0 = time.perf_counter()
    ttft: float | None = None
    parts: list[str] = []
    with p.client.stream("POST", path, json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            doc = json.loads(line[6:])
            assert "error" not in doc, doc
            for c in doc.get("choices") or []:
                piece = c.get("delta", {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    parts.append(piece)
    assert ttft is not None
    return Timed(ttft_s=ttft, total_s=time.perf_counter() - t0, text="".join(parts))


def read_log(path: Path, kind: str = "pair") -> list[dict[str, Any]]:
    """The comparison log's records of one ``type`` (pair records by default; a run also writes run, engine and
    end records)."""
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("type", "pair") == kind]


# --------------------------------------------------------------------------------------------- isolation


def test_slow_refusing_and_hanging_shadows_leave_the_primary_alone(
    proxy_factory: ProxyFactory,
) -> None:
    n = 6
    with ExitStack() as stack:
        primary = stack.enter_context(fault_process("--tokens", "10", "--cadence-ms", "20", "--ttft-ms", "50"))
        # 10x slower in both TTFT and cadence: a copy takes 0.5 + 9 x 0.2 = 2.3 s, within mirror.timeout
        slow = stack.enter_context(fault_process("--tokens", "10", "--cadence-ms", "200", "--ttft-ms", "500"))
        hang = stack.enter_context(fault_process("--fault", "hang"))
        refused = f"http://127.0.0.1:{free_port()}"
        p = proxy_factory(
            mirrored(
                engine("primary", primary, kind="llamacpp"),
                engine("slow", slow, kind="llamacpp"),
                engine("refused", refused, kind="llamacpp"),
                engine("hang", hang, kind="llamacpp"),
                timeout=4.0,
            )
        )
        timed_stream(p)  # warm the connections on both sides of the proxy (mirrored too)
        assert admin(p, enabled=False)["enabled"] is False
        off = [timed_stream(p) for _ in range(n)]
        assert admin(p, enabled=True)["enabled"] is True
        on = [timed_stream(p) for _ in range(n)]

        # the copies really went out, and the primary still finished first every time
        for s in ("slow", "refused", "hang"):
            assert p.value("enginemeter_mirror_requests_total", engine=s, result="sent") == n + 1
            assert p.value("enginemeter_mirror_requests_total", engine=s, result="dropped_disabled") == n
        ttft_off = statistics.median(t.ttft_s for t in off)
        ttft_on = statistics.median(t.ttft_s for t in on)
        total_off = statistics.median(t.total_s for t in off)
        total_on = statistics.median(t.total_s for t in on)
        print(
            f"primary TTFT median off/on {ttft_off * 1e3:.1f}/{ttft_on * 1e3:.1f} ms, stream {total_off * 1e3:.0f}/{total_on * 1e3:.0f} ms"
        )
        # generous bounds (a shared 2-core machine); the precise overhead figure belongs to bench/
        assert ttft_on < ttft_off + 0.1, (ttft_off, ttft_on)
        assert total_on < total_off + 0.15, (total_off, total_on)
        assert max(t.total_s for t in on) < 0.5 + 9 * 0.2, "a primary stream waited for the slow shadow"
        assert {t.text for t in on} == {t.text for t in off}, "the client stream changed with mirroring on"

        # every copy ends in exactly one shadow Result: slow ones finish, refused ones fail fast, hanging
        # ones are cut by mirror.timeout; none of it shows on the primary's side
        wait_until(lambda: len(p.of("shadow")) == 3 * (n + 1), timeout=30)
        outcomes = {(r.engine, r.outcome) for r in p.of("shadow")}
        assert outcomes == {("slow", "ok"), ("refused", "connect_error"), ("hang", "timeout")}
        assert {r.outcome for r in p.of("primary")} == {"ok"}
        for s in ("slow", "refused", "hang"):
            assert p.value("enginemeter_in_flight_requests", engine=s, role="shadow") == 0
        # the slow shadow is timed like a primary: its TTFT/TPOT histograms fill, and the pairs are compared
        assert p.value("enginemeter_time_to_first_token_seconds_count", engine="slow", model="other", role="shadow", stream="true") == n + 1  # fmt: skip
        assert p.value("enginemeter_compared_pairs_total", primary="primary", shadow="slow") == n + 1
        ratio_sum = p.value("enginemeter_shadow_ratio_sum", primary="primary", shadow="slow", metric="tpot")
        assert ratio_sum / (n + 1) > 3, "the 10x slower shadow should show a TPOT ratio well above 1"


@contextmanager
def hanging_shadow(proxy_factory: ProxyFactory, timeout: float) -> Iterator[tuple[ProxyUnderTest, str]]:
    """A proxy mirroring a 4-token primary to an engine that sends its headers and then nothing ("h"), one copy
    in flight at most, cut off after ``timeout``; yields the proxy and the hanging engine's URL."""
    with (
        run_in_thread(FaultEngineConfig(knobs=Knobs(tokens=4))) as primary,
        run_in_thread(FaultEngineConfig(knobs=Knobs(hang=True))) as hang,
    ):
        settings = mirrored(
            engine("p", primary, kind="llamacpp"), engine("h", hang, kind="llamacpp"), max_in_flight=1, timeout=timeout
        )
        yield proxy_factory(settings), hang


def test_a_full_shadow_drops_copies_instead_of_queueing(proxy_factory: ProxyFactory) -> None:
    with hanging_shadow(proxy_factory, timeout=3.0) as (p, _):
        t0 = time.perf_counter()
        for _ in range(3):
            timed_stream(p)
        assert time.perf_counter() - t0 < 2.5, "requests waited for the hanging shadow"
        assert p.value("enginemeter_mirror_requests_total", engine="h", result="sent") == 1
        assert p.value("enginemeter_mirror_requests_total", engine="h", result="dropped_full") == 2
        assert p.value("enginemeter_in_flight_requests", engine="h", role="shadow") == 1
        # the timeout frees the slot; the next copy goes out again
        wait_until(lambda: p.value("enginemeter_in_flight_requests", engine="h", role="shadow") == 0, timeout=10)
        (r,) = p.of("shadow")
        assert r.outcome == "timeout"
        assert 2.5 < (r.timing.e2e_s or 0) < 6
        timed_stream(p)
        assert p.value("enginemeter_mirror_requests_total", engine="h", result="sent") == 2
        state = httpx.get(f"{p.url}/admin/mirror", headers=ADMIN).json()
        assert state["dropped"]["dropped_full"] == 2
        assert state["in_flight"]["h"] == 1


def test_a_shadow_cut_off_before_its_first_event_frees_its_connection(proxy_factory: ProxyFactory) -> None:
    """mirror.timeout while the shadow engine is still prefilling (headers sent, no event yet): the engine sees
    its connection close, and the shadow's pool slot (max_in_flight 1) is free for the next copy."""
    with hanging_shadow(proxy_factory, timeout=0.5) as (p, hang):

        def ended(n: int) -> bool:
            return len(p.of("shadow")) == n

        def cancelled(n: int) -> dict[str, Any] | None:
            st: dict[str, Any] = httpx.get(f"{hang}/_fake/stats").json()
            return st if st["cancelled"] == n else None

        for n in (1, 2):
            timed_stream(p)
            wait_until(functools.partial(ended, n), timeout=10, message=f"shadow copy {n} to end")
            assert p.of("shadow")[-1].outcome == "timeout"
            stats = wait_until(functools.partial(cancelled, n), timeout=5, message=f"the engine to see copy {n} close")
            assert stats is not None
            assert stats["requests"] == n  # the second copy got the pool's one slot: the first gave it back
        assert p.value("enginemeter_in_flight_requests", engine="h", role="shadow") == 0


def test_the_client_hanging_up_does_not_cancel_the_shadow(proxy_factory: ProxyFactory, tmp_path: Path) -> None:
    log = tmp_path / "pairs.jsonl"
    with (
        run_in_thread(FaultEngineConfig(knobs=Knobs(tokens=40, cadence_ms=25))) as primary,
        run_in_thread(FaultEngineConfig(knobs=Knobs(tokens=40, cadence_ms=10, ttft_ms=300))) as shadow,
    ):
        p = proxy_factory(
            mirrored(engine("p", primary, kind="llamacpp"), engine("s", shadow, kind="llamacpp"), log_path=str(log))
        )
        body = {"model": "m", "messages": MSGS, "stream": True, "max_tokens": 40}
        with httpx.stream("POST", f"{p.url}/v1/chat/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if '"content":"' in line:
                    break  # first token seen: hang up
        wait_until(lambda: len(p.of("primary")) == 1 and len(p.of("shadow")) == 1, timeout=15)
        assert p.of("primary")[0].outcome == "client_disconnect"
        (s,) = p.of("shadow")
        assert s.outcome == "ok"
        assert s.usage is not None and s.usage.completion_tokens == 40
        wait_until(lambda: len(read_log(log)) == 1, timeout=10)
        (rec,) = read_log(log)
        assert rec["primary"]["outcome"] == "client_disconnect"
        assert rec["shadow"]["outcome"] == "ok"
        assert rec["comparable"] is False
        assert rec["mismatch"] == {
            "prompt_tokens": None,
            "completion_tokens": None,
            "finish_reason": None,
            "output": None,
        }
        assert p.value("enginemeter_compared_pairs_total", primary="p", shadow="s") == 0


# ------------------------------------------------------------------------------------------------- admin


def test_admin_switches_mirroring_at_run_time(proxy_factory: ProxyFactory) -> None:
    with (
        run_in_thread(FaultEngineConfig(knobs=Knobs(tokens=2))) as primary,
        run_in_thread(FaultEngineConfig(knobs=Knobs(tokens=2))) as shadow,
    ):
        p = proxy_factory(mirrored(engine("p", primary, kind="llamacpp"), engine("s", shadow, kind="llamacpp")))

        def sent() -> float:
            return p.value("enginemeter_mirror_requests_total", engine="s", result="sent")

        # auth: no key / wrong key -> 401, marked as the proxy's
        for headers in ({}, {"authorization": "Bearer nope"}):
            r = httpx.get(f"{p.url}/admin/mirror", headers=headers)
            assert r.status_code == 401
            assert r.json()["error"]["enginemeter"] is True
        state = httpx.get(f"{p.url}/admin/mirror", headers=ADMIN).json()
        assert state["enabled"] is True
        assert state["routes"] == [{"route": 0, "models": ["*"], "shadows": ["s"], "sample_rate": 1.0}]

        timed_stream(p, max_tokens=2)
        assert sent() == 1
        admin(p, enabled=False)
        timed_stream(p, max_tokens=2)
        assert sent() == 1
        assert p.value("enginemeter_mirror_requests_total", engine="s", result="dropped_disabled") == 1
        state = admin(p, enabled=True, sample_rate=0.0)
        assert state["routes"][0]["sample_rate"] == 0.0
        timed_stream(p, max_tokens=2)
        assert sent() == 1
        assert p.value("enginemeter_mirror_requests_total", engine="s", result="dropped_sampled") == 1
        admin(p, sample_rate=1.0, route=0)
        timed_stream(p, max_tokens=2)
        assert sent() == 2

        health = httpx.get(f"{p.url}/health").json()
        assert health["mirror"]["enabled"] is True
        assert health["mirror"]["sent"] == 2
        assert health["mirror"]["dropped"]["dropped_sampled"] == 1

        # bad input: a 400 from the proxy, state unchanged
        for bad in ({"sample_rate": 2}, {"sample_rate": 0.5, "route": 7}, {"enabled": "yes"}, {"rate": 1}, [1]):
            r = httpx.post(f"{p.url}/admin/mirror", json=bad, headers=ADMIN)
            assert r.status_code == 400, bad
            assert r.json()["error"]["enginemeter"] is True
        r = httpx.post(f"{p.url}/admin/mirror", content=b"{oops", headers=ADMIN)
        assert r.status_code == 400
        assert httpx.get(f"{p.url}/admin/mirror", headers=ADMIN).json()["routes"][0]["sample_rate"] == 1.0


def test_admin_endpoints_are_off_without_an_admin_key(proxy_factory: ProxyFactory) -> None:
    with run_in_thread(FaultEngineConfig(knobs=Knobs(tokens=2))) as primary:
        p = proxy_factory(replace(mirrored(engine("p", primary, kind="llamacpp")), admin_key=None))
        for method in ("GET", "POST"):
            r = httpx.request(method, f"{p.url}/admin/mirror", json={"enabled": False}, headers=ADMIN)
            assert r.status_code == 404
            assert r.json()["error"]["enginemeter"] is True


def test_sampling_mirrors_about_the_configured_fraction(proxy_factory: ProxyFactory) -> None:
    with (
        run_in_thread(FaultEngineConfig(knobs=Knobs(tokens=1))) as primary,
        run_in_thread(FaultEngineConfig(knobs=Knobs(tokens=1))) as shadow,
    ):
        s = mirrored(engine("p", primary, kind="llamacpp"), engine("s", shadow, kind="llamacpp"))
        s = replace(s, routes=(replace(s.routes[0], sample_rate=0.3),))
        p = proxy_factory(s)
        n = 100
        for _ in range(n):
            r = p.client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1}, timeout=10)
            assert r.status_code == 200
        sent = p.value("enginemeter_mirror_requests_total", engine="s", result="sent")
        sampled_out = p.value("enginemeter_mirror_requests_total", engine="s", result="dropped_sampled")
        assert sent + sampled_out == n
        assert 10 <= sent <= 50, sent  # binomial(100, 0.3): sd 4.6


# ------------------------------------------------------------------------------------ real engines


def greedy_requests(url: str, model: str = "tiny") -> list[str]:
    """Chat and completions, stream and not, all greedy; returns the texts the client saw."""
    texts: list[str] = []
    for path, stream in (
        ("/v1/chat/completions", True),
        ("/v1/chat/completions", False),
        ("/v1/completions", True),
        ("/v1/completions", False),
    ):
        body: dict[str, Any] = {"model": model, "max_tokens": 24, "temperature": 0, "stream": stream}
        if "chat" in path:
            body["messages"] = MSGS
        else:
            body["prompt"] = "Once upon a time, in a lighthouse by the sea,"
        r = httpx.post(url + path, json=body, timeout=60)
        assert r.status_code == 200, r.text
        if stream:
            events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
            parts = [c.get("delta", {}).get("content") or c.get("text") or "" for e in events for c in e["choices"]]
            texts.append("".join(parts))
        else:
            c0 = r.json()["choices"][0]
            texts.append(c0["message"]["content"] if "message" in c0 else c0["text"])
    return texts


def test_same_model_with_different_slots_greedy_outputs_match(
    proxy_factory: ProxyFactory, llama_server_factory: LlamaServerFactory, tmp_path: Path
) -> None:
    a = llama_server_factory(np=1)
    b = llama_server_factory(np=2)
    log = tmp_path / "pairs.jsonl"
    p = proxy_factory(mirrored(engine("np1", a.url), engine("np2", b.url), log_path=str(log), record_text=True))
    texts = greedy_requests(p.url)
    assert all(texts)
    wait_until(lambda: p.value("enginemeter_compared_pairs_total", primary="np1", shadow="np2") == 4, timeout=30)
    for name in (
        "enginemeter_token_count_mismatches_total",
        "enginemeter_output_mismatches_total",
        "enginemeter_finish_reason_mismatches_total",
    ):
        assert p.total(name) == 0, name
    assert p.value("enginemeter_shadow_ratio_count", primary="np1", shadow="np2", metric="ttft") == 2  # streams
    wait_until(lambda: len(read_log(log)) == 4, timeout=10)
    records = read_log(log)
    for rec, client_text in zip(records, texts, strict=True):
        assert rec["greedy"] is True and rec["comparable"] is True
        assert rec["mismatch"] == {
            "prompt_tokens": False,
            "completion_tokens": False,
            "finish_reason": False,
            "output": False,
        }
        assert rec["first_diff_pos"] is None
        assert rec["primary"]["text"] == rec["shadow"]["text"] == client_text  # record_text: true
        assert rec["primary"]["completion_tokens"] == rec["shadow"]["completion_tokens"] == 24
        assert rec["primary"]["kind"] == rec["shadow"]["kind"] == "llamacpp"
        assert rec["shadow"]["cached_tokens"] is not None  # llama.cpp reports cache_n / cached_tokens
        assert rec["shadow"]["engine_decode_tps"] is not None
        assert "prompt" in rec


def test_different_tokenizers_count_a_prompt_token_mismatch(
    proxy_factory: ProxyFactory,
    llama_server_factory: LlamaServerFactory,
    tiny_model: Path,
    tiny_model_spm: Path,
    tmp_path: Path,
) -> None:
    qwen = llama_server_factory(model=tiny_model)
    spm = llama_server_factory(model=tiny_model_spm)
    log = tmp_path / "pairs.jsonl"
    p = proxy_factory(mirrored(engine("qwen", qwen.url), engine("spm", spm.url), log_path=str(log)))
    greedy_requests(p.url)
    labels = {"primary": "qwen", "shadow": "spm"}
    wait_until(lambda: p.value("enginemeter_compared_pairs_total", **labels) == 4, timeout=30)
    assert p.value("enginemeter_token_count_mismatches_total", kind="prompt", **labels) == 4
    assert p.value("enginemeter_token_count_mismatches_total", kind="completion", **labels) == 0
    assert p.value("enginemeter_token_count_delta_count", kind="prompt", **labels) == 4
    wait_until(lambda: len(read_log(log)) == 4, timeout=10)
    for rec in read_log(log):
        assert rec["mismatch"]["prompt_tokens"] is True
        assert rec["delta"]["prompt_tokens"] == rec["shadow"]["prompt_tokens"] - rec["primary"]["prompt_tokens"] != 0
        assert "prompt" not in rec and "text" not in rec["primary"]  # record_text is off by default


def test_sglang_emulator_as_shadow(proxy_factory: ProxyFactory, llama_server: LlamaServer) -> None:
    with run_emulator(EmulatorConfig(backend=llama_server.url, served_model_name="tiny-sglang")) as sglang:
        p = proxy_factory(mirrored(engine("llama", llama_server.url), engine("sglang", sglang)))
        greedy_requests(p.url)
        labels = {"primary": "llama", "shadow": "sglang"}
        wait_until(lambda: p.value("enginemeter_compared_pairs_total", **labels) == 4, timeout=30)
        shadows = p.of("shadow", "sglang")
        assert len(shadows) == 4
        assert {r.engine_kind for r in shadows} == {"sglang"}
        assert {r.outcome for r in shadows} == {"ok"}
        for r in shadows:
            assert r.usage is not None and r.usage.completion_tokens == 24
            if r.stream:
                # TTFT at the first content event, not SGLang's role chunk with content ""
                assert r.timing.ttft_s is not None and r.n_token_events == 24
        # same weights behind both: the greedy texts and token counts agree
        assert p.total("enginemeter_output_mismatches_total") == 0
        assert p.total("enginemeter_token_count_mismatches_total", kind="completion") == 0
        assert p.total("enginemeter_finish_reason_mismatches_total") == 0


# ------------------------------------------------------------------------------------------------ pairing


def test_the_pair_takes_the_primary_that_served_after_a_fallback(proxy_factory: ProxyFactory) -> None:
    with (
        run_in_thread(FaultEngineConfig(model="a", knobs=Knobs(tokens=3))) as a,
        run_in_thread(FaultEngineConfig(model="s", knobs=Knobs(tokens=3))) as s,
    ):
        dead = f"http://127.0.0.1:{free_port()}"
        settings = mirrored(engine("dead", dead, kind="llamacpp"), engine("s", s, kind="llamacpp"))
        settings = replace(
            settings,
            engines=(*settings.engines, engine("a", a, kind="llamacpp")),
            routes=(replace(settings.routes[0], fallback=("a",)),),
        )
        p = proxy_factory(settings)
        r = httpx.post(f"{p.url}/v1/chat/completions", json={"model": "m", "messages": MSGS, "max_tokens": 3})
        assert r.status_code == 200 and r.headers["x-enginemeter-engine"] == "a"
        wait_until(lambda: p.value("enginemeter_compared_pairs_total", primary="a", shadow="s") == 1, timeout=10)
        assert p.total("enginemeter_compared_pairs_total", primary="dead") == 0
        assert [(x.engine, x.outcome) for x in p.of("primary")] == [("dead", "connect_error"), ("a", "ok")]


def test_a_lost_half_expires_as_unpaired() -> None:
    from proxy.server.app import make_engines
    from proxy.server.mirror.shadows import PAIR_GRACE_S, Mirror
    from proxy.server.record.metrics import Metrics
    from proxy.server.request.attempts import Attempts
    from proxy.server.request.routing import Router

    async def main() -> None:
        refused = f"http://127.0.0.1:{free_port()}"
        settings = mirrored(engine("p", refused, kind="llamacpp"), engine("s", refused, kind="llamacpp"))
        registry = CollectorRegistry()
        metrics = Metrics(registry)
        engines = make_engines(settings)
        attempts = Attempts(settings, engines, metrics)
        m = Mirror(settings, engines, attempts, metrics)
        attempts.observers.append(m.on_result)
        shadow_done = asyncio.Event()
        attempts.observers.append(lambda r: shadow_done.set() if r.role == "shadow" else None)
        async with m.lifespan():
            decision = Router(settings).decide("m", {}, None)
            # the primary is never run here: its half is lost
            assert m.submit(decision, {"model": "m", "messages": MSGS}, "chat", "r1")
            await asyncio.wait_for(shadow_done.wait(), timeout=10)
            assert m.state()["pending_pairs"] == 1
            m.sweep(time.monotonic() + m.timeout + PAIR_GRACE_S - 5)
            assert m.state()["pending_pairs"] == 1, "expired too early"
            m.sweep(time.monotonic() + m.timeout + PAIR_GRACE_S + 1)
            assert m.state()["pending_pairs"] == 0
            assert m.state()["unpaired"] == 1
            assert (
                registry.get_sample_value("enginemeter_mirror_requests_total", {"engine": "s", "result": "unpaired"})
                == 1
            )
        await asyncio.gather(*(e.aclose() for e in engines.values()))

    asyncio.run(main())


def test_quick_flags_mirror_every_request(proxy_factory: ProxyFactory) -> None:
    from proxy.config.configfile import load

    with (
        run_in_thread(FaultEngineConfig(knobs=Knobs(tokens=2))) as primary,
        run_in_thread(FaultEngineConfig(knobs=Knobs(tokens=2))) as shadow,
    ):
        p = proxy_factory(load(primary=primary, shadow=shadow, env={}))
        for _ in range(5):
            timed_stream(p, max_tokens=2)
        assert p.value("enginemeter_mirror_requests_total", engine="engine2", result="sent") == 5
        wait_until(lambda: p.value("enginemeter_compared_pairs_total", primary="engine1", shadow="engine2") == 5)


# --------------------------------------------------------------------------------- opt-out, runs, records


def test_a_request_that_says_mirror_off_is_served_and_never_copied(proxy_factory: ProxyFactory, tmp_path: Path) -> None:
    log = tmp_path / "pairs.jsonl"
    with (
        run_in_thread(FaultEngineConfig(knobs=Knobs(tokens=3))) as primary,
        run_in_thread(FaultEngineConfig(knobs=Knobs(tokens=3))) as shadow,
    ):
        p = proxy_factory(
            mirrored(engine("p", primary, kind="llamacpp"), engine("s", shadow, kind="llamacpp"), log_path=str(log))
        )
        body = {"model": "m", "messages": MSGS, "max_tokens": 3}
        for value in ("off", "OFF"):
            r = p.client.post("/v1/chat/completions", json=body, headers={"x-enginemeter-mirror": value})
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
        bad = p.client.post("/v1/chat/completions", json=body, headers={"x-enginemeter-mirror": "sometimes"})
        assert bad.status_code == 400
        err = bad.json()["error"]
        assert err["param"] == "x-enginemeter-mirror" and err["enginemeter"] is True
        assert (
            p.client.post("/v1/chat/completions", json=body, headers={"x-enginemeter-mirror": "on"}).status_code == 200
        )
        wait_until(lambda: p.value("enginemeter_compared_pairs_total", primary="p", shadow="s") == 1)
        assert p.value("enginemeter_mirror_requests_total", engine="s", result="dropped_header") == 2
        assert p.value("enginemeter_mirror_requests_total", engine="s", result="sent") == 1
        assert httpx.get(f"{shadow}/_fake/stats", timeout=5).json()["requests"] == 1  # the one copy, nothing else
        assert httpx.get(f"{primary}/_fake/stats", timeout=5).json()["requests"] == 3
        mirror = p.gateway.mirror
        assert mirror is not None and mirror.log is not None and mirror.log.flush()
        assert len(read_log(log)) == 1


def test_a_run_writes_its_id_on_every_record_between_its_run_and_end_records(tmp_path: Path) -> None:
    from proxy.server.mirror.compare import new_run_id
    from tests.helpers import start_proxy

    log = tmp_path / "pairs.jsonl"
    run = new_run_id()
    knobs = Knobs(tokens=6, cadence_ms=30)
    with (
        run_in_thread(FaultEngineConfig(knobs=knobs)) as primary,
        run_in_thread(FaultEngineConfig(knobs=knobs)) as shadow,
    ):
        with ExitStack() as stack:
            settings = replace(
                mirrored(
                    engine("p", primary, kind="llamacpp"), engine("s", shadow, kind="llamacpp"), log_path=str(log)
                ),
                run_id=run,
            )
            p = start_proxy(stack, settings)
            body = {"model": "m", "messages": MSGS, "max_tokens": 6, "stream": True, "temperature": 0,
                    "top_k": 0, "stream_options": {"include_usage": True}}  # fmt: skip
            assert p.client.post("/v1/chat/completions", json=body).status_code == 200  # alone
            wait_until(lambda: p.value("enginemeter_compared_pairs_total", primary="p", shadow="s") == 1)
            with ThreadPoolExecutor(4) as pool:  # four at once: each overlapped the others
                codes = list(pool.map(lambda _: p.client.post("/v1/chat/completions", json=body).status_code, range(4)))
            assert codes == [200] * 4
            wait_until(lambda: p.value("enginemeter_compared_pairs_total", primary="p", shadow="s") == 5)
            state = httpx.get(f"{p.url}/health", timeout=5).json()["mirror"]
            assert state["run"] == run
            (live,) = state["live"]
            assert (live["primary"], live["shadow"]) == ("p", "s")
            assert {(x["regime"], x["metric"]) for x in live["streams"]} >= {("decode", "tpot_s"), ("load", "ttft_s")}
        # the proxy has stopped: the end record is written
    recs = [json.loads(x) for x in log.read_text().splitlines()]
    assert recs[0]["type"] == "run" and recs[-1]["type"] == "end"
    assert {r["run"] for r in recs} == {run}
    first = recs[0]
    assert first["pairs"] == [["p", "s"]] and first["listen"].startswith("http://127.0.0.1:")
    assert first["engines"]["s"]["kind"] == "llamacpp"
    pairs = [r for r in recs if r["type"] == "pair"]
    assert len(pairs) == 5 and recs[-1]["counts"]["sent"] == 5 and recs[-1]["compared"] == 5
    assert pairs[0]["concurrency"] == {"at_start": 1, "overlapping": 1}
    assert all(r["concurrency"]["overlapping"] >= 2 for r in pairs[1:])
    assert all(r["t_start"] < r["ts"] for r in pairs)
    for r in pairs:  # what each engine got, after the per-kind mapping (top_k 0 = off on llama.cpp)
        for side in ("primary", "shadow"):
            assert r[side]["sampling"]["params"]["temperature"] == 0 and r[side]["sampling"]["params"]["top_k"] == 0
            assert r[side]["sampling"]["dropped"] == [] and "top_p" in r[side]["sampling"]["defaulted"]


def test_a_pair_starts_when_its_primary_was_received_as_its_e2e_counts(tmp_path: Path) -> None:
    """The log's ``t_start`` is the wall time the primary was received, the start its ``e2e_s`` counts from: a body
    that arrives 0.6 s after its head does not move the pair 0.6 s late, so ``t_start + e2e_s`` is when the answer
    ended and a client's next request does not overlap its last one (``--traffic LOG`` sweeps these intervals)."""
    from tests.helpers import start_proxy

    log = tmp_path / "pairs.jsonl"
    body = json.dumps({"model": "m", "messages": MSGS, "max_tokens": 3}).encode()

    bodies: list[float] = []  # the wall time the body went out

    def late_body() -> Iterator[bytes]:
        time.sleep(0.6)  # the head is sent; the body (chunked) comes later
        bodies.append(time.time())
        yield body

    with (
        run_in_thread(FaultEngineConfig(knobs=Knobs(tokens=3))) as primary,
        run_in_thread(FaultEngineConfig(knobs=Knobs(tokens=3))) as shadow,
        ExitStack() as stack,
    ):
        p = start_proxy(stack, mirrored(engine("p", primary), engine("s", shadow), log_path=str(log)))
        sent = time.time()
        r = p.client.post("/v1/chat/completions", content=late_body(), headers={"content-type": "application/json"})
        ended = time.time()
        assert r.status_code == 200
        wait_until(lambda: p.value("enginemeter_compared_pairs_total", primary="p", shadow="s") == 1)
        assert p.gateway.mirror is not None and p.gateway.mirror.log is not None and p.gateway.mirror.log.flush()
    (pair,) = read_log(log)
    # The primary's clock started with the head, not with the body: counted from the body, e2e_s would be the few
    # ms the fake engine takes. Not a full 0.6 s: the sleep starts once the client has written the head, and the
    # server may parse that head a little later still (a loaded CI machine gave 0.59998), so 0.5 leaves room.
    assert pair["primary"]["e2e_s"] >= 0.5, pair["primary"]["e2e_s"]
    # t_start is the head's receipt: after the client sent it, and well before the body, which leaves 0.6 s after
    # `sent` at the earliest (0.5 leaves a loaded machine room to get the head to the server)
    assert sent <= pair["t_start"] < sent + 0.5, pair["t_start"] - sent
    # (t_start, t_start + e2e_s) spans the whole request: it ends after the body went out (a clock started at the
    # body would end a few ms after the head), and no later than the client got the answer
    assert bodies[0] < pair["t_start"] + pair["primary"]["e2e_s"] <= ended + 0.05, (bodies[0], ended)
