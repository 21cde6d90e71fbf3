"""Every object the operator renders from the committed samples (those it can plan without a
cluster: a `configMapRef` or a `configPath` absent here is skipped), and from tiny-cpu.yaml with
fields no committed sample sets (an API key's Secret: a sample with one would need the key to
run under `dsv4 up`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import yaml
from repo_paths import SAMPLES

from dsv4_common.api.deployment import MemoryPlanError
from dsv4_common.api.spec import SpecError
from dsv4_operator.render import desired_state_for


def rendered_objects() -> Iterator[dict[str, Any]]:
    for path in sorted(SAMPLES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc.get("kind") != "DSV4Deployment":
                continue
            try:
                yield from desired_state_for(doc).objects
            except (SpecError, MemoryPlanError):
                continue  # needs the cluster (a ConfigMap) or a local config.json
    tiny = yaml.safe_load((SAMPLES / "tiny-cpu.yaml").read_text())
    tiny["metadata"]["name"] = "tiny-keyed"
    tiny["spec"]["apiKey"] = {"secretRef": {"name": "tiny-api-key"}}
    yield from desired_state_for(tiny).objects
