"""Gang scheduling of PP groups (`spec.scheduling.gang`): one PodGroup per group, so that a
group's PP ranks are bound together or not at all, and what ties the group's pods to it.

- `volcano`: a `scheduling.volcano.sh/v1beta1` PodGroup; the pods carry `schedulerName: volcano`
  and the annotation `scheduling.k8s.io/group-name`.
- `coscheduling` (kubernetes-sigs/scheduler-plugins): a `scheduling.x-k8s.io/v1alpha1` PodGroup;
  the pods carry the label `scheduling.x-k8s.io/pod-group` and the scheduler name of the
  plugins' second-scheduler install, `scheduler-plugins-scheduler`.

A podTemplate's `schedulerName` overrides either scheduler name. A PodGroup is named after its
group (the StatefulSet), carries the group's labels and the CR's ownerReference, has minMember =
the PP size and, on GPUs, minResources = the group's GPUs. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from dsv4_common.api.names import GPU_RESOURCE, GangScheduler
from dsv4_common.api.spec import DeploymentMeta, DeploymentSpec
from dsv4_operator import labels as L
from dsv4_operator.manifests import Obj, group_meta

VOLCANO_API_VERSION: Final = "scheduling.volcano.sh/v1beta1"
COSCHEDULING_API_VERSION: Final = "scheduling.x-k8s.io/v1alpha1"
POD_GROUP_KINDS: Final = ((VOLCANO_API_VERSION, "PodGroup"), (COSCHEDULING_API_VERSION, "PodGroup"))
VOLCANO_SCHEDULER: Final = "volcano"
COSCHEDULING_SCHEDULER: Final = "scheduler-plugins-scheduler"
VOLCANO_GROUP_ANNOTATION: Final = "scheduling.k8s.io/group-name"
COSCHEDULING_GROUP_LABEL: Final = "scheduling.x-k8s.io/pod-group"


@dataclass(frozen=True, slots=True)
class GangPodFields:
    """What a group's pod template carries to join its PodGroup."""

    scheduler_name: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)


def pod_fields(gang: GangScheduler, group: str) -> GangPodFields:
    if gang == "volcano":
        return GangPodFields(VOLCANO_SCHEDULER, annotations={VOLCANO_GROUP_ANNOTATION: group})
    if gang == "coscheduling":
        return GangPodFields(COSCHEDULING_SCHEDULER, labels={COSCHEDULING_GROUP_LABEL: group})
    return GangPodFields()


def build_pod_group(
    meta: DeploymentMeta, spec: DeploymentSpec, role: L.WorkerRole, replica: int, template: Obj
) -> Obj | None:
    """The PodGroup of one PP group (None without gang scheduling). `template` is the group's
    pod template as merged: Volcano orders gangs by its priorityClassName."""
    gang = spec.scheduling.gang
    if gang == "none":
        return None
    pp = spec.role(role).pipeline_parallel
    pg_spec: Obj = {"minMember": pp}
    if not spec.gpu.cpu_mode:
        pg_spec["minResources"] = {GPU_RESOURCE: str(pp * spec.gpu.per_pod)}
    if gang == "volcano":
        if spec.scheduling.queue is not None:
            pg_spec["queue"] = spec.scheduling.queue
        if priority := template["spec"].get("priorityClassName"):
            pg_spec["priorityClassName"] = priority
    api_version = VOLCANO_API_VERSION if gang == "volcano" else COSCHEDULING_API_VERSION
    return {
        "apiVersion": api_version,
        "kind": "PodGroup",
        "metadata": group_meta(meta, role, replica),
        "spec": pg_spec,
    }
