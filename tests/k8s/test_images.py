"""Every image of every rendered overlay is fully qualified: registry/repository:tag."""
from __future__ import annotations

import re

import pytest

from tests.k8s.manifests import OVERLAYS, rendered

# registry host (a dot, a port or localhost) / repository path : tag, and optionally @digest.
QUALIFIED_IMAGE = re.compile(r"^(?P<registry>[a-z0-9-]+(\.[a-z0-9-]+)+(:\d+)?|localhost(:\d+)?)"
                             r"/(?P<repository>[a-z0-9]+([._/-][a-z0-9]+)*):(?P<tag>[\w][\w.-]{0,127})"
                             r"(@sha256:[0-9a-f]{64})?$")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_are_fully_qualified(overlay):
    """registry/repository:tag everywhere, init containers too: a short name means whatever
    registry the node's runtime searches first (docker.io, or a mirror's look-alike)."""
    for pod in rendered(overlay).pod_templates():
        for container in pod.containers + pod.spec.get("initContainers", []):
            image = container["image"]
            assert QUALIFIED_IMAGE.match(image), f"{pod.owner}/{container['name']}: {image} is not registry/repo:tag"


def test_the_image_check_refuses_short_names():
    for image in ("spindle:0.1.0", "jaegertracing/jaeger:2.5.0", "docker.io/library/spindle",
                  "docker.io/library/spindle:"):
        assert not QUALIFIED_IMAGE.match(image), image
    for image in ("docker.io/library/spindle:0.1.0", "ghcr.io/llm-d/llm-d-router-endpoint-picker:v0.10.0",
                  "registry.example.com:5000/ml/spindle-cuda:0.1.0", "localhost:5000/spindle:0.1.0"):
        assert QUALIFIED_IMAGE.match(image), image
