"""Admission of a DSV4Deployment: the validating webhook's decision. It runs the reconcile's
steps 1-4 (parse, resolve the model and plan, context fit, desired state) on the object the API
server is about to store, so that `kubectl apply` (and `--dry-run=server`) refuses what the
reconcile would reject, with the same message. Pure apart from the `Kube` port and the model
resolver it is handed: `handlers.py` passes the request in.

NOTE: a model that cannot be read yet never refuses a CR. Reading the model config can fail: a
`configPath` not mounted in the operator pod, a ConfigMap not created yet or without the key,
or an API error. That failure is the cluster's state, not the spec's, and may go away without a
spec edit. So the CR is admitted with a warning, and the reconcile reports the problem
(PlanValid=False, PlanFailed) until the model can be read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from dsv4_common.api.deployment import MemoryPlanError, load_model, plan_memory
from dsv4_common.api.model_files import with_hf_weights
from dsv4_common.api.spec import DeploymentSpec, SpecError, parse_meta, parse_spec
from dsv4_common.core.model import ModelConfig
from dsv4_operator.config import DEFAULT_CONFIG, OperatorConfig
from dsv4_operator.kube import Kube, KubeError
from dsv4_operator.modelsource import resolve_model
from dsv4_operator.objects import build_desired_state, source_errors

# kopf serves a handler at /<handler id>. The chart's ValidatingWebhookConfiguration calls this
# path, and a chart test checks that the two agree: at any other path, kopf runs no handler
# and admits everything.
WEBHOOK_ID: Final = "validate-dsv4deployment"
WEBHOOK_PATH: Final = f"/{WEBHOOK_ID}"
# The webhook's name in the chart's ValidatingWebhookConfiguration. The API server's refusal
# names it: 'admission webhook "<name>" denied the request: <reason>: <message>'.
WEBHOOK_NAME: Final = "validate.dsv4deployments.serving.dsv4.io"
# The webhook's matchConditions in the chart (Kubernetes >= 1.28 evaluates them): the API server
# skips the webhook for what review() admits anyway, kopf's finalizer and annotation patches
# included, so those never wait for (or fail on) the webhook.
MATCH_CONDITIONS: Final = (
    {
        "name": "spec-changed",
        "expression": "request.operation == 'CREATE' || object.spec != oldObject.spec",
    },
    {"name": "not-deleting", "expression": "!has(object.metadata.deletionTimestamp)"},
)
# The HTTP status of a refusal (the API server passes it on to the client): the object is invalid.
REFUSAL_CODE: Final = 422
CHECKED_OPERATIONS: Final = frozenset({"CREATE", "UPDATE"})
# An hf:// source's pods are checked as if mounting this commit (the reconcile resolves it).
ADMISSION_COMMIT: Final = "0" * 40

# spec -> its model config. A MemoryPlanError or KubeError means that the model cannot be read.
ModelResolver = Callable[[DeploymentSpec], ModelConfig]


@dataclass(frozen=True, slots=True)
class AdmissionRequest:
    """The parts of an AdmissionReview request the decision reads. A dry run gets the same
    decision: the decision has no side effects."""

    operation: str  # CREATE, UPDATE, DELETE or CONNECT
    obj: Mapping[str, Any] | None  # the object as it would be stored (None on DELETE)
    old: Mapping[str, Any] | None = None  # the stored object (UPDATE, DELETE)
    subresource: str | None = None  # e.g. "status"; None for the main resource


@dataclass(frozen=True, slots=True)
class Verdict:
    allowed: bool
    reason: str = ""  # when refused: InvalidSpec, PlanFailed or ContextTooLong
    message: str = ""
    warnings: tuple[str, ...] = ()  # shown by kubectl as "Warning: ..."

    @property
    def refusal(self) -> str:
        """What the API server tells the client after 'denied the request: '."""
        return f"{self.reason}: {self.message}"


ADMITTED: Final = Verdict(allowed=True)


def cluster_resolver(namespace: str, kube: Kube) -> ModelResolver:
    """The reconcile's model resolution (`modelsource.resolve_model`: a configMapRef is read
    through `kube` from the CR's namespace), for a CR in `namespace`."""
    return lambda spec: resolve_model(spec, namespace, kube).config


def review(
    request: AdmissionRequest,
    *,
    resolve: ModelResolver = load_model,
    config: OperatorConfig = DEFAULT_CONFIG,
) -> Verdict:
    """
    1. admit what changes no spec: DELETE, a subresource, an object being deleted, and an
       UPDATE that leaves the spec alone (kopf's finalizer and annotation patches). These must
       never fail, even for a CR that was admitted before the webhook existed.
    2. parse the spec -> refuse InvalidSpec (the error names the field)
    3. resolve the model -> admit with a warning if it cannot be read (see the NOTE above)
    4. plan memory -> refuse PlanFailed (the error names the field)
    5. check that maxContextTokens fits -> refuse ContextTooLong, naming the largest fit
    6. build the desired state -> refuse InvalidSpec (a podTemplate setting an operator field)
    """
    body = request.obj
    if (
        request.operation not in CHECKED_OPERATIONS
        or request.subresource is not None
        or body is None
        or (body.get("metadata") or {}).get("deletionTimestamp")
        or (request.operation == "UPDATE" and _spec(request.old) == _spec(body))
    ):
        return ADMITTED
    try:
        spec = parse_spec(body)
        meta = parse_meta(body)
        if errors := source_errors(spec):
            raise SpecError(errors)
    except SpecError as exc:
        return _refuse("InvalidSpec", exc)
    try:
        model = resolve(spec)
    except (MemoryPlanError, KubeError) as exc:
        warning = f"{exc} (not checked at admission; the DSV4Deployment's status will report it)"
        return Verdict(allowed=True, warnings=(warning,))
    try:
        memory = plan_memory(spec, model)
    except MemoryPlanError as exc:
        return _refuse("PlanFailed", exc)
    if not memory.context_fits:
        return Verdict(allowed=False, reason="ContextTooLong", message=memory.context_message())
    if spec.model.hf is not None:  # the workers mount its snapshot, at a commit not known here
        spec = with_hf_weights(spec, "admission", ADMISSION_COMMIT)
    try:
        build_desired_state(
            spec,
            meta,
            memory,
            default_image=config.default_image,
            metrics_scrape_namespace=config.metrics_scrape_namespace,
            operator_namespace=config.operator_namespace,
            pod_security=config.pod_security,
        )
    except SpecError as exc:
        return _refuse("InvalidSpec", exc)
    return ADMITTED


def _refuse(reason: str, exc: Exception) -> Verdict:
    return Verdict(allowed=False, reason=reason, message=str(exc))


def _spec(body: Mapping[str, Any] | None) -> Any:
    return None if body is None else body.get("spec")
