"""The paged forward: prefill chunks and decode steps of many requests in one batch, reading and
writing every piece of KV state only through the pools and page tables of `dsv4_worker.mem`.

Where each component lives (P = page size, r = compression ratio, R = ring rows):

    window KV (swa_kv)        SWA slot   full_to_swa[page_table[req, t // P]] * P + t % P
    full KV (hybrid full_kv)  full slot  page_table[req, t // P] * P + t % P
    compressed KV, indexer    full page  page_table[req, b*r // P] * (P // r) + (b*r % P) // r
    CSA rings (per SWA page)  SWA page   full_to_swa[page_table[req, t // P]] * R + t % R
    HCA ring (per request)    req slot   req * R + t % R        (online form: req * 3 + row)

The caller has already grown the requests' page tables by this batch's tokens (`extend` /
`decode`); this module only moves bytes. Per layer, every token's state is written first, then
the compressed rows its block completes, then attention reads what the oracle would see. KV
rows (window, compressed, indexer keys) go through engine/kv_rows.py in the pool's format
(the release's fp8 rows are quantized on write, dequantized on gather); compressor states are
plain float rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from dsv4_common.core.layout import ComponentKind, IndexSpace
from dsv4_common.core.model import DSV4Config, HybridSWAConfig, ModelConfig
from dsv4_worker.engine.kv_rows import ComponentRows
from dsv4_worker.mem.device import upload
from dsv4_worker.mem.memory import KVMemory
from dsv4_worker.model import attention as A
from dsv4_worker.model import compressor as C
from dsv4_worker.model import dsv4
from dsv4_worker.model import indexer as I
from dsv4_worker.model import layers as L
from dsv4_worker.model.kv_quant import check_kv_formats, row_format
from dsv4_worker.model.ops import rms_norm, stored
from dsv4_worker.model.params import Params
from dsv4_worker.model.rope import compress_freq, layer_freq


class Segment(NamedTuple):
    """One request's tokens in a forward batch: positions [start, start + len(token_ids)).
    (A NamedTuple: the engine builds one per request per step.)"""

    slot: int  # request slot
    start: int
    token_ids: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


class _Batch(NamedTuple):
    """The flattened tokens of one forward: position and request slot per token, and each
    segment's [lo, hi) range among them."""

    positions: Tensor
    slots: Tensor
    segments: Sequence[Segment]
    bounds: list[tuple[int, int]]
    starts: Tensor  # per token: its segment's first position
    host_positions: np.ndarray  # `positions` on the host: sizes are decided from it, no sync
    host_ends: np.ndarray  # per token, on the host: its segment's end position


@dataclass(frozen=True, slots=True)
class Stage:
    """The target layers one PP stage runs; the first embeds, the last computes logits."""

    layers: range
    first: bool = True
    last: bool = True

    @classmethod
    def whole(cls, model: ModelConfig) -> Stage:
        return cls(range(model.num_hidden_layers))


class PagedModel:
    """The reference model over one PP stage's KV memory (the whole model by default). It
    computes in the compute dtype of `params` (a mapping of plain tensors: their dtype)."""

    def __init__(
        self,
        model: ModelConfig,
        params: Params | Mapping[str, Tensor],
        memory: KVMemory,
        stage: Stage | None = None,
    ) -> None:
        if memory.pool is None:
            raise ValueError("the paged model needs KV memory with buffers")
        self.stage = stage or Stage.whole(model)
        missing = [i for i in self.stage.layers if i not in memory.layout.layer_ids]
        if missing:
            raise ValueError(f"the KV layout holds no state for stage layers {missing}")
        self.model = model
        self.p = Params.of(params)
        self.memory = memory
        # Hidden states passed between PP stages, per token: DSV4's residual streams flattened.
        streams = model.arch.hc_mult if isinstance(model, DSV4Config) else 1
        self.hidden_size = streams * model.weights.hidden_size
        self.dtype = self.p.dtype  # the compute dtype (hidden states between PP stages too)
        self.pool = memory.pool
        self.page = memory.config.page_size
        self.device = memory.device
        self._kv = _kv_rows(model, memory)
        if isinstance(model, DSV4Config):
            sparse = model.sparse_ratio
            if sparse in model.nonzero_ratios and model.window_tokens < 2 * sparse:
                raise ValueError(
                    f"window {model.window_tokens} < 2 x ratio {sparse}: the overlapped "
                    "compressor reads the previous block from an SWA page the window released"
                )

    # -- addressing ------------------------------------------------------------------------------

    def _full_pages(self, slots: Tensor, positions: Tensor) -> Tensor:
        return self.memory.pages.page_table[slots, positions // self.page]

    def _swa_pages(self, slots: Tensor, positions: Tensor) -> Tensor:
        pages = self.memory.pages.full_to_swa[self._full_pages(slots, positions)]
        # Checked on the device, without a sync (on CUDA a failure is a device-side assert).
        torch._assert_async((pages > 0).all(), "a token outside the retained window was addressed")
        return pages

    def _rows(self, name: str, layer: int) -> Tensor:
        """One layer of a plain (float) component as [units * rows_per_unit, row_elems] (a
        view): the compressor states. KV rows go through `self._kv` (their stored format)."""
        view = self.pool.layer(name, layer)
        return view.view(-1, view.shape[-1])

    def _compressed_index(self, slots: Tensor, blocks: Tensor, ratio: int) -> Tensor:
        first = blocks * ratio
        per_page = self.page // ratio
        return self._full_pages(slots, first) * per_page + (first % self.page) // ratio

    def _ring_index(self, name: str, slots: Tensor, positions: Tensor) -> Tensor:
        c = self.memory.layout.component(name)
        ring = c.rows_per_unit
        if c.index_space is IndexSpace.SWA_PAGE:
            return self._swa_pages(slots, positions) * ring + positions % ring
        return slots * ring + positions % ring

    # -- forward ---------------------------------------------------------------------------------

    def forward(self, segments: Sequence[Segment], every: Sequence[bool] = ()) -> Tensor:
        """Logits at each segment's last token, or at each of its tokens where `every` says
        so (rows as `logprobs.row_layout` lays them out; the whole model)."""
        assert self.stage.first and self.stage.last, "forward runs the whole model"
        return self.forward_stage(segments, None, every)

    @torch.inference_mode()
    def forward_stage(
        self, segments: Sequence[Segment], hidden: Tensor | None, every: Sequence[bool] = ()
    ) -> Tensor:
        """This stage's layers over the batch, under torch's inference mode (no autograd or
        version-counter bookkeeping: ~9% of a medium decode step on a CPU). The first stage
        embeds the token ids (`hidden` is None), later ones continue from the previous stage's
        hidden states [tokens, dim]; the last returns logits at each segment's last token (at
        every token of the segments `every` marks: prompt logprobs), the others their hidden
        states."""
        lengths = [len(s.token_ids) for s in segments]
        bounds = _bounds(lengths)
        host = _batch_rows(segments, lengths, _logit_rows(bounds, every))
        rows = upload(np.concatenate(host), self.device)
        positions, slots, starts, ids, last = torch.split(rows, [len(a) for a in host])
        ends = np.repeat(np.array([s.end for s in segments], dtype=np.int64), lengths)
        batch = _Batch(positions, slots, segments, bounds, starts, host[0], ends)
        if isinstance(self.model, DSV4Config):
            m = self.model
            if self.stage.first:
                h = dsv4.embed(m, self.p, ids)
            else:
                assert hidden is not None, "a later PP stage continues from hidden states"
                h = hidden.view(len(ids), m.arch.hc_mult, m.weights.hidden_size)
            for layer in self.stage.layers:

                def attn(x: Tensor, layer: int = layer) -> Tensor:
                    return self._dsv4_attention(m, layer, x, batch)

                h = dsv4.block(m, self.p, layer, h, ids, attn)
            if not self.stage.last:
                return h.reshape(len(ids), -1)
            return dsv4.logits(m, self.p, h[last])
        if self.stage.first:
            h = L.embed(self.p, ids)
        else:
            assert hidden is not None, "a later PP stage continues from hidden states"
            h = hidden
        for layer in self.stage.layers:
            x = rms_norm(h, self.p.vector(f"model.layers.{layer}.input_layernorm.weight"))
            h = h + self._hybrid_attention(self.model, layer, x, batch)
            h = L.ffn(h, self.p, layer)
        if not self.stage.last:
            return h
        return L.logits(self.p, h[last])

    # -- DSV4 ------------------------------------------------------------------------------------

    def _dsv4_attention(
        self,
        m: DSV4Config,
        layer: int,
        x: Tensor,
        batch: _Batch,
    ) -> Tensor:
        positions, slots = batch.positions, batch.slots
        freq = layer_freq(m, layer, self.device)
        q, latent = A.query(m, self.p, layer, x, positions, freq)
        kv = A.window_kv(m, self.p, layer, x, positions, freq)
        swa_slots = self._swa_pages(slots, positions) * self.page + positions % self.page
        self._kv["swa_kv"].write(layer, swa_slots, kv)
        ratio = m.compress_ratios[layer]
        if ratio:
            self._compress(m, layer, x, batch, ratio, indexer=False)
            if ratio == m.sparse_ratio:
                self._compress(m, layer, x, batch, ratio, indexer=True)
        # One-token segments (decode) attend together over keys gathered per token; longer
        # ones (prefill chunks) share one key set per segment.
        out = torch.empty_like(q)
        singles = np.array([lo for lo, hi in batch.bounds if hi - lo == 1], dtype=np.int64)
        if singles.size:
            idx = upload(singles, self.device)
            end = int(batch.host_positions[singles].max()) + 1  # the furthest token's, host
            out[idx] = self._dsv4_token_attention(m, layer, idx, end, x, q, latent, batch)
        for seg, (lo, hi) in zip(batch.segments, batch.bounds, strict=True):
            if hi - lo > 1:
                out[lo:hi] = self._dsv4_segment_attention(
                    m, layer, seg, x[lo:hi], q[lo:hi], latent[lo:hi]
                )
        return A.output(m, self.p, layer, out, positions, freq)

    def _dsv4_token_attention(
        self,
        m: DSV4Config,
        layer: int,
        idx: Tensor,
        end: int,
        x: Tensor,
        q: Tensor,
        latent: Tensor,
        batch: _Batch,
    ) -> Tensor:
        """Attention of the batch tokens `idx` [N] (`end`: 1 + the largest of their positions),
        each over its own request's keys: the
        window padded to `window_tokens` and the complete compressed blocks padded to the
        most any of them has, masked per token. Padding addresses a position the token's
        request holds (itself, or block 0), so every gathered row is a real, finite row."""
        dev = self.device
        pos, slot = batch.positions[idx], batch.slots[idx]
        n, span = len(idx), m.window_tokens
        key_pos = pos[:, None] + torch.arange(1 - span, 1, device=dev)[None, :]
        mask = key_pos >= 0
        key_pos = torch.where(mask, key_pos, pos[:, None])
        key_slot = slot[:, None].expand(n, span)
        swa = self._swa_pages(key_slot, key_pos) * self.page + key_pos % self.page
        keys = self._kv["swa_kv"].read(layer, swa, self.dtype)
        ratio = m.compress_ratios[layer]
        num_blocks = end // ratio if ratio else 0
        if num_blocks:
            blocks = torch.arange(num_blocks, device=dev)[None, :]
            available = blocks < ((pos + 1) // ratio)[:, None]
            blocks = torch.where(available, blocks, 0)
            index = self._compressed_index(slot[:, None].expand(n, num_blocks), blocks, ratio)
            rows = self._kv[f"c{ratio}_kv"].read(layer, index, self.dtype)
            if ratio == m.sparse_ratio:
                ikeys = self._kv[f"c{ratio}_indexer"].read(layer, index, self.dtype)
                iq, iw = I.query(m, self.p, layer, x[idx], latent[idx], pos, compress_freq(m, dev))
                available = I.top_k_mask(I.row_scores(iq, iw, ikeys), available, m.index_topk)
            keys = torch.cat([keys, rows], dim=1)
            mask = torch.cat([mask, available], dim=1)
        return A.attend_rows(q[idx], keys, mask, self.p.vector(f"layers.{layer}.attn.attn_sink"))

    def _dsv4_segment_attention(
        self, m: DSV4Config, layer: int, seg: Segment, x: Tensor, q: Tensor, latent: Tensor
    ) -> Tensor:
        dev = self.device
        pos = torch.arange(seg.start, seg.end, device=dev)
        first = max(0, seg.start - m.window_tokens + 1)
        key_pos = torch.arange(first, seg.end, device=dev)
        slot = torch.full_like(key_pos, seg.slot)
        swa = self._swa_pages(slot, key_pos) * self.page + key_pos % self.page
        keys = self._kv["swa_kv"].read(layer, swa, self.dtype)
        diff = pos[:, None] - key_pos[None, :]
        mask = (diff >= 0) & (diff < m.window_tokens)
        ratio = m.compress_ratios[layer]
        num_blocks = seg.end // ratio if ratio else 0
        if num_blocks:
            blocks = torch.arange(num_blocks, device=dev)
            bslot = torch.full_like(blocks, seg.slot)
            index = self._compressed_index(bslot, blocks, ratio)
            rows = self._kv[f"c{ratio}_kv"].read(layer, index, self.dtype)
            available = (blocks[None, :] + 1) * ratio - 1 <= pos[:, None]
            if ratio == m.sparse_ratio:
                ikeys = self._kv[f"c{ratio}_indexer"].read(layer, index, self.dtype)
                iq, iw = I.query(m, self.p, layer, x, latent, pos, compress_freq(m, dev))
                available = I.top_k_mask(I.scores(iq, iw, ikeys), available, m.index_topk)
            keys = torch.cat([keys, rows])
            mask = torch.cat([mask, available], dim=1)
        return A.attend(q, keys, mask, self.p.vector(f"layers.{layer}.attn.attn_sink"))

    def _compress(
        self,
        m: DSV4Config,
        layer: int,
        x: Tensor,
        batch: _Batch,
        ratio: int,
        *,
        indexer: bool,
    ) -> None:
        """Write this batch's token states, then every compressed row a block completes."""
        positions, slots = batch.positions, batch.slots
        overlap = ratio == m.sparse_ratio
        prefix = f"layers.{layer}.attn" + (".indexer" if indexer else "") + ".compressor"
        state_name = (
            f"c{ratio}_indexer_state"
            if indexer
            else (f"c{ratio}_attn_state" if overlap else f"c{ratio}_state")
        )
        states = stored(C.token_states(x, positions, self.p, prefix, ratio), m.state_dtype)
        ring = self._rows(state_name, layer)
        online = self.memory.layout.request_state == "online" and not overlap
        if online:
            done_pos, done_slot, pooled = self._online(m, ring, states, positions, slots, ratio)
            if not pooled:
                return
            blocks = torch.tensor(done_pos, device=self.device)
            block_slots = torch.tensor(done_slot, device=self.device)
            pooled_rows = torch.stack(pooled)
        else:
            done_h = np.flatnonzero((batch.host_positions + 1) % ratio == 0)
            done = upload(done_h, self.device)
            if done_h.size:
                blocks, block_slots = positions[done] // ratio, slots[done]
                rows, valid = self._block_rows(
                    state_name, ring, states, batch, done, ratio, overlap
                )
                pooled_rows = C.pool_blocks(rows, valid, overlap)
            self._write_ring(state_name, ring, states, batch)
            if not done_h.size:
                return
        rows = C.finish_rows(
            pooled_rows,
            blocks,
            ratio,
            self.p.vector(f"{prefix}.norm.weight", pooled_rows.dtype),
            m.arch.rms_norm_eps,
            compress_freq(m, self.device),
        )
        if indexer:
            rows = I.rotate(m, rows)
        target = self._kv[f"c{ratio}_indexer" if indexer else f"c{ratio}_kv"]
        target.write(layer, self._compressed_index(block_slots, blocks, ratio), rows)

    def _block_rows(
        self,
        name: str,
        ring: Tensor,
        states: Tensor,
        batch: _Batch,
        done: Tensor,
        ratio: int,
        overlap: bool,
    ) -> tuple[Tensor, Tensor]:
        """State rows [N, ratio (x2 overlapped: previous block first), width] of the blocks
        the batch tokens `done` [N] complete, in position order, and which exist [N, ...]
        (block 0 has no previous block). Rows of this batch come from `states`, older ones
        from the ring (read before this batch writes it); a missing row reads the token's
        own, masked."""
        pos, slot, start = batch.positions[done], batch.slots[done], batch.starts[done]
        first = (pos // ratio - (2 if overlap else 1) + 1) * ratio
        width = (2 if overlap else 1) * ratio
        block_pos = first[:, None] + torch.arange(width, device=self.device)[None, :]
        valid = block_pos >= 0
        block_pos = torch.where(valid, block_pos, pos[:, None])
        fresh = block_pos >= start[:, None]
        from_batch = torch.where(fresh, done[:, None] - (pos[:, None] - block_pos), done[:, None])
        stored_rows = ring[self._ring_index(name, slot[:, None].expand_as(block_pos), block_pos)]
        rows = torch.where(fresh[..., None], states[from_batch], stored_rows.to(states.dtype))
        return rows, valid

    def _write_ring(
        self,
        name: str,
        ring: Tensor,
        states: Tensor,
        batch: _Batch,
    ) -> None:
        """Write each ring row's latest token state, in one write: the batch rows that no
        later token of their segment overwrites (`ring_writers`, decided on the host; every
        row at decode), whose ring indices are therefore distinct."""
        c = self.memory.layout.component(name)
        per_page = self.page if c.index_space is IndexSpace.SWA_PAGE else None
        keep = ring_writers(batch.host_positions, batch.host_ends, c.rows_per_unit, per_page)
        if keep is None:
            index = self._ring_index(name, batch.slots, batch.positions)
            ring[index] = states.to(ring.dtype)
            return
        pick = upload(keep, self.device)
        index = self._ring_index(name, batch.slots[pick], batch.positions[pick])
        ring[index] = states[pick].to(ring.dtype)

    def _online(
        self,
        m: DSV4Config,
        ring: Tensor,
        states: Tensor,
        positions: Tensor,
        slots: Tensor,
        ratio: int,
    ) -> tuple[list[int], list[int], list[Tensor]]:
        """Fold tokens into their requests' online states in position order; returns the
        blocks completed (block, slot, pooled row)."""
        done_pos: list[int] = []
        done_slot: list[int] = []
        pooled: list[Tensor] = []
        for i in range(len(positions)):  # in batch order == position order per request
            slot, pos = int(slots[i]), int(positions[i])
            rows = ring[slot * C.ONLINE_ROWS : (slot + 1) * C.ONLINE_ROWS]
            prior = None if pos % ratio == 0 else rows.to(states.dtype)
            state = stored(C.online_update(prior, states[i]), m.state_dtype)
            rows.copy_(state.to(ring.dtype))
            if pos % ratio == ratio - 1:
                done_pos.append(pos // ratio)
                done_slot.append(slot)
                pooled.append(C.online_pooled(state))
        return done_pos, done_slot, pooled

    # -- generic hybrid --------------------------------------------------------------------------

    def _hybrid_attention(
        self,
        m: HybridSWAConfig,
        layer: int,
        x: Tensor,
        batch: _Batch,
    ) -> Tensor:
        positions, slots, segments, bounds = (
            batch.positions,
            batch.slots,
            batch.segments,
            batch.bounds,
        )
        q, kv = L.hybrid_query_kv(m, self.p, layer, x, positions)
        sliding = m.layer_types[layer] == "sliding"
        rows = self._kv["swa_kv" if sliding else "full_kv"]
        rows.write(layer, self._kv_index(sliding, slots, positions), kv)
        out = []
        for seg, (lo, hi) in zip(segments, bounds, strict=True):
            pos = torch.arange(seg.start, seg.end, device=self.device)
            first = max(0, seg.start - m.window_tokens + 1) if sliding else 0
            key_pos = torch.arange(first, seg.end, device=self.device)
            index = self._kv_index(sliding, torch.full_like(key_pos, seg.slot), key_pos)
            keys, values = L.hybrid_split_kv(m, rows.read(layer, index, self.dtype))
            diff = pos[:, None] - key_pos[None, :]
            mask = (diff >= 0) & ((diff < m.window_tokens) if sliding else True)
            out.append(L.masked_attention(q[lo:hi], keys[None], values[None], mask))
        return L.hybrid_output(self.p, layer, torch.cat(out))

    def _kv_index(self, sliding: bool, slots: Tensor, positions: Tensor) -> Tensor:
        pages = self._swa_pages(slots, positions) if sliding else self._full_pages(slots, positions)
        return pages * self.page + positions % self.page


_KV_KINDS = (
    ComponentKind.WINDOW_KV,
    ComponentKind.FULL_KV,
    ComponentKind.COMPRESSED_KV,
    ComponentKind.INDEXER_KEYS,
)


def _kv_rows(model: ModelConfig, memory: KVMemory) -> dict[str, ComponentRows]:
    """Row access to every KV component (not the compressor states), in its stored format."""
    assert memory.pool is not None
    check_kv_formats(model)
    out = {}
    for c in memory.layout.components:
        if c.kind not in _KV_KINDS:
            continue
        fmt = row_format(model, c.kind) if isinstance(model, DSV4Config) else None
        out[c.name] = ComponentRows(memory.pool, c, fmt)
    return out


def _logit_rows(bounds: Sequence[tuple[int, int]], every: Sequence[bool]) -> list[int]:
    """The tokens whose logits a forward returns: each segment's last, or all of a segment's
    tokens where `every` marks it."""
    if not any(every):
        return [hi - 1 for _, hi in bounds]
    return [
        r
        for (lo, hi), all_rows in zip(bounds, every, strict=True)
        for r in (range(lo, hi) if all_rows else (hi - 1,))
    ]


def _batch_rows(
    segments: Sequence[Segment], lengths: Sequence[int], logit_rows: Sequence[int]
) -> list[np.ndarray]:
    """Per token, built on the host (one upload takes them to the device): its position, its
    request slot, its segment's first position, its token id; then the logit rows."""
    count = np.array(lengths, dtype=np.int64)
    starts = np.repeat(np.array([s.start for s in segments], dtype=np.int64), count)
    firsts = np.repeat(np.cumsum(count) - count, count)  # each token's segment's first row
    positions = starts + np.arange(int(count.sum()), dtype=np.int64) - firsts
    slots = np.repeat(np.array([s.slot for s in segments], dtype=np.int64), count)
    ids = np.array([t for s in segments for t in s.token_ids], dtype=np.int64)
    return [positions, slots, starts, ids, np.array(logit_rows, dtype=np.int64)]


def ring_writers(
    positions: np.ndarray, ends: np.ndarray, ring_rows: int, page_size: int | None
) -> np.ndarray | None:
    """The batch rows (ascending) whose ring row no later token of the same segment writes,
    or None when that is every row. A token at position p writes row p % ring_rows of its
    request's ring (`page_size` None) or of its SWA page's ring (p // page_size), so the next
    token to write the same row is p + ring_rows, when it is in the segment (< `ends`, the
    token's segment end) and, per page, in the same page. Writing just these rows leaves every
    ring row as writing all of them in position order would, and no two of them share a row."""
    later = positions + ring_rows
    keep = later >= ends
    if page_size is not None:
        keep |= later // page_size != positions // page_size
    if keep.all():
        return None
    return np.flatnonzero(keep)


def _bounds(lengths: Sequence[int]) -> list[tuple[int, int]]:
    out, lo = [], 0
    for n in lengths:
        out.append((lo, lo + n))
        lo += n
    return out
