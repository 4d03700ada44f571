"""The shipped Grafana dashboard: every store panel's query runs against a store holding a run's rows and
returns rows; every metrics panel asks for metrics the services export; the datasources it names are
the ones provisioned. (Grafana cannot be installed on these machines; its queries can be run.)"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from tests.test_queries import filled  # noqa: F401  (the fixture: one episode group, a step, a trace, ...)

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = sorted((ROOT / "dashboards").glob("*.json"))


def panels():
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            yield path.name, panel


def test_the_dashboards_use_the_provisioned_datasources():
    provisioned = yaml.safe_load((ROOT / "dashboards/provisioning/datasources/crucible.yaml").read_text())
    uids = {d["uid"]: d["type"] for d in provisioned["datasources"]}
    assert DASHBOARDS
    for name, panel in panels():
        for target in [panel, *panel["targets"]]:
            ds = target["datasource"]
            assert uids.get(ds["uid"]) == ds["type"], (name, panel["title"])
    provider = yaml.safe_load((ROOT / "dashboards/provisioning/dashboards/crucible.yaml").read_text())
    assert provider["providers"][0]["options"]["path"].endswith("/crucible")


@pytest.mark.store
def test_every_store_panel_returns_rows_over_a_runs_data(filled):  # noqa: F811
    client, _, _ = filled
    ran = 0
    for name, panel in panels():
        for target in panel["targets"]:
            if "rawSql" not in target:
                continue
            result = client.query(target["rawSql"])
            assert result.result_rows, f"{name}: panel {panel['title']!r} returned no rows"
            ran += 1
    assert ran >= 8


def test_every_metrics_panel_asks_for_metrics_the_services_export():
    declared = set()
    for source in ROOT.glob("**/*.py"):
        if "tests" in source.parts or ".git" in source.parts:
            continue
        for kind, name in re.findall(r'metrics\.(counter|histogram|gauge)\(\s*"([^"]+)"', source.read_text()):
            base = name.replace(".", "_")
            declared |= {base + "_total"} if kind == "counter" else set()
            declared |= {base + s for s in ("_bucket", "_sum", "_count")} if kind == "histogram" else set()
            declared |= {base} if kind == "gauge" else set()
    asked = 0
    for name, panel in panels():
        for target in panel["targets"]:
            for metric in re.findall(r"\b(crucible_[a-z_]+)\b", target.get("expr", "")):
                assert metric in declared, f"{name}: panel {panel['title']!r} asks for {metric}, which nothing exports"
                asked += 1
    assert asked >= 4
