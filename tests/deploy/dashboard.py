"""Read the Grafana dashboard's PromQL so that tests can run it against a real Prometheus."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))

# What Grafana would put in place of its variables when every model and adapter is selected. A
# dashboard that grows a new variable fails `substitute` until it is added here.
VARIABLES = {
    "$__rate_interval": "1m",
    "$__interval": "15s",
    "$__range": "5m",
    "$model": ".*",
    "$adapter": ".*",
}
METRIC = re.compile(r"\b(tserve_[a-z0-9_]+)\b")
LABEL_VALUES = re.compile(r"^label_values\((?:(?P<selector>.+),\s*)?(?P<label>\w+)\)$")


@dataclass(frozen=True)
class Query:
    dashboard: str
    panel: str
    ref: str
    expr: str

    def __str__(self) -> str:
        return f"{self.dashboard} / {self.panel} / {self.ref}: {self.expr}"


def load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def panels(dashboard: dict) -> Iterator[dict]:
    """Every panel, including those nested in collapsed rows."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def queries(paths: list[Path] = DASHBOARDS) -> list[Query]:
    found = []
    for path in paths:
        dashboard = load(path)
        for panel in panels(dashboard):
            for target in panel.get("targets", []):
                found.append(Query(path.name, panel["title"], target["refId"], target["expr"]))
    return found


def variable_queries(paths: list[Path] = DASHBOARDS) -> list[tuple[str, str]]:
    """(variable name, query) of every query variable (Grafana's label_values(...) syntax)."""
    out = []
    for path in paths:
        for var in load(path).get("templating", {}).get("list", []):
            if var.get("type") == "query":
                query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
                out.append((var["name"], query))
    return out


def substitute(expr: str) -> str:
    """The PromQL Prometheus would receive from Grafana with every value of every variable selected."""
    for name in sorted(VARIABLES, key=len, reverse=True):
        expr = expr.replace("${" + name[1:] + "}", VARIABLES[name]).replace(name, VARIABLES[name])
    if "$" in expr:
        raise ValueError(f"unknown dashboard variable in {expr!r}: add it to tests/deploy/dashboard.py VARIABLES")
    return expr


def metric_names(expr: str) -> set[str]:
    return set(METRIC.findall(expr))
