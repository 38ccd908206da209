"""The chart ships the Grafana dashboard ``dashboards/tessera.json`` in a ConfigMap for
Grafana's sidecar (on by default), a valid Kubernetes object; and every PromQL query of
the dashboard reads only series that /metrics exports, so renaming a metric without the
dashboard fails here."""

from __future__ import annotations

import json
import re
from typing import Any

import kubernetes_validate
import pytest

from tests.deploy.helm import CHART, HelmError, documents, only, template
from tests.deploy.test_kubernetes_schemas import KUBERNETES_VERSIONS
from tests.metrics_scrape import exported_names

DASHBOARD = CHART / "dashboards" / "tessera.json"
#: The series a dashboard for vLLM shows first: Tessera's must show them too.
ESSENTIAL = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
}
#: PromQL words that look like series names: set operators, modifiers, and the
#: aggregation clauses (their label lists are dropped before names are read).
KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}
CLAUSES = r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)"


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression (with Grafana's ``$variables``) reads."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings, which may hold anything
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range and subquery windows
    expr = re.sub(CLAUSES, "", expr)
    # a whole identifier (not part of a number, a $variable or a longer name) that is
    # not a function call
    words = re.findall(r"(?<![\w:$.])[a-zA-Z_:][\w:]*(?![\w:])(?!\s*\()", expr)
    return {word for word in words if word.lower() not in KEYWORDS}


def queries(dashboard: dict[str, Any]) -> list[str]:
    """Every panel's PromQL (rows' nested panels too) and the variables' queries."""
    panels = list(dashboard["panels"])
    out = []
    while panels:
        panel = panels.pop()
        panels += panel.get("panels", [])
        out += [target["expr"] for target in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):  # label_values(<series>, <label>)
            (series,) = re.fullmatch(r"label_values\((.+),\s*\w+\)", query["query"]).groups()
            out.append(series)
    return out


def dashboard_configmap(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return only(docs, "ConfigMap")


def test_the_configmap_holds_the_file_labelled_for_the_sidecar(default_render):
    configmap = dashboard_configmap(default_render)
    assert configmap["metadata"]["name"] == "tessera-grafana-dashboard"
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert "namespace" not in configmap["metadata"]  # the release's
    assert configmap["data"] == {"tessera.json": DASHBOARD.read_text().rstrip("\n")}
    for version in KUBERNETES_VERSIONS:  # strictly, as the API server would take it
        kubernetes_validate.validate(configmap, version, strict=True)


def test_values_move_or_remove_the_configmap():
    docs = documents(
        template(
            sets=(
                "metrics.grafanaDashboard.namespace=monitoring",
                "metrics.grafanaDashboard.labels.grafana_dashboard=tessera",
                "metrics.grafanaDashboard.annotations.grafana_folder=LLM",
            )
        )
    )
    metadata = dashboard_configmap(docs)["metadata"]
    assert metadata["namespace"] == "monitoring"
    assert metadata["labels"]["grafana_dashboard"] == "tessera"
    assert metadata["annotations"] == {"grafana_folder": "LLM"}
    off = documents(template(sets=("metrics.grafanaDashboard.enabled=false",)))
    assert "ConfigMap" not in [doc["kind"] for doc in off]
    with pytest.raises(HelmError, match="/metrics/grafanaDashboard/enabled"):
        template(sets=("metrics.grafanaDashboard.enabled=maybe",))


def test_every_query_reads_only_series_the_server_exports():
    dashboard = json.loads(DASHBOARD.read_text())
    exported = exported_names()
    read: set[str] = set()
    for expr in queries(dashboard):
        names = metric_names(expr)
        assert names, f"no series in {expr!r}"
        assert names <= exported, f"{expr!r} reads {sorted(names - exported)}, not exported"
        read |= names
    assert read >= ESSENTIAL, sorted(ESSENTIAL - read)
    assert any(name.startswith("tessera_") for name in read)  # and what only Tessera has


def test_metric_names_reads_names_not_functions_labels_or_variables():
    expr = (
        'histogram_quantile(0.99, sum by (le) (max by (le, replica) (rate(vllm:ttft_bucket{m=~"$m"}'
        "[$__rate_interval])))) / ignoring (x) tessera_a_total offset 5m and on (y) b:c > 1e-9"
    )
    assert metric_names(expr) == {"vllm:ttft_bucket", "tessera_a_total", "b:c"}
    tiny = {
        "panels": [{"type": "row", "panels": [{"targets": [{"expr": "up"}]}]}],
        "templating": {"list": [{"query": {"query": 'label_values(x{a="b"}, model_name)'}}]},
    }
    assert queries(tiny) == ["up", 'x{a="b"}']
