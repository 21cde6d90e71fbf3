"""One idempotent reconcile of a DSV4Deployment: plan purely, apply thinly, then status.

Level-based: every call recomputes everything from the CR and what the cluster holds, so
create, update, resume, the periodic timer and child events (worker pods, the router) all
call the same function. Writes happen only where the cluster differs from the plan.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping, MutableSet, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from dsv4_common.api.deployment import (
    MemoryPlan,
    MemoryPlanError,
    model_from_config_text,
    plan_memory,
)
from dsv4_common.api.load_figures import Latency
from dsv4_common.api.model_files import with_hf_weights
from dsv4_common.api.spec import DeploymentMeta, DeploymentSpec, SpecError, parse_meta, parse_spec
from dsv4_common.core.model import ModelConfig
from dsv4_operator import labels as L
from dsv4_operator import weights as W
from dsv4_operator.autoscale import STATUS_KEY as AUTOSCALING_KEY
from dsv4_operator.autoscale import Autoscaled, Change, autoscale, operator_scales
from dsv4_operator.config import DEFAULT_CONFIG, OperatorConfig
from dsv4_operator.diff import needs_apply, status_patch
from dsv4_operator.flavors import flavor_of
from dsv4_operator.groups import GroupAction, GroupPlan, GroupState, group_states, plan_groups
from dsv4_operator.kube import Kube, KubeError
from dsv4_operator.latency import LatencyTracker, MetricsProbe
from dsv4_operator.manifests import build_pd_secret
from dsv4_operator.modelsource import resolve_model
from dsv4_operator.objects import (
    MANAGED_KINDS,
    OPTIONAL_KINDS,
    DesiredState,
    ObjKey,
    build_desired_state,
    source_errors,
    stamped,
)
from dsv4_operator.observe import Observed, WorkerProbe, pod_state
from dsv4_operator.restarts import format_time, records_from_status
from dsv4_operator.scalers import (
    SCALER_API_VERSION,
    SCALER_KIND,
    external,
    external_roles,
    external_spec,
    scaler_name,
)
from dsv4_operator.status import STATUS_KEYS, Problem, summarize
from dsv4_operator.weights import Event, Hub, WeightsDecision
from dsv4_operator.weights_step import observe as observe_weights
from dsv4_operator.weights_step import owners, resolve_source, stale_objects


@dataclass(frozen=True, slots=True)
class ReconcileResult:
    status: dict[str, Any]
    status_written: bool
    applied: tuple[ObjKey, ...] = ()
    pruned: tuple[ObjKey, ...] = ()
    group_actions: tuple[GroupAction, ...] = ()
    problem: Problem | None = None  # set when the spec was rejected (nothing applied)
    permanent: bool = False  # the problem needs a spec edit (SpecError)
    memory: MemoryPlan | None = None  # the plan, when there is one (the operator's metrics)
    failed_groups: tuple[str, ...] = ()  # groups whose restart budget ran out just now
    scale_changes: tuple[Change, ...] = ()  # roles the autoscaler resized just now
    events: tuple[Event, ...] = ()  # the weights' download: start, each 10%, ready, failed


def utc_clock() -> datetime:
    return datetime.now(UTC)


def reconcile(
    body: Mapping[str, Any],
    kube: Kube,
    probe: WorkerProbe,
    *,
    config: OperatorConfig = DEFAULT_CONFIG,
    clock: Callable[[], datetime] = utc_clock,
    pd_secrets: MutableSet[str] | None = None,
    latency: LatencyTracker | None = None,
    hub: Hub | None = None,
) -> ReconcileResult:
    """
    1. parse and validate the spec; an invalid spec -> PlanValid=False (InvalidSpec), stop
    2. resolve the model (a configMapRef's ConfigMap is read here; an hf:// source is resolved
       through `hub` to a commit, pinned in status, and may bring config.json) and plan
       memory per role and PP rank; an error -> PlanValid=False (PlanFailed), stop
    3. a maxContextTokens that does not fit -> ContextFits=False with the largest fit, stop
       (steps 1-3 apply nothing: no worker pod is created; running workers are left alone)
    3b. an hf:// source: apply the shared download (claim, NetworkPolicy, Job) and observe
       it (`weights_step`, `weights`); until it is complete and matches the plan ->
       WeightsReady=False with its progress, stop (no worker object is built or changed)
    4. autoscaling (engine operator): observe the workers and decide the groups each
       autoscaled role runs (`autoscale.py`); build every desired child object (pure) for
       them; a podTemplate setting a field the operator owns -> PlanValid=False
       (InvalidSpec), stop, nothing applied
    5. observe worker pods, the router and the workers' realized capacity, and plan the PP
       groups (groups.py): which broken groups restart now, with backoff and a budget
       (restarts.py), and which outdated groups roll and with how many surge groups
       (rollout.py)
    6. create the deployment's PD Secret unless it exists (a random value, made once and
       never rewritten, so it does not change under running pods; the operator never reads
       it back: the only Secret it reads is an hf:// source's tokenSecretRef, used only when
       labelled as a hub token; `pd_secrets`
       remembers the deployments it did this for, so a converged deployment costs no write);
       server-side apply each planned object the
       cluster does not already hold (missing or drifted), surge groups included; prune owned
       children no longer planned
    7. delete the pods of the groups that restart or roll (their StatefulSets recreate them);
       observe again if anything was deleted or pruned
    8. summarize status; patch it only when it changed
    """
    meta = _meta(body)
    previous: Mapping[str, Any] = body.get("status") or {}
    now = clock()

    def finish(
        spec: DeploymentSpec | None,
        memory: MemoryPlan | None,
        observed: Observed,
        *,
        groups: Sequence[GroupState] = (),
        applied: tuple[ObjKey, ...] = (),
        pruned: tuple[ObjKey, ...] = (),
        group_plan: GroupPlan | None = None,
        problem: Problem | None = None,
        permanent: bool = False,
        scaled: Autoscaled | None = None,
        weights: WeightsDecision | None = None,
    ) -> ReconcileResult:
        group_actions = group_plan.actions if group_plan is not None else ()
        status = summarize(
            spec,
            memory,
            observed,
            meta.generation,
            meta=meta,
            groups=groups,
            group_plan=group_plan,
            problem=problem,
            previous=previous,
            now=format_time(now),
            weights=weights.condition if weights is not None else None,
            weights_status=weights.status if weights is not None else None,
        )
        if scaled is not None and scaled.status:
            status[AUTOSCALING_KEY] = scaled.status
        elif AUTOSCALING_KEY in previous and (
            memory is None or problem is not None or (weights is not None and not weights.ready)
        ):
            status[AUTOSCALING_KEY] = previous[AUTOSCALING_KEY]  # nothing planned: kept as is
        patch = status_patch(previous, status, STATUS_KEYS)
        if patch is not None:
            kube.patch_status(meta.namespace, meta.name, patch)
        return ReconcileResult(
            status=status,
            status_written=patch is not None,
            applied=applied,
            pruned=pruned,
            group_actions=group_actions,
            problem=problem,
            permanent=permanent,
            memory=memory,
            failed_groups=group_plan.failed if group_plan is not None else (),
            scale_changes=scaled.changes if scaled is not None else (),
            events=weights.events if weights is not None else (),
        )

    # Steps 1-3.
    try:
        spec = parse_spec(body)
        if errors := source_errors(spec):  # what a cluster cannot read (a local path)
            raise SpecError(errors)
    except SpecError as exc:
        problem = Problem("InvalidSpec", str(exc))
        return finish(None, None, Observed(), problem=problem, permanent=True)
    source = resolve_source(spec, meta, previous, kube, hub, config.hf_endpoint)
    failed = None
    if source is not None and source.error is not None:
        failed = W.unresolved(spec, source.error.reason, source.error.message, previous, now)
    resolved = source.resolved if source is not None else None
    try:
        origin_config = resolved.config_text if resolved is not None else None
        model = resolve_model(spec, meta.namespace, kube, origin_config)
        memory = plan_memory(spec, model.config)
    except MemoryPlanError as exc:  # not permanent: a missing ConfigMap may appear later
        problem = Problem("PlanFailed", str(exc))
        return finish(spec, None, Observed(), problem=problem, weights=failed)
    if not memory.context_fits:
        problem = Problem("ContextTooLong", memory.context_message())
        return finish(spec, memory, Observed(), problem=problem, weights=failed)

    # Step 3b: an hf:// source's download, shared with the namespace's other users of it.
    weights, weights_applied = _weights(
        spec, meta, memory, resolved, failed, kube, probe, previous=previous, now=now, config=config
    )
    if not weights.ready:
        return finish(spec, memory, Observed(), applied=weights_applied, weights=weights)
    if resolved is not None and weights.target is not None:
        spec = with_hf_weights(spec, weights.target.claim, resolved.commit)

    # Step 4. Autoscaling first: the groups each role runs; then the children for them. A
    # podTemplate that sets what the operator owns is an invalid spec too.
    scaled: Autoscaled | None = None
    seen: Observed | None = None
    if operator_scales(spec):
        seen = _observe(kube, probe, meta, spec)
        figures = _latency(spec, meta, probe, seen, latency, now)
        scaled = autoscale(spec, meta.name, seen, previous, now, figures)
        spec = scaled.spec
    elif external(spec):  # an HPA or KEDA sets the groups through each role's scaler
        live_scalers = {
            role: kube.get(
                SCALER_API_VERSION, SCALER_KIND, meta.namespace, scaler_name(meta.name, role)
            )
            for role in external_roles(spec)
        }
        spec = external_spec(spec, live_scalers)
    try:
        desired = build_desired_state(
            spec,
            meta,
            memory,
            default_image=config.default_image,
            metrics_scrape_namespace=config.metrics_scrape_namespace,
            operator_namespace=config.operator_namespace,
            pod_security=config.pod_security,
            model_config_hash=model.config_hash,
        )
    except SpecError as exc:
        problem = Problem("InvalidSpec", str(exc))
        return finish(None, None, Observed(), problem=problem, permanent=True)

    # Step 5: what runs decides the restarts and the roll (which surge groups exist).
    live = _list_owned(kube, meta, desired.prune_selector)
    observed = seen if seen is not None else _observe(kube, probe, meta, spec)
    surge_live = _live_surge(live, spec)
    groups = group_states(spec, meta.name, desired.template_hashes, observed.pods, surge_live)
    group_plan = plan_groups(spec, groups, records_from_status(previous), now)
    planned = desired.with_surge(group_plan.surge)

    # Step 6.
    applied = list(weights_applied)
    made = f"{meta.namespace}/{meta.name}/{meta.uid}"
    if pd_secrets is None or made not in pd_secrets:
        if kube.create(build_pd_secret(meta, secrets.token_hex(32))):
            applied.append(("v1", "Secret", L.pd_secret_name(meta.name)))
        if pd_secrets is not None:
            pd_secrets.add(made)
    for obj in planned.objects:
        key = (obj["apiVersion"], obj["kind"], obj["metadata"]["name"])
        if needs_apply(obj, live.get(key)):
            kube.apply(obj)
            applied.append(key)
    pruned = []
    for key in sorted(live.keys() - planned.keys()):
        if _owned_by(live[key], meta):
            kube.delete(key[0], key[1], meta.namespace, key[2])
            pruned.append(key)

    # Step 7.
    for action in group_plan.actions:
        selector = L.selector_string(L.group_selector(meta.name, action.group))
        kube.delete_pods(meta.namespace, selector)
    if group_plan.actions or pruned:
        observed = _observe(kube, probe, meta, spec)
    groups = group_states(spec, meta.name, desired.template_hashes, observed.pods, group_plan.surge)

    # Step 8.
    if weights.target is not None:  # a revision this CR left: its download, when it was the last
        pruned += _prune_stale_weights(kube, meta, weights.target.key)
    return finish(
        spec,
        memory,
        observed,
        groups=groups,
        applied=tuple(applied),
        pruned=tuple(pruned),
        group_plan=group_plan,
        scaled=scaled,
        weights=weights,
    )


def _latency(
    spec: DeploymentSpec,
    meta: DeploymentMeta,
    probe: WorkerProbe,
    observed: Observed,
    tracker: LatencyTracker | None,
    now: datetime,
) -> dict[L.WorkerRole, Latency] | None:
    """The latency of each role with a latency target, from its serving pods' /metrics."""
    if tracker is None or not isinstance(probe, MetricsProbe):
        return None
    out: dict[L.WorkerRole, Latency] = {}
    for role in L.WORKER_ROLES:
        auto = spec.role(role).autoscaling
        if auto is None or not auto.targets.latency:
            continue
        pods = [p for p in observed.pods if p.role == role and p.pp_rank == L.SERVING_RANK]
        figure = tracker.update(
            (meta.namespace, meta.name),
            role,
            probe.metrics(pods),
            auto.targets.latency_percentile,
            now.timestamp(),
        )
        if figure is not None:
            out[role] = figure
    return out


def _weights(
    spec: DeploymentSpec,
    meta: DeploymentMeta,
    memory: MemoryPlan,
    resolved: W.Resolved | None,
    failed: WeightsDecision | None,
    kube: Kube,
    probe: WorkerProbe,
    *,
    previous: Mapping[str, Any],
    now: datetime,
    config: OperatorConfig,
) -> tuple[WeightsDecision, tuple[ObjKey, ...]]:
    """The weights' decision, and the shared objects applied for it (a Job whose template
    changed is deleted: the next reconcile creates it again, and it resumes)."""
    if spec.model.hf is None:
        return W.not_hf(spec), ()
    if resolved is None:
        assert failed is not None
        return failed, ()
    target = W.target_of(spec, resolved)
    repo_model = _repo_model(spec, resolved)
    decision = W.decide(
        spec,
        meta,
        resolved,
        observe_weights(kube, probe, meta.namespace, target),
        owners=owners(kube, meta, target.key),
        previous=previous,
        now=now,
        image=spec.image or config.default_image,
        endpoint=spec.model.hub.endpoint or config.hf_endpoint,
        tensor_mismatch=W.config_mismatch(spec, memory.prefill.inputs.model, repo_model),
    )
    applied = []
    if decision.recreate_job:
        kube.delete("batch/v1", "Job", meta.namespace, target.job)
    selector = L.selector_string({L.WEIGHTS_KEY_LABEL: target.key})
    live = {
        (api_version, kind, o["metadata"]["name"]): o
        for api_version, kind in WEIGHTS_KINDS
        for o in kube.list(api_version, kind, meta.namespace, selector)
    }
    for obj in (stamped(o) for o in decision.objects):
        key = (obj["apiVersion"], obj["kind"], obj["metadata"]["name"])
        if needs_apply(obj, live.get(key)):
            kube.apply(obj)
            applied.append(key)
    return decision, tuple(applied)


def _repo_model(spec: DeploymentSpec, resolved: W.Resolved) -> ModelConfig | None:
    """The repo's own config.json's model (None: none, or one the planner cannot read)."""
    if resolved.config_text is None or spec.model.config_from_origin:
        return None
    try:
        return model_from_config_text(spec, resolved.config_text, name="repo")
    except MemoryPlanError:
        return None


# The shared download's kinds, in apply order.
WEIGHTS_KINDS: tuple[tuple[str, str], ...] = (
    ("v1", "PersistentVolumeClaim"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
    ("batch/v1", "Job"),
)


def _prune_stale_weights(kube: Kube, meta: DeploymentMeta, key: str) -> list[ObjKey]:
    """Downloads of other revisions whose only owner is this CR: deleted (a claim still
    mounted by old pods goes once they are gone). Co-owned ones are left: their other owners'
    applies drop this CR's reference (one field manager owns the list)."""
    pruned = []
    for obj_key, obj in stale_objects(kube, meta, key, WEIGHTS_KINDS):
        refs = obj["metadata"].get("ownerReferences") or []
        if all(r.get("uid") == meta.uid for r in refs):
            kube.delete(obj_key[0], obj_key[1], meta.namespace, obj_key[2])
            pruned.append(obj_key)
    return pruned


def _meta(body: Mapping[str, Any]) -> DeploymentMeta:
    """The CR's metadata; a name the CRD should have refused still gets a status (parse_spec
    reports it as the problem)."""
    try:
        return parse_meta(body)
    except SpecError:
        raw = body.get("metadata") or {}
        return DeploymentMeta(
            name=str(raw.get("name", "")),
            namespace=str(raw.get("namespace") or "default"),
            uid=raw.get("uid"),
            generation=int(raw.get("generation") or 0),
        )


def _list_owned(kube: Kube, meta: DeploymentMeta, selector: str) -> dict[ObjKey, dict[str, Any]]:
    live: dict[ObjKey, dict[str, Any]] = {}
    for api_version, kind in MANAGED_KINDS:
        try:
            objects = kube.list(api_version, kind, meta.namespace, selector)
        except KubeError as exc:
            if exc.status != 404 or (api_version, kind) not in OPTIONAL_KINDS:
                raise
            objects = []  # not served here (e.g. no Volcano): none of ours can exist
        for obj in objects:
            live[(api_version, kind, obj["metadata"]["name"])] = obj
    return live


def _live_surge(
    live: Mapping[ObjKey, Mapping[str, Any]], spec: DeploymentSpec
) -> dict[L.WorkerRole, int]:
    """Per role, how many surge slots are taken: one past the highest surge StatefulSet index
    that the role's rollout.maxSurge still allows (beyond it: pruned)."""
    out: dict[L.WorkerRole, int] = {role: 0 for role in L.WORKER_ROLES}
    for (_, kind, _), obj in live.items():
        labels = obj.get("metadata", {}).get("labels") or {}
        role, index = labels.get(L.ROLE_LABEL), labels.get(L.REPLICA_LABEL, "")
        if kind != "StatefulSet" or role not in L.WORKER_ROLES or not index.isdigit():
            continue
        r = spec.role(role)
        slot = int(index) - r.replicas
        if 0 <= slot < r.rollout.max_surge:
            out[role] = max(out[role], slot + 1)
    return out


def _owned_by(obj: Mapping[str, Any], meta: DeploymentMeta) -> bool:
    """Never prune what another owner controls, even if it carries our labels."""
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    if meta.uid is None:
        return False
    return any(r.get("uid") == meta.uid for r in refs)


def _observe(
    kube: Kube, probe: WorkerProbe, meta: DeploymentMeta, spec: DeploymentSpec
) -> Observed:
    pods = tuple(
        pod_state(p) for p in kube.list("v1", "Pod", meta.namespace, L.worker_selector(meta.name))
    )
    router = kube.get("apps/v1", "Deployment", meta.namespace, L.router_name(meta.name))
    ready_replicas = int(((router or {}).get("status") or {}).get("readyReplicas") or 0)
    return flavor_of(spec).observe(probe, pods, ready_replicas)


__all__ = ["DesiredState", "OperatorConfig", "ReconcileResult", "reconcile", "utc_clock"]
