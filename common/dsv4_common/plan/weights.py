"""Weight bytes per PP rank per GPU: an estimate from the model shape. Pure Python.

Dominant terms only (for MoE models the routed experts are > 95% of the bytes): embedding on
the first rank, LM head and (when speculating) the MTP layer on the last, everything sharded
by TP (experts by TP/EP, embedding and head vocab-parallel). The worker replaces this estimate
with the memory it measures after loading.
"""

from __future__ import annotations

from dsv4_common.core.model import DSV4Config, HybridSWAConfig, ModelConfig, WeightShape


def _moe_layer_bytes(w: WeightShape, dense: bool) -> float:
    if dense or w.num_routed_experts == 0:
        return 3 * w.hidden_size * w.intermediate_size * w.dense_bytes_per_param
    ffn = 3 * w.hidden_size * w.moe_intermediate_size
    router = w.hidden_size * w.num_routed_experts * 2.0
    return (
        w.num_routed_experts * ffn * w.expert_bytes_per_param
        + w.num_shared_experts * ffn * w.dense_bytes_per_param
        + router
    )


def _dsv4_attention_bytes(m: DSV4Config) -> float:
    w = m.weights
    d, h = m.head_dim, w.num_attention_heads
    q = w.hidden_size * w.q_lora_rank + w.q_lora_rank * h * d
    kv = w.hidden_size * d
    o_rank = w.o_lora_rank or w.hidden_size
    o = h * d * o_rank + o_rank * w.hidden_size
    indexer = w.hidden_size * m.index_n_heads * m.index_head_dim
    compressor = w.hidden_size * 4 * d
    return (q + kv + o + indexer + compressor) * w.dense_bytes_per_param


def _hybrid_attention_bytes(m: HybridSWAConfig) -> float:
    w = m.weights
    q = w.hidden_size * w.num_attention_heads * m.head_dim
    kv = w.hidden_size * m.num_key_value_heads * (m.head_dim + m.v_head_dim)
    o = w.num_attention_heads * m.v_head_dim * w.hidden_size
    return (q + kv + o) * w.dense_bytes_per_param


def layer_bytes(model: ModelConfig, layer_id: int) -> int:
    """Whole bytes, so a rank's total is an exact sum over its layers (the split search sums
    layer ranges as prefix-sum differences)."""
    w = model.weights
    if isinstance(model, DSV4Config):
        dense = layer_id < w.num_dense_layers
        return round(_dsv4_attention_bytes(model) + _moe_layer_bytes(w, dense))
    return round(_hybrid_attention_bytes(model) + _moe_layer_bytes(w, dense=True))


def rank_extra_bytes(model: ModelConfig, *, first: bool, last: bool, with_draft: bool) -> int:
    """What a rank holds besides its target layers: the embedding on the first, the LM head
    and (when speculating) the MTP layer on the last."""
    w = model.weights
    vocab = round(w.vocab_size * w.hidden_size * w.embedding_bytes_per_param)
    total = vocab if first else 0
    if last:
        total += vocab  # LM head (untied)
        if with_draft:
            n = model.num_hidden_layers
            # NextN layer: one transformer layer + the (embedding, hidden) -> hidden projection.
            total += layer_bytes(model, n) + round(2 * w.hidden_size**2 * w.dense_bytes_per_param)
    return total


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
    total = sum(layer_bytes(model, i) for i in layer_ids)
    total += rank_extra_bytes(model, first=first, last=last, with_draft=with_draft)
    return total // tp_size
