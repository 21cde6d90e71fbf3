"""Every object the operator renders from the committed samples (those it can plan without a
cluster: a `configMapRef` or a `configPath` absent here is skipped), and from tiny-cpu.yaml with
fields no committed sample sets (an API key's Secret: a sample with one would need the key to
run under `dsv4 up`); for an hf:// sample, also the shared download objects (claim,
NetworkPolicy, Job) it applies before them."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import yaml
from repo_paths import SAMPLES
from support import checkov_scan

from dsv4_common.api.deployment import MemoryPlanError
from dsv4_common.api.spec import SpecError, parse_meta, parse_spec
from dsv4_operator import weights as W
from dsv4_operator.render import desired_state_for

SCAN = checkov_scan.load()
GIB = 1 << 30


def rendered_objects() -> Iterator[dict[str, Any]]:
    for path in sorted(SAMPLES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc.get("kind") != "DSV4Deployment":
                continue
            if str(doc["spec"]["model"].get("source", "")).startswith("hf://"):
                yield from _download_objects(path)
            try:
                yield from desired_state_for(doc).objects
            except (SpecError, MemoryPlanError):
                continue  # needs the cluster (a ConfigMap) or a local config.json
    tiny = yaml.safe_load((SAMPLES / "tiny-cpu.yaml").read_text())
    tiny["metadata"]["name"] = "tiny-keyed"
    tiny["spec"]["apiKey"] = {"secretRef": {"name": "tiny-api-key"}}
    yield from desired_state_for(tiny).objects


def _download_objects(path: Any) -> Iterator[dict[str, Any]]:
    body, config = SCAN.sample_input(path)
    body["metadata"].update(namespace=SCAN.SAMPLE_NAMESPACE)
    spec, meta = parse_spec(body), parse_meta(body)
    hf = spec.model.hf
    assert hf is not None
    resolved = W.Resolved(hf, hf.revision, 160 * GIB, 50, config)
    decision = W.decide(
        spec,
        meta,
        resolved,
        W.Seen(),
        owners=[],  # as rendered for a file never applied: no owners
        previous={},
        now=datetime(2026, 1, 1, tzinfo=UTC),
        image="ghcr.io/dsv4-serve/worker:0.1.0",
        endpoint=None,
    )
    yield from decision.objects
    yield from desired_state_for(body, namespace=SCAN.SAMPLE_NAMESPACE, model_config=config).objects
