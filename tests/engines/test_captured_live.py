"""The real proxy in front of the real engines' recorded answers (issue 11's H200 captures, served back on
127.0.0.1 by ``tests.captured.serve_answers``): what enginemeter's ``/health`` and ``/metrics`` say about llama.cpp,
SGLang 0.5.17 and vLLM 0.26.0.

On the H200 the proxy (before the engine dialects) called a healthy SGLang 0.5.17 down, ``"HTTP 404 from
/ready"``, and exported no slot count for it. Here the same answers, 404 on ``/ready`` and the 1-second
``/health`` included, must give ``up`` and 4096 slots.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.config.settings import CollectorSettings, EngineSettings, RouteSettings, Settings, Timeouts
from tests import captured
from tests.captured import GPU
from tests.helpers import ProxyFactory, wait_until


def _samples(text: str, name: str) -> dict[str, dict[str, str] | float]:
    """``name``'s samples by their ``engine`` label: the value, or for an ``_info`` metric the labels."""
    out: dict[str, dict[str, str] | float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out[s.labels["engine"]] = dict(s.labels) if name.endswith("_info") else s.value
    return out


@pytest.fixture
def replayed() -> Iterator[dict[str, str]]:
    """The three H200 captures served on 127.0.0.1, by engine kind (requested before ``proxy_factory``, so the
    proxy stops first and its poller never sees them gone)."""
    with contextlib.ExitStack() as stack:
        yield {
            kind: stack.enter_context(captured.serve_answers(captured.answers(folder), delays=True))
            for kind, folder in GPU.items()
        }


def test_proxy_health_and_slots_against_the_captured_engines(
    replayed: dict[str, str], proxy_factory: ProxyFactory
) -> None:
    s = Settings(
        engines=tuple(
            EngineSettings(name=kind, url=url, timeouts=Timeouts(connect=2, read=10)) for kind, url in replayed.items()
        ),
        routes=(RouteSettings(models=("*",), primary="llamacpp", shadows=("sglang", "vllm")),),
        collectors=CollectorSettings(gpu=False, engine_interval=0.2),
    )
    p = proxy_factory(s)
    assert p.gateway.engine_state is not None
    poller = p.gateway.engine_state
    wait_until(lambda: all(st.up for st in poller.states.values()) and len(poller.states) == 3, timeout=20)

    health = p.client.get("/health").json()
    by_name = {e["name"]: e for e in health["engines"]}
    assert {n: (e["kind"], e["up"], e.get("error")) for n, e in by_name.items()} == {
        "llamacpp": ("llamacpp", True, None),
        "sglang": ("sglang", True, None),  # on the H200: False, "HTTP 404 from /ready"
        "vllm": ("vllm", True, None),
    }
    assert health["status"] == "ok"
    assert {e["model"] for e in health["engines"]} == {"m7b"}

    text = p.client.get("/metrics").text
    assert _samples(text, "enginemeter_engine_up") == {"llamacpp": 1.0, "sglang": 1.0, "vllm": 1.0}
    # SGLang 0.5.17: internal_states[0].effective_max_running_requests_per_dp; vLLM reports none
    assert _samples(text, "enginemeter_engine_slots") == {"llamacpp": 64.0, "sglang": 4096.0}
    assert _samples(text, "enginemeter_engine_context_length") == {"llamacpp": 8192.0, "sglang": 8192.0, "vllm": 8192.0}
    info = _samples(text, "enginemeter_engine_info")
    assert {n: (i["kind"], i["build"]) for n, i in info.items() if isinstance(i, dict)} == {
        "llamacpp": ("llamacpp", "b0-unknown"),
        "sglang": ("sglang", "0.5.17"),
        "vllm": ("vllm", "0.26.0"),
    }
    sglang_info = info["sglang"]
    assert isinstance(sglang_info, dict) and re.fullmatch(r"(?i)float16|f16", sglang_info["quantization"])
