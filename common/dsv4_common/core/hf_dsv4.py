"""A DeepSeek-V4 `config.json` -> DSV4Config, in both forms in use. Pure; a missing, malformed,
contradictory or unknown value raises ModelConfigError naming the field.

| setting             | as released (DeepSeek)           | as transformers >= 5.24 writes it   |
| ------------------- | -------------------------------- | ----------------------------------- |
| attention per layer | compress_ratios: 0/4/128 per     | layer_types (sliding_attention,     |
|                     | layer, then one per MTP layer    | compressed_sparse_attention, ...)   |
|                     |                                  | + compress_rates {type: ratio}      |
| hash-routed layers  | num_hash_layers                  | mlp_layer_types: hash_moe.., moe..  |
| rotary dims         | head_dim, qk_rope_head_dim       | head_dim, partial_rotary_factor     |
| rotary settings     | rope_theta, compress_rope_theta, | rope_parameters {main, compress}    |
|                     | rope_scaling {type yarn, ...}    |                                     |
| storage             | torch_dtype, expert_dtype,       | dtype, quantization_config          |
|                     | quantization_config              | {..., expert_dtype}                 |

A file may carry both spellings of a setting (transformers keeps qk_rope_head_dim, rope_theta,
compress_rope_theta and expert_dtype beside its own): they must agree. `qk_nope_head_dim` is
optional (head_dim - qk_rope_head_dim) and must agree where given. Keys not read here are
tolerated (HF configs carry many); every key that shapes the model or its storage is read.
NOTE: the `layer_types` form lists target layers only; the MTP layers keep a window only, so
`compress_ratios` gets one 0 per `num_nextn_predict_layers` appended (as the release lists).
Settings the release always ships but that do not change a shape (routing, rotary bases, eps)
default to transformers' defaults, which are the Flash release's. Three keys are this project's
own: `kv_cache_dtype` (fp8_e4m3 | bf16 | fp32, also spelled fp8 | bfloat16 | float32; absent
or auto: fp8_e4m3 for an FP8 checkpoint, as released; else the weights' dtype, fp32 or bf16),
`window_size` (DeepSeek's inference config's name for
sliding_window) and `first_k_dense_replace` with `intermediate_size` (dense layers; the release
has none).
`release_config` is the inverse: a DSV4Config -> the release's form, which parses back to it;
for a model whose ratios transformers' fixed table (0, 4, 128) does not map (tiny's 16) it
adds `layer_types` + `compress_rates`, so transformers loads the file too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Final, cast, get_args

from dsv4_common.core.model import (
    ALLOWED_RATIOS,
    MAX_LAYERS,
    DSV4Arch,
    DSV4Config,
    ExpertDtype,
    IndexerDtype,
    KVDtype,
    ModelConfigError,
    Quantization,
    ScaleFmt,
    ScoringFunc,
    WeightDtype,
    WeightShape,
    YarnScaling,
)

SLIDING, CSA, HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)
LAYER_TYPES = (SLIDING, CSA, HCA)
DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}
MLP_LAYER_TYPES = ("hash_moe", "moe")
TORCH_DTYPES: dict[str, WeightDtype] = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
QUANTIZATION_KEYS = frozenset(
    {
        "quant_method",
        "fmt",
        "scale_fmt",
        "weight_block_size",
        "activation_scheme",
        "expert_dtype",
        # transformers' FineGrainedFP8Config writes these; only their no-op values are accepted
        "modules_to_not_convert",
        "modules_to_convert",
        "dequantize",
    }
)
YARN_KEYS = frozenset(
    {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor"}
)
YARN_BETAS = (32.0, 1.0)  # beta_fast, beta_slow where absent (transformers' YaRN defaults)
ROPE_TYPE_KEYS = frozenset({"rope_type", "type"})
ROPE_SHARED_KEYS = frozenset({"rope_theta", "partial_rotary_factor"})


def is_dsv4(raw: Mapping[str, Any]) -> bool:
    """Whether a config.json describes a DeepSeek-V4 model (either form)."""
    if str(raw.get("model_type", "")).startswith("deepseek_v4"):
        return True
    if "compress_ratios" in raw or "compress_rates" in raw:
        return True
    types = raw.get("layer_types")
    return isinstance(types, list) and any(t in (CSA, HCA) for t in types)


def dsv4_from_hf(raw: Mapping[str, Any], name: str) -> DSV4Config:
    """A DeepSeek-V4 config.json (either form, already decoded) -> DSV4Config named `name`."""
    n = _int(raw, "num_hidden_layers", minimum=1, maximum=MAX_LAYERS)
    mtp = _int(raw, "num_nextn_predict_layers", minimum=0, maximum=16)
    head_dim, rope_dim = _head_dims(raw)
    ratios, sparse = _attention_ratios(raw, n, mtp)
    _expect(raw, "num_key_value_heads", 1, "DeepSeek-V4 attends with one shared latent KV head")
    _expect(raw, "tie_word_embeddings", False, "DeepSeek-V4 keeps a separate LM head")
    _expect(raw, "attention_bias", False, "DeepSeek-V4's projections have no bias")
    _expect(raw, "mlp_bias", False, "DeepSeek-V4's projections have no bias")
    _expect(raw, "hidden_act", "silu", "DeepSeek-V4's experts are SwiGLU")
    _expect(raw, "topk_method", "noaux_tc", "DeepSeek-V4 routes top-k with a correction bias")
    quantization, weight_dtype = _storage(raw)
    kv_default = "fp8_e4m3" if quantization else ("fp32" if weight_dtype == "fp32" else "bf16")
    kv_dtype = _kv_dtype(raw, kv_default)
    fp8_kv = kv_dtype == "fp8_e4m3"
    return DSV4Config(
        name=name,
        num_hidden_layers=n,
        compress_ratios=ratios,
        num_nextn_predict_layers=mtp,
        window_tokens=_window(raw),
        qk_nope_head_dim=head_dim - rope_dim,
        qk_rope_head_dim=rope_dim,
        index_head_dim=_int(raw, "index_head_dim", minimum=1),
        index_n_heads=_int(raw, "index_n_heads", minimum=1),
        index_topk=_int(raw, "index_topk", minimum=1),
        kv_dtype=cast(KVDtype, kv_dtype),
        indexer_dtype="fp8" if fp8_kv else cast(IndexerDtype, kv_dtype),
        state_dtype="fp32",
        weights=_weight_shape(raw),
        max_position_embeddings=_int(raw, "max_position_embeddings", minimum=1),
        sparse_ratio=sparse,
        kv_page_align_bytes=576 if fp8_kv else 1,
        arch=_arch(raw, n, head_dim, rope_dim),
        quantization=quantization,
        weight_dtype=weight_dtype,
    )


# --- the inverse: DSV4Config -> config.json as released ----------------------------------------


def release_config(model: DSV4Config) -> dict[str, Any]:
    """`model` as a config.json in the release's form: `dsv4_from_hf` of it (or of its JSON
    text) equals `model`, name aside. The MTP tail of compress_ratios is written out in full,
    as released. Raises ModelConfigError naming each setting no config.json can carry: those
    the parser derives (indexer and state dtypes, page alignment, the CSA ratio when it is not
    4 and three compressed ratios are in use) and generic-family fields."""
    problems = _unwritable(model)
    if problems:
        raise ModelConfigError(
            f"model {model.name!r} has no config.json form: " + "; ".join(problems)
        )
    w, a = model.weights, model.arch
    mtp_tail = model.num_hidden_layers + model.num_nextn_predict_layers - len(model.compress_ratios)
    raw: dict[str, Any] = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "num_hidden_layers": model.num_hidden_layers,
        "num_nextn_predict_layers": model.num_nextn_predict_layers,
        "compress_ratios": [*model.compress_ratios, *[0] * mtp_tail],
        "sliding_window": model.window_tokens,
        "head_dim": model.head_dim,
        "qk_rope_head_dim": model.qk_rope_head_dim,
        "index_head_dim": model.index_head_dim,
        "index_n_heads": model.index_n_heads,
        "index_topk": model.index_topk,
        "vocab_size": w.vocab_size,
        "hidden_size": w.hidden_size,
        "num_attention_heads": w.num_attention_heads,
        "num_key_value_heads": 1,
        "q_lora_rank": w.q_lora_rank,
        "o_lora_rank": w.o_lora_rank,
        "o_groups": a.o_groups,
        "n_routed_experts": w.num_routed_experts,
        "n_shared_experts": w.num_shared_experts,
        "num_experts_per_tok": w.num_experts_per_token,
        "moe_intermediate_size": w.moe_intermediate_size,
        "num_hash_layers": a.num_hash_layers,
        "hc_mult": a.hc_mult,
        "hc_sinkhorn_iters": a.hc_sinkhorn_iters,
        "hc_eps": a.hc_eps,
        "hidden_act": "silu",
        "topk_method": "noaux_tc",
        "scoring_func": a.scoring_func,
        "routed_scaling_factor": a.routed_scaling_factor,
        "norm_topk_prob": a.norm_topk_prob,
        "swiglu_limit": a.swiglu_limit,
        "rope_theta": a.rope_theta,
        "compress_rope_theta": a.compress_rope_theta,
        "rms_norm_eps": a.rms_norm_eps,
        "max_position_embeddings": model.max_position_embeddings,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": _TORCH_DTYPE_NAMES[model.weight_dtype],
    }
    if _needs_layer_types(model):  # for transformers (the release's own loader ignores them)
        raw["compress_rates"] = {CSA: model.sparse_ratio, HCA: _hca_ratio(model)}
        raw["layer_types"] = [
            SLIDING if r == 0 else CSA if r == model.sparse_ratio else HCA
            for r in model.target_ratios
        ]
    if w.num_dense_layers:
        raw["first_k_dense_replace"] = w.num_dense_layers
        raw["intermediate_size"] = w.intermediate_size
    if a.rope_scaling is not None:
        y = a.rope_scaling
        raw["rope_scaling"] = {
            "type": "yarn",
            "factor": y.factor,
            "original_max_position_embeddings": y.original_max_position_embeddings,
            "beta_fast": y.beta_fast,
            "beta_slow": y.beta_slow,
        }
    q = model.quantization
    if q is not None:
        raw["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "scale_fmt": q.scale_fmt,
            "weight_block_size": list(q.weight_block_size),
            "activation_scheme": "dynamic",
        }
        raw["expert_dtype"] = q.expert_dtype
    if model.kv_dtype != _default_kv_dtype(q, model.weight_dtype):
        raw["kv_cache_dtype"] = model.kv_dtype
    return raw


_TORCH_DTYPE_NAMES: dict[WeightDtype, str] = {v: k for k, v in TORCH_DTYPES.items()}


def _default_kv_dtype(quantization: Quantization | None, weight_dtype: WeightDtype) -> KVDtype:
    """The KV dtype a config.json without kv_cache_dtype means."""
    if quantization is not None:
        return "fp8_e4m3"
    return "fp32" if weight_dtype == "fp32" else "bf16"


# How transformers (5.24) turns a release's compress_ratios into layer types: a fixed table,
# whatever compress_rates says; any other ratio needs layer_types + compress_rates beside them.
TRANSFORMERS_RATIO_TYPES: dict[int, str] = {0: SLIDING, 4: CSA, 128: HCA}


def _needs_layer_types(model: DSV4Config) -> bool:
    """Whether compress_ratios alone would not load in transformers (a ratio outside its
    table, or a CSA ratio other than 4), and one HCA ratio can say it (transformers has one)."""
    ratios = set(model.target_ratios)
    hca = ratios - {0, model.sparse_ratio}
    unmapped = bool(ratios - TRANSFORMERS_RATIO_TYPES.keys())
    return len(hca) <= 1 and (unmapped or model.sparse_ratio != DEFAULT_COMPRESS_RATES[CSA])


def _hca_ratio(model: DSV4Config) -> int:
    """compress_rates' HCA entry: the other compressed ratio in use (else the default)."""
    others = [r for r in model.nonzero_ratios if r != model.sparse_ratio]
    if others:
        return others[0]
    default = DEFAULT_COMPRESS_RATES[HCA]
    return default if default != model.sparse_ratio else DEFAULT_COMPRESS_RATES[CSA]


def _unwritable(model: DSV4Config) -> list[str]:
    """Each setting of `model` that differs from what the parser derives for it."""
    fp8 = model.kv_dtype == "fp8_e4m3"
    w = model.weights
    shape_defaults = {f.name: f.default for f in dataclasses.fields(WeightShape)}
    derived: list[tuple[str, object, object]] = [
        ("indexer_dtype", model.indexer_dtype, "fp8" if fp8 else model.kv_dtype),
        ("state_dtype", model.state_dtype, "fp32"),
        ("kv_page_align_bytes", model.kv_page_align_bytes, 576 if fp8 else 1),
        ("intermediate_size", w.intermediate_size if not w.num_dense_layers else 0, 0),
    ]
    for name in ("dense_bytes_per_param", "embedding_bytes_per_param"):
        derived.append((name, getattr(w, name), shape_defaults[name]))
    problems = [
        f"{name} is {value!r}, where config.json can only mean {want!r}"
        for name, value, want in derived
        if value != want
    ]
    if model.sparse_ratio != DEFAULT_COMPRESS_RATES[CSA]:
        if model.sparse_ratio not in ALLOWED_RATIOS - {0}:
            problems.append(f"sparse_ratio {model.sparse_ratio} is not a compress ratio")
        others = [r for r in model.nonzero_ratios if r != model.sparse_ratio]
        if len(others) > 1:
            problems.append(
                f"sparse_ratio {model.sparse_ratio} with ratios {model.nonzero_ratios}: "
                "compress_rates names one CSA and one HCA ratio"
            )
    return problems


# --- shape ----------------------------------------------------------------------------------


def _head_dims(raw: Mapping[str, Any]) -> tuple[int, int]:
    """(head_dim, qk_rope_head_dim): head_dim, or qk_nope + qk_rope where head_dim is absent;
    the rotary part from qk_rope_head_dim or head_dim x partial_rotary_factor."""
    nope = _opt_int(raw, "qk_nope_head_dim", minimum=1)
    rope = _opt_int(raw, "qk_rope_head_dim", minimum=0)
    head = _opt_int(raw, "head_dim", minimum=1)
    if head is None:
        if nope is None:
            raise _missing("head_dim")
        if rope is None:
            raise _missing("qk_rope_head_dim")
        head = nope + rope
    factor_rope = _rotary_dims(raw, head)
    if rope is None:
        rope = factor_rope
    elif factor_rope is not None and factor_rope != rope:
        raise _error(
            "partial_rotary_factor",
            f"({raw['partial_rotary_factor']}) x head_dim ({head}) = {factor_rope} "
            f"contradicts qk_rope_head_dim ({rope})",
        )
    if rope is None:
        raise _missing("qk_rope_head_dim")
    if rope >= head:
        raise _error("qk_rope_head_dim", f"({rope}) must be < head_dim ({head})")
    if nope is not None and nope != head - rope:
        raise _error(
            "qk_nope_head_dim",
            f"({nope}) contradicts head_dim - qk_rope_head_dim ({head} - {rope} = {head - rope})",
        )
    return head, rope


def _rotary_dims(
    raw: Mapping[str, Any], head_dim: int, where: str = "partial_rotary_factor"
) -> int | None:
    """head_dim x partial_rotary_factor (None where absent): a whole number of dimensions."""
    factor = _opt_num(raw, "partial_rotary_factor", minimum=0.0, where=where)
    if factor is None:
        return None
    dims = head_dim * factor
    if factor > 1 or abs(dims - round(dims)) > 1e-6:
        raise _error(
            where, f"({factor}) x head_dim ({head_dim}) = {dims:g} is not a whole number of dims"
        )
    return round(dims)


def _window(raw: Mapping[str, Any]) -> int:
    hf = _opt_int(raw, "sliding_window", minimum=1)
    ours = _opt_int(raw, "window_size", minimum=1)
    if hf is not None and ours is not None and hf != ours:
        raise _error("window_size", f"({ours}) contradicts sliding_window ({hf})")
    window = hf if hf is not None else ours
    if window is None:
        raise _missing("sliding_window")
    return window


def _attention_ratios(raw: Mapping[str, Any], n: int, mtp: int) -> tuple[tuple[int, ...], int]:
    """(compress_ratios with the MTP tail, the CSA ratio) from compress_ratios and/or
    layer_types + compress_rates."""
    rates = _compress_rates(raw)
    sparse = rates[CSA] if rates is not None else DEFAULT_COMPRESS_RATES[CSA]
    from_types = _layer_type_ratios(raw, n, rates or DEFAULT_COMPRESS_RATES)
    ratios = _opt_int_list(raw, "compress_ratios")
    if ratios is None:
        if from_types is None:
            raise _missing("compress_ratios", "layer_types")
        ratios = from_types
    elif from_types is not None:
        for i, (r, t) in enumerate(zip(ratios[:n], raw["layer_types"], strict=False)):
            if r != from_types[i]:
                raise _error(
                    f"compress_ratios[{i}]",
                    f"({r}) contradicts layer_types[{i}] ({t!r}: ratio {from_types[i]})",
                )
    elif rates is not None:
        used = {0, rates[CSA], rates[HCA]}
        for i, r in enumerate(ratios):
            if r not in used:
                raise _error(f"compress_ratios[{i}]", f"({r}) is none of compress_rates {rates}")
    if n <= len(ratios) < n + mtp:  # the MTP layers: window only
        ratios = [*ratios, *[0] * (n + mtp - len(ratios))]
    return tuple(ratios), sparse


def _compress_rates(raw: Mapping[str, Any]) -> dict[str, int] | None:
    """compress_rates (and transformers' older compress_rate_csa / compress_rate_hca)."""
    rates: dict[str, int] | None = None
    given = raw.get("compress_rates")
    if given is not None:
        if not isinstance(given, dict):
            raise _error("compress_rates", f"must be an object, got {given!r}")
        for key in given:
            if key not in (CSA, HCA):
                raise _error(
                    f"compress_rates.{key}", f"is not a compressed layer type ({CSA}, {HCA})"
                )
        rates = {t: _int(given, t, where=f"compress_rates.{t}", minimum=1) for t in (CSA, HCA)}
    for t, key in ((CSA, "compress_rate_csa"), (HCA, "compress_rate_hca")):
        value = _opt_int(raw, key, minimum=1)
        if value is None:
            continue
        rates = rates or dict(DEFAULT_COMPRESS_RATES)
        if given is not None and rates[t] != value:
            raise _error(key, f"({value}) contradicts compress_rates.{t} ({rates[t]})")
        rates[t] = value
    if rates is not None:
        for t, r in rates.items():
            if r not in ALLOWED_RATIOS:
                raise _error(f"compress_rates.{t}", f"({r}) not in {sorted(ALLOWED_RATIOS - {0})}")
        if rates[CSA] == rates[HCA]:
            raise _error(f"compress_rates.{HCA}", f"({rates[HCA]}) must differ from {CSA}'s")
    return rates


def _layer_type_ratios(
    raw: Mapping[str, Any], n: int, rates: Mapping[str, int]
) -> list[int] | None:
    types = raw.get("layer_types")
    if types is None:
        return None
    if not isinstance(types, list) or len(types) != n:
        raise _error("layer_types", f"must list one type per layer ({n}), got {_count(types)}")
    out = []
    for i, t in enumerate(types):
        if t not in LAYER_TYPES:
            raise _error(
                f"layer_types[{i}]",
                f"has unknown value {t!r}: expected one of {', '.join(LAYER_TYPES)}",
            )
        out.append(0 if t == SLIDING else rates[t])
    return out


def _weight_shape(raw: Mapping[str, Any]) -> WeightShape:
    dense = _opt_int(raw, "first_k_dense_replace", minimum=0) or 0
    return WeightShape(
        hidden_size=_int(raw, "hidden_size", minimum=1),
        vocab_size=_int(raw, "vocab_size", minimum=1),
        num_attention_heads=_int(raw, "num_attention_heads", minimum=1),
        intermediate_size=_int(raw, "intermediate_size", minimum=1) if dense else 0,
        num_dense_layers=dense,
        num_routed_experts=_int(raw, "n_routed_experts", minimum=1),
        num_shared_experts=_int(raw, "n_shared_experts", minimum=0),
        moe_intermediate_size=_int(raw, "moe_intermediate_size", minimum=1),
        num_experts_per_token=_int(raw, "num_experts_per_tok", minimum=1),
        q_lora_rank=_int(raw, "q_lora_rank", minimum=1),
        o_lora_rank=_int(raw, "o_lora_rank", minimum=1),
    )


def _hash_layers(raw: Mapping[str, Any], n: int) -> int:
    """num_hash_layers, or the hash_moe prefix of mlp_layer_types."""
    count = _opt_int(raw, "num_hash_layers", minimum=0)
    types = raw.get("mlp_layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != n:
            raise _error(
                "mlp_layer_types", f"must list one type per layer ({n}), got {_count(types)}"
            )
        for i, t in enumerate(types):
            if t not in MLP_LAYER_TYPES:
                raise _error(
                    f"mlp_layer_types[{i}]", f"has unknown value {t!r}: expected hash_moe or moe"
                )
            if t == "hash_moe" and i and types[i - 1] == "moe":
                raise _error(
                    f"mlp_layer_types[{i}]",
                    "is hash_moe after moe: hash-routed layers must come first",
                )
        prefix = types.count("hash_moe")
        if count is not None and count != prefix:
            raise _error(
                "num_hash_layers", f"({count}) contradicts mlp_layer_types ({prefix} hash_moe)"
            )
        count = prefix
    if count is None:
        raise _missing("num_hash_layers", "mlp_layer_types")
    return count


# --- architecture beyond the shape ----------------------------------------------------------


def _arch(raw: Mapping[str, Any], n: int, head_dim: int, rope_dim: int) -> DSV4Arch:
    d = DSV4Arch()
    theta, compress_theta, yarn = _rope(raw, head_dim, rope_dim)
    norm_topk = raw.get("norm_topk_prob")
    norm_topk = d.norm_topk_prob if norm_topk is None else norm_topk
    if not isinstance(norm_topk, bool):
        raise _error("norm_topk_prob", f"must be true or false, got {norm_topk!r}")
    return DSV4Arch(
        hc_mult=_int(raw, "hc_mult", minimum=1),
        hc_sinkhorn_iters=_opt_int(raw, "hc_sinkhorn_iters", minimum=1) or d.hc_sinkhorn_iters,
        hc_eps=_num(raw, "hc_eps", d.hc_eps),
        o_groups=_int(raw, "o_groups", minimum=1),
        num_hash_layers=_hash_layers(raw, n),
        scoring_func=cast(
            ScoringFunc, _choice(raw, "scoring_func", get_args(ScoringFunc), d.scoring_func)
        ),
        routed_scaling_factor=_num(raw, "routed_scaling_factor", d.routed_scaling_factor),
        norm_topk_prob=norm_topk,
        swiglu_limit=_num(raw, "swiglu_limit", d.swiglu_limit),
        rope_theta=theta,
        compress_rope_theta=compress_theta,
        rope_scaling=yarn,
        rms_norm_eps=_num(raw, "rms_norm_eps", d.rms_norm_eps),
    )


def _rope(
    raw: Mapping[str, Any], head_dim: int, rope_dim: int
) -> tuple[float, float, YarnScaling | None]:
    """(rope_theta, compress_rope_theta, YaRN of the compressed layers) from the top-level
    keys and/or rope_parameters {main, compress}."""
    d = DSV4Arch()
    theta = _opt_num(raw, "rope_theta", minimum=1.0)
    compress_theta = _opt_num(raw, "compress_rope_theta", minimum=1.0)
    legacy = raw.get("rope_scaling") is not None
    yarn = _yarn(raw["rope_scaling"], "rope_scaling", require_type=True) if legacy else None
    params = raw.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict) or set(params) != {"main", "compress"}:
            raise _error("rope_parameters", "must be an object of exactly 'main' and 'compress'")
        for label, value in params.items():
            where = f"rope_parameters.{label}"
            if not isinstance(value, dict):
                raise _error(where, f"must be an object, got {value!r}")
            dims = _rotary_dims(value, head_dim, f"{where}.partial_rotary_factor")
            if dims is not None and dims != rope_dim:
                raise _error(
                    f"{where}.partial_rotary_factor",
                    f"gives {dims} rotary dims, contradicting qk_rope_head_dim ({rope_dim})",
                )
        _yarn(params["main"], "rope_parameters.main", require_type=False)  # default only
        theta = _nested_theta(params, "main", theta, "rope_theta")
        compress_theta = _nested_theta(params, "compress", compress_theta, "compress_rope_theta")
        compress = _yarn(params["compress"], "rope_parameters.compress", require_type=False)
        if legacy and yarn != compress:
            raise _error(
                "rope_scaling",
                f"({_yarn_text(yarn)}) contradicts rope_parameters.compress "
                f"({_yarn_text(compress)})",
            )
        yarn = compress
    return (
        d.rope_theta if theta is None else theta,
        d.compress_rope_theta if compress_theta is None else compress_theta,
        yarn,
    )


def _nested_theta(
    params: Mapping[str, Any], label: str, top: float | None, top_name: str
) -> float | None:
    """rope_parameters.<label>.rope_theta, which must agree with the top-level key."""
    where = f"rope_parameters.{label}.rope_theta"
    nested = _opt_num(params[label], "rope_theta", minimum=1.0, where=where)
    if top is not None and nested is not None and top != nested:
        raise _error(top_name, f"({top:g}) contradicts {where} ({nested:g})")
    return nested if nested is not None else top


def _yarn(value: object, where: str, *, require_type: bool) -> YarnScaling | None:
    """A rope_scaling / rope_parameters entry: yarn -> YarnScaling, default -> None."""
    if not isinstance(value, dict):
        raise _error(where, f"must be an object, got {value!r}")
    if "rope_type" in value and "type" in value and value["rope_type"] != value["type"]:
        raise _error(
            f"{where}.type",
            f"({value['type']!r}) contradicts {where}.rope_type ({value['rope_type']!r})",
        )
    key = "rope_type" if "rope_type" in value else "type"
    kind = value.get(key, None if require_type else "default")
    allowed = ROPE_TYPE_KEYS | (ROPE_SHARED_KEYS if where.startswith("rope_parameters") else set())
    if kind == "default":
        extra = sorted(set(value) - allowed)
        if extra:
            raise _error(f"{where}.{extra[0]}", "is not a setting of the default rope type")
        return None
    if where.endswith(".main"):  # the window-only layers
        raise _error(f"{where}.{key}", f"has unknown value {kind!r}: expected default")
    if kind != "yarn":
        raise _error(f"{where}.{key}", f"has unknown value {kind!r}: expected yarn or default")
    extra = sorted(set(value) - allowed - YARN_KEYS)
    if extra:
        raise _error(f"{where}.{extra[0]}", "is not a YaRN setting DeepSeek-V4 uses")
    attention = _opt_num(value, "attention_factor", minimum=0.0, where=f"{where}.attention_factor")
    if attention is not None and attention != 1.0:
        raise _error(
            f"{where}.attention_factor",
            f"must be 1.0 (DeepSeek-V4 scales no logits), got {attention}",
        )
    original = "original_max_position_embeddings"
    return YarnScaling(
        factor=_num(value, "factor", None, where=f"{where}.factor"),
        original_max_position_embeddings=_int(value, original, where=f"{where}.{original}"),
        beta_fast=_num(value, "beta_fast", YARN_BETAS[0], where=f"{where}.beta_fast"),
        beta_slow=_num(value, "beta_slow", YARN_BETAS[1], where=f"{where}.beta_slow"),
    )


# --- storage ----------------------------------------------------------------------------------


def _storage(raw: Mapping[str, Any]) -> tuple[Quantization | None, WeightDtype]:
    """(block-FP8 quantization or None, torch_dtype) from torch_dtype / dtype,
    quantization_config and expert_dtype."""
    dtypes = {k: raw[k] for k in ("torch_dtype", "dtype") if raw.get(k) is not None}
    for key, value in dtypes.items():
        if not isinstance(value, str) or value not in TORCH_DTYPES:
            raise _error(key, f"has unknown value {value!r}: expected {', '.join(TORCH_DTYPES)}")
    if len(set(dtypes.values())) > 1:
        raise _error(
            "dtype", f"({dtypes['dtype']!r}) contradicts torch_dtype ({dtypes['torch_dtype']!r})"
        )
    weight_dtype = TORCH_DTYPES[next(iter(dtypes.values()), "bfloat16")]
    q = raw.get("quantization_config")
    expert = raw.get("expert_dtype")
    if q is None:
        if expert is not None:
            raise _error("expert_dtype", "needs a quantization_config (quant_method fp8)")
        return None, weight_dtype
    if not isinstance(q, dict):
        raise _error("quantization_config", f"must be an object, got {q!r}")
    for key in sorted(q):
        if key not in QUANTIZATION_KEYS:
            raise _error(f"quantization_config.{key}", "is not understood (block FP8 is)")
    where = "quantization_config"
    if q.get("quant_method") != "fp8":
        if "quant_method" not in q:
            raise _missing(f"{where}.quant_method")
        raise _error(
            f"{where}.quant_method", f"has unknown value {q['quant_method']!r}: expected fp8"
        )
    _expect(q, "fmt", "e4m3", "FP8 weights are E4M3", where=f"{where}.fmt")
    _expect(
        q,
        "activation_scheme",
        "dynamic",
        "activations are quantized on the fly",
        where=f"{where}.activation_scheme",
    )
    _expect(q, "dequantize", False, "the weights are served quantized", where=f"{where}.dequantize")
    for key in ("modules_to_not_convert", "modules_to_convert"):
        if q.get(key):
            raise _error(f"{where}.{key}", f"must be empty: every linear is FP8, got {q[key]!r}")
    scale_fmt = _choice(q, "scale_fmt", get_args(ScaleFmt), "float", where=f"{where}.scale_fmt")
    block = q.get("weight_block_size", [128, 128])
    if not (isinstance(block, list) and len(block) == 2 and all(_is_int(b) for b in block)):
        raise _error(f"{where}.weight_block_size", f"must be two integers, got {block!r}")
    inner = q.get("expert_dtype")
    if expert is not None and inner is not None and expert != inner:
        raise _error("expert_dtype", f"({expert!r}) contradicts {where}.expert_dtype ({inner!r})")
    source = "expert_dtype" if expert is not None else f"{where}.expert_dtype"
    chosen = expert if expert is not None else inner
    if chosen is not None and chosen not in get_args(ExpertDtype):
        raise _error(source, f"has unknown value {chosen!r}: expected fp4 or fp8")
    return (
        Quantization(
            scale_fmt=cast(ScaleFmt, scale_fmt),
            weight_block_size=(block[0], block[1]),
            # absent: FP4, what every DeepSeek-V4 release stores (vLLM's default too)
            expert_dtype=cast(ExpertDtype, chosen or "fp4"),
        ),
        weight_dtype,
    )


# --- field readers ----------------------------------------------------------------------------


def _error(field: str, message: str) -> ModelConfigError:
    return ModelConfigError(f"config.json field '{field}' {message}")


def _missing(field: str, other_form: str | None = None) -> ModelConfigError:
    alternative = f" (or '{other_form}')" if other_form else ""
    return ModelConfigError(f"config.json is missing required field '{field}'{alternative}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _opt_int(
    raw: Mapping[str, Any],
    key: str,
    *,
    where: str | None = None,
    minimum: int | None = None,
    maximum: int | None = None,
) -> int | None:
    """An integer field, or None where it is absent (or null). Bounds guard the arithmetic
    done here before the config exists; the config types check the rest."""
    value = raw.get(key)
    if value is None:
        return None
    name = where or key
    if not _is_int(value):
        raise _error(name, f"must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise _error(name, f"must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise _error(name, f"must be <= {maximum}, got {value}")
    return int(value)


def _int(raw: Mapping[str, Any], key: str, *, where: str | None = None, **bounds: int) -> int:
    value = _opt_int(raw, key, where=where, **bounds)
    if value is None:
        raise _missing(where or key)
    return value


def _opt_int_list(raw: Mapping[str, Any], key: str) -> list[int] | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(_is_int(v) for v in value):
        raise _error(key, f"must be a list of integers, got {value!r}")
    return list(value)


def _opt_num(
    raw: Mapping[str, Any], key: str, *, minimum: float, where: str | None = None
) -> float | None:
    value = raw.get(key)
    if value is None:
        return None
    name = where or key
    if not isinstance(value, int | float) or isinstance(value, bool) or not _finite(value):
        raise _error(name, f"must be a finite number, got {value!r}")
    if value < minimum:
        raise _error(name, f"must be >= {minimum}, got {value}")
    return float(value)


def _num(
    raw: Mapping[str, Any], key: str, default: float | None, *, where: str | None = None
) -> float:
    """A number field (>= 0; the config types check tighter bounds), or `default`."""
    value = _opt_num(raw, key, minimum=0.0, where=where)
    if value is None:
        if default is None:
            raise _missing(where or key)
        return default
    return value


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        return False


# kv_cache_dtype spellings beside ours (SGLang's and torch's names); "auto" is the default.
KV_DTYPE_ALIASES: Final = {"bfloat16": "bf16", "float32": "fp32", "fp8": "fp8_e4m3"}


def _kv_dtype(raw: Mapping[str, Any], default: str) -> str:
    """`kv_cache_dtype`: fp8_e4m3 | bf16 | fp32 (or bfloat16 | float32 | fp8 | auto); absent
    or auto: `default` (fp8_e4m3 with quantization_config, else the weights' float type)."""
    value = raw.get("kv_cache_dtype")
    if value is None or value == "auto":
        return default
    choices = (*get_args(KVDtype), *KV_DTYPE_ALIASES, "auto")
    if not isinstance(value, str) or value not in choices:
        raise _error(
            "kv_cache_dtype", f"has unknown value {value!r}: expected {', '.join(choices)}"
        )
    return KV_DTYPE_ALIASES.get(value, value)


def _choice(
    raw: Mapping[str, Any],
    key: str,
    choices: tuple[str, ...],
    default: str,
    *,
    where: str | None = None,
) -> str:
    value = raw.get(key)
    if value is None:
        return default
    if value not in choices:
        raise _error(where or key, f"has unknown value {value!r}: expected {', '.join(choices)}")
    return str(value)


def _expect(
    raw: Mapping[str, Any], key: str, expected: object, why: str, *, where: str | None = None
) -> None:
    """A key that may be absent, but where present holds the only value DeepSeek-V4 has."""
    value = raw.get(key, expected)
    if value is None or (value == expected and type(value) is type(expected)):
        return
    raise _error(where or key, f"must be {json_text(expected)} ({why}), got {json_text(value)}")


def _count(value: object) -> str:
    return f"{len(value)} entries" if isinstance(value, list) else repr(value)


def _yarn_text(yarn: YarnScaling | None) -> str:
    if yarn is None:
        return "no YaRN"
    return (
        f"yarn factor {yarn.factor:g}, original {yarn.original_max_position_embeddings}, "
        f"beta {yarn.beta_fast:g}/{yarn.beta_slow:g}"
    )


def json_text(value: object) -> str:
    """A value as config.json spells it (true, not True)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value)
    return str(value)
