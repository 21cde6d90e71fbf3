"""HuggingFace `config.json` samples shared by the common and operator tests
(`import model_samples`): small DeepSeek-V4-shaped models that plan in milliseconds."""

from __future__ import annotations

import json


def tiny_hf_config(num_hidden_layers: int = 6, max_position_embeddings: int = 4096) -> str:
    """The `tiny` preset's shape as a config.json (one MTP layer, ratios {0, 4, 16})."""
    target = [0, *(4 if i % 2 else 16 for i in range(1, num_hidden_layers - 1)), 0]
    doc = {
        "model_type": "deepseek_v4",
        "num_hidden_layers": num_hidden_layers,
        "compress_ratios": [*target, 0],  # + the MTP layer
        "num_nextn_predict_layers": 1,
        "window_size": 8,
        "qk_nope_head_dim": 24,
        "qk_rope_head_dim": 8,
        "index_head_dim": 16,
        "index_n_heads": 2,
        "index_topk": 8,
        "kv_cache_dtype": "bf16",
        "hidden_size": 64,
        "vocab_size": 256,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "first_k_dense_replace": num_hidden_layers,
        "q_lora_rank": 32,
        "o_lora_rank": 32,
        "max_position_embeddings": max_position_embeddings,
    }
    return json.dumps(doc, indent=2) + "\n"
