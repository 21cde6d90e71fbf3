"""Pure builders for the Gateway API Inference Extension (`spec.gateway`): the InferencePool
(inference.networking.k8s.io/v1) whose members are the decode groups' serving pods (PP rank
0, API port `http`), an HTTPRoute (gateway.networking.k8s.io/v1) from the user's Gateways to
it, and a NetworkPolicy admitting the gateway's namespaces to those pods' API and status
ports (the endpoint picker scrapes /metrics on `status`: the model-server protocol's vLLM
names, KV utilisation the binding pool's).

Decode serves the API in our PD split (it reserves KV first and takes the prompt's KV from a
prefill), so it is what an endpoint picker chooses among; prefill stays behind it.
"""

from __future__ import annotations

from typing import Final

from dsv4_common.api.gateway_spec import GatewaySpec
from dsv4_common.api.spec import DeploymentMeta
from dsv4_operator import labels as L
from dsv4_operator.manifests import Obj, object_meta
from dsv4_operator.workerconfig import HTTP_PORT, STATUS_PORT

POOL_API_VERSION: Final = "inference.networking.k8s.io/v1"
ROUTE_API_VERSION: Final = "gateway.networking.k8s.io/v1"
GIE_KINDS: Final = ((POOL_API_VERSION, "InferencePool"), (ROUTE_API_VERSION, "HTTPRoute"))
POOL_TEMPLATE: Final = "{name}-pool"
GATEWAY_POLICY_TEMPLATE: Final = "{name}-gateway"


def pool_name(name: str) -> str:
    return POOL_TEMPLATE.format(name=name)


def build_inference_pool(meta: DeploymentMeta, gateway: GatewaySpec) -> Obj:
    picker = gateway.endpoint_picker
    ref: Obj = {
        "name": picker.name,
        "kind": picker.kind,
        "port": {"number": picker.port},
        "failureMode": picker.failure_mode,
    }
    if picker.group:
        ref["group"] = picker.group
    return {
        "apiVersion": POOL_API_VERSION,
        "kind": "InferencePool",
        "metadata": object_meta(meta, pool_name(meta.name), L.role_labels(meta.name, "decode")),
        "spec": {
            "selector": {"matchLabels": L.serving_selector(meta.name, "decode")},
            "targetPorts": [{"number": HTTP_PORT}],
            "endpointPickerRef": ref,
        },
    }


def build_http_route(meta: DeploymentMeta, gateway: GatewaySpec) -> Obj | None:
    """None without parentRefs (the user routes to the pool from a route of their own)."""
    if not gateway.parent_refs:
        return None
    parents = []
    for p in gateway.parent_refs:
        parent: Obj = {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": p.name}
        if p.namespace is not None:
            parent["namespace"] = p.namespace
        if p.section_name is not None:
            parent["sectionName"] = p.section_name
        parents.append(parent)
    return {
        "apiVersion": ROUTE_API_VERSION,
        "kind": "HTTPRoute",
        "metadata": object_meta(meta, pool_name(meta.name), L.role_labels(meta.name, "decode")),
        "spec": {
            "parentRefs": parents,
            "rules": [
                {
                    "matches": [{"path": {"type": "PathPrefix", "value": gateway.path_prefix}}],
                    "backendRefs": [
                        {
                            "group": "inference.networking.k8s.io",
                            "kind": "InferencePool",
                            "name": pool_name(meta.name),
                        }
                    ],
                }
            ],
        },
    }


def build_gateway_network_policy(meta: DeploymentMeta, gateway: GatewaySpec) -> Obj | None:
    """The gateway's namespaces to the decode pods' `http` and `status` ports (NetworkPolicies
    add up: the worker policy's rules stay). None without namespaces."""
    if not gateway.allow_from_namespaces:
        return None
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": object_meta(
            meta,
            GATEWAY_POLICY_TEMPLATE.format(name=meta.name),
            L.role_labels(meta.name, "decode"),
        ),
        "spec": {
            "podSelector": {"matchLabels": L.role_selector(meta.name, "decode")},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [
                        {"namespaceSelector": {"matchLabels": {L.NAMESPACE_NAME_LABEL: ns}}}
                        for ns in gateway.allow_from_namespaces
                    ],
                    "ports": [
                        {"protocol": "TCP", "port": HTTP_PORT},
                        {"protocol": "TCP", "port": STATUS_PORT},
                    ],
                }
            ],
        },
    }


def build_gateway_objects(meta: DeploymentMeta, gateway: GatewaySpec | None) -> list[Obj]:
    if gateway is None:
        return []
    out = [build_inference_pool(meta, gateway)]
    for obj in (build_http_route(meta, gateway), build_gateway_network_policy(meta, gateway)):
        if obj is not None:
            out.append(obj)
    return out
