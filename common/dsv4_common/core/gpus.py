"""Named GPU types and their memory as the device reports it (`nvidia-smi
--query-gpu=name,memory.total --format=csv`, in MiB), so a plan uses every byte a device has.

NOTE: marketing sizes are not device sizes: an "H200 141GB" reports 143,771 MiB (140.4 GiB),
not 141e9 bytes (131.3 GiB), and an "H100 80GB" reports 81,559 MiB (79.6 GiB). Pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from dsv4_common.core.units import MIB


@dataclass(frozen=True, slots=True)
class GpuType:
    name: str  # the CLI's --gpu and the CR's spec.gpu.type
    device_name: str  # what nvidia-smi prints as `name`
    memory_mib: int  # what nvidia-smi prints as `memory.total`

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * MIB


GPU_TYPES: Final[dict[str, GpuType]] = {
    g.name: g
    for g in (
        GpuType("h100-80gb", "NVIDIA H100 80GB HBM3", 81_559),
        GpuType("h200", "NVIDIA H200", 143_771),
        GpuType("a100-80gb", "NVIDIA A100-SXM4-80GB", 81_920),
        GpuType("a100-40gb", "NVIDIA A100-SXM4-40GB", 40_960),
    )
}
GPU_TYPE_NAMES: Final[tuple[str, ...]] = tuple(GPU_TYPES)


def gpu_type(name: str) -> GpuType:
    """The GPU type called `name`; KeyError names the known ones."""
    try:
        return GPU_TYPES[name]
    except KeyError:
        raise KeyError(f"unknown GPU type {name!r} (known: {', '.join(GPU_TYPE_NAMES)})") from None
