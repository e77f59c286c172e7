"""docs/metrics.md and /metrics agree: every documented metric is exported after traffic, and every exported
``enginemeter_*`` metric is documented. GPU metrics are absent (not zero) without an NVIDIA driver, so they are
only required when NVML works here."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from fakes.fault_engine import FaultEngineConfig, Knobs, run_in_thread
from proxy.config.configfile import load
from tests.helpers import ProxyFactory, wait_until

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def documented() -> dict[str, str]:
    """metric name -> the doc section it is listed under."""
    names: dict[str, str] = {}
    section = ""
    for line in DOC.read_text().splitlines():
        if line.startswith("#"):
            section = line.strip("# ").lower()
        m = re.match(r"\|\s*`(enginemeter_[a-z0-9_]+)`", line)
        if m:
            names[m.group(1)] = section
    return names


def nvml_works() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


def exported(text: str) -> set[str]:
    """Names as docs/metrics.md writes them: counters with ``_total``, histograms by their base name.

    Only families with at least one sample count: a labelled metric never used exports nothing."""
    return {
        f"{fam.name}_total" if fam.type == "counter" else fam.name
        for fam in text_string_to_metric_families(text)
        if fam.samples
    }


def test_every_documented_metric_is_exported_and_vice_versa(proxy_factory: ProxyFactory) -> None:
    docs = documented()
    assert len(docs) > 20
    # the primary runs into max_tokens (finish "length"), the shadow stops early ("stop"): every mismatch fires
    knobs = Knobs(tokens=20, cadence_ms=2, cached=3)
    with (
        run_in_thread(FaultEngineConfig(model="p", knobs=knobs)) as primary,
        run_in_thread(FaultEngineConfig(model="s", knobs=Knobs(tokens=5, cadence_ms=2))) as shadow,
    ):
        settings = load(primary=primary, shadow=shadow, env={})
        url = proxy_factory(settings).url
        body = {"model": "p", "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
        for stream in (True, False):
            r = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": stream, "mirostat": 1, "x": 1})
            assert r.status_code == 200
        # llama.cpp puts usage on the last text event of /v1/completions: stripping it re-serializes
        r = httpx.post(f"{url}/v1/completions", json={"model": "p", "prompt": "hi", "max_tokens": 8, "stream": True})
        assert r.status_code == 200
        httpx.post(f"{url}/v1/chat/completions", content=b"{bad")  # a rejected request
        assert httpx.post(f"{url}/tokenize", json={"content": "hi"}).status_code == 200  # a pass-through request

        def have_pairs() -> bool:
            # the pair's counter exists from start-up (primed at 0): wait for a compared pair
            text = httpx.get(f"{url}/metrics").text
            return any(
                s.value >= 1
                for fam in text_string_to_metric_families(text)
                if fam.name == "enginemeter_compared_pairs"
                for s in fam.samples
            )

        wait_until(have_pairs, timeout=15)
        text = httpx.get(f"{url}/metrics").text
    names = exported(text)
    gpu_ok = nvml_works()
    # the engine-diagnosis section needs a llama.cpp engine on this machine (tests/server/observe/test_livediagnosis.py
    # checks it), the rollout section a route with a rollout (tests/server/switch/test_rollout.py), the swap section a
    # route with a swap (tests/server/switch/test_swap_serve.py)
    missing = sorted(
        n
        for n, sec in docs.items()
        if n not in names
        and (gpu_ok or "gpu" not in sec)
        and not any(part in sec for part in ("diagnosis", "rollout", "swap"))
    )
    assert not missing, f"documented but not exported: {missing}"
    undocumented = sorted(n for n in names if n.startswith("enginemeter_") and n not in docs)
    assert not undocumented, f"exported but not in docs/metrics.md: {undocumented}"
