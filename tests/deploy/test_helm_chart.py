"""The Helm chart: lint, schema validation of the rendered manifests, and what they say."""

from __future__ import annotations

import base64
import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from tests.conftest import require_program
from tests.deploy.conftest import (
    CHART,
    KUBE_VERSION,
    NAMESPACE,
    RELEASE,
    Manifest,
    Rendered,
    require_tool,
    set_args,
    walk_containers,
)

FULLNAME = f"{RELEASE}-specserve"
REDIS = f"{FULLNAME}-redis"
STANDARD_LABELS = ("helm.sh/chart", "app.kubernetes.io/name", "app.kubernetes.io/instance",
                   "app.kubernetes.io/version", "app.kubernetes.io/managed-by")
# Kinds kubernetes-validate has no schema for; checked by hand below.
CUSTOM_KINDS = {"ServiceMonitor", "PrometheusRule"}
DASHBOARD = CHART / "files" / "specserve-dashboard.json"
ALERTS = CHART / "files" / "specserve-alerts.yaml"
# Value sets rendered and validated besides the defaults and ci/full-values.yaml.
VARIANTS: dict[str, dict[str, str]] = {
    "inline-keys": {"apiKeys.keys": '["k1","k2"]', "service.type": "NodePort"},
    "external-redis": {"redis.url": "redis://cache.example:6379/1", "replicaCount": "3",
                       "podDisruptionBudget.enabled": "true",
                       "topologySpreadConstraints":
                           '[{"maxSkew":1,"topologyKey":"kubernetes.io/hostname",'
                           '"whenUnsatisfiable":"DoNotSchedule"}]'},
    "redis-url-secret": {"redis.existingSecret": "redis-creds", "networkPolicy.enabled": "true",
                         "model.persistence.enabled": "true",
                         "model.persistence.existingClaim": "models",
                         "strategy.type": "Recreate"},
    "own-model": {"config.target": "/var/lib/specserve/my-model", "config.draft": "none",
                  "preStopSleepSeconds": "0", "terminationGracePeriodSeconds": "90"},
}


# ---------------------------------------------------------------------------- lint


@pytest.mark.parametrize("values_file", [None, "ci/full-values.yaml"], ids=["default", "full"])
def test_helm_lint_strict_is_clean(helm: Callable[..., subprocess.CompletedProcess[str]],
                                   values_file: str | None) -> None:
    args = ["lint", "--strict", str(CHART)]
    if values_file:
        args += ["-f", str(CHART / values_file)]
    result = helm(*args, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    findings = [line for line in result.stdout.splitlines()
                if line.startswith(("[INFO]", "[WARNING]", "[ERROR]"))]
    assert findings == [], findings


@pytest.mark.parametrize("bad", [
    {"config.dtype": "float16"},
    {"config.draftDtype": "int8"},
    {"config.draftBackend": "cuda"},
    {"replicaCount": "-1"},
    {"unknownTopLevelKey": "1"},
    {"service.type": "ExternalName"},
    {"redis.url": "http://not-redis:6379"},
    {"apiKeys.keys": '["has,comma"]'},
    {"metrics.prometheusRule.disabled": '["NoSuchAlert"]'},
    {"metrics.prometheusRule.alertLabels": '{"bad-name":"x"}'},
    {"metrics.grafanaDashboard.label": ""},
], ids=lambda bad: next(iter(bad)))
def test_schema_rejects_bad_values(helm: Callable[..., subprocess.CompletedProcess[str]],
                                   bad: dict[str, str]) -> None:
    result = helm("template", RELEASE, str(CHART), *set_args(bad), check=False)
    assert result.returncode != 0
    assert "schema" in result.stderr.lower()


def test_values_are_documented_line_by_line() -> None:
    """Each key has a comment above it, or sits inside a value documented as a whole
    ("# -- ..." above an ancestor), or is a group whose own keys are documented."""
    undocumented = []
    stack: list[tuple[int, bool]] = []  # (indent, documents everything below)
    previous, dashed = "", False  # the last non-blank line; a "# --" in the comment above
    for number, line in enumerate((CHART / "values.yaml").read_text().splitlines(), 1):
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith(("#", "-")) or ":" not in stripped:
            dashed = dashed or stripped.startswith("# --")
            previous = stripped
            continue
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        covered = any(documents for _, documents in stack)
        commented = previous.startswith("#")
        if not (commented or covered or stripped.endswith(":")):
            undocumented.append(f"{number}: {stripped}")
        stack.append((indent, covered or (commented and dashed)))
        previous, dashed = stripped, False
    assert undocumented == []


def test_schema_covers_every_value() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def check(value: object, node: dict, path: str) -> None:
        if not isinstance(value, dict) or "properties" not in node:
            return
        for key, sub in value.items():
            assert key in node["properties"], f"{path}{key} is not in values.schema.json"
            check(sub, node["properties"][key], f"{path}{key}.")

    check(values, schema, "")


# ---------------------------------------------------------------------------- schema validation


def _validate(text: str, tmp_path: Path, version: str) -> subprocess.CompletedProcess[str]:
    validator = require_tool("kubernetes-validate")
    manifest = tmp_path / "manifest.yaml"
    manifest.write_text(text)
    return subprocess.run([validator, "--strict", "-k", version, str(manifest)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("variant", ["default", "full", *VARIANTS])
def test_rendered_manifests_pass_kubernetes_validate(render: Callable[..., Rendered],
                                                     tmp_path: Path, variant: str) -> None:
    rendered = {"default": lambda: render(),
                "full": lambda: render("ci/full-values.yaml")}.get(
        variant, lambda: render(values=VARIANTS[variant]))()
    for version in ("1.27.0", KUBE_VERSION):
        result = _validate(rendered.text, tmp_path, version)
        output = result.stdout + result.stderr
        assert result.returncode == 0, output
        unchecked = {kind for kind in CUSTOM_KINDS if f"kind {kind} " in output}
        assert unchecked == CUSTOM_KINDS & rendered.kinds(), output
        passed = output.count(" passed for resource ")
        assert passed == len(rendered.objects) - len(unchecked), output


def test_default_render_has_only_the_core_objects(default_render: Rendered) -> None:
    assert sorted(o["kind"] for o in default_render.objects) == [
        "ConfigMap", "Deployment", "Service", "ServiceAccount"]


def test_full_render_has_every_optional_object(full_render: Rendered) -> None:
    assert sorted(o["kind"] for o in full_render.objects) == sorted([
        "ConfigMap", "Deployment", "Deployment", "HorizontalPodAutoscaler", "NetworkPolicy",
        "NetworkPolicy", "PersistentVolumeClaim", "PodDisruptionBudget", "Service", "Service",
        "ServiceAccount", "ServiceMonitor", "ConfigMap", "PrometheusRule"])


# ---------------------------------------------------------------------------- labels, selectors


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("which", ["default", "full"])
def test_every_object_has_the_standard_labels(render: Callable[..., Rendered],
                                              which: str) -> None:
    rendered = render() if which == "default" else render("ci/full-values.yaml")
    for obj in rendered.objects:
        labels = obj["metadata"]["labels"]
        assert all(label in labels for label in STANDARD_LABELS), obj["metadata"]["name"]
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/managed-by"] == "Helm"


def test_selectors_pick_exactly_their_pods(full_render: Rendered) -> None:
    server = full_render.deployment
    redis = full_render.get("Deployment", REDIS)
    server_pods = server["spec"]["template"]["metadata"]["labels"]
    redis_pods = redis["spec"]["template"]["metadata"]["labels"]
    for deployment, pods in ((server, server_pods), (redis, redis_pods)):
        assert _matches(deployment["spec"]["selector"]["matchLabels"], pods)

    def selects_server_only(selector: dict[str, str]) -> bool:
        return _matches(selector, server_pods) and not _matches(selector, redis_pods)

    assert selects_server_only(full_render.get("Service", FULLNAME)["spec"]["selector"])
    assert selects_server_only(full_render.get("PodDisruptionBudget")["spec"]["selector"]
                               ["matchLabels"])
    assert selects_server_only(full_render.get("ServiceMonitor")["spec"]["selector"]
                               ["matchLabels"])
    assert selects_server_only(full_render.get("NetworkPolicy", FULLNAME)["spec"]["podSelector"]
                               ["matchLabels"])
    redis_service = full_render.get("Service", REDIS)["spec"]["selector"]
    assert _matches(redis_service, redis_pods) and not _matches(redis_service, server_pods)
    # the ServiceMonitor selects the Service's labels, the Service carries them
    service_labels = full_render.get("Service", FULLNAME)["metadata"]["labels"]
    assert _matches(full_render.get("ServiceMonitor")["spec"]["selector"]["matchLabels"],
                    service_labels)
    spread = full_render.pod["topologySpreadConstraints"][0]
    assert selects_server_only(spread["labelSelector"]["matchLabels"])
    hpa = full_render.get("HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]
    assert (hpa["kind"], hpa["name"]) == ("Deployment", FULLNAME)


def test_service_ports_reach_named_container_ports(full_render: Rendered) -> None:
    container_ports = {p["name"]: p["containerPort"] for p in full_render.server["ports"]}
    assert container_ports == {"http": 8000, "metrics": 9100}
    service = full_render.get("Service", FULLNAME)
    ports = {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]}
    assert ports == {"http": (8000, "http"), "metrics": (9100, "metrics")}
    config = full_render.get("ConfigMap", FULLNAME)["data"]
    assert (config["SPECSERVE_PORT"], config["SPECSERVE_METRICS_PORT"]) == ("8000", "9100")
    endpoint = full_render.get("ServiceMonitor")["spec"]["endpoints"][0]
    assert (endpoint["port"], endpoint["path"]) == ("metrics", "/metrics")
    assert full_render.get("ServiceMonitor")["spec"]["namespaceSelector"] == {
        "matchNames": [NAMESPACE]}
    assert full_render.get("ServiceMonitor")["metadata"]["labels"]["release"] == "prometheus"


def test_scrape_annotations_point_at_the_metrics_port(default_render: Rendered) -> None:
    annotations = default_render.deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == "9100"
    assert annotations["prometheus.io/path"] == "/metrics"


# ---------------------------------------------------------------------------- probes, lifecycle


def test_three_distinct_probes(default_render: Rendered) -> None:
    server = default_render.server
    startup, liveness, readiness = (server[p] for p in (
        "startupProbe", "livenessProbe", "readinessProbe"))
    assert startup["httpGet"] == {"path": "/health", "port": "http"}
    assert liveness["httpGet"] == {"path": "/health", "port": "http"}
    assert readiness["httpGet"] == {"path": "/ready", "port": "http"}
    # model load gets minutes before the kubelet gives up
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
    assert liveness["periodSeconds"] * liveness["failureThreshold"] <= 60


@pytest.mark.parametrize("values", [{}, {"config.shutdownTimeout": "120"},
                                    {"preStopSleepSeconds": "0", "config.shutdownTimeout": "5"}])
def test_grace_period_outlasts_the_drain(render: Callable[..., Rendered],
                                         values: dict[str, str]) -> None:
    rendered = render(values=values)
    shutdown = int(rendered.get("ConfigMap", FULLNAME)["data"]["SPECSERVE_SHUTDOWN_TIMEOUT"])
    pre_stop = rendered.server.get("lifecycle", {}).get("preStop", {}).get("exec", {})
    sleep = int(pre_stop["command"][1]) if pre_stop else 0
    assert rendered.pod["terminationGracePeriodSeconds"] > shutdown + sleep


def test_rolling_update_never_drops_below_capacity(default_render: Rendered) -> None:
    rolling = default_render.deployment["spec"]["strategy"]["rollingUpdate"]
    assert rolling["maxUnavailable"] == 0


def test_recreate_strategy_drops_rolling_update_settings(render: Callable[..., Rendered]
                                                         ) -> None:
    strategy = render(values=VARIANTS["redis-url-secret"]).deployment["spec"]["strategy"]
    assert strategy == {"type": "Recreate"}


# ---------------------------------------------------------------------------- security


@pytest.mark.parametrize("which", ["default", "full"])
def test_pods_run_locked_down(render: Callable[..., Rendered], which: str) -> None:
    rendered = render() if which == "default" else render("ci/full-values.yaml")
    for deployment in rendered.all("Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["automountServiceAccountToken"] is False
        writable = {v["name"] for v in pod["volumes"]}
        for container in walk_containers(pod):
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True, container["name"]
            assert context["allowPrivilegeEscalation"] is False, container["name"]
            assert context["capabilities"] == {"drop": ["ALL"]}, container["name"]
            assert context.get("privileged", False) is False
            assert {m["name"] for m in container.get("volumeMounts", [])} <= writable


def test_server_has_writable_model_cache_and_tmp(default_render: Rendered) -> None:
    mounts = {m["mountPath"]: m["name"] for m in default_render.server["volumeMounts"]}
    assert mounts == {"/var/lib/specserve": "models", "/tmp": "tmp"}
    volumes = {v["name"]: v for v in default_render.pod["volumes"]}
    assert "emptyDir" in volumes["models"] and "emptyDir" in volumes["tmp"]
    config = default_render.get("ConfigMap", FULLNAME)["data"]
    assert config["SPECSERVE_HOME"] == "/var/lib/specserve"
    assert config["HF_HOME"].startswith("/var/lib/specserve/")
    assert config["XDG_CACHE_HOME"].startswith("/tmp/")


def test_resources_are_set(default_render: Rendered) -> None:
    resources = default_render.server["resources"]
    assert resources["requests"]["cpu"] and resources["requests"]["memory"]
    assert resources["limits"]["memory"]
    assert "nvidia.com/gpu" not in resources["limits"]


# ---------------------------------------------------------------------------- config and rollouts


def _annotations(rendered: Rendered) -> dict[str, str]:
    return rendered.deployment["spec"]["template"]["metadata"]["annotations"]


def test_config_change_rolls_the_pods(render: Callable[..., Rendered]) -> None:
    base = _annotations(render())
    changed = _annotations(render(values={"config.draft": "none"}))
    assert changed["checksum/config"] != base["checksum/config"]
    assert changed["checksum/secret"] == base["checksum/secret"]
    scaled = _annotations(render(values={"replicaCount": "3"}))
    assert scaled["checksum/config"] == base["checksum/config"]


def test_key_change_rolls_the_pods(render: Callable[..., Rendered]) -> None:
    one = _annotations(render(values={"apiKeys.keys": '["k1"]'}))
    two = _annotations(render(values={"apiKeys.keys": '["k1","k2"]'}))
    assert one["checksum/secret"] != two["checksum/secret"]
    assert one["checksum/config"] == two["checksum/config"]


def test_configmap_carries_the_settings(full_render: Rendered) -> None:
    data = full_render.get("ConfigMap", FULLNAME)["data"]
    assert all(isinstance(v, str) for v in data.values())
    assert data["SPECSERVE_TARGET"] == "default"
    assert data["SPECSERVE_DTYPE"] == "bfloat16"
    assert data["SPECSERVE_DRAFT_DTYPE"] == "bfloat16"
    assert data["SPECSERVE_DRAFT_BACKEND"] == "tensorrt"
    assert data["SPECSERVE_MAX_QUEUE"] == "128"
    assert data["SPECSERVE_MAX_ACTIVE"] == "8"
    assert data["SPECSERVE_PREFILL_CHUNK"] == "256"
    assert data["SPECSERVE_KV_CACHE_BYTES"] == "8589934592"
    assert data["SPECSERVE_BATCH_SPECULATION"] == "adaptive"
    assert data["SPECSERVE_VERIFY_CURVE"] == "measure"
    assert data["SPECSERVE_SAMPLING_DEFAULTS"] == "openai"
    assert data["SPECSERVE_MAX_PROMPT_TOKENS"] == "4096"
    assert data["SPECSERVE_MAX_TOKENS"] == "1024"
    assert data["SPECSERVE_REQUEST_TIMEOUT"] == "120"
    assert data["SPECSERVE_CORS_ORIGINS"] == "https://app.example.com"
    assert data["SPECSERVE_PLAYGROUND"] == "false"
    assert data["SPECSERVE_SHUTDOWN_TIMEOUT"] == "30"
    assert data["SPECSERVE_EXAMPLE_FLAG"] == "1"
    assert data["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger-collector.tracing:4318"
    assert data["OTEL_SERVICE_NAME"] == FULLNAME
    assert "SPECSERVE_API_KEYS" not in data  # keys live in a Secret
    env_from = full_render.server["envFrom"]
    assert env_from == [{"configMapRef": {"name": FULLNAME}}]


def test_unset_limits_keep_server_defaults(default_render: Rendered) -> None:
    data = default_render.get("ConfigMap", FULLNAME)["data"]
    assert data["SPECSERVE_PLAYGROUND"] == "true"  # the page is on unless turned off
    for key in ("SPECSERVE_MAX_QUEUE", "SPECSERVE_MAX_ACTIVE", "SPECSERVE_MAX_TOKENS",
                "SPECSERVE_PREFILL_CHUNK", "SPECSERVE_KV_CACHE_BYTES",
                "SPECSERVE_BATCH_SPECULATION", "SPECSERVE_REDIS_URL", "SPECSERVE_CORS_ORIGINS",
                "SPECSERVE_SAMPLING_DEFAULTS", "SPECSERVE_VERIFY_CURVE",
                "OTEL_EXPORTER_OTLP_ENDPOINT"):
        assert key not in data


# ---------------------------------------------------------------------------- API keys


def _env(container: Manifest) -> dict[str, Manifest]:
    return {e["name"]: e for e in container.get("env", [])}


def test_inline_keys_go_into_a_chart_secret(render: Callable[..., Rendered]) -> None:
    rendered = render(values=VARIANTS["inline-keys"])
    secret = rendered.get("Secret")
    assert base64.b64decode(secret["data"]["api-keys"]).decode() == "k1,k2"
    ref = _env(rendered.server)["SPECSERVE_API_KEYS"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": secret["metadata"]["name"], "key": "api-keys"}


def test_existing_secret_is_referenced_not_created(full_render: Rendered) -> None:
    assert full_render.all("Secret") == []
    ref = _env(full_render.server)["SPECSERVE_API_KEYS"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "specserve-api-keys", "key": "api-keys"}


def test_no_keys_no_secret(default_render: Rendered) -> None:
    assert default_render.all("Secret") == []
    assert "SPECSERVE_API_KEYS" not in _env(default_render.server)


# ---------------------------------------------------------------------------- model volume


def test_init_container_pulls_the_default_model(default_render: Rendered) -> None:
    (init,) = default_render.pod["initContainers"]
    assert init["command"] == ["specserve", "models", "pull"]
    assert init["image"] == default_render.server["image"]
    assert init["envFrom"] == default_render.server["envFrom"]
    assert {m["mountPath"] for m in init["volumeMounts"]} == {"/var/lib/specserve", "/tmp"}
    assert _env(default_render.server)["SPECSERVE_PULL_MODEL"]["value"] == "never"


@pytest.mark.parametrize("values", [VARIANTS["own-model"], {"model.pull.enabled": "false"}])
def test_no_pull_without_the_default_model(render: Callable[..., Rendered],
                                           values: dict[str, str]) -> None:
    rendered = render(values=values)
    assert "initContainers" not in rendered.pod
    assert "SPECSERVE_PULL_MODEL" not in _env(rendered.server)


def test_persistent_model_volume(full_render: Rendered) -> None:
    claim = full_render.get("PersistentVolumeClaim")
    assert claim["metadata"]["name"] == f"{FULLNAME}-models"
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "10Gi"
    assert claim["spec"]["storageClassName"] == "fast-ssd"
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    volumes = {v["name"]: v for v in full_render.pod["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"]["claimName"] == f"{FULLNAME}-models"


def test_existing_claim_is_used_not_created(render: Callable[..., Rendered]) -> None:
    rendered = render(values=VARIANTS["redis-url-secret"])
    assert rendered.all("PersistentVolumeClaim") == []
    volumes = {v["name"]: v for v in rendered.pod["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"]["claimName"] == "models"


# ---------------------------------------------------------------------------- GPU, scheduling


def test_gpu_flavour(full_render: Rendered, default_render: Rendered) -> None:
    server = full_render.server
    assert server["image"] == "specserve:0.1.0-gpu"
    assert default_render.server["image"] == "specserve:0.1.0"
    assert server["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert server["resources"]["limits"]["memory"] == "4Gi"  # merged, not replaced
    assert full_render.pod["runtimeClassName"] == "nvidia"
    tolerations = full_render.pod["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations
    assert any(t.get("key") == "dedicated" for t in tolerations)
    assert full_render.pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert "podAntiAffinity" in full_render.pod["affinity"]
    assert "tolerations" not in default_render.pod


def test_explicit_image_tag_wins(render: Callable[..., Rendered]) -> None:
    rendered = render(values={"gpu.enabled": "true", "image.tag": "custom",
                              "image.repository": "registry.local/specserve"})
    assert rendered.server["image"] == "registry.local/specserve:custom"


# ---------------------------------------------------------------------------- HPA, PDB


def test_autoscaling_replaces_the_replica_count(full_render: Rendered,
                                                default_render: Rendered) -> None:
    assert "replicas" not in full_render.deployment["spec"]
    assert default_render.deployment["spec"]["replicas"] == 1
    hpa = full_render.get("HorizontalPodAutoscaler")["spec"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 6)
    targets = {m["resource"]["name"]: m["resource"]["target"]["averageUtilization"]
               for m in hpa["metrics"]}
    assert targets == {"cpu": 70, "memory": 80}
    assert hpa["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300


def test_pod_disruption_budget(full_render: Rendered, render: Callable[..., Rendered]) -> None:
    assert full_render.get("PodDisruptionBudget")["spec"]["minAvailable"] == 1
    spec = render(values=VARIANTS["external-redis"]).get("PodDisruptionBudget")["spec"]
    assert spec["maxUnavailable"] == 1 and "minAvailable" not in spec


# ---------------------------------------------------------------------------- Redis


def test_in_chart_redis(full_render: Rendered) -> None:
    data = full_render.get("ConfigMap", FULLNAME)["data"]
    assert data["SPECSERVE_REDIS_URL"] == f"redis://{REDIS}:6379/0"
    redis = full_render.get("Deployment", REDIS)
    assert redis["spec"]["replicas"] == 1
    (container,) = redis["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "redis:7.4-alpine"
    assert "--maxmemory-policy" in container["args"]
    assert container["readinessProbe"]["exec"]["command"][0] == "redis-cli"
    service = full_render.get("Service", REDIS)
    assert service["spec"]["ports"] == [
        {"name": "redis", "port": 6379, "targetPort": "redis", "protocol": "TCP"}]


def test_external_redis(render: Callable[..., Rendered]) -> None:
    rendered = render(values=VARIANTS["external-redis"])
    assert rendered.get("ConfigMap", FULLNAME)["data"]["SPECSERVE_REDIS_URL"] == \
        "redis://cache.example:6379/1"
    assert [d["metadata"]["name"] for d in rendered.all("Deployment")] == [FULLNAME]


def test_redis_url_from_a_secret(render: Callable[..., Rendered]) -> None:
    rendered = render(values=VARIANTS["redis-url-secret"])
    assert "SPECSERVE_REDIS_URL" not in rendered.get("ConfigMap", FULLNAME)["data"]
    ref = _env(rendered.server)["SPECSERVE_REDIS_URL"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "redis-creds", "key": "redis-url"}


# ---------------------------------------------------------------------------- NetworkPolicy


def test_network_policies(full_render: Rendered) -> None:
    policy = full_render.get("NetworkPolicy", FULLNAME)["spec"]
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    ingress = {rule["ports"][0]["port"]: rule for rule in policy["ingress"]}
    assert set(ingress) == {"http", "metrics"}
    assert ingress["metrics"]["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "monitoring"}
    egress_ports = [p["port"] for rule in policy["egress"] for p in rule.get("ports", [])]
    assert 53 in egress_ports and 6379 in egress_ports and 443 in egress_ports
    redis_policy = full_render.get("NetworkPolicy", REDIS)["spec"]
    (rule,) = redis_policy["ingress"]
    server_pods = full_render.deployment["spec"]["template"]["metadata"]["labels"]
    assert _matches(rule["from"][0]["podSelector"]["matchLabels"], server_pods)


def test_network_policy_allows_everyone_by_default(render: Callable[..., Rendered]) -> None:
    policy = render(values=VARIANTS["redis-url-secret"]).get("NetworkPolicy")["spec"]
    assert policy["policyTypes"] == ["Ingress"]
    assert all("from" not in rule for rule in policy["ingress"])


# ---------------------------------------------------------------------------- ServiceMonitor


def test_service_monitor_shape(full_render: Rendered) -> None:
    """kubernetes-validate has no schema for this CRD, so check its shape here."""
    monitor = full_render.get("ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}
    assert set(monitor["spec"]) == {"selector", "namespaceSelector", "endpoints"}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert set(endpoint) == {"port", "path", "scheme", "interval", "scrapeTimeout"}
    assert endpoint["interval"] == "30s" and endpoint["scrapeTimeout"] == "10s"


# ---------------------------------------------------------------------------- dashboard, alerts


def test_dashboard_and_alerts_are_off_by_default(default_render: Rendered) -> None:
    assert "PrometheusRule" not in default_render.kinds()
    assert [c["metadata"]["name"] for c in default_render.all("ConfigMap")] == [FULLNAME]


def test_dashboard_configmap_carries_the_dashboard(full_render: Rendered) -> None:
    """A ConfigMap Grafana's sidecar picks up (its label), holding the dashboard as shipped."""
    config = full_render.get("ConfigMap", f"{FULLNAME}-dashboard")
    assert config["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    assert "namespace" not in config["metadata"]  # the release's
    (key,) = config["data"]
    assert key.endswith(".json")
    assert json.loads(config["data"][key]) == json.loads(DASHBOARD.read_text())


def test_dashboard_label_and_namespace_follow_the_values(render: Callable[..., Rendered]
                                                         ) -> None:
    rendered = render(values={"metrics.grafanaDashboard.enabled": "true",
                              "metrics.grafanaDashboard.namespace": "monitoring",
                              "metrics.grafanaDashboard.label": "dashboards",
                              "metrics.grafanaDashboard.labelValue": "specserve"})
    config = rendered.get("ConfigMap", f"{FULLNAME}-dashboard")
    assert config["metadata"]["namespace"] == "monitoring"
    assert config["metadata"]["labels"]["dashboards"] == "specserve"
    assert "grafana_dashboard" not in config["metadata"]["labels"]
    assert "PrometheusRule" not in rendered.kinds()


def _alerts() -> list[Manifest]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"]
            for rule in group["rules"]]


def test_prometheus_rule_carries_the_alerts(full_render: Rendered) -> None:
    """kubernetes-validate has no schema for this CRD: its shape is checked here, and its
    rules are the shipped file's, with the values' labels added to every alert."""
    rule = full_render.get("PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(rule) == {"apiVersion", "kind", "metadata", "spec"}
    assert rule["metadata"]["name"] == FULLNAME
    assert rule["metadata"]["labels"]["release"] == "prometheus"
    assert set(rule["spec"]) == {"groups"}
    rendered = [r for group in rule["spec"]["groups"] for r in group["rules"]]
    shipped = _alerts()
    assert [r["alert"] for r in rendered] == [r["alert"] for r in shipped]
    for got, want in zip(rendered, shipped, strict=True):
        assert got == {**want, "labels": {**want["labels"], "team": "inference"}}


def test_alerts_can_be_left_out_and_keep_their_own_labels(
        render: Callable[..., Rendered]) -> None:
    rendered = render(values={"metrics.prometheusRule.enabled": "true",
                              "metrics.prometheusRule.disabled": '["SpecserveSlowFirstToken"]',
                              "metrics.prometheusRule.alertLabels": '{"severity":"page"}'})
    rules = [r for g in rendered.get("PrometheusRule")["spec"]["groups"] for r in g["rules"]]
    assert [r["alert"] for r in rules] == [r["alert"] for r in _alerts()
                                           if r["alert"] != "SpecserveSlowFirstToken"]
    assert {r["labels"]["severity"] for r in rules} == {"warning", "critical"}
    assert "ConfigMap" in rendered.kinds() and len(rendered.all("ConfigMap")) == 1


def test_rendered_rules_pass_promtool(full_render: Rendered, tmp_path: Path) -> None:
    promtool = require_program("promtool", "prometheus")
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(full_render.get("PrometheusRule")["spec"]))
    result = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(_alerts())} rules found" in result.stdout


def test_schema_names_every_alert() -> None:
    """The values that leave alerts out accept exactly the shipped alerts' names."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    rule = schema["properties"]["metrics"]["properties"]["prometheusRule"]
    names = rule["properties"]["disabled"]["items"]["enum"]
    assert sorted(names) == sorted(r["alert"] for r in _alerts())


# ---------------------------------------------------------------------------- NOTES


@pytest.mark.parametrize("values, expected", [
    ({}, ["port-forward service/rel-specserve 8000:8000", "-c pull-model",
          "http://rel-specserve.ml.svc:8000/v1"]),
    ({"service.type": "LoadBalancer", "apiKeys.keys": '["k"]'},
     ["loadBalancer.ingress", "Authorization: Bearer", "rel-specserve-api-keys"]),
    ({"service.type": "NodePort", "replicaCount": "2"}, ["nodePort", "separate prefix caches"]),
])
def test_notes_tell_how_to_reach_the_service(
        helm: Callable[..., subprocess.CompletedProcess[str]],
        values: dict[str, str], expected: list[str]) -> None:
    result = helm("install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE,
                  *set_args(values))
    notes = result.stdout.split("NOTES:", 1)[1]
    for text in expected:
        assert text in notes
