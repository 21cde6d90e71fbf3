"""Placement of PP groups (`spec.scheduling.topologyKey`): a group's pods in one topology
domain, and a role's groups spread over domains. Pure.

- Packing: pod affinity of each rank to the pods of its own group on the topology key,
  preferred (weight 100) by default or required (`topologyPolicy: required`). Kubernetes places
  the first pod of a group anywhere (a pod that matches its own affinity term and finds no peer
  may go anywhere); the others follow it.
- Spreading: preferred anti-affinity (weight 50) to the other groups of the same role, so the
  replicas of a role land in different domains when there is room, and a failed domain takes
  out fewer of them.

Without a topology key there are no rules: a group may span any nodes. The key is a node label
that names a domain whose nodes have a fast network between them (a rack, an NVLink domain, a
network block); `kubernetes.io/hostname` packs a whole group onto one node, which fits only
small CPU deployments.
"""

from __future__ import annotations

from typing import Final

from dsv4_common.api.spec import SchedulingSpec
from dsv4_operator import labels as L
from dsv4_operator.manifests import Obj

PACK_WEIGHT: Final = 100
SPREAD_WEIGHT: Final = 50


def group_affinity(
    name: str, scheduling: SchedulingSpec, role: L.WorkerRole, replica: int
) -> Obj | None:
    """The affinity of one group's pods (None without a topology key)."""
    key = scheduling.topology_key
    if key is None:
        return None
    group = L.group_name(name, role, replica)
    pack: Obj = {
        "labelSelector": {"matchLabels": L.group_selector(name, group)},
        "topologyKey": key,
    }
    others: Obj = {
        "labelSelector": {
            "matchLabels": L.role_selector(name, role),
            "matchExpressions": [{"key": L.GROUP_LABEL, "operator": "NotIn", "values": [group]}],
        },
        "topologyKey": key,
    }
    if scheduling.topology_policy == "required":
        pod_affinity: Obj = {"requiredDuringSchedulingIgnoredDuringExecution": [pack]}
    else:
        pod_affinity = {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": PACK_WEIGHT, "podAffinityTerm": pack}
            ]
        }
    return {
        "podAffinity": pod_affinity,
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": SPREAD_WEIGHT, "podAffinityTerm": others}
            ]
        },
    }
