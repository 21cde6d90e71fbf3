"""Unit pairs -> byte blocks: where each component's units of one transfer step lie in the
source and destination buffers. Pure (ints only).

A component's buffer is layer-major, `[num_layers, num_units, unit_bytes]`, so unit u of layer
index l starts at byte `(l * num_units + u) * unit_bytes`. Both sides share `unit_bytes` and the
layer order (the manifest handshake guarantees it); `num_units` differs (each side's pools).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dsv4_common.api.manifest import Manifest
from dsv4_worker.pd.transfer.base import Block, merge_blocks

UnitPairs = Mapping[str, Sequence[tuple[int, int]]]  # index space -> (source, destination) units


def transfer_blocks(
    manifest: Manifest,
    src_units: Mapping[str, int],
    dst_units: Mapping[str, int],
    pairs: UnitPairs,
) -> list[Block]:
    """Every component's blocks for `pairs`, merged where contiguous on both sides.
    `src_units` / `dst_units`: units per index space of each side's buffers (unit 0 included)."""
    blocks: list[Block] = []
    for c in manifest.components:
        unit_pairs = pairs.get(c.index_space, ())
        if not unit_pairs:
            continue
        src_n, dst_n, size = src_units[c.index_space], dst_units[c.index_space], c.unit_bytes
        for layer in range(len(c.layer_ids)):
            for src, dst in unit_pairs:
                blocks.append(
                    Block(
                        c.name,
                        (layer * src_n + src) * size,
                        (layer * dst_n + dst) * size,
                        size,
                    )
                )
    return merge_blocks(blocks)
