"""transformers' DeepseekV4ForCausalLM as an oracle: a config equal to one of ours, every
parameter randomized (sinks, hash tables, correction bias and hyper-connection weights too),
and its state dict under the published names our model reads."""

from __future__ import annotations

from typing import Any

import torch

from dsv4_common.core.model import DSV4Config
from dsv4_worker.model.checkpoint_names import FusedExperts, published_name


def hf_config(m: DSV4Config) -> Any:
    from transformers import DeepseekV4Config

    ratios = m.target_ratios
    hca = sorted({r for r in ratios if r and r != m.sparse_ratio})
    assert len(hca) <= 1, "transformers has one heavily-compressed rate"
    names = {0: "sliding_attention", m.sparse_ratio: "compressed_sparse_attention"}
    if hca:
        names[hca[0]] = "heavily_compressed_attention"
    a, w = m.arch, m.weights
    rope: dict[str, Any] = {"rope_type": "default"}
    if a.rope_scaling is not None:
        y = a.rope_scaling
        rope = {
            "rope_type": "yarn",
            "factor": y.factor,
            "original_max_position_embeddings": y.original_max_position_embeddings,
            "beta_fast": y.beta_fast,
            "beta_slow": y.beta_slow,
        }
    cfg = DeepseekV4Config(
        vocab_size=w.vocab_size,
        hidden_size=w.hidden_size,
        moe_intermediate_size=w.moe_intermediate_size,
        num_hidden_layers=m.num_hidden_layers,
        num_attention_heads=w.num_attention_heads,
        num_key_value_heads=1,
        head_dim=m.head_dim,
        q_lora_rank=w.q_lora_rank,
        num_experts_per_tok=w.num_experts_per_token,
        n_routed_experts=w.num_routed_experts,
        n_shared_experts=w.num_shared_experts,
        scoring_func=a.scoring_func,
        norm_topk_prob=a.norm_topk_prob,
        routed_scaling_factor=a.routed_scaling_factor,
        max_position_embeddings=m.max_position_embeddings,
        rope_theta=a.rope_theta,
        layer_types=[names[r] for r in ratios],
        compress_rates={
            "compressed_sparse_attention": m.sparse_ratio,
            "heavily_compressed_attention": hca[0] if hca else 128,
        },
        compress_rope_theta=a.compress_rope_theta,
        hc_mult=a.hc_mult,
        hc_sinkhorn_iters=a.hc_sinkhorn_iters,
        hc_eps=a.hc_eps,
        mlp_layer_types=["hash_moe"] * a.num_hash_layers
        + ["moe"] * (m.num_hidden_layers - a.num_hash_layers),
        swiglu_limit=a.swiglu_limit,
        sliding_window=m.window_tokens,
        o_groups=a.o_groups,
        o_lora_rank=w.o_lora_rank,
        index_n_heads=m.index_n_heads,
        index_head_dim=m.index_head_dim,
        index_topk=m.index_topk,
        num_nextn_predict_layers=m.num_nextn_predict_layers,
        partial_rotary_factor=m.qk_rope_head_dim / m.head_dim,
        rope_parameters=rope,
        rms_norm_eps=a.rms_norm_eps,
        bos_token_id=0,
        eos_token_id=1,
    )
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"  # float64: grouped_mm takes fp32/bf16 only
    return cfg


def hf_model(m: DSV4Config, seed: int) -> Any:
    """A float64 DeepseekV4ForCausalLM with every parameter and buffer drawn at random."""
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(hf_config(m)).double().eval()
    gen = torch.Generator().manual_seed(seed)
    experts, k = m.weights.num_routed_experts, m.weights.num_experts_per_token
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in name:
                continue
            if name.endswith("tid2eid"):
                rows = [torch.randperm(experts, generator=gen)[:k] for _ in range(t.shape[0])]
                t.copy_(torch.stack(rows))
            elif name.endswith(("norm.weight", "layernorm.weight")):
                t.copy_(1.0 + 0.2 * torch.randn(t.shape, generator=gen))
            elif name.endswith(("position_bias", "base", "sinks", "e_score_correction_bias")):
                t.copy_(0.5 * torch.randn(t.shape, generator=gen))
            elif name.endswith(("scale", "hc_scale")):
                t.copy_(0.5 + torch.rand(t.shape, generator=gen))
            elif name.endswith("embed_tokens.weight"):
                t.copy_(torch.randn(t.shape, generator=gen))
            else:
                gain = 4.0 if name == "lm_head.weight" else 1.0
                t.copy_(torch.randn(t.shape, generator=gen) * gain / t.shape[-1] ** 0.5)
    return model


def published_params(model: Any) -> dict[str, torch.Tensor]:
    """The HF model's parameters under the published names (experts unfused), through the
    worker's own renaming (checkpoint_names), so a wrong rename fails the oracle tests too."""
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if "inv_freq" in name:
            continue
        target = published_name(name)
        if isinstance(target, FusedExperts):
            out |= {k: v.to(torch.float64) for k, v in target.split(t).items()}
        else:
            out[target] = t.clone() if not t.is_floating_point() else t.to(torch.float64)
    return out


def load_into_hf(model: Any, params: dict[str, torch.Tensor]) -> None:
    """Copy our parameters (published names) into the HF model, every one of them."""
    expected = published_params(model)
    missing, extra = sorted(set(expected) - set(params)), sorted(set(params) - set(expected))
    assert not missing and not extra, (missing[:5], extra[:5])
    experts = model.config.n_routed_experts
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if "inv_freq" in name:
                continue
            target = published_name(name)
            if isinstance(target, FusedExperts):
                parts = [params[n] for n in target.names(experts)]
                per_expert = 2 if target.kind == "gate_up" else 1
                rows = [
                    torch.cat(parts[e * per_expert : (e + 1) * per_expert]) for e in range(experts)
                ]
                t.copy_(torch.stack(rows))
            else:
                t.copy_(params[target])
    again = published_params(model)
    assert all(torch.equal(again[k], params[k].to(again[k].dtype)) for k in params)


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens through HF's cached path (prefill, then one token at a time) and the
    full-forward logits [len(prompt) + max_new_tokens - 1, vocab] of the whole sequence."""
    from transformers import DynamicCache

    ids = list(prompt)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        out = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
        new: list[int] = []
        for _ in range(max_new_tokens):
            nxt = int(out.logits[0, -1].argmax())
            new.append(nxt)
            if len(new) == max_new_tokens:
                break
            out = model(input_ids=torch.tensor([[nxt]]), cache=out.cache, use_cache=True)
        full = model(input_ids=torch.tensor([ids + new[:-1]])).logits[0]
    return new, full


def save_model_dir(m: DSV4Config, seed: int, root: Any, shards: int = 3) -> Any:
    """A random DeepseekV4ForCausalLM saved by transformers' save_pretrained (float32), then
    resharded into `shards` files with an index. Returns the float64 model holding exactly the
    saved values (the reference to compare with)."""
    import json
    from pathlib import Path

    from checkpoint_writer import save_sharded
    from safetensors.torch import load_file

    root = Path(root)
    model = hf_model(m, seed).float()
    saved = root / "saved"
    model.save_pretrained(saved)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(saved.glob("*.safetensors")):
        tensors |= load_file(str(file))
    config = json.loads((saved / "config.json").read_text())
    save_sharded(root, tensors, shards, config)
    return model.double().eval()


def hf_reference(m: DSV4Config, params: dict[str, torch.Tensor]) -> Any:
    """transformers' model holding exactly `params` (our published names)."""
    model = hf_model(m, 0)
    load_into_hf(model, params)
    return model


def hf_tokens(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation (its cached path)."""
    return hf_greedy(model, list(prompt), max_new_tokens)[0]
