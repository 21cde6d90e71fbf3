"""The admission decision (`admission.review`), pure: what the validating webhook refuses (with
the reconcile's reason and message, the field named; an unfit context naming the largest
context that fits), what it must always admit (DELETE, status and metadata-only updates), and
what it admits with a warning (a model that cannot be read yet)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from model_samples import tiny_hf_config
from repo_paths import SAMPLES
from support import crd_support as S
from support.fake_kube import FakeKube

from dsv4_common.api.deployment import plan_memory
from dsv4_common.api.spec import parse_spec
from dsv4_operator.admission import (
    ADMITTED,
    AdmissionRequest,
    Verdict,
    cluster_resolver,
    review,
)
from dsv4_operator.kube import KubeError

Body = dict[str, Any]
INVALID = S.invalid_samples()


def sample(name: str = "tiny-cpu.yaml", **spec: Any) -> Body:
    body: Body = yaml.safe_load((SAMPLES / name).read_text())
    body["metadata"].update({"namespace": "team-a", "uid": "uid-1"})
    body["spec"].update(spec)
    return body


def create(body: Body, **kwargs: Any) -> Verdict:
    return review(AdmissionRequest("CREATE", body), **kwargs)


def flash_on(memory_gib: int, context: int) -> Body:
    """DeepSeek-V4-Flash, TP 4, on GPUs of `memory_gib`: decode's KV pool bounds the context."""
    gpu = {"memoryGiB": memory_gib, "perPod": 4}
    return sample("flash-gpu.yaml", gpu=gpu, maxContextTokens=context)


def test_a_fitting_cr_is_admitted() -> None:
    assert create(sample()) == ADMITTED
    assert create(sample("flash-gpu.yaml")) == ADMITTED


def test_an_unfit_context_is_refused_naming_the_largest_fit_which_is_admitted() -> None:
    body = flash_on(52, 1_000_000)
    largest = plan_memory(parse_spec(body)).max_context_tokens
    assert 0 < largest < 1_000_000
    verdict = create(body)
    assert not verdict.allowed and verdict.reason == "ContextTooLong"
    assert f"the largest context that fits is {largest} tokens" in verdict.message
    assert "decode PP rank 0" in verdict.message  # the bottleneck, as the status says it
    assert verdict.refusal.startswith("ContextTooLong: maxContextTokens 1000000 does not fit")
    # The largest fit it names is admitted; one token more is not.
    assert create(flash_on(52, largest)) == ADMITTED
    assert create(flash_on(52, largest + 1)).reason == "ContextTooLong"


def test_a_context_beyond_the_models_is_refused_naming_the_models_context() -> None:
    verdict = create(sample(maxContextTokens=100_000))
    assert verdict.reason == "ContextTooLong"
    assert "the model's context is 4096 tokens" in verdict.message
    assert "the largest context that fits is 4096 tokens" in verdict.message


@pytest.mark.parametrize("path", INVALID, ids=[p.name for p in INVALID])
def test_an_invalid_spec_is_refused_naming_the_field(path: Path) -> None:
    body = yaml.safe_load(path.read_text())
    verdict = create(body)
    assert not verdict.allowed and verdict.reason == "InvalidSpec"
    assert S.expected_path(path) in verdict.message, verdict.message


def test_a_plan_failure_is_refused_naming_the_field() -> None:
    verdict = create(flash_on(40, 131072))  # the weights alone do not fit
    assert not verdict.allowed and verdict.reason == "PlanFailed"
    assert verdict.message.startswith("spec.prefill: PP rank 0: weights need")


def test_a_pod_template_setting_an_operator_field_is_refused_naming_it() -> None:
    template = {"spec": {"containers": [{"name": "worker", "command": ["sh"]}]}}
    body = sample(decode={"podTemplate": template})
    verdict = create(body)
    assert not verdict.allowed and verdict.reason == "InvalidSpec"
    assert verdict.message == (
        "spec.decode.podTemplate.spec.containers[worker].command: owned by the operator"
    )
    allowed = {"spec": {"containers": [{"name": "worker", "env": [{"name": "A", "value": "1"}]}]}}
    assert create(sample(decode={"podTemplate": allowed})) == ADMITTED


def test_an_update_that_changes_the_spec_is_checked() -> None:
    old = sample()
    new = sample(maxContextTokens=100_000)
    verdict = review(AdmissionRequest("UPDATE", new, old))
    assert verdict.reason == "ContextTooLong"
    assert review(AdmissionRequest("UPDATE", sample(maxContextTokens=2048), old)) == ADMITTED


def unfit_with(**meta: Any) -> Body:
    body = sample(maxContextTokens=100_000)
    body["metadata"].update(meta)
    return body


@pytest.mark.parametrize(
    "request_",
    [
        AdmissionRequest("DELETE", None, unfit_with()),
        AdmissionRequest("CONNECT", unfit_with()),
        # kopf's own writes: its finalizer and annotations, and status.
        AdmissionRequest("UPDATE", unfit_with(finalizers=["x/finalizer"]), unfit_with()),
        AdmissionRequest("UPDATE", unfit_with(annotations={"a": "b"}), unfit_with()),
        AdmissionRequest("UPDATE", unfit_with(), unfit_with(), subresource="status"),
        # An object being deleted: its finalizer must come off whatever its spec says.
        AdmissionRequest("UPDATE", unfit_with(deletionTimestamp="2026-01-01T00:00:00Z"), sample()),
    ],
    ids=["delete", "connect", "finalizer", "annotations", "status", "deleting"],
)
def test_what_changes_no_spec_is_admitted_even_for_an_unfit_cr(
    request_: AdmissionRequest,
) -> None:
    assert review(request_) == ADMITTED


def test_a_config_path_not_mounted_here_is_admitted_with_a_warning() -> None:
    body = sample("flash-gpu.yaml", model={"configPath": "/models/not-mounted-here/config.json"})
    verdict = create(body)
    assert verdict.allowed
    (warning,) = verdict.warnings
    assert warning.startswith("spec.model.configPath: ")
    assert "status will report it" in warning


def config_map_cr(context: int = 4096) -> Body:
    body = sample(
        "tiny-cpu.yaml",
        model={"configMapRef": {"name": "tiny-model"}},
        maxContextTokens=context,
        gpu={"type": "h100-80gb", "perPod": 1},
    )
    return body


def with_config_map(kube: FakeKube, text: str) -> FakeKube:
    kube.objects[("v1", "ConfigMap", "team-a", "tiny-model")] = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "tiny-model", "namespace": "team-a"},
        "data": {"config.json": text},
    }
    return kube


def test_a_config_map_model_is_read_through_the_api_and_planned() -> None:
    body = config_map_cr()
    kube = with_config_map(FakeKube(body), tiny_hf_config(max_position_embeddings=8192))
    resolve = cluster_resolver("team-a", kube)
    assert create(body, resolve=resolve) == ADMITTED
    verdict = create(config_map_cr(context=100_000), resolve=resolve)
    assert verdict.reason == "ContextTooLong"
    assert "the model's context is 8192 tokens" in verdict.message


class FailingKube(FakeKube):
    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Body | None:
        raise KubeError("get: 503 Service Unavailable", retryable=True, status=503)


@pytest.mark.parametrize(
    ("kube_for", "warning"),
    [
        (FakeKube, "ConfigMap team-a/tiny-model not found"),
        (lambda body: with_config_map(FakeKube(body), "{not json"), "spec.model.configMapRef"),
        (FailingKube, "503 Service Unavailable"),
    ],
    ids=["missing", "unparsable", "api-error"],
)
def test_a_config_map_model_not_readable_yet_is_admitted_with_a_warning(
    kube_for: Callable[[Body], FakeKube], warning: str
) -> None:
    body = config_map_cr(context=100_000)  # unfit for the tiny model: not known yet
    verdict = create(body, resolve=cluster_resolver("team-a", kube_for(copy.deepcopy(body))))
    assert verdict.allowed
    (text,) = verdict.warnings
    assert warning in text
    # Without a cluster (the default resolver) it cannot be read either.
    assert create(body).allowed and create(body).warnings
