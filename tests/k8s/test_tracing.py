"""Trace sampling: every Spindle container keeps a share of new traces (parentbased_traceidratio,
the ratio in k8s/base/config.env), not every request, and the services' tracing set-up really
applies the variables the manifests set."""
from __future__ import annotations

import pytest

from tests.k8s.manifests import OVERLAYS, ROOT, rendered

SAMPLER = "parentbased_traceidratio"


def config_env() -> dict[str, str]:
    lines = (ROOT / "k8s" / "base" / "config.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def test_config_env_sets_a_parent_based_ratio_below_one():
    settings = config_env()
    assert settings["OTEL_TRACES_SAMPLER"] == SAMPLER
    assert 0.0 < float(settings["OTEL_TRACES_SAMPLER_ARG"]) < 1.0


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_spindle_container_samples_with_the_configured_ratio(overlay):
    r = rendered(overlay)
    expected = config_env()
    containers = r.spindle_containers()
    assert containers
    for pod, container in containers:
        env = r.environment(container)
        assert env.get("OTEL_EXPORTER_OTLP_ENDPOINT"), f"{pod.owner}/{container['name']}: tracing off"
        assert (env.get("OTEL_TRACES_SAMPLER"), env.get("OTEL_TRACES_SAMPLER_ARG")) == (
            expected["OTEL_TRACES_SAMPLER"], expected["OTEL_TRACES_SAMPLER_ARG"]), f"{pod.owner}/{container['name']}"


def test_the_services_tracing_applies_the_sampler_variables(monkeypatch):
    """services.common.telemetry builds its TracerProvider without a sampler of its own, so the
    SDK reads OTEL_TRACES_SAMPLER(_ARG): new traces at the ratio, children as their parent."""
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    from services.common.telemetry import setup_tracing

    settings = config_env()
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", settings["OTEL_TRACES_SAMPLER"])
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", settings["OTEL_TRACES_SAMPLER_ARG"])
    tracing = setup_tracing("spindle-frontend", None, exporter=InMemorySpanExporter())
    try:
        sampler = tracing.provider.sampler
        assert isinstance(sampler, ParentBased)
        assert isinstance(sampler._root, TraceIdRatioBased)
        assert sampler._root.rate == float(settings["OTEL_TRACES_SAMPLER_ARG"])
    finally:
        tracing.shutdown()
