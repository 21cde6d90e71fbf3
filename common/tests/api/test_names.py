"""Names are defined once (dsv4_common.api.names, core.presets, core.gpus) and the CRD's enums
and bounds say the same."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from repo_paths import CRD_FILE

from dsv4_common.api import names
from dsv4_common.core.gpus import GPU_TYPE_NAMES, GPU_TYPES
from dsv4_common.core.presets import PRESETS
from dsv4_common.core.units import GIB, MIB


def spec_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD_FILE.read_text())
    (version,) = crd["spec"]["versions"]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return schema


def prop(*path: str) -> dict[str, Any]:
    node = spec_schema()
    for key in path:
        node = node["properties"][key]
    return node


def test_crd_identity_is_the_names_module() -> None:
    crd = yaml.safe_load(CRD_FILE.read_text())
    assert crd["spec"]["group"] == names.GROUP
    assert crd["spec"]["names"]["kind"] == names.KIND
    assert crd["spec"]["names"]["plural"] == names.PLURAL
    assert [v["name"] for v in crd["spec"]["versions"]] == [names.VERSION]


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        (("model", "preset"), list(names.MODEL_PRESETS)),
        (("kv", "transfer"), list(names.TRANSFERS)),
        (("gpu", "type"), list(GPU_TYPE_NAMES)),
        (("scheduling", "gang"), list(names.GANG_SCHEDULERS)),
        (("scheduling", "topologyPolicy"), list(names.TOPOLOGY_POLICIES)),
    ],
)
def test_crd_enums_are_the_names(path: tuple[str, ...], expected: list[str]) -> None:
    assert prop(*path)["enum"] == expected


def test_crd_bounds_are_the_names() -> None:
    for role in names.WORKER_ROLES:
        assert prop(role, "replicas")["maximum"] == names.MAX_ROLE_REPLICAS
        assert prop(role, "pipelineParallel")["maximum"] == names.MAX_PIPELINE_PARALLEL
        assert prop(role, "tensorParallel")["maximum"] == names.MAX_TENSOR_PARALLEL
    assert prop("kv", "transfer")["default"] == names.DEFAULT_TRANSFER
    served = prop("model", "servedModelNames")
    assert served["maxItems"] == names.MAX_SERVED_MODEL_NAMES
    assert served["items"]["maxLength"] == names.MAX_SERVED_MODEL_NAME_LENGTH
    crd_text = CRD_FILE.read_text()
    assert f"self.metadata.name.size() <= {names.MAX_NAME_LENGTH}" in crd_text


def test_every_preset_is_deployable_and_cpu_presets_exist() -> None:
    assert set(names.MODEL_PRESETS) == set(PRESETS)
    assert set(PRESETS) >= names.CPU_PRESETS
    for preset in names.CPU_PRESETS:  # the CRD's CPU-mode rule names each CPU preset
        assert f"self.model.preset == '{preset}'" in CRD_FILE.read_text()


def test_gpu_types_carry_the_memory_the_device_reports() -> None:
    # nvidia-smi --query-gpu=name,memory.total --format=csv (MiB): H100 80GB and H200.
    assert GPU_TYPES["h100-80gb"].memory_bytes == 81_559 * MIB
    assert GPU_TYPES["h200"].memory_bytes == 143_771 * MIB
    # The marketing size (141e9 bytes = 131.3 GiB) under-plans an H200 by about 9 GiB.
    assert (GPU_TYPES["h200"].memory_bytes - 141e9) / GIB == pytest.approx(9.09, abs=0.01)
