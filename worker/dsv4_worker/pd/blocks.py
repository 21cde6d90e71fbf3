"""Unit pairs -> byte blocks: where each component's units of one transfer step lie in the
source and destination buffers. Pure (ints only).

A component's buffer is layer-major, `[num_layers, num_units, unit_bytes]`, so unit u of layer
index l starts at byte `(l * num_units + u) * unit_bytes`. Both sides share `unit_bytes` and the
layer ids (the manifest handshake guarantees it); `num_units` differs (each side's pools), and
under PP so does a layer's index (a stage holds a slice of the layers).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dsv4_common.api.manifest import Manifest
from dsv4_worker.pd.transfer.base import Block, merge_blocks

UnitPairs = Mapping[str, Sequence[tuple[int, int]]]  # index space -> (source, destination) units


def transfer_blocks(
    src: Manifest,
    dst: Manifest,
    src_units: Mapping[str, int],
    dst_units: Mapping[str, int],
    pairs: UnitPairs,
) -> list[Block]:
    """Every component's blocks for `pairs`, merged where contiguous on both sides, for the
    layers both sides hold (PP: a stage writes its own layers into the peer's buffers, where
    each layer sits at its index among the peer's layer ids).
    `src_units` / `dst_units`: units per index space of each side's buffers (unit 0 included)."""
    dst_layers = {c.name: {lid: i for i, lid in enumerate(c.layer_ids)} for c in dst.components}
    blocks: list[Block] = []
    for c in src.components:
        unit_pairs = pairs.get(c.index_space, ())
        theirs = dst_layers.get(c.name, {})
        if not unit_pairs or not theirs:
            continue
        src_n, dst_n, size = src_units[c.index_space], dst_units[c.index_space], c.unit_bytes
        for src_l, layer_id in enumerate(c.layer_ids):
            dst_l = theirs.get(layer_id)
            if dst_l is None:
                continue
            for s, d in unit_pairs:
                blocks.append(
                    Block(c.name, (src_l * src_n + s) * size, (dst_l * dst_n + d) * size, size)
                )
    return merge_blocks(blocks)
