"""One truth on every screen: the same headline in the console's last lines, report.md's first screen, the HTML
and verdict.json; no decision from fewer pairs than the live verdict needs; the answer on the first screen of the
HTML as a browser draws it (headless Chromium)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from proxy.cli import main
from proxy.config.settings import EngineSettings, MirrorSettings, RouteSettings, Settings, Timeouts
from proxy.server.mirror.compare import new_run_id
from tests.helpers import REPO, LlamaServerFactory, start_proxy, wait_until


def _eng(name: str, url: str) -> EngineSettings:
    return EngineSettings(name=name, url=url, kind="llamacpp", timeouts=Timeouts(connect=2, read=60))


def test_three_mirrored_pairs_are_not_yet_everywhere(
    llama_server_factory: LlamaServerFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The demo's own case: np1 serving, np2 mirrored, three requests, then the banner's report command. The live
    verdict needs 30 pairs in a regime: "not yet" in the console, report.md, the HTML and verdict.json alike —
    never a stay or a switch from three pairs."""
    np1, np2 = llama_server_factory(np=1), llama_server_factory(np=2, ctx_size=4096)
    log = tmp_path / "cmp.jsonl"
    s = Settings(engines=(_eng("np1", np1.url), _eng("np2", np2.url)),
                 routes=(RouteSettings(primary="np1", shadows=("np2",)),), admin_key="k",
                 mirror=MirrorSettings(log_path=str(log)), run_id=new_run_id())  # fmt: skip
    with ExitStack() as stack:
        p = start_proxy(stack, s)
        for _ in range(3):
            r = httpx.post(f"{p.url}/v1/chat/completions", timeout=60, json={
                "model": "tiny", "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "hello"}]})  # fmt: skip
            assert r.status_code == 200
        wait_until(lambda: p.value("enginemeter_compared_pairs_total", primary="np1", shadow="np2") >= 3, timeout=60)
        assert p.gateway.mirror is not None and p.gateway.mirror.log is not None and p.gateway.mirror.log.flush()
    out = tmp_path / "rep"
    capsys.readouterr()
    main(["report", "--log", str(log), "--out", str(out)])
    printed = capsys.readouterr().out
    vj = json.loads((out / "verdict.json").read_text())
    assert vj["decision"] == "not yet" and vj["headline"]["decision"] == "not yet", vj["headline"]
    assert all(v["decision"] == "not yet" for v in vj["verdicts"])
    assert "nothing is decided before 30" in vj["headline"]["sentence"]
    last = [line for line in printed.splitlines() if line.strip()]
    assert any(line.startswith("NOT YET: ") for line in last[-8:]) and "STAY" not in printed and "SWITCH" not in printed
    md = (out / "report.md").read_text()
    first = md[: md.index("## Verdict")]
    assert "**NOT YET**" in first and "STAY" not in md and "SWITCH" not in md
    html = (out / "report.html").read_text()
    assert "<strong>NOT YET</strong>" in html and "STAY" not in html


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(chromium() is None, reason="chromium is not installed (scripts/install-report-tools.sh)")
@pytest.mark.parametrize("report", ["docs/sample-report", "docs/gpu-results/h200-2026-12-03-27b/report"])
def test_the_answer_is_on_the_first_screen_of_the_html(report: str, tmp_path: Path) -> None:
    """The committed reports, drawn by a real browser at 1280 x 800: the answer — the table, then the decision's
    sentence — ends above the fold; a screenshot is taken too (kept in tmp_path)."""
    page = (REPO / report / "report.html").read_text()
    # the decision's paragraph: the first after the heading (below the answer's tables)
    probe = ("<script>const p = document.querySelector('#the-answer ~ p').getBoundingClientRect();"
             "document.body.setAttribute('data-answer-bottom', String(Math.round(p.bottom)));</script></body>")  # fmt: skip
    copy = tmp_path / "report.html"
    copy.write_text(page.replace("</body>", probe))
    browser = chromium()
    assert browser is not None
    base = [browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1280,800",
            f"--user-data-dir={tempfile.mkdtemp(dir=tmp_path)}"]  # fmt: skip
    env = {**os.environ, "HOME": str(tmp_path)}
    dom = subprocess.run([*base, "--dump-dom", copy.as_uri()], capture_output=True, text=True, timeout=120, env=env)
    assert dom.returncode == 0, dom.stderr[-2000:]
    bottom = dom.stdout.split('data-answer-bottom="', 1)[1].split('"', 1)[0]
    assert 0 < int(bottom) <= 800, f"the answer ends {bottom} px down, below the first screen"
    shot = subprocess.run([*base, f"--screenshot={tmp_path / 'first-screen.png'}", copy.as_uri()],
                          capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert shot.returncode == 0 and (tmp_path / "first-screen.png").stat().st_size > 10_000
