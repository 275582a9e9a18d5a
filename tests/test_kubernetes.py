"""deploy/kubernetes offline: no API server or operator runs here, so each overlay is rendered with
``kubectl kustomize``; built-in objects (and the pod templates inside the KubeRay resources) pass
``kubernetes-validate --strict``; the custom resources carry the fields their operators require; the
PrometheusRule's rules pass ``promtool check rules``; generated manifests match their generator; hadolint
and checkov find nothing in the Dockerfile and deploy/."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from mixin import dashboards
from mixin import kubernetes as manifests
from tqmon import rules
from tqmon.exporters.otlp import POD_ENV

ROOT = Path(__file__).resolve().parent.parent
OVERLAYS = {overlay.name: overlay for overlay in manifests.OVERLAYS}
CHECKOV = ROOT / ".venv-checkov" / "bin" / "checkov"
K8S_VERSION = "1.30.0"


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: run `make test` (system-deps installs it)")
    return path


def render(overlay: str) -> list[dict[str, Any]]:
    result = subprocess.run(
        [tool("kubectl"), "kustomize", str(ROOT / "deploy" / "kubernetes" / "overlays" / overlay)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc["kind"] == kind]


def pod_template(doc: dict[str, Any]) -> dict[str, Any]:
    """The pod template the overlay's sidecar patch targets (the Pod itself for the pod overlay)."""
    if doc["kind"] == "Pod":
        return doc
    spec = doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]
    template: dict[str, Any] = spec["headGroupSpec"]["template"]
    return template


def workload(overlay: str) -> dict[str, Any]:
    kind = {"raycluster": "RayCluster", "rayjob": "RayJob", "pod": "Pod"}[overlay]
    (doc,) = by_kind(render(overlay), kind)
    return doc


def test_generated_manifests_match_their_generator() -> None:
    for relative, text in manifests.rendered().items():
        assert (ROOT / relative).read_text() == text, f"{relative} drifted: run `make docs`"


def test_prometheus_rule_holds_the_rules_file() -> None:
    (rule,) = by_kind(render("raycluster"), "PrometheusRule")
    shipped = yaml.safe_load((ROOT / "deploy" / "prometheus" / "tqmon-rules.yml").read_text())
    assert rule["spec"] == shipped == rules.rule_groups()
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_prometheus_rule_passes_promtool(tmp_path: Path) -> None:
    (rule,) = by_kind(render("rayjob"), "PrometheusRule")
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    result = subprocess.run(
        [tool("promtool"), "check", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rule['spec']['groups'][0]['rules'])} rules found" in result.stdout


def test_dashboard_config_maps_hold_the_dashboards() -> None:
    maps = by_kind(render("pod"), "ConfigMap")
    shipped = {p.name: p.read_text() for p in (ROOT / "grafana" / "dashboards").glob("*.json")}
    assert {name: text for m in maps for name, text in m["data"].items()} == shipped == dashboards.rendered()
    for config_map in maps:
        assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
        (text,) = config_map["data"].values()
        assert json.loads(text)["uid"] in (rules.RESUME_DASHBOARD_UID, rules.FLEET_DASHBOARD_UID)


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_built_in_objects_pass_strict_validation(overlay: str) -> None:
    docs = render(overlay)
    checked = 0
    for rendered in docs:
        doc = rendered
        if doc["kind"] in ("RayCluster", "RayJob"):
            # No schema for the CRDs; their pod templates are core PodTemplateSpecs and validate as such.
            doc = {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": "head"},
                "template": pod_template(doc),
            }
        elif "/" in doc["apiVersion"] and doc["apiVersion"].split("/")[0].endswith(("coreos.com", "ray.io")):
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        checked += 1
    assert checked == len(docs) - 2  # all but the PodMonitor and the PrometheusRule


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_sidecar_is_appended_hardened_and_keeps_state_on_a_claim(overlay: str) -> None:
    template = pod_template(workload(overlay))
    spec = template["spec"]
    first, sidecar = spec["containers"]
    assert first["name"] != "tqmon" and sidecar["name"] == "tqmon"  # KubeRay needs the Ray container first
    assert template["metadata"]["labels"]["tqmon.io/sidecar"] == "true"
    security = sidecar["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] > 0
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert sidecar["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert sidecar["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert {"requests", "limits"} <= set(sidecar["resources"])
    (port,) = sidecar["ports"]
    assert len(port["name"]) <= 15
    volumes = {v["name"]: v for v in spec["volumes"]}
    state = next(m for m in sidecar["volumeMounts"] if m["mountPath"] == "/state")
    assert volumes[state["name"]] == {"name": state["name"], "persistentVolumeClaim": {"claimName": "tqmon-state"}}
    (token,) = (e for e in sidecar["env"] if e["name"] == "TQMON_TOKEN")
    (secret,) = by_kind(render(overlay), "Secret")
    assert token["valueFrom"]["secretKeyRef"] == {"name": secret["metadata"]["name"], "key": "token"}
    # OTLP push reads the pod's identity from these (tqmon.exporters.otlp.POD_ENV).
    downward = {
        e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"]
        for e in sidecar["env"]
        if "fieldRef" in e.get("valueFrom", {})
    }
    assert downward == {POD_ENV["k8s.pod.name"]: "metadata.name", POD_ENV["k8s.namespace.name"]: "metadata.namespace"}
    checkpoints = next(m for m in sidecar["volumeMounts"] if m["mountPath"] == manifests.CHECKPOINTS)
    assert checkpoints["readOnly"] is True


@pytest.mark.parametrize("overlay", ["raycluster", "rayjob"])
def test_kuberay_head_shares_ray_logs_and_the_sidecar_follows_driver_logs(overlay: str) -> None:
    doc = workload(overlay)
    assert doc["apiVersion"] == "ray.io/v1"
    spec = doc["spec"]["rayClusterSpec"] if overlay == "rayjob" else doc["spec"]
    if overlay == "rayjob":
        assert doc["spec"]["entrypoint"]
    # Fields KubeRay requires of a cluster spec.
    head = spec["headGroupSpec"]
    assert "rayStartParams" in head and head["template"]["spec"]["containers"]
    for group in spec["workerGroupSpecs"]:
        assert group["groupName"] and "rayStartParams" in group and group["template"]["spec"]["containers"]
    ray, sidecar = head["template"]["spec"]["containers"]
    volumes = {v["name"]: v for v in head["template"]["spec"]["volumes"]}
    shared = [m["name"] for m in ray["volumeMounts"] if m["mountPath"] == "/tmp/ray"]
    assert shared == [m["name"] for m in sidecar["volumeMounts"] if m["mountPath"] == "/tmp/ray"]
    assert volumes[shared[0]] == {"name": shared[0], "emptyDir": {}}
    args = sidecar["args"]
    assert args[args.index("--log") + 1] == "/tmp/ray/session_latest/logs/job-driver-*.log"
    assert args[args.index("--ray-address") + 1] == "127.0.0.1:6379"
    assert sidecar["image"].endswith("-tq")
    # tqmon's Ray driver finds the head's raylet among the processes it sees (bench/bench_image.py).
    assert head["template"]["spec"]["shareProcessNamespace"] is True


def test_pod_monitor_selects_the_sidecar_port_for_kube_prometheus_stack() -> None:
    docs = render("raycluster")
    (monitor,) = by_kind(docs, "PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    template = pod_template(workload("raycluster"))
    labels = template["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    sidecar = template["spec"]["containers"][1]
    assert endpoint["port"] == sidecar["ports"][0]["name"]
    relabel = {r["targetLabel"]: r for r in endpoint["relabelings"]}
    assert relabel["ray_io_cluster"]["sourceLabels"] == ["__meta_kubernetes_pod_label_ray_io_cluster"]
    # The shipped rules select job="tqmon": the monitor must produce that job label.
    assert relabel["job"]["replacement"] == "tqmon" and rules.RuleConfig().selector == 'job="tqmon"'


def test_network_policy_admits_only_scraper_and_trainer_to_the_tqmon_port() -> None:
    docs = render("rayjob")
    (policy,) = by_kind(docs, "NetworkPolicy")
    template = pod_template(workload("rayjob"))
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    port = template["spec"]["containers"][1]["ports"][0]["containerPort"]
    tqmon_rule, others = policy["spec"]["ingress"]
    assert tqmon_rule["ports"] == [{"protocol": "TCP", "port": port}]
    peers = [peer["podSelector"]["matchLabels"] for peer in tqmon_rule["from"]]
    assert peers == [{"app.kubernetes.io/name": "prometheus"}, {"ray.io/is-ray-node": "yes"}]
    # The rule for the pod's other ports (Ray's) leaves the tqmon port out.
    assert "from" not in others
    assert all(not (p["port"] <= port <= p["endPort"]) for p in others["ports"] if p["protocol"] == "TCP")


def test_dockerfile_has_no_hadolint_findings() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    result = subprocess.run([str(hadolint), str(ROOT / "Dockerfile")], capture_output=True, text=True, check=False)
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr


@pytest.mark.parametrize("target", [["-d", "deploy"], ["-f", "Dockerfile"]])
def test_checkov_finds_no_failed_checks(target: list[str]) -> None:
    if not CHECKOV.exists():
        pytest.fail(f"{CHECKOV} missing: run `make checkov` (make test does)")
    env = {**os.environ, "BC_SKIP_MAPPING": "TRUE"}
    result = subprocess.run(
        [str(CHECKOV), *target, "--skip-download", "--quiet", "--compact", "-o", "json"],
        capture_output=True, text=True, cwd=ROOT, env=env, check=False,
    )  # fmt: skip
    reports = json.loads(result.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    failed = [(f["check_id"], f["resource"]) for r in reports for f in r["results"]["failed_checks"]]
    assert failed == []
    assert sum(r["summary"]["passed"] for r in reports) > 50
    assert {r["check_type"] for r in reports} >= ({"kubernetes", "kustomize"} if "deploy" in target else {"dockerfile"})
