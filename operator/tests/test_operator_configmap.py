"""`spec.model.configMapRef` with the real operator against the loopback API server: a CR whose
ConfigMap is missing says so in status and applies nothing; once the ConfigMap exists the model
in it is planned, and editing it re-plans and gives the workers a new template at once (the
operator watches ConfigMaps; the re-plan comes from that event, not from the 15 s timer)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes
from model_samples import tiny_hf_config
from support.live_operator import NS, Live

from dsv4_operator import labels as L

NAME = "tiny"  # the sample's
CONFIG_MAP = "tiny-model"
GPU = {"type": "h100-80gb", "perPod": 1}


def _status(live: Live) -> dict[str, Any]:
    return (live.cr(NAME) or {}).get("status") or {}


def _layers(status: dict[str, Any]) -> dict[tuple[str, int], list[int]]:
    return {(p["role"], p["ppRank"]): p["layers"] for p in status.get("plan") or []}


def _planned_with(live: Live, layers: int) -> dict[str, Any] | None:
    """The status once PlanValid is True for a model of `layers` target layers."""
    status = _status(live)
    cond = live.condition(NAME, "PlanValid")
    planned = _layers(status)
    fits = planned and max(end for _, end in planned.values()) == layers
    return status if cond and cond["status"] == "True" and fits else None


def _worker_hashes(live: Live) -> dict[str, tuple[str, str]]:
    """StatefulSet -> (template hash, model-config hash) of its pod template."""
    out = {}
    for name, sts in live.children("StatefulSet", "apps/v1").items():
        annotations = sts["spec"]["template"]["metadata"]["annotations"]
        out[name] = (
            annotations[L.TEMPLATE_HASH_ANNOTATION],
            annotations[L.MODEL_CONFIG_HASH_ANNOTATION],
        )
    return out


def _edit_config_map(tmp_path: Path, text: str) -> None:
    """Edit the ConfigMap as a user would: a patch through the API (kubectl edit)."""
    client = kubernetes.config.new_client_from_config(config_file=str(tmp_path / "kubeconfig"))
    with client:
        kubernetes.client.CoreV1Api(client).patch_namespaced_config_map(
            CONFIG_MAP, NS, {"data": {"config.json": text}}
        )


def _cr_reads_since(live: Live, mark: int) -> int:
    """GETs of the CR itself: only a reconcile triggered by a watched object's event reads it
    (kopf's own handlers get the CR from their watch)."""
    path = f"/namespaces/{NS}/{L.PLURAL}/{NAME}"
    return sum(
        1 for r in live.server.requests[mark:] if r.method == "GET" and r.path.endswith(path)
    )


def test_a_config_map_model_is_planned_and_editing_it_replans(live: Live, tmp_path: Path) -> None:
    # The ConfigMap does not exist yet: PlanValid False naming the field, nothing applied.
    live.create_cr("tiny-cpu.yaml", model={"configMapRef": {"name": CONFIG_MAP}}, gpu=GPU)
    cond = live.wait(
        "PlanValid False (no ConfigMap)",
        lambda: (c := live.condition(NAME, "PlanValid")) and c["status"] == "False" and c,
    )
    assert cond["reason"] == "PlanFailed"
    assert cond["message"].startswith("spec.model.configMapRef: ")
    assert f"ConfigMap {NS}/{CONFIG_MAP} not found" in cond["message"]
    assert live.children("StatefulSet", "apps/v1") == {}
    assert live.cr(NAME)["spec"]["model"]["configMapRef"]["key"] == "config.json"  # type: ignore[index]

    # It is created: the ConfigMap's event re-plans with the model it holds.
    mark = len(live.server.requests)
    live.server.create(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": CONFIG_MAP, "namespace": NS},
            "data": {"config.json": tiny_hf_config(num_hidden_layers=6)},
        }
    )
    status = live.wait("planned from the ConfigMap", lambda: _planned_with(live, 6))
    assert _cr_reads_since(live, mark) >= 1, "the re-plan did not come from the ConfigMap event"
    assert _layers(status) == {
        ("prefill", 0): [0, 3],
        ("prefill", 1): [3, 6],
        ("decode", 0): [0, 6],
    }
    before = live.wait(
        "StatefulSets applied",
        lambda: len(live.children("StatefulSet", "apps/v1")) == 2 and _worker_hashes(live),
    )
    sts = live.children("StatefulSet", "apps/v1")[f"{NAME}-decode-0"]
    (volume,) = [
        v
        for v in sts["spec"]["template"]["spec"]["volumes"]
        if "configMap" in v and v["configMap"]["name"] == CONFIG_MAP
    ]
    assert volume["configMap"]["items"] == [
        {"key": "config.json", "path": f"{CONFIG_MAP}/config.json"}
    ]

    # Edited (fewer layers): re-planned, and every worker template changes (the pods roll).
    live.settle()
    mark = len(live.server.requests)
    _edit_config_map(tmp_path, tiny_hf_config(num_hidden_layers=4))
    status = live.wait("re-planned after the edit", lambda: _planned_with(live, 4))
    assert _cr_reads_since(live, mark) >= 1, "the re-plan did not come from the ConfigMap event"
    assert _layers(status) == {
        ("prefill", 0): [0, 2],
        ("prefill", 1): [2, 4],
        ("decode", 0): [0, 4],
    }
    after = live.wait(
        "worker templates changed",
        lambda: (h := _worker_hashes(live)) and all(h[g] != before[g] for g in before) and h,
    )
    assert set(after) == set(before)
    assert len({model_hash for _, model_hash in after.values()}) == 1

    # Broken JSON: PlanValid False naming the field; the applied workers are left alone.
    live.settle()
    _edit_config_map(tmp_path, "{not json")
    cond = live.wait(
        "PlanValid False (bad JSON)",
        lambda: (c := live.condition(NAME, "PlanValid")) and c["status"] == "False" and c,
    )
    assert cond["message"].startswith("spec.model.configMapRef: ")
    assert "not valid JSON" in cond["message"]
    assert _worker_hashes(live) == after
