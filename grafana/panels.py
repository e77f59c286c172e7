"""The dashboards' building blocks (``grafana/generate.py`` composes them): PromQL helpers (``q()`` for a quantile of a
histogram, ``rate()``, ``pair_ratio()``), panel and row builders, the grid layout, the template variables and the
dashboard envelope. Plain dicts, no Grafana library (``generate.py`` says why)."""

from __future__ import annotations

from typing import Any

Json = dict[str, Any]

DS: Json = {"type": "prometheus", "uid": "${datasource}"}
RI = "$__rate_interval"
#: request-level series carry engine, model, role, stream
SEL = 'engine=~"$engine", model=~"$model"'
ENG = 'engine=~"$engine"'
TOKS = "suffix: tok/s"
#: outcomes that are the engine's or the proxy's fault (a client going away or sending junk is not)
FAILED = SEL + ', outcome!~"ok|client_disconnect|rejected"'
RATIO = "suffix: ×"
LENGTH = SEL + ', reason="length"'


# ------------------------------------------------------------------------------------------- PromQL helpers


def q(quantile: float, hist: str, by: str = "engine, role", sel: str = SEL, window: str = RI) -> str:
    """Quantile of a histogram over the window, per ``by`` group (summed over replicas and streams)."""
    return f"histogram_quantile({quantile}, sum by (le, {by}) (rate({hist}_bucket{{{sel}}}[{window}])))"


def mean(hist: str, by: str = "engine, role", sel: str = SEL) -> str:
    # `> 0` drops idle groups instead of drawing NaN
    return f"sum by ({by}) (rate({hist}_sum{{{sel}}}[{RI}])) / (sum by ({by}) (rate({hist}_count{{{sel}}}[{RI}])) > 0)"


def rate(counter: str, by: str = "engine, role", sel: str = SEL) -> str:
    return f"sum by ({by}) (rate({counter}{{{sel}}}[{RI}]))"


def pair_ratio(counter: str, by: str = "primary, shadow", window: str = RI) -> str:
    """Share of compared pairs with a mismatch; 0 (not "no data") while pairs exist and none mismatched."""
    pairs = f"sum by (primary, shadow) (rate(enginemeter_compared_pairs_total[{window}]))"
    bad = f"sum by ({by}) (rate({counter}[{window}]))"
    if by == "primary, shadow":
        return f"({bad} or {pairs} * 0) / ({pairs} > 0)"
    return f"{bad} / on (primary, shadow) group_left () ({pairs} > 0)"


# ------------------------------------------------------------------------------------------- panel builders


def target(expr: str, legend: str = "", *, instant: bool = False, fmt: str = "time_series") -> Json:
    return {
        "datasource": DS,
        "expr": expr,
        "legendFormat": legend or "__auto",
        "range": not instant,
        "instant": instant,
        "format": fmt,
    }


def panel(
    title: str,
    description: str,
    targets: list[Json],
    unit: str,
    *,
    kind: str = "timeseries",
    w: int = 8,
    h: int = 8,
    min_: float | None = None,
    max_: float | None = None,
    thresholds: list[tuple[float | None, str]] | None = None,
    options: Json | None = None,
    transformations: list[Json] | None = None,
) -> Json:
    for i, t in enumerate(targets):
        t["refId"] = chr(ord("A") + i)
    defaults: Json = {"unit": unit}
    if min_ is not None:
        defaults["min"] = min_
    if max_ is not None:
        defaults["max"] = max_
    steps = thresholds or [(None, "green")]
    defaults["thresholds"] = {"mode": "absolute", "steps": [{"color": c, "value": v} for v, c in steps]}
    if kind == "timeseries":
        defaults["custom"] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "spanNulls": False}
        opts: Json = {
            "legend": {
                "displayMode": "table",
                "placement": "bottom",
                "calcs": ["lastNotNull", "max"],
                "showLegend": True,
            },
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    elif kind == "stat":
        defaults["color"] = {"mode": "thresholds"}
        opts = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}, "colorMode": "background",
                "graphMode": "area", "textMode": "value_and_name", "justifyMode": "auto", "orientation": "auto"}  # fmt: skip
    else:
        opts = {"showHeader": True, "cellHeight": "sm", "footer": {"show": False, "reducer": ["sum"]}}
    if options:
        opts.update(options)
    p: Json = {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": opts,
        "targets": targets,
        "_size": (w, h),
    }
    if transformations:
        p["transformations"] = transformations
    return p


def row(title: str, repeat: str | None = None) -> Json:
    r: Json = {"type": "row", "title": title, "collapsed": False, "panels": [], "_size": (24, 1)}
    if repeat:
        # one copy of the row (and the panels up to the next row) per selected value of the variable
        r["repeat"] = repeat
    return r


def heatmap(title: str, description: str, hist: str, unit: str, sel: str = SEL) -> Json:
    """Distribution over time of a histogram's observations: the buckets' rates per `le`, as Grafana cells."""
    t = target(f"sum by (le) (rate({hist}_bucket{{{sel}}}[{RI}]))", "{{le}}", fmt="heatmap")
    p = panel(title, description, [t], unit)
    p["type"] = "heatmap"
    p["fieldConfig"]["defaults"] = {
        "unit": unit,
        "custom": {"hideFrom": {"legend": False, "tooltip": False, "viz": False},
                   "scaleDistribution": {"type": "linear"}},
    }  # fmt: skip
    p["options"] = {
        "calculate": False,
        "cellGap": 1,
        "color": {"mode": "scheme", "scheme": "Spectral", "reverse": True, "scale": "exponential", "exponent": 0.5,
                  "steps": 64, "fill": "dark-orange"},
        "filterValues": {"le": 1e-9},  # hide empty cells
        "rowsFrame": {"layout": "auto"},
        "yAxis": {"axisPlacement": "left", "unit": unit, "reverse": False},
        "cellValues": {"unit": "short"},  # observations per second in the bucket
        "tooltip": {"mode": "single", "yHistogram": True, "showColorScale": True},
        "legend": {"show": True},
        "exemplars": {"color": "rgba(255,0,255,0.7)"},
    }  # fmt: skip
    return p


def layout(items: list[Json]) -> list[Json]:
    """Left-to-right, top-to-bottom packing on Grafana's 24-column grid; ids in order."""
    x = y = row_h = 0
    out = []
    for i, p in enumerate(items, start=1):
        w, h = p.pop("_size")
        if p["type"] == "row" or x + w > 24:
            x, y, row_h = 0, y + row_h, 0
        p["gridPos"] = {"h": h, "w": w, "x": x, "y": y}
        p["id"] = i
        x += w
        row_h = max(row_h, h)
        if p["type"] == "row":
            x, y, row_h = 0, y + h, 0
        out.append(p)
    return out


def datasource_var() -> Json:
    return {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
            "current": {}, "hide": 0, "refresh": 1, "regex": "", "options": []}  # fmt: skip


def query_var(name: str, label: str, query: str) -> Json:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DS,
        "definition": query,
        "query": {"query": query, "refId": f"{name}-var"},
        "refresh": 2,  # on time-range change: replicas and engines come and go
        "includeAll": True,
        "multi": True,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
        "hide": 0,
        "regex": "",
        "options": [],
    }


def dashboard(uid: str, title: str, description: str, variables: list[Json], items: list[Json]) -> Json:
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["enginemeter", "llm"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "weekStart": "",
        "links": [
            {
                "title": "enginemeter",
                "type": "dashboards",
                "tags": ["enginemeter"],
                "asDropdown": True,
                "includeVars": True,
                "keepTime": True,
            }
        ],
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "templating": {"list": variables},
        "panels": layout(items),
    }
