"""infra/deploy/prometheus and infra/deploy/grafana: the alert rules pass promtool's checks and
its unit tests (tests/infra/deploy/alerts_test.yml: each condition fires when it should and not
before), the dashboard's queries are PromQL promtool parses, and every metric either of them
uses is one the API exports (worker/fleet_metrics.py) or a rule records."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO
from tests.prometheus_text import samples
from tests.worker.test_fleet_metrics import NOW, a_fleet, a_twin
from worker.fleet_metrics import exposition

RULES = REPO / "infra" / "deploy" / "prometheus" / "forgeline-rules.yml"
DASHBOARD = REPO / "infra" / "deploy" / "grafana" / "forgeline-fleet.json"
ALERT_TESTS = Path(__file__).with_name("alerts_test.yml")
# A metric name, or a recording rule's (level:metric:operations).
METRIC = re.compile(r"\bforgeline_[a-z_]+(?::[a-z_]+)*")


def _rules() -> list[dict]:
    return [
        rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
    ]


def _dashboard_queries() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [target["expr"] for panel in panels for target in panel["targets"]]


def _promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool is missing: apt-get install prometheus (CI's .ci/run installs it)")
    return found


def _promtool_run(*args: str | Path) -> None:
    done = subprocess.run([_promtool(), *map(str, args)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_rules_pass_promtool_and_their_unit_tests() -> None:
    _promtool_run("check", "rules", RULES)
    _promtool_run("test", "rules", ALERT_TESTS)


def test_the_dashboard_queries_are_promql(tmp_path: Path) -> None:
    """promtool parses a recording rule's expression as Prometheus would: one per query."""
    rules = [{"record": f"dashboard:query_{i}:check", "expr": q}
             for i, q in enumerate(_dashboard_queries())]  # fmt: skip
    checked = tmp_path / "dashboard-queries.yml"
    checked.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    _promtool_run("check", "rules", checked)


def test_every_metric_the_alerts_and_the_dashboard_use_is_exported() -> None:
    exported = {name for name, _ in samples(exposition(*a_fleet(), NOW, a_twin()).decode())}
    recorded = {rule["record"] for rule in _rules() if "record" in rule}
    used = {m for rule in _rules() for m in METRIC.findall(rule["expr"])}
    used |= {m for query in _dashboard_queries() for m in METRIC.findall(query)}
    assert used - exported - recorded == set()
    alerts = {rule["alert"] for rule in _rules() if "alert" in rule}
    tested = set(re.findall(r"alertname: (\w+)", ALERT_TESTS.read_text()))
    assert alerts == tested, "every alert has a promtool unit test"


def test_every_alert_says_what_to_do() -> None:
    for rule in _rules():
        if "alert" in rule:
            assert rule["labels"]["severity"] in ("page", "ticket"), rule["alert"]
            assert rule["annotations"]["summary"] and rule["annotations"]["description"]
