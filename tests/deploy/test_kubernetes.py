"""deploy/kubernetes: every built-in object validates against the Kubernetes schemas (kubernetes-validate, strict:
an unknown field fails); the LeaderWorkerSet's pod templates validate as PodTemplates; and the manifests agree with
the daemon (real settings, probe paths, a grace period above unready delay + drain)."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from diffusiond.daemon.config import ServeConfig, env_var

DEPLOY = Path(__file__).parents[2] / "deploy" / "kubernetes"
VERSION = "1.33.0"
SETTINGS = {env_var(name) for name in ServeConfig.__struct_fields__}


def documents(name: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all((DEPLOY / name).read_text()) if doc]


def validate(doc: dict) -> None:
    kubernetes_validate.validate(doc, VERSION, strict=True)


def pod_templates() -> list[tuple[str, dict]]:
    """(where, pod template spec) of every workload in the folder."""
    out = []
    for name in ("replicas.yaml", "group.yaml"):
        for doc in documents(name):
            if doc["kind"] == "Deployment":
                out.append((f"{name} Deployment", doc["spec"]["template"]))
            elif doc["kind"] == "LeaderWorkerSet":
                lws = doc["spec"]["leaderWorkerTemplate"]
                out += [(f"{name} leader", lws["leaderTemplate"]), (f"{name} worker", lws["workerTemplate"])]
    return out


def as_pod_template(name: str, template: dict) -> dict:
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template}


@pytest.mark.parametrize("name", ["replicas.yaml", "group.yaml", "servicemonitor.yaml"])
def test_built_in_objects_validate(name):
    docs = documents(name)
    custom = {"LeaderWorkerSet", "ServiceMonitor"}
    for doc in docs:
        if doc["kind"] not in custom:
            validate(doc)
    assert any(doc["kind"] in custom for doc in docs) or name == "replicas.yaml"


def test_replicas_have_what_a_service_needs():
    kinds = {doc["kind"]: doc for doc in documents("replicas.yaml")}
    assert set(kinds) == {"Deployment", "Service", "PodDisruptionBudget", "PersistentVolumeClaim"}
    labels = kinds["Deployment"]["spec"]["template"]["metadata"]["labels"]
    # Video jobs shared by the pods: PostgreSQL, and one folder every pod mounts (ReadWriteMany).
    pod = kinds["Deployment"]["spec"]["template"]["spec"]
    env = {e["name"] for e in pod["containers"][0]["env"]}
    assert {"DIFFUSIOND_STATE_URL", "DIFFUSIOND_STATE_DIR", "DIFFUSIOND_REPLICA_ID", "DIFFUSIOND_URL_SECRET"} <= env
    claim = kinds["PersistentVolumeClaim"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert {"name": "state", "persistentVolumeClaim": {"claimName": claim["metadata"]["name"]}} in pod["volumes"]
    assert kinds["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert kinds["Service"]["spec"]["selector"].items() <= labels.items()
    container = kinds["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_the_leader_worker_set_pod_templates_validate():
    for where, template in pod_templates():
        validate(as_pod_template(re.sub(r"[^a-z0-9-]", "-", where.lower()), template))


def test_validation_catches_a_mistake():
    """The check above can fail: a misspelt field or a wrong type is refused."""
    _, template = pod_templates()[0]
    broken = copy.deepcopy(template)
    broken["spec"]["containers"][0]["imagePullPolicyy"] = "IfNotPresent"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(as_pod_template("broken", broken))
    broken = copy.deepcopy(template)
    broken["spec"]["terminationGracePeriodSeconds"] = "sixty"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(as_pod_template("broken", broken))


def env_of(container: dict) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


@pytest.mark.parametrize("where,template", pod_templates(), ids=[w for w, _ in pod_templates()])
def test_pods_agree_with_the_daemon(where, template):
    spec = template["spec"]
    container = spec["containers"][0]
    env = env_of(container)
    # Only real settings (a typo would stop the daemon with exit code 2 at start).
    assert {k for k in env if k.startswith("DIFFUSIOND_")} <= SETTINGS, env
    flags = [a.split("=", 1)[0] for a in container.get("args", [])]
    known = {"--" + f.replace("_", "-") for f in ServeConfig.__struct_fields__}
    assert set(flags) <= known, flags
    # The grace period covers the whole stop: unready delay, then the drain.
    stop = float(env.get("DIFFUSIOND_UNREADY_DELAY") or 0) + float(env.get("DIFFUSIOND_DRAIN_TIMEOUT") or 30)
    assert spec["terminationGracePeriodSeconds"] > stop + 5, (where, stop)
    if "--nnodes" in flags:
        assert stop <= 25, "the agent kills ranks 30 s after SIGTERM"
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    if "http" not in ports:  # a worker of a group: no HTTP, no probes
        assert not any(k in container for k in ("readinessProbe", "livenessProbe", "startupProbe")), where
        return
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "model download and load take minutes"
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/path"] == "/metrics" and int(annotations["prometheus.io/port"]) == ports["http"]


def test_prometheus_finds_the_pods():
    """The scrape configuration keeps the pods the manifests annotate. Debian's promtool is built without
    Kubernetes discovery, so it checks the file only where it can."""
    text = (DEPLOY / "prometheus-scrape.yml").read_text()
    config = yaml.safe_load(text)
    (job,) = config["scrape_configs"]
    keep = [r for r in job["relabel_configs"] if r.get("action") == "keep"]
    names = [r["regex"] for r in keep if r["source_labels"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_name"]]
    for where, template in pod_templates():
        if "annotations" in template["metadata"]:
            assert re.fullmatch(names[0], template["metadata"]["labels"]["app.kubernetes.io/name"]), where
    promtool = shutil.which("promtool")
    if promtool is None:
        return
    result = subprocess.run([promtool, "check", "config", str(DEPLOY / "prometheus-scrape.yml")], capture_output=True)
    output = (result.stdout + result.stderr).decode()
    if "kubernetes_sd_configs not found" in output:
        return  # this promtool lacks Kubernetes discovery (Debian's)
    assert result.returncode == 0, output
