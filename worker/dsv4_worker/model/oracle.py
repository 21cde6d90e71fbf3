"""The naive, unpaged forward: recomputes everything from the token ids, one sequence at a
time, with masks instead of pools. It is the oracle the paged engine must equal.

DSV4 attention at position t of layer i (ratio r, window W):
  - the raw window: KV rows of positions (t - W, t];
  - r > 0: the compressed rows of every block complete at t (blocks b with (b+1)r - 1 <= t);
    for r == sparse_ratio (CSA) only the top-k of them by the lightning indexer, for other
    ratios (HCA) all of them;
  - every head's sink logit; the blocks around it (hyper-connections, MoE) are dsv4.py's.
The generic hybrid family: full layers attend to every earlier position, sliding ones to the
window.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import torch

from dsv4_common.core.model import DSV4Config, HybridSWAConfig, ModelConfig
from dsv4_worker.model import attention as A
from dsv4_worker.model import compressor as C
from dsv4_worker.model import dsv4
from dsv4_worker.model import indexer as I
from dsv4_worker.model import layers as L
from dsv4_worker.model.kv_quant import stored_index_keys, stored_kv
from dsv4_worker.model.ops import rms_norm, stored
from dsv4_worker.model.params import Params
from dsv4_worker.model.rope import compress_freq, layer_freq

RequestState = Literal["ring", "online"]


def compressed_rows(
    m: DSV4Config,
    params: Params | Mapping[str, torch.Tensor],
    layer: int,
    x: torch.Tensor,
    positions: torch.Tensor,
    *,
    indexer: bool = False,
    request_state: RequestState = "ring",
) -> torch.Tensor:
    """Rows [T // r, dim] (as stored, in x's dtype) of every complete block of layer `layer`'s
    compressor (`indexer`: the indexer's compressor). `request_state` picks the ring or the
    online form for a plain (HCA) compressor."""
    p = Params.of(params)
    ratio = m.compress_ratios[layer]
    overlap = ratio == m.sparse_ratio
    prefix = f"layers.{layer}.attn" + (".indexer" if indexer else "") + ".compressor"
    states = stored(C.token_states(x, positions, p, prefix, ratio), m.state_dtype)
    num_blocks = len(x) // ratio
    pooled = []
    for b in range(num_blocks):
        block = states[b * ratio : (b + 1) * ratio]
        if request_state == "online" and not overlap:
            state = None
            for token in block:
                state = stored(C.online_update(state, token), m.state_dtype)
            assert state is not None
            pooled.append(C.online_pooled(state))
        else:
            prev = states[(b - 1) * ratio : b * ratio] if overlap and b > 0 else None
            pooled.append(C.pool_block(prev, block, overlap))
    dim = states.shape[-1] // (4 if overlap else 2)
    if not pooled:
        return torch.zeros(0, dim, device=x.device, dtype=x.dtype)
    blocks = torch.arange(num_blocks, device=x.device)
    rows = C.finish_rows(
        torch.stack(pooled),
        blocks,
        ratio,
        p.vector(f"{prefix}.norm.weight", states.dtype),
        m.arch.rms_norm_eps,
        compress_freq(m, x.device),
    )
    rows = stored_index_keys(m, I.rotate(m, rows)) if indexer else stored_kv(m, rows)
    return rows.to(x.dtype)


def _window_mask(t: int, window: int, device: torch.device) -> torch.Tensor:
    pos = torch.arange(t, device=device)
    diff = pos[:, None] - pos[None, :]
    return (diff >= 0) & (diff < window)


def _dsv4_attention(
    m: DSV4Config,
    p: Params,
    layer: int,
    x: torch.Tensor,
    positions: torch.Tensor,
    request_state: RequestState,
) -> torch.Tensor:
    t, dev = len(x), x.device
    freq = layer_freq(m, layer, dev)
    q, latent = A.query(m, p, layer, x, positions, freq)
    keys = stored_kv(m, A.window_kv(m, p, layer, x, positions, freq))
    mask = _window_mask(t, m.window_tokens, dev)
    ratio = m.compress_ratios[layer]
    if ratio:
        rows = compressed_rows(m, p, layer, x, positions, request_state=request_state)
        blocks = torch.arange(len(rows), device=dev)
        available = (blocks[None, :] + 1) * ratio - 1 <= positions[:, None]
        if ratio == m.sparse_ratio:
            ikeys = compressed_rows(m, p, layer, x, positions, indexer=True)
            iq, iw = I.query(m, p, layer, x, latent, positions, compress_freq(m, dev))
            available = I.top_k_mask(I.scores(iq, iw, ikeys), available, m.index_topk)
        keys = torch.cat([keys, rows])
        mask = torch.cat([mask, available], dim=1)
    out = A.attend(q, keys, mask, p.vector(f"layers.{layer}.attn.attn_sink"))
    return A.output(m, p, layer, out, positions, freq)


def _hybrid_attention(
    m: HybridSWAConfig,
    p: Params,
    layer: int,
    x: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    t = len(x)
    q, rows = L.hybrid_query_kv(m, p, layer, x, positions)
    keys, values = L.hybrid_split_kv(m, rows)
    window = m.window_tokens if m.layer_types[layer] == "sliding" else t
    mask = _window_mask(t, window, x.device)
    return L.hybrid_output(p, layer, L.masked_attention(q, keys[None], values[None], mask))


def oracle_logits(
    model: ModelConfig,
    params: Params | Mapping[str, torch.Tensor],
    token_ids: Sequence[int],
    *,
    request_state: RequestState = "ring",
) -> torch.Tensor:
    """Logits [T, vocab] of every position of `token_ids`, in the compute dtype of `params`
    (a mapping of float64 tensors: float64, the oracle tests' dtype)."""
    p = Params.of(params)
    device = p.device
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=device)
    positions = torch.arange(len(ids), device=device)
    if isinstance(model, DSV4Config):
        m = model
        h = dsv4.embed(m, p, ids)
        for layer in range(m.num_hidden_layers):

            def attn(x: torch.Tensor, layer: int = layer) -> torch.Tensor:
                return _dsv4_attention(m, p, layer, x, positions, request_state)

            h = dsv4.block(m, p, layer, h, ids, attn)
        return dsv4.logits(m, p, h)
    h = L.embed(p, ids)
    for layer in range(model.num_hidden_layers):
        x = rms_norm(h, p.vector(f"model.layers.{layer}.input_layernorm.weight"))
        h = h + _hybrid_attention(model, p, layer, x, positions)
        h = L.ffn(h, p, layer)
    return L.logits(p, h)


def oracle_greedy(
    model: ModelConfig,
    p: Params | Mapping[str, torch.Tensor],
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    request_state: RequestState = "ring",
) -> list[int]:
    """Greedy continuation, recomputing the whole sequence for every new token."""
    ids = list(prompt)
    out: list[int] = []
    for _ in range(max_new_tokens):
        nxt = int(oracle_logits(model, p, ids, request_state=request_state)[-1].argmax())
        out.append(nxt)
        ids.append(nxt)
    return out
