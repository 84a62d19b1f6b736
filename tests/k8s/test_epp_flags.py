"""The endpoint picker (EPP) in every overlay with an InferencePool, checked against the release its
image tag names: every argument is a flag that release accepts (tests/k8s/epp_<tag>_flags.txt, kept
with its source), no metric-name flag is passed (the release refuses to start with one), Spindle's
gauge names sit in the engine config that release reads them from, and the picker's ports, drain,
RBAC and config file are what that release expects."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.common.messages import SchedulerStats
from services.common.metrics import engine_stats_families
from tests.k8s.manifests import ROOT, PodTemplate, Rendered, container_ports, rendered
from tests.k8s.test_crds import POOL_OVERLAYS

FLAGS_DIR = Path(__file__).parent
IMAGE = re.compile(r"^(?P<repository>[^@:]+(?::\d+/[^@:]+)?):(?P<tag>v\d+\.\d+\.\d+(?:-rc\.\d+)?)(?:@sha256:[0-9a-f]{64})?$")
# After SIGTERM, and after draining, the picker needs a moment to close.
CLOSE_MARGIN_S = 10
# The flags that named model server metrics; from v1.4.0 of the Inference Extension on (and in every
# llm-d-router release) setting one stops the picker: pkg/epp/server/options.go, deprecatedMetricFlags.
METRIC_NAME_FLAGS = {"--total-queued-requests-metric", "--total-running-requests-metric",
                     "--kv-cache-usage-percentage-metric", "--lora-info-metric", "--cache-info-metric"}


@dataclass(frozen=True)
class PickerRelease:
    """What one picker release expects beyond its flags, read from its source at that tag."""

    repository: str
    config_api_versions: frozenset[str]
    config_fields: frozenset[str]  # EndpointPickerConfig's JSON fields (decoded strictly)
    extractor_type: str
    extractor_params: frozenset[str]
    engine_config_fields: frozenset[str]
    engine_label_keys: tuple[str, ...]  # pod labels that pick an engine, first found wins
    default_engine: str
    source_type: str
    source_params: frozenset[str]
    default_ports: dict[str, int]  # flag -> default
    default_drain_s: float
    rbac: dict[tuple[str, str], frozenset[str]]  # (API group, resource) -> verbs it needs


RELEASES = {
    # llm-d/llm-d-router v0.10.0 (71f4f0999f95b96c49a9d0c4afbd18dfdb943c26):
    # apix/config/v1alpha1/endpointpickerconfig_types.go, pkg/epp/config/loader/configloader.go,
    # pkg/epp/framework/plugins/datalayer/{extractor/metrics/factories.go,extractor/metrics/extractor.go,
    # source/metrics/datasource.go}, pkg/epp/server/{options.go,controller_config.go,controller_manager.go}.
    "v0.10.0": PickerRelease(
        repository="ghcr.io/llm-d/llm-d-router-endpoint-picker",
        config_api_versions=frozenset({"llm-d.ai/v1alpha1"}),
        config_fields=frozenset({"apiVersion", "kind", "featureGates", "plugins", "schedulingProfiles", "dataLayer",
                                 "flowControl", "requestHandler", "saturationDetector", "parser"}),
        extractor_type="core-metrics-extractor",
        extractor_params=frozenset({"engineLabelKey", "defaultEngine", "engineConfigs"}),
        engine_config_fields=frozenset({"name", "queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "loraSpec",
                                        "cacheInfoSpec", "cacheBlockSizeLabelName", "cacheNumBlocksLabelName",
                                        "cacheBlockSizeSpec", "cacheNumBlocksSpec", "customMetrics"}),
        engine_label_keys=("llm-d.ai/engine-type", "inference.networking.k8s.io/engine-type"),
        default_engine="vllm",
        source_type="metrics-data-source",
        source_params=frozenset({"scheme", "path", "port", "insecureSkipVerify", "caCertPath", "clientCertPath",
                                 "clientKeyPath", "interval"}),
        default_ports={"--grpc-port": 9002, "--grpc-health-port": 9003, "--metrics-port": 9090},
        default_drain_s=30.0,
        rbac={("", "pods"): frozenset({"get", "list", "watch"}),
              ("inference.networking.k8s.io", "inferencepools"): frozenset({"get", "list", "watch"}),
              **{(group, resource): frozenset({"get", "list", "watch"})
                 for group in ("llm-d.ai", "inference.networking.x-k8s.io")
                 for resource in ("inferenceobjectives", "inferencemodelrewrites")},
              # --metrics-endpoint-auth is on by default: the picker reviews its scrapers' tokens.
              ("authentication.k8s.io", "tokenreviews"): frozenset({"create"}),
              ("authorization.k8s.io", "subjectaccessreviews"): frozenset({"create"})},
    ),
}


@dataclass(frozen=True)
class Picker:
    """The EPP of one overlay: its pod, its container, and the release its image names."""

    pod: PodTemplate
    container: dict[str, Any]
    version: str

    @property
    def release(self) -> PickerRelease:
        assert self.version in RELEASES, f"no PickerRelease for the picker {self.version}: read its source, add one"
        return RELEASES[self.version]

    def flags(self) -> dict[str, str]:
        return {name: value for name, _, value in (a.partition("=") for a in self.container.get("args", []))}


def image_version(image: str) -> tuple[str, str]:
    match = IMAGE.match(image)
    assert match, f"{image}: the picker's image must name a release tag (vX.Y.Z), optionally with a digest"
    return match["repository"], match["tag"]


def flags_file(version: str) -> Path:
    return FLAGS_DIR / f"epp_{version}_flags.txt"


def accepted_flags(version: str) -> set[str]:
    path = flags_file(version)
    assert path.exists(), (f"no flag list for the picker {version}: write {path.relative_to(ROOT)} from that "
                           f"release's source (see the header of an existing epp_*_flags.txt)")
    return {line.strip() for line in path.read_text().splitlines() if line.startswith("--")}


def flag_errors(args: list[str], accepted: set[str]) -> list[str]:
    """Why the picker would not start with `args`, one line per reason (none: it parses them)."""
    errors, seen = [], set()
    for arg in args:
        name = arg.partition("=")[0]
        if not arg.startswith("--"):
            errors.append(f"{arg!r} is not a --flag: write --name=value")
        elif name in METRIC_NAME_FLAGS:
            errors.append(f"{name} names a metric: refused at start-up; the names go in engineConfigs")
        elif name not in accepted:
            errors.append(f"{name} is not a flag of this release")
        elif name in seen:
            errors.append(f"{name} given twice")
        seen.add(name)
    return errors


def the_picker(r: Rendered) -> Picker:
    """The container behind the InferencePool's endpointPickerRef (the Service port's target)."""
    (pool,) = r.of_kind("InferencePool")
    ref = pool["spec"]["endpointPickerRef"]
    service = r.get("Service", ref["name"])
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    (pod,) = r.selected(service["spec"]["selector"])
    (container,) = [c for c in pod.containers if port.get("targetPort", port["port"]) in container_ports(c)]
    _, version = image_version(container["image"])
    return Picker(pod, container, version)


def plugins_config(r: Rendered, picker: Picker) -> dict[str, Any]:
    """The EndpointPickerConfig that --config-file names, through its volume mount and ConfigMap."""
    path = picker.flags()["--config-file"]
    (mount,) = [m for m in picker.container.get("volumeMounts", []) if path.startswith(m["mountPath"].rstrip("/") + "/")]
    (volume,) = [v for v in picker.pod.spec["volumes"] if v["name"] == mount["name"]]
    data = r.config_map_data(volume["configMap"]["name"])
    key = path[len(mount["mountPath"].rstrip("/")) + 1:]
    assert key in data, f"{path}: the ConfigMap has {sorted(data)}"
    return yaml.safe_load(data[key])


def plugin(config: dict[str, Any], plugin_type: str) -> dict[str, Any]:
    (spec,) = [p for p in config["plugins"] if p["type"] == plugin_type]
    return spec


def duration_s(value: str) -> float:
    """A Go duration ("600s", "10m", "1m30s") in seconds."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s)", value)
    assert parts and "".join(n + u for n, u in parts) == value, f"{value!r} is not a Go duration"
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1, "ms": 0.001}[u] for n, u in parts)


def spindle_gauges() -> dict[str, float]:
    """The engine gauges Spindle exports on every pool pod's /metrics, name -> value, for stats
    whose three Model Server Protocol readings are told apart by value."""
    stats = SchedulerStats(num_waiting_reqs=5, num_running_reqs=3, kv_cache_usage=0.25)
    return {f.name: f.samples[0].value for f in engine_stats_families(stats, "m") if f.type == "gauge"}


def test_some_overlay_runs_an_endpoint_picker():
    assert POOL_OVERLAYS


@pytest.mark.parametrize("overlay", POOL_OVERLAYS)
def test_every_flag_is_one_the_pinned_picker_accepts(overlay):
    picker = the_picker(rendered(overlay))
    accepted = accepted_flags(picker.version)
    repository, _ = image_version(picker.container["image"])
    assert repository == picker.release.repository, f"{picker.version} is a tag of {picker.release.repository}"
    assert not picker.container.get("command"), "the image's entrypoint is the picker; flags go in args"
    assert flag_errors(picker.container.get("args", []), accepted) == []


def test_flag_errors_names_every_flag_the_picker_would_refuse():
    picker = the_picker(rendered(POOL_OVERLAYS[0]))
    accepted = accepted_flags(picker.version)
    # The manifest's own arguments pass; one wrong flag more does not.
    args = picker.container["args"]
    assert flag_errors(args, accepted) == []
    assert flag_errors(args + ["--total-running-requests-metric=spindle:num_requests_running"], accepted) == [
        "--total-running-requests-metric names a metric: refused at start-up; the names go in engineConfigs"]
    # The old manifest's arguments: a metric flag v1.2.1 lacked and the four it had.
    old = ["--pool-name=spindle", "--total-queued-requests-metric=spindle:num_requests_waiting",
           "--total-running-requests-metric=spindle:num_requests_running",
           "--kv-cache-usage-percentage-metric=spindle:kv_cache_usage_perc", "--lora-info-metric="]
    assert [e.split()[0] for e in flag_errors(old, accepted)] == [a.partition("=")[0] for a in old[1:]]
    wrong = ["--pool_name=spindle", "--model-server-metrics-port=8000", "--grpc-port", "9002",
             "--zap-encoder=json", "--zap-encoder=console"]
    assert flag_errors(wrong, accepted) == [
        "--pool_name is not a flag of this release", "--model-server-metrics-port is not a flag of this release",
        "'9002' is not a --flag: write --name=value", "--zap-encoder given twice"]


@pytest.mark.parametrize("path", sorted(FLAGS_DIR.glob("epp_*_flags.txt")), ids=lambda p: p.name)
def test_every_flags_file_names_its_source_and_lists_no_metric_flag(path):
    version = path.name.removeprefix("epp_").removesuffix("_flags.txt")
    header = "\n".join(line for line in path.read_text().splitlines() if line.startswith("#"))
    assert version in RELEASES, f"{path.name}: add the release's PickerRelease too"
    release = RELEASES[version]
    assert f"{release.repository}:{version}" in header
    assert re.search(rf"tag {re.escape(version)} = commit [0-9a-f]{{40}}", header), "name the tag's commit"
    assert "pkg/epp/server/options.go" in header and "cmd/epp/runner/runner.go" in header
    flags = accepted_flags(version)
    assert {"--pool-name", "--pool-namespace", "--config-file", "--grpc-port", "--grpc-health-port"} <= flags
    assert all(re.fullmatch(r"--[a-z0-9][-a-z0-9]*", flag) for flag in flags)
    assert not flags & METRIC_NAME_FLAGS and not [f for f in flags if f.endswith("-metric")]


@pytest.mark.parametrize("overlay", POOL_OVERLAYS)
def test_spindles_gauge_names_are_in_the_engine_config_the_picker_reads(overlay):
    r = rendered(overlay)
    picker = the_picker(r)
    release = picker.release
    config = plugins_config(r, picker)
    assert config["apiVersion"] in release.config_api_versions and config["kind"] == "EndpointPickerConfig"
    assert set(config) <= release.config_fields, "the picker decodes its config strictly"
    extractor = plugin(config, release.extractor_type)
    source = plugin(config, release.source_type)
    source_params = source.get("parameters") or {}
    assert set(source_params) <= release.source_params
    assert source_params.get("scheme", "http") == "http", "the pool's port 8000 serves plain HTTP"
    # The extractor reads what the metrics source scrapes.
    names = {p["type"]: p.get("name", p["type"]) for p in config["plugins"]}
    assert {"pluginRef": names[release.extractor_type]} in [
        e for s in config["dataLayer"]["sources"] if s["pluginRef"] == names[release.source_type] for e in s["extractors"]]
    params = extractor["parameters"]
    assert set(params) <= release.extractor_params
    gauges = spindle_gauges()
    # Spindle serves no LoRA adapters and exports no cache_config_info: those readings stay off.
    exports_lora = any("lora" in p.read_text().lower() for p in (ROOT / "services").glob("*/metrics.py"))
    assert not exports_lora and "spindle:cache_config_info" not in gauges
    # Every pod of the pool takes the engine its label names, else defaultEngine.
    for pod in r.selected(r.of_kind("InferencePool")[0]["spec"]["selector"]["matchLabels"]):
        engine = next((pod.labels[k] for k in release.engine_label_keys if pod.labels.get(k)),
                      params.get("defaultEngine", release.default_engine))
        (engine_config,) = [e for e in params["engineConfigs"] if e["name"] == engine]
        assert set(engine_config) <= release.engine_config_fields
        read = {key: engine_config.get(key, "") for key in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec")}
        assert {key: gauges.get(spec) for key, spec in read.items()} == {
            "queuedRequestsSpec": 5, "runningRequestsSpec": 3, "kvUsageSpec": 0.25}, read
        # Empty (or absent) turns a reading off; the config says so explicitly.
        assert engine_config.get("loraSpec") == "" and engine_config.get("cacheInfoSpec") == ""
    assert not set(picker.flags()) & METRIC_NAME_FLAGS


@pytest.mark.parametrize("overlay", POOL_OVERLAYS)
def test_picker_names_its_pool_ports_and_probes(overlay):
    r = rendered(overlay)
    picker = the_picker(r)
    flags, ports = picker.flags(), container_ports(picker.container)
    (pool,) = r.of_kind("InferencePool")
    assert flags["--pool-name"] == pool["metadata"]["name"]
    assert flags["--pool-namespace"] == "$(POD_NAMESPACE)"
    assert {v["name"]: v.get("valueFrom") for v in picker.container["env"]}["POD_NAMESPACE"] == {
        "fieldRef": {"fieldPath": "metadata.namespace"}}
    assert flags.get("--pool-group", "inference.networking.k8s.io") == pool["apiVersion"].split("/")[0]
    listen = {flag: int(flags.get(flag, default)) for flag, default in picker.release.default_ports.items()}
    assert {"grpc": ports["grpc"], "grpc-health": ports["grpc-health"], "metrics": ports["metrics"]} == {
        "grpc": listen["--grpc-port"], "grpc-health": listen["--grpc-health-port"], "metrics": listen["--metrics-port"]}
    assert pool["spec"]["endpointPickerRef"]["port"]["number"] in {
        p["port"] for p in r.get("Service", pool["spec"]["endpointPickerRef"]["name"])["spec"]["ports"]
        if ports.get(p["targetPort"]) == listen["--grpc-port"]}
    for kind in ("readinessProbe", "livenessProbe"):
        assert picker.container[kind]["grpc"]["port"] == listen["--grpc-health-port"], kind
    # One replica, so no leader election: the health server answers any service name.
    assert "--ha-enable-leader-election" not in flags


@pytest.mark.parametrize("overlay", POOL_OVERLAYS)
def test_the_picker_outlasts_every_stream_it_routes(overlay):
    """After SIGTERM the picker keeps answering ext-proc for --drain-timeout: that must cover every
    route's request timeout, and the grace period the drain plus a moment to close."""
    r = rendered(overlay)
    picker = the_picker(r)
    drain_s = duration_s(picker.flags()["--drain-timeout"]) if "--drain-timeout" in picker.flags() \
        else picker.release.default_drain_s
    timeouts = [duration_s(rule["timeouts"]["request"]) for route in r.of_kind("HTTPRoute")
                for rule in route["spec"]["rules"] if "request" in rule.get("timeouts", {})]
    assert timeouts and drain_s >= max(timeouts)
    assert picker.pod.spec["terminationGracePeriodSeconds"] >= drain_s + CLOSE_MARGIN_S


@pytest.mark.parametrize("overlay", POOL_OVERLAYS)
def test_the_pickers_service_account_may_do_what_the_release_needs(overlay):
    r = rendered(overlay)
    picker = the_picker(r)
    account = picker.pod.spec["serviceAccountName"]
    granted: dict[tuple[str, str], set[str]] = {}
    for kind, role_kind in (("RoleBinding", "Role"), ("ClusterRoleBinding", "ClusterRole")):
        for binding in r.of_kind(kind):
            if {"kind": "ServiceAccount", "name": account} not in [
                    {"kind": s["kind"], "name": s["name"]} for s in binding["subjects"]]:
                continue
            role = r.get(binding["roleRef"]["kind"], binding["roleRef"]["name"])
            assert role is not None and role["kind"] == role_kind, binding["roleRef"]
            for rule in role["rules"]:
                for group in rule.get("apiGroups", []):
                    for resource in rule.get("resources", []):
                        granted.setdefault((group, resource), set()).update(rule["verbs"])
    missing = {key: sorted(verbs - granted.get(key, set())) for key, verbs in picker.release.rbac.items()
               if verbs - granted.get(key, set())}
    assert missing == {}
