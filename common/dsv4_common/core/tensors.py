"""Every tensor of a DeepSeek-V4 checkpoint: name, shape, storage dtype, parameters, and whether
tensor parallelism splits it. Pure Python (no torch): the planner counts weight bytes from here,
and a loader can take its parameter shapes from the same lists.

Names and storage follow the release (DeepSeek's checkpoint: no `model.` prefix, an FP8 or FP4
weight with its `.scale` beside it). Per block (`layers.N`, or `mtp.J` for an MTP layer): H
hidden, hc residual streams, m = (2 + hc) * hc, d = head_dim, g = o_groups, k = 2 for an
overlapped compressor (the `sparse_ratio` layers, CSA) and 1 otherwise, ih x id the indexer's
heads x dim, E routed experts of width f, s shared experts:

| parameter (N: layer)                  | shape                        | kind   | TP    |
| ------------------------------------- | ---------------------------- | ------ | ----- |
| attn_norm, ffn_norm                   | [H]                          | keep   | whole |
| hc_attn_*, hc_ffn_*: fn, base, scale  | [m, hc*H], [m], [3]          | f32    | whole |
| attn.wq_a                             | [q_lora, H]                  | linear | whole |
| attn.q_norm, attn.kv_norm             | [q_lora], [d]                | keep   | whole |
| attn.wq_b                             | [heads*d, q_lora]            | linear | split |
| attn.wkv                              | [d, H]                       | linear | whole |
| attn.wo_a (grouped output)            | [g*o_lora, heads*d/g]        | linear | split |
| attn.wo_b                             | [H, g*o_lora]                | linear | split |
| attn.attn_sink                        | [heads]                      | f32    | split |
| attn.compressor.wkv, .wgate; .norm    | [k*d, H]; [d]                | keep   | whole |
| attn.compressor.ape                   | [ratio, k*d]                 | f32    | whole |
| attn.indexer.wq_b (CSA)               | [ih*id, q_lora]              | linear | split |
| attn.indexer.weights_proj (CSA)       | [ih, H]                      | keep   | split |
| attn.indexer.compressor.* (CSA)       | as compressor, 2*id wide     | keep   | whole |
| ffn.gate.weight                       | [E, H]                       | keep   | whole |
| ffn.gate.bias (top-k routed layer)    | [E]                          | f32    | whole |
| ffn.gate.tid2eid (hash layer)         | [vocab, top-k]               | hash   | whole |
| ffn.experts.{e}.w1, w3; w2            | [f, H]; [H, f]               | expert | split |
| ffn.shared_experts.w1, w3; w2         | [s*f, H]; [H, s*f]           | linear | split |
| mtp.J.e_proj, h_proj                  | [H, H]                       | linear | whole |
| mtp.J.enorm, hnorm, norm              | [H]                          | keep   | whole |
| mtp.J.hc_head_*                       | as the model's hc_head_*     | f32    | whole |
| embed.weight, head.weight             | [vocab, H]                   | keep   | split |
| norm.weight                           | [H]                          | keep   | whole |
| hc_head_fn, _base, _scale             | [hc, hc*H], [hc], [1]        | f32    | whole |

Storage of each kind, by the config's quantization:
- linear: F8_E4M3 + one scale per 128x128 block (F8_E8M0 for scale_fmt ue8m0, else F32);
- expert: FP4 E2M1, two per byte (I8, last dim halved) + one F8_E8M0 scale per 32 values, or
  as `linear` for expert_dtype fp8;
- keep: the checkpoint's torch_dtype (BF16 in the release); f32: F32; hash (tid2eid): I64.
An unquantized config stores linear and expert weights in its torch_dtype too.
These kinds are the release's: with them Flash's tensor list sums to its index's
`total_size` to the byte (common/tests/data/README.md), which F32 norms or compressor weights
or an I32 `tid2eid` would not (DeepSeek's reference code widens the BF16 norms and compressor
weights to float32 and declares `tid2eid` int32 when it loads them; the files hold BF16 and
I64, and so do transformers' notes on which projections ship in BF16).
TP: a split tensor is divided over the TP ranks (attention heads, vocabulary, experts by TP or
EP); the others are whole on every rank, as DeepSeek's reference code splits them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from dsv4_common.core.model import DSV4Config

Kind = Literal["linear", "expert", "keep", "f32", "hash"]
StorageDtype = Literal["BF16", "F16", "F32", "F8_E4M3", "F8_E8M0", "I8", "I64"]

DTYPE_SIZE: dict[StorageDtype, int] = {
    "BF16": 2,
    "F16": 2,
    "F32": 4,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I8": 1,
    "I64": 8,
}
_TORCH_DTYPE: dict[str, StorageDtype] = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}
FP8_BLOCK = 128  # FP8 weights: one scale per 128x128 block
FP4_GROUP = 32  # FP4 experts: one scale per 32 values of a row


@dataclass(frozen=True, slots=True)
class Param:
    """One logical parameter (`copies` identical ones when the name holds `{e}`: experts)."""

    name: str
    shape: tuple[int, ...]  # logical; linears are [out, in]
    kind: Kind
    split: bool  # divided over the TP ranks; else each rank holds it whole
    copies: int = 1

    @property
    def numel(self) -> int:
        return self.copies * math.prod(self.shape)

    def names(self) -> tuple[str, ...]:
        """The concrete tensor names (expert e = 0..copies-1)."""
        if self.copies == 1 and "{e}" not in self.name:
            return (self.name,)
        return tuple(self.name.format(e=e) for e in range(self.copies))


@dataclass(frozen=True, slots=True)
class Tensor:
    """One stored tensor (or `copies` identical ones): what the checkpoint holds on disk."""

    name: str
    shape: tuple[int, ...]
    dtype: StorageDtype
    params: int  # logical parameters it carries (a scale: 0; FP4: 2 per byte)
    split: bool
    copies: int = 1

    @property
    def nbytes(self) -> int:
        return self.copies * math.prod(self.shape) * DTYPE_SIZE[self.dtype]

    def bytes_per_rank(self, tp_size: int) -> int:
        """Bytes one TP rank holds: a split tensor's share (rounded up), else all of it."""
        return -(-self.nbytes // tp_size) if self.split else self.nbytes


# --- logical parameters ---------------------------------------------------------------------


def _hc(prefix: str, hc: int, hidden: int) -> list[Param]:
    mix = (2 + hc) * hc
    return [
        Param(f"{prefix}_fn", (mix, hc * hidden), "f32", False),
        Param(f"{prefix}_base", (mix,), "f32", False),
        Param(f"{prefix}_scale", (3,), "f32", False),
    ]


def _hc_head(prefix: str, hc: int, hidden: int) -> list[Param]:
    return [
        Param(f"{prefix}hc_head_fn", (hc, hc * hidden), "f32", False),
        Param(f"{prefix}hc_head_base", (hc,), "f32", False),
        Param(f"{prefix}hc_head_scale", (1,), "f32", False),
    ]


def _compressor(prefix: str, hidden: int, dim: int, ratio: int, overlap: bool) -> list[Param]:
    width = (2 if overlap else 1) * dim
    return [
        Param(f"{prefix}.wkv.weight", (width, hidden), "keep", False),
        Param(f"{prefix}.wgate.weight", (width, hidden), "keep", False),
        Param(f"{prefix}.ape", (ratio, width), "f32", False),
        Param(f"{prefix}.norm.weight", (dim,), "keep", False),
    ]


def _mlp(prefix: str, hidden: int, inter: int, kind: Kind, copies: int = 1) -> list[Param]:
    return [
        Param(f"{prefix}.w1.weight", (inter, hidden), kind, True, copies),
        Param(f"{prefix}.w2.weight", (hidden, inter), kind, True, copies),
        Param(f"{prefix}.w3.weight", (inter, hidden), kind, True, copies),
    ]


def _attention(m: DSV4Config, a: str, ratio: int) -> list[Param]:
    w, g = m.weights, m.arch.o_groups
    h, d, heads = w.hidden_size, m.head_dim, w.num_attention_heads
    params = [
        Param(f"{a}.wq_a.weight", (w.q_lora_rank, h), "linear", False),
        Param(f"{a}.q_norm.weight", (w.q_lora_rank,), "keep", False),
        Param(f"{a}.wq_b.weight", (heads * d, w.q_lora_rank), "linear", True),
        Param(f"{a}.wkv.weight", (d, h), "linear", False),
        Param(f"{a}.kv_norm.weight", (d,), "keep", False),
        Param(f"{a}.wo_a.weight", (g * w.o_lora_rank, heads * d // g), "linear", True),
        Param(f"{a}.wo_b.weight", (h, g * w.o_lora_rank), "linear", True),
        Param(f"{a}.attn_sink", (heads,), "f32", True),
    ]
    if ratio:
        sparse = ratio == m.sparse_ratio
        params += _compressor(f"{a}.compressor", h, d, ratio, overlap=sparse)
        if sparse:
            ih, idim = m.index_n_heads, m.index_head_dim
            params += [
                Param(f"{a}.indexer.wq_b.weight", (ih * idim, w.q_lora_rank), "linear", True),
                Param(f"{a}.indexer.weights_proj.weight", (ih, h), "keep", True),
            ]
            params += _compressor(f"{a}.indexer.compressor", h, idim, ratio, overlap=True)
    return params


def _ffn(m: DSV4Config, f: str, dense: bool, hash_routed: bool) -> list[Param]:
    w = m.weights
    h = w.hidden_size
    if dense:  # first_k_dense_replace layers (the release has none)
        return _mlp(f, h, w.intermediate_size, "linear")
    params = [Param(f"{f}.gate.weight", (w.num_routed_experts, h), "keep", False)]
    if hash_routed:
        params.append(
            Param(f"{f}.gate.tid2eid", (w.vocab_size, w.num_experts_per_token), "hash", False)
        )
    else:
        params.append(Param(f"{f}.gate.bias", (w.num_routed_experts,), "f32", False))
    params += _mlp(f"{f}.experts.{{e}}", h, w.moe_intermediate_size, "expert", w.num_routed_experts)
    if w.num_shared_experts:
        inter = w.num_shared_experts * w.moe_intermediate_size
        params += _mlp(f"{f}.shared_experts", h, inter, "linear")
    return params


def _block(m: DSV4Config, p: str, ratio: int, dense: bool, hash_routed: bool) -> list[Param]:
    h, hc = m.weights.hidden_size, m.arch.hc_mult
    return [
        Param(f"{p}.attn_norm.weight", (h,), "keep", False),
        Param(f"{p}.ffn_norm.weight", (h,), "keep", False),
        *_hc(f"{p}.hc_attn", hc, h),
        *_hc(f"{p}.hc_ffn", hc, h),
        *_attention(m, f"{p}.attn", ratio),
        *_ffn(m, f"{p}.ffn", dense, hash_routed),
    ]


def layer_params(m: DSV4Config, layer: int) -> tuple[Param, ...]:
    """Target layer `layer` (0 <= layer < num_hidden_layers)."""
    assert 0 <= layer < m.num_hidden_layers, layer
    dense = layer < m.weights.num_dense_layers
    hashed = not dense and layer < m.arch.num_hash_layers
    return tuple(_block(m, f"layers.{layer}", m.compress_ratios[layer], dense, hashed))


def mtp_params(m: DSV4Config, index: int) -> tuple[Param, ...]:
    """MTP layer `index`: a block (top-k routed, never hashed) plus the projections that mix
    the next token's embedding into the hidden state, and its own head hyper-connection. It
    shares the model's embedding and LM head."""
    assert 0 <= index < m.num_nextn_predict_layers, index
    h, p = m.weights.hidden_size, f"mtp.{index}"
    return (
        *_block(m, p, m.draft_ratio(index), dense=False, hash_routed=False),
        Param(f"{p}.e_proj.weight", (h, h), "linear", False),
        Param(f"{p}.h_proj.weight", (h, h), "linear", False),
        Param(f"{p}.enorm.weight", (h,), "keep", False),
        Param(f"{p}.hnorm.weight", (h,), "keep", False),
        Param(f"{p}.norm.weight", (h,), "keep", False),
        *_hc_head(f"{p}.", m.arch.hc_mult, h),
    )


def embedding_params(m: DSV4Config) -> tuple[Param, ...]:
    """The first PP stage's (and an MTP layer's, which embeds its next tokens)."""
    return (Param("embed.weight", (m.weights.vocab_size, m.weights.hidden_size), "keep", True),)


def head_params(m: DSV4Config) -> tuple[Param, ...]:
    """The last PP stage's: the head hyper-connection, the final norm and the LM head."""
    w = m.weights
    return (
        *_hc_head("", m.arch.hc_mult, w.hidden_size),
        Param("norm.weight", (w.hidden_size,), "keep", False),
        Param("head.weight", (w.vocab_size, w.hidden_size), "keep", True),
    )


def checkpoint_params(m: DSV4Config) -> tuple[Param, ...]:
    """Every parameter of the checkpoint, MTP layers included."""
    params = [*embedding_params(m), *head_params(m)]
    for layer in range(m.num_hidden_layers):
        params += layer_params(m, layer)
    for index in range(m.num_nextn_predict_layers):
        params += mtp_params(m, index)
    return tuple(params)


# --- storage --------------------------------------------------------------------------------


def stored(m: DSV4Config, p: Param) -> tuple[Tensor, ...]:
    """The tensor(s) the checkpoint stores for `p`: a quantized weight and its `.scale`."""
    q = m.quantization
    plain: StorageDtype = _TORCH_DTYPE[m.weight_dtype]
    if p.kind == "f32":
        return (Tensor(p.name, p.shape, "F32", p.numel, p.split, p.copies),)
    if p.kind == "hash":
        return (Tensor(p.name, p.shape, "I64", p.numel, p.split, p.copies),)
    if q is None or p.kind == "keep":
        return (Tensor(p.name, p.shape, plain, p.numel, p.split, p.copies),)
    out, cols = p.shape
    scale = p.name.removesuffix(".weight") + ".scale"
    if p.kind == "expert" and q.expert_dtype == "fp4":
        packed = (out, -(-cols // 2))
        groups = (out, -(-cols // FP4_GROUP))
        return (
            Tensor(p.name, packed, "I8", p.numel, p.split, p.copies),
            Tensor(scale, groups, "F8_E8M0", 0, p.split, p.copies),
        )
    blocks = (-(-out // FP8_BLOCK), -(-cols // FP8_BLOCK))
    scale_dtype: StorageDtype = "F8_E8M0" if q.scale_fmt == "ue8m0" else "F32"
    return (
        Tensor(p.name, p.shape, "F8_E4M3", p.numel, p.split, p.copies),
        Tensor(scale, blocks, scale_dtype, 0, p.split, p.copies),
    )


def stored_tensors(m: DSV4Config, params: tuple[Param, ...]) -> tuple[Tensor, ...]:
    return tuple(t for p in params for t in stored(m, p))


def bytes_per_rank(m: DSV4Config, params: tuple[Param, ...], tp_size: int) -> int:
    """Bytes of `params` as stored, on one of `tp_size` tensor-parallel ranks."""
    return sum(t.bytes_per_rank(tp_size) for t in stored_tensors(m, params))
