"""HuggingFace `config.json` samples shared by the common and operator tests
(`import model_samples`): small DeepSeek-V4 models, in the release's form, that plan in
milliseconds."""

from __future__ import annotations

import json


def tiny_hf_config(num_hidden_layers: int = 6, max_position_embeddings: int = 4096) -> str:
    """The `tiny` preset as a config.json (the release's keys; one MTP layer, ratios
    {0, 4, 16}; float32 weights): with 6 layers it parses to the preset, `name` aside."""
    target = [0, *(4 if i % 2 else 16 for i in range(1, num_hidden_layers))]
    doc = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "num_hidden_layers": num_hidden_layers,
        "compress_ratios": [*target, 0],  # + the MTP layer
        "num_nextn_predict_layers": 1,
        "sliding_window": 8,
        "head_dim": 32,
        "qk_rope_head_dim": 8,
        "index_head_dim": 16,
        "index_n_heads": 16,
        "index_topk": 8,
        "kv_cache_dtype": "fp32",
        "hidden_size": 64,
        "vocab_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "q_lora_rank": 32,
        "o_lora_rank": 16,
        "o_groups": 2,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "num_hash_layers": 1,
        "hc_mult": 2,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-06,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "routed_scaling_factor": 1.5,
        "norm_topk_prob": True,
        "swiglu_limit": 10.0,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000,
        "compress_rope_theta": 160000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "max_position_embeddings": max_position_embeddings,
        "torch_dtype": "float32",
    }
    return json.dumps(doc, indent=2) + "\n"
