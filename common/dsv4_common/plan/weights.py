"""Weight bytes per PP rank per GPU. Pure Python.

DeepSeek-V4: exact, tensor by tensor as the checkpoint stores them (`core/tensors.py`: FP8
dense weights with their block scales, FP4 routed experts with theirs, BF16 and F32 tensors as
the release keeps them), each split over the TP ranks or replicated on every one. The first
rank holds the embedding; the last the final norm, head hyper-connection and LM head, and, when
speculating, the MTP layers (plus a copy of the embedding they read, unless it is also the
first rank). The generic hybrid family is estimated from its shape (attention and MLP
matrices, its bytes per parameter). Every count is whole bytes per layer, so a rank's total is
an exact sum over its layers (the split search sums layer ranges as prefix-sum differences).
The worker replaces the estimate with the memory it measures after loading.
"""

from __future__ import annotations

from dsv4_common.core.model import DSV4Config, HybridSWAConfig, ModelConfig
from dsv4_common.core.tensors import (
    bytes_per_rank,
    embedding_params,
    head_params,
    layer_params,
    mtp_params,
)


def _hybrid_layer_bytes(m: HybridSWAConfig) -> float:
    w = m.weights
    q = w.hidden_size * w.num_attention_heads * m.head_dim
    kv = w.hidden_size * m.num_key_value_heads * (m.head_dim + m.v_head_dim)
    o = w.num_attention_heads * m.v_head_dim * w.hidden_size
    mlp = 3 * w.hidden_size * w.intermediate_size
    return (q + kv + o + mlp) * w.dense_bytes_per_param


def _split(total: float, tp_size: int) -> int:
    return -(-round(total) // tp_size)


def layer_bytes(model: ModelConfig, layer_id: int, tp_size: int = 1) -> int:
    """Bytes of target layer `layer_id` on one GPU of a `tp_size`-way TP group."""
    if isinstance(model, DSV4Config):
        return bytes_per_rank(model, layer_params(model, layer_id), tp_size)
    return _split(_hybrid_layer_bytes(model), tp_size)


def rank_extra_bytes(
    model: ModelConfig, *, first: bool, last: bool, with_draft: bool, tp_size: int = 1
) -> int:
    """What one GPU of a rank holds besides its target layers: the embedding on the first,
    the LM head (and its norm and hyper-connection) on the last, and there, when speculating,
    the MTP layers."""
    if not isinstance(model, DSV4Config):
        w = model.weights
        vocab = _split(w.vocab_size * w.hidden_size * w.embedding_bytes_per_param, tp_size)
        total = (vocab if first else 0) + (vocab if last else 0)
        if last and with_draft:  # per NextN layer: a layer + the (embedding, hidden) projection
            nextn = _hybrid_layer_bytes(model) + 2 * w.hidden_size**2 * w.dense_bytes_per_param
            total += model.num_nextn_predict_layers * _split(nextn, tp_size)
        return total
    params = embedding_params(model) if first else ()
    if last:
        params += head_params(model)
        if with_draft:
            for index in range(model.num_nextn_predict_layers):
                params += mtp_params(model, index)
            if not first:  # the MTP layers embed their next tokens
                params += embedding_params(model)
    return bytes_per_rank(model, params, tp_size)


def estimate_weight_bytes(
    model: ModelConfig,
    layer_ids: range,
    *,
    first: bool,
    last: bool,
    with_draft: bool,
    tp_size: int,
) -> int:
    """Bytes of weights one GPU of this PP rank holds."""
    total = sum(layer_bytes(model, i, tp_size) for i in layer_ids)
    return total + rank_extra_bytes(
        model, first=first, last=last, with_draft=with_draft, tp_size=tp_size
    )
