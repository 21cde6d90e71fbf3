"""Checkpoint tensor names -> the published DeepSeek-V4 names our model uses (pure: strings,
and the split of transformers' stacked experts). Scales and MTP names are recognized here too.

A checkpoint may spell each tensor three ways; each tensor is renamed on its own:

    published     layers.3.attn.wq_a.weight        DeepSeek's release; canonical in our worker
    transformers  model.layers.3.self_attn.q_a_proj.weight   DeepseekV4ForCausalLM's modules
    HF-saved      model.layers.3.attn.wq_a.weight  what save_pretrained writes: published leaves
                  under `model.`, except model.embed_tokens, model.hc_head.hc_*, head.weight
                  (no prefix), and the attention's kv_norm written back as `attn.norm`

transformers stacks routed experts: `mlp.experts.gate_up_proj` [E, 2*inter, H] holds
cat(w1, w3) on dim 1 per expert, `mlp.experts.down_proj` [E, H, inter] holds w2 (its
`conversion_mapping.py`, key deepseek_v4). Quantization scales: `<w>.scale` for `<w>.weight`
(published), `<w>.weight_scale_inv` or `<stacked>_scale_inv` (transformers' FP8 layout).
MTP layers (`mtp.K.*`, published only; SGLang's deepseek_v4_nextn and the release's MTPBlock):
a full block with compress ratio 0 plus e_proj, h_proj, enorm, hnorm, norm and hc_head_*.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch

from dsv4_worker.model.weights import Shapes, mtp_param_shapes

__all__ = ["FusedExperts", "Target", "mtp_param_shapes", "published_name", "scale_owner"]

_SCOPED = re.compile(r"^(layers|mtp)\.(\d+)\.(.+)$")
_FUSED: dict[str, Literal["gate_up", "down"]] = {
    "mlp.experts.gate_up_proj": "gate_up",
    "mlp.experts.down_proj": "down",
}

_GLOBALS = {
    "embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}


def _local_table() -> dict[str, str]:
    """transformers' names inside one layer -> the published ones (others pass unchanged)."""
    table = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.sinks": "attn.attn_sink",
        "self_attn.q_a_proj.weight": "attn.wq_a.weight",
        "self_attn.q_a_norm.weight": "attn.q_norm.weight",
        "self_attn.q_b_proj.weight": "attn.wq_b.weight",
        "self_attn.kv_proj.weight": "attn.wkv.weight",
        "self_attn.kv_norm.weight": "attn.kv_norm.weight",
        "self_attn.o_a_proj.weight": "attn.wo_a.weight",
        "self_attn.o_b_proj.weight": "attn.wo_b.weight",
        "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
        "self_attn.compressor.indexer.scorer.weights_proj.weight": (
            "attn.indexer.weights_proj.weight"
        ),
        "mlp.gate.weight": "ffn.gate.weight",
        "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
        "mlp.gate.tid2eid": "ffn.gate.tid2eid",
        "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
        "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
        "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
        # NOTE: save_pretrained's reverse of `.norm.` -> `.kv_norm.` also hits this one.
        "attn.norm.weight": "attn.kv_norm.weight",
    }
    for hc in ("attn", "ffn"):
        for leaf in ("fn", "base", "scale"):
            table[f"{hc}_hc.{leaf}"] = f"hc_{hc}_{leaf}"
    compressor = {
        "kv_proj.weight": "wkv.weight",
        "gate_proj.weight": "wgate.weight",
        "position_bias": "ape",
        "kv_norm.weight": "norm.weight",
    }
    for leaf, pub in compressor.items():
        table[f"self_attn.compressor.{leaf}"] = f"attn.compressor.{pub}"
        table[f"self_attn.compressor.indexer.{leaf}"] = f"attn.indexer.compressor.{pub}"
    return table


_LOCAL = _local_table()


@dataclass(frozen=True, slots=True)
class FusedExperts:
    """transformers' stacked routed experts of one layer (`scope` = `layers.N` or `mtp.K`)."""

    scope: str
    kind: Literal["gate_up", "down"]

    def names(self, num_experts: int) -> list[str]:
        """The published names it holds, in split order."""
        out: list[str] = []
        for e in range(num_experts):
            p = f"{self.scope}.ffn.experts.{e}"
            kinds = ("w1", "w3") if self.kind == "gate_up" else ("w2",)
            out += [f"{p}.{w}.weight" for w in kinds]
        return out

    def shape(self, shapes: Shapes, num_experts: int) -> tuple[int, ...]:
        """[E, 2*inter, H] (gate_up) or [E, H, inter] (down), from the published shapes."""
        w = shapes[f"{self.scope}.ffn.experts.0.{'w1' if self.kind == 'gate_up' else 'w2'}.weight"]
        return (num_experts, 2 * w[0], w[1]) if self.kind == "gate_up" else (num_experts, *w)

    def split(self, stacked: torch.Tensor) -> dict[str, torch.Tensor]:
        """gate_up [E, 2*inter, H] -> w1 = [e, :inter], w3 = [e, inter:]; down -> w2 = [e]."""
        out: dict[str, torch.Tensor] = {}
        inter = stacked.shape[1] // 2
        for e in range(stacked.shape[0]):
            p = f"{self.scope}.ffn.experts.{e}"
            if self.kind == "gate_up":
                out[f"{p}.w1.weight"] = stacked[e, :inter].clone()
                out[f"{p}.w3.weight"] = stacked[e, inter:].clone()
            else:
                out[f"{p}.w2.weight"] = stacked[e].clone()
        return out


Target = str | FusedExperts


def published_name(name: str) -> Target:
    """Any spelling of a parameter -> its published name (or the stacked experts it holds).
    Names it does not know come back without a `model.` prefix, otherwise unchanged."""
    name = name.removeprefix("model.")
    scoped = _SCOPED.match(name)
    if scoped is None:
        return _GLOBALS.get(name, name)
    kind, index, local = scoped.groups()
    scope = f"{kind}.{index}"
    if local in _FUSED:
        return FusedExperts(scope, _FUSED[local])
    return f"{scope}.{_LOCAL.get(local, local)}"


def scale_owner(name: str) -> str | None:
    """The weight a quantization scale belongs to, in the scale's own spelling, or None when
    the name does not look like a scale."""
    if name.endswith("_scale_inv"):  # `.weight_scale_inv` or a stacked `<name>_scale_inv`
        return name.removesuffix("_scale_inv")
    if name.endswith(".scale"):
        return name.removesuffix(".scale") + ".weight"
    return None
