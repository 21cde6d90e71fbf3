"""Loading DeepSeek-V4 model directories: both namings (and what save_pretrained writes), BF16 /
F32 / FP8-block / FP4 storage, PP stages reading only their shards, MTP layers, and every
refusal naming the tensor and its file."""

from __future__ import annotations

import json
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_writer import (
    Quant,
    decoded,
    encode,
    published_config,
    quant_kind,
    save_sharded,
    write_checkpoint,
)
from safetensors import safe_open
from safetensors.torch import load_file

from dsv4_common.core.model import DSV4Config
from dsv4_common.core.presets import deepseek_v4_flash, tiny
from dsv4_worker.model import checkpoint as C
from dsv4_worker.model.checkpoint import CheckpointError, is_model_dir, load_checkpoint
from dsv4_worker.model.checkpoint_names import FusedExperts, mtp_param_shapes, published_name
from dsv4_worker.model.weights import WeightsError, init_weights, param_shapes, stage_param_names

MODEL = tiny()


def _mtp_weights(model: DSV4Config, seed: int) -> dict[str, torch.Tensor]:
    """Random float32-valued MTP tensors under the release's names."""
    gen = torch.Generator().manual_seed(seed)
    return {
        n: (torch.randn(s, generator=gen) / math.sqrt(s[-1])).to(torch.float64)
        for n, s in sorted(mtp_param_shapes(model).items())
    }


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    """Target and MTP parameters (published names), float32 values held as float64."""
    return init_weights(MODEL, seed=0) | _mtp_weights(MODEL, seed=1)


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Same names, float64 (or long) tensors of exactly the wanted values."""
    assert set(got) == set(want)
    for name, t in want.items():
        assert got[name].dtype == (torch.float64 if t.is_floating_point() else torch.long), name
        assert torch.equal(got[name], t.to(got[name].dtype)), name


@dataclass
class _Reads:
    """What the loader materialized from shards: bytes in all, bytes alive at once (peak)."""

    opened: set[str] = field(default_factory=set)
    open_now: int = 0
    max_open: int = 0
    total_bytes: int = 0
    live_bytes: int = 0
    peak_live_bytes: int = 0
    names: list[str] = field(default_factory=list)

    def add(self, name: str, t: torch.Tensor) -> None:
        self.names.append(name)
        self.total_bytes += t.nbytes
        self.live_bytes += t.nbytes
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
        weakref.finalize(t, self._free, t.nbytes)

    def _free(self, nbytes: int) -> None:
        self.live_bytes -= nbytes


def _counting_open(reads: _Reads) -> Callable[..., Any]:
    class Counting:
        def __init__(self, path: str, **kwargs: Any) -> None:
            reads.opened.add(Path(path).name)
            self._f = safe_open(path, **kwargs)

        def __enter__(self) -> Counting:
            self._f.__enter__()
            reads.open_now += 1
            reads.max_open = max(reads.max_open, reads.open_now)
            return self

        def __exit__(self, *exc: object) -> None:
            reads.open_now -= 1
            self._f.__exit__(*exc)

        def keys(self) -> list[str]:
            return list(self._f.keys())

        def get_slice(self, name: str) -> Any:
            return self._f.get_slice(name)

        def get_tensor(self, name: str) -> torch.Tensor:
            t = self._f.get_tensor(name)
            reads.add(name, t)
            return t

    return Counting


# ---- names ---------------------------------------------------------------------------------

NAMES = [
    ("model.embed_tokens.weight", "embed.weight"),
    ("embed.weight", "embed.weight"),
    ("lm_head.weight", "head.weight"),
    ("head.weight", "head.weight"),
    ("model.norm.weight", "norm.weight"),
    ("model.hc_head.hc_fn", "hc_head_fn"),
    ("model.hc_head.hc_base", "hc_head_base"),
    ("model.hc_head.hc_scale", "hc_head_scale"),
    ("hc_head_scale", "hc_head_scale"),
    ("model.layers.3.input_layernorm.weight", "layers.3.attn_norm.weight"),
    ("model.layers.3.post_attention_layernorm.weight", "layers.3.ffn_norm.weight"),
    ("model.layers.3.attn_hc.fn", "layers.3.hc_attn_fn"),
    ("model.layers.3.attn_hc.base", "layers.3.hc_attn_base"),
    ("model.layers.3.ffn_hc.scale", "layers.3.hc_ffn_scale"),
    ("model.layers.3.self_attn.sinks", "layers.3.attn.attn_sink"),
    ("model.layers.3.self_attn.q_a_proj.weight", "layers.3.attn.wq_a.weight"),
    ("model.layers.3.self_attn.q_a_norm.weight", "layers.3.attn.q_norm.weight"),
    ("model.layers.3.self_attn.q_b_proj.weight", "layers.3.attn.wq_b.weight"),
    ("model.layers.3.self_attn.kv_proj.weight", "layers.3.attn.wkv.weight"),
    ("model.layers.3.self_attn.kv_norm.weight", "layers.3.attn.kv_norm.weight"),
    ("model.layers.3.self_attn.o_a_proj.weight", "layers.3.attn.wo_a.weight"),
    ("model.layers.3.self_attn.o_b_proj.weight", "layers.3.attn.wo_b.weight"),
    ("model.layers.3.self_attn.compressor.kv_proj.weight", "layers.3.attn.compressor.wkv.weight"),
    (
        "model.layers.3.self_attn.compressor.gate_proj.weight",
        "layers.3.attn.compressor.wgate.weight",
    ),
    ("model.layers.3.self_attn.compressor.position_bias", "layers.3.attn.compressor.ape"),
    ("model.layers.3.self_attn.compressor.kv_norm.weight", "layers.3.attn.compressor.norm.weight"),
    (
        "model.layers.3.self_attn.compressor.indexer.kv_proj.weight",
        "layers.3.attn.indexer.compressor.wkv.weight",
    ),
    (
        "model.layers.3.self_attn.compressor.indexer.gate_proj.weight",
        "layers.3.attn.indexer.compressor.wgate.weight",
    ),
    (
        "model.layers.3.self_attn.compressor.indexer.position_bias",
        "layers.3.attn.indexer.compressor.ape",
    ),
    (
        "model.layers.3.self_attn.compressor.indexer.kv_norm.weight",
        "layers.3.attn.indexer.compressor.norm.weight",
    ),
    (
        "model.layers.3.self_attn.compressor.indexer.q_b_proj.weight",
        "layers.3.attn.indexer.wq_b.weight",
    ),
    (
        "model.layers.3.self_attn.compressor.indexer.scorer.weights_proj.weight",
        "layers.3.attn.indexer.weights_proj.weight",
    ),
    ("model.layers.3.mlp.gate.weight", "layers.3.ffn.gate.weight"),
    ("model.layers.3.mlp.gate.e_score_correction_bias", "layers.3.ffn.gate.bias"),
    ("model.layers.0.mlp.gate.tid2eid", "layers.0.ffn.gate.tid2eid"),
    ("model.layers.3.mlp.shared_experts.gate_proj.weight", "layers.3.ffn.shared_experts.w1.weight"),
    ("model.layers.3.mlp.shared_experts.up_proj.weight", "layers.3.ffn.shared_experts.w3.weight"),
    ("model.layers.3.mlp.shared_experts.down_proj.weight", "layers.3.ffn.shared_experts.w2.weight"),
    # What save_pretrained writes: published leaves under `model.`, kv_norm as attn.norm.
    ("model.layers.3.attn.norm.weight", "layers.3.attn.kv_norm.weight"),
    ("model.layers.3.attn.compressor.norm.weight", "layers.3.attn.compressor.norm.weight"),
    ("model.layers.3.ffn.experts.2.w3.weight", "layers.3.ffn.experts.2.w3.weight"),
    ("model.layers.3.hc_ffn_base", "layers.3.hc_ffn_base"),
    # Published names pass unchanged, MTP ones too.
    ("layers.3.attn.indexer.compressor.ape", "layers.3.attn.indexer.compressor.ape"),
    ("layers.3.ffn.gate.bias", "layers.3.ffn.gate.bias"),
    ("mtp.0.e_proj.weight", "mtp.0.e_proj.weight"),
    ("mtp.0.hc_head_fn", "mtp.0.hc_head_fn"),
    ("mtp.0.self_attn.q_a_proj.weight", "mtp.0.attn.wq_a.weight"),
    ("layers.3.attn.bogus", "layers.3.attn.bogus"),
]


@pytest.mark.parametrize(("name", "published"), NAMES)
def test_every_spelling_renames_to_the_published_name(name: str, published: str) -> None:
    assert published_name(name) == published


@pytest.mark.parametrize(
    ("name", "fused"),
    [
        ("model.layers.2.mlp.experts.gate_up_proj", FusedExperts("layers.2", "gate_up")),
        ("model.layers.2.mlp.experts.down_proj", FusedExperts("layers.2", "down")),
        ("mtp.0.mlp.experts.down_proj", FusedExperts("mtp.0", "down")),
    ],
)
def test_stacked_experts_are_recognized(name: str, fused: FusedExperts) -> None:
    assert published_name(name) == fused


def test_stacked_experts_split_gate_up_as_w1_then_w3() -> None:
    e, inter, hidden = 3, 4, 5
    w1, w3 = torch.randn(e, inter, hidden), torch.randn(e, inter, hidden)
    parts = FusedExperts("layers.1", "gate_up").split(torch.cat([w1, w3], dim=1))
    assert list(parts) == FusedExperts("layers.1", "gate_up").names(e)
    for i in range(e):
        assert torch.equal(parts[f"layers.1.ffn.experts.{i}.w1.weight"], w1[i])
        assert torch.equal(parts[f"layers.1.ffn.experts.{i}.w3.weight"], w3[i])
    w2 = torch.randn(e, hidden, inter)
    down = FusedExperts("layers.1", "down").split(w2)
    assert torch.equal(down["layers.1.ffn.experts.2.w2.weight"], w2[2])


def test_transformers_module_names_cover_the_published_parameters_once() -> None:
    from hf_support import hf_config
    from transformers import DeepseekV4ForCausalLM

    with torch.device("meta"):
        hf = DeepseekV4ForCausalLM(hf_config(MODEL))
    covered: list[str] = []
    for name in hf.state_dict():
        target = published_name(name)
        covered += target.names(4) if isinstance(target, FusedExperts) else [target]
    assert sorted(covered) == sorted(param_shapes(MODEL))


def test_the_release_mtp_layer_has_its_1575_tensors() -> None:
    """Flash's mtp.0: 797 parameters, 778 of them quantized (each with a scale), as the
    release's listing counts them; hc_head_fn [4, 16384], no compressor or indexer."""
    shapes = mtp_param_shapes(deepseek_v4_flash())
    metas = {n: torch.empty(s, device="meta") for n, s in shapes.items()}
    quantized = [n for n, t in metas.items() if quant_kind(n, t, "fp4") != "none"]
    assert (len(shapes), len(quantized), len(shapes) + len(quantized)) == (797, 778, 1575)
    assert shapes["mtp.0.hc_head_fn"] == (4, 16384) and shapes["mtp.0.hc_head_scale"] == (1,)
    assert shapes["mtp.0.e_proj.weight"] == shapes["mtp.0.h_proj.weight"] == (4096, 4096)
    assert "mtp.0.ffn.gate.bias" in shapes and "mtp.0.attn.attn_sink" in shapes
    assert not any(".compressor." in n or ".indexer." in n for n in shapes)


# ---- published checkpoints -----------------------------------------------------------------

STORAGE = [
    pytest.param("none", torch.float32, True, id="f32"),
    pytest.param("none", torch.bfloat16, True, id="bf16"),
    pytest.param("fp8", torch.bfloat16, True, id="fp8-e8m0"),
    pytest.param("fp8", torch.float32, False, id="fp8-f32-scales"),
    pytest.param("fp4", torch.bfloat16, True, id="fp8+fp4-experts"),
]


@pytest.mark.parametrize(("quant", "float_dtype", "pow2"), STORAGE)
def test_published_checkpoint_loads_exactly_its_dequantized_values(
    tmp_path: Path,
    weights: dict[str, torch.Tensor],
    quant: Quant,
    float_dtype: torch.dtype,
    pow2: bool,
) -> None:
    config = published_config(MODEL, quant)
    write_checkpoint(
        tmp_path, weights, config, quant=quant, pow2=pow2, float_dtype=float_dtype, shards=3
    )
    ckpt = load_checkpoint(tmp_path, MODEL, mtp=True, dtype=torch.float64)
    want = decoded(weights, quant, pow2=pow2, float_dtype=float_dtype)
    _assert_equal(ckpt.params, {n: t for n, t in want.items() if not n.startswith("mtp.")})
    _assert_equal(ckpt.mtp, {n: t for n, t in want.items() if n.startswith("mtp.")})
    assert all(t.dtype in (torch.float64, torch.long) for t in ckpt.params.values())
    # Within the formats' error: FP8 2**-4 relative (+ subnormals), FP4 1/4 of a group's max.
    for name, t in weights.items():
        if t.is_floating_point():
            got = ckpt.mtp[name] if name.startswith("mtp.") else ckpt.params[name]
            err = (got - t).abs().max()
            kind = quant_kind(name, t, quant)
            bound = {"none": 2.0**-8, "fp8": 2.0**-4, "fp4": 0.35}[kind] * t.abs().max()
            assert err <= bound, name


def test_single_file_checkpoint_without_an_index_loads_as_float32(
    tmp_path: Path, weights: dict[str, torch.Tensor]
) -> None:
    write_checkpoint(tmp_path, weights, published_config(MODEL, "fp8"), quant="fp8", shards=None)
    assert not (tmp_path / C.INDEX).exists()
    ckpt = load_checkpoint(tmp_path, MODEL, dtype=torch.float32)
    want = decoded(weights, "fp8")
    assert all(torch.equal(t, want[n].to(t.dtype)) for n, t in ckpt.params.items())
    assert ckpt.params["layers.1.attn.wq_a.weight"].dtype == torch.float32


def test_a_scale_in_another_shard_than_its_weight_is_found(
    tmp_path: Path, weights: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Weights in the first shard, scales in the last: two shards open at once, no more."""
    stored = encode(weights, quant="fp4")
    place = lambda n: 2 if n.endswith(".scale") else 0  # noqa: E731
    save_sharded(tmp_path, stored, 3, published_config(MODEL, "fp4"), place=place)
    reads = _Reads()
    monkeypatch.setattr(C, "safe_open", _counting_open(reads))
    ckpt = load_checkpoint(tmp_path, MODEL, dtype=torch.float64)
    assert reads.max_open == 2 and reads.open_now == 0
    _assert_equal(ckpt.params, {n: t for n, t in decoded(weights, "fp4").items() if "mtp" not in n})


# ---- transformers naming -------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_named(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Config]:
    """Our tiny weights as transformers itself names them: a published checkpoint loaded by
    DeepseekV4ForCausalLM.from_pretrained, then its state dict (and its config.json)."""
    from hf_support import hf_config
    from transformers import DeepseekV4ForCausalLM

    root = tmp_path_factory.mktemp("published")
    params = init_weights(MODEL, seed=0)
    save_sharded(root, encode(params), None, published_config(MODEL))
    config = json.loads(hf_config(MODEL).to_json_string())
    (root / "config.json").write_text(json.dumps(config))
    hf = DeepseekV4ForCausalLM.from_pretrained(root, dtype=torch.float32)
    state = {
        n: t.detach().to(torch.float64) if t.is_floating_point() else t.detach()
        for n, t in hf.state_dict().items()
    }
    return state, config


@pytest.mark.parametrize("quant", ["none", "fp8", "fp4"])
def test_transformers_named_checkpoint_loads_as_transformers_renamed_it(
    tmp_path: Path, hf_named: tuple[dict[str, Any], Config], quant: Quant
) -> None:
    """Unquantized: exactly our published weights (our renaming = transformers' own).
    Quantized (stacked experts quantized whole, `weight_scale_inv` scales): exactly what the
    same checkpoint stored unquantized with dequant(quant(x)) values gives."""
    state, config = hf_named
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    write_checkpoint(tmp_path / "q", state, config, quant=quant, naming="transformers")
    got = load_checkpoint(tmp_path / "q", MODEL, mtp=True, dtype=torch.float64)
    assert got.mtp == {}
    if quant == "none":
        _assert_equal(got.params, init_weights(MODEL, seed=0))
        return
    names = encode(state, quant=quant, naming="transformers")
    assert "model.layers.1.mlp.experts.gate_up_proj_scale_inv" in names
    assert "model.layers.1.self_attn.q_a_proj.weight_scale_inv" in names
    plain = decoded(state, quant)
    write_checkpoint(tmp_path / "plain", plain, config, float_dtype=torch.float64)
    _assert_equal(
        got.params, load_checkpoint(tmp_path / "plain", MODEL, dtype=torch.float64).params
    )


def test_save_pretrained_output_resharded_loads_every_hf_parameter(tmp_path: Path) -> None:
    """A randomized transformers model saved with save_pretrained (its own mixed naming), then
    resharded over 3 files with an index: every HF parameter lands at its published name."""
    from hf_support import hf_model

    hf = hf_model(MODEL, seed=5)
    hf.save_pretrained(tmp_path / "saved")
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    # save_pretrained mixes spellings; each tensor is renamed on its own.
    assert {"model.embed_tokens.weight", "head.weight", "model.hc_head.hc_fn"} <= set(saved)
    assert "model.layers.0.attn.norm.weight" in saved  # the attention's kv_norm
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    save_sharded(tmp_path / "resharded", saved, 3, config)
    assert (
        len(set(json.loads((tmp_path / "resharded" / C.INDEX).read_text())["weight_map"].values()))
        == 3
    )
    ckpt = load_checkpoint(tmp_path / "resharded", MODEL, dtype=torch.float64)
    checked: set[str] = set()
    for name, t in hf.state_dict().items():
        target = published_name(name)
        parts = target.split(t) if isinstance(target, FusedExperts) else {target: t}
        for published, value in parts.items():
            assert torch.equal(ckpt.params[published], value.to(ckpt.params[published].dtype))
            checked.add(published)
    assert checked == set(ckpt.params) == set(param_shapes(MODEL))


# ---- PP stages and MTP ---------------------------------------------------------------------


def test_a_pp_stage_reads_only_its_shards_and_tensors_one_at_a_time(
    tmp_path: Path, weights: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bound asserted: the stage opens exactly the shards holding its tensors, reads each of
    its stored tensors (and scales) once and nothing else, and the stored tensors alive at any
    moment never exceed the largest (weight + scale) pair: far below one shard."""
    stored = encode(weights, quant="fp4")
    weight_map = save_sharded(tmp_path, stored, 6, published_config(MODEL, "fp4"))
    layers = range(2, 4)
    names = stage_param_names(MODEL, layers, first=False, last=False)
    owner = {n: n.removesuffix(".scale") + ".weight" if n.endswith(".scale") else n for n in stored}
    mine = {n for n in stored if owner[n] in names}
    shard_bytes: dict[str, int] = {}
    for n, shard in weight_map.items():
        shard_bytes[shard] = shard_bytes.get(shard, 0) + stored[n].nbytes
    no_scale = torch.empty(0)
    pairs = [
        stored[n].nbytes + stored.get(n.removesuffix(".weight") + ".scale", no_scale).nbytes
        for n in mine
        if not n.endswith(".scale")
    ]

    reads = _Reads()
    monkeypatch.setattr(C, "safe_open", _counting_open(reads))
    ckpt = load_checkpoint(tmp_path, MODEL, layers=layers, first=False, last=False)

    assert set(ckpt.params) == names and ckpt.mtp == {}
    assert reads.opened == {weight_map[n] for n in mine} != set(weight_map.values())
    assert sorted(reads.names) == sorted(mine)
    assert reads.total_bytes == sum(stored[n].nbytes for n in mine)
    assert reads.peak_live_bytes <= max(pairs) < max(shard_bytes.values())
    assert reads.live_bytes == 0 and reads.max_open == 1
    print(
        f"stage layers 2-3: read {reads.total_bytes} B from {len(reads.opened)} of "
        f"{len(shard_bytes)} shards, peak alive {reads.peak_live_bytes} B (largest pair "
        f"{max(pairs)} B, largest shard {max(shard_bytes.values())} B), own weights "
        f"{sum(t.nbytes for t in ckpt.params.values())} B"
    )


@pytest.mark.parametrize(
    ("layers", "first", "last"),
    [(range(0, 2), True, False), (range(2, 4), False, False), (range(4, 6), False, True)],
)
def test_each_stage_gets_exactly_its_parameters_and_the_last_the_mtp_layer(
    tmp_path: Path, weights: dict[str, torch.Tensor], layers: range, first: bool, last: bool
) -> None:
    write_checkpoint(tmp_path, weights, published_config(MODEL))
    ckpt = load_checkpoint(tmp_path, MODEL, layers=layers, first=first, last=last, mtp=True)
    assert set(ckpt.params) == stage_param_names(MODEL, layers, first=first, last=last)
    assert set(ckpt.mtp) == (set(mtp_param_shapes(MODEL)) if last else set())


def test_a_checkpoint_without_mtp_tensors_loads_with_none(
    tmp_path: Path, weights: dict[str, torch.Tensor]
) -> None:
    plain = {n: t for n, t in weights.items() if not n.startswith("mtp.")}
    write_checkpoint(tmp_path, plain, published_config(MODEL))
    assert load_checkpoint(tmp_path, MODEL, mtp=True).mtp == {}


# ---- refusals ------------------------------------------------------------------------------

Stored = dict[str, torch.Tensor]
Config = dict[str, Any]


def _drop(name: str) -> Callable[[Stored, Config], None]:
    def drop(stored: Stored, config: Config) -> None:
        del stored[name]

    return drop


def _put(name: str, value: torch.Tensor) -> Callable[[Stored, Config], None]:
    return lambda s, c: s.__setitem__(name, value)


def _cast(name: str, dtype: torch.dtype) -> Callable[[Stored, Config], None]:
    return lambda s, c: s.__setitem__(name, s[name].to(dtype))


def _config(key: str, value: object) -> Callable[[Stored, Config], None]:
    return lambda s, c: c.__setitem__(key, value)


WQ_A = "layers.2.attn.wq_a"
REFUSALS = [
    ("missing", _drop("layers.3.attn.wkv.weight"), ["missing tensors: layers.3.attn.wkv.weight"]),
    (
        "extra",
        _put("layers.3.attn.bogus.weight", torch.zeros(2)),
        ["layers.3.attn.bogus.weight (model-0000", "not a model tensor"],
    ),
    (
        "extra layer",
        _put("layers.6.attn_norm.weight", torch.zeros(64)),
        ["layers.6.attn_norm.weight (model-0000", "not a model tensor"],
    ),
    (
        "unknown mtp tensor",
        _put("mtp.0.bogus", torch.zeros(2)),
        ["mtp.0.bogus (model-00003-of-00003.safetensors): not a model tensor, an MTP tensor"],
    ),
    ("incomplete mtp layer", _drop("mtp.0.enorm.weight"), ["missing tensors: mtp.0.enorm.weight"]),
    (
        "mis-shaped",
        _put("layers.1.attn.wq_b.weight", torch.zeros(32, 128)),
        ["layers.1.attn.wq_b.weight (model-0000", "shape [32, 128], expected [128, 32]"],
    ),
    (
        "mis-shaped packed fp4",
        _put("layers.1.ffn.experts.0.w2.weight", torch.zeros(64, 32, dtype=torch.int8)),
        ["layers.1.ffn.experts.0.w2.weight", "shape [64, 32], expected [64, 16]"],
    ),
    (
        "unknown dtype",
        _cast(f"{WQ_A}.weight", torch.float8_e5m2),
        [f"{WQ_A}.weight (model-0000", "dtype F8_E5M2 is not supported"],
    ),
    (
        "float hash table",
        _cast("layers.0.ffn.gate.tid2eid", torch.float32),
        ["layers.0.ffn.gate.tid2eid", "dtype F32, expected an integer dtype"],
    ),
    (
        "scale without weight",
        _drop(f"{WQ_A}.weight"),
        [f"{WQ_A}.scale (model-0000", "a scale without its weight"],
    ),
    (
        "weight without scale",
        _drop(f"{WQ_A}.scale"),
        [f"{WQ_A}.weight (model-0000", "stored F8_E4M3 (quantized) without its scale"],
    ),
    (
        "bad scale dtype",
        _cast(f"{WQ_A}.scale", torch.bfloat16),
        [f"{WQ_A}.scale (model-0000", "scale dtype BF16 is not supported"],
    ),
    (
        "bad scale shape",
        _put(f"{WQ_A}.scale", torch.ones(2, 1).to(torch.float8_e8m0fnu)),
        [f"{WQ_A}.scale", "scale shape [2, 1], expected [1, 1]"],
    ),
    (
        "NaN scale",
        _put(
            f"{WQ_A}.scale", torch.full((1, 1), 255, dtype=torch.uint8).view(torch.float8_e8m0fnu)
        ),
        [f"{WQ_A}.scale (model-0000", "the scale holds NaN or infinite values"],
    ),
    (
        "scale of a float",
        _put("layers.2.ffn.gate.scale", torch.ones(1, 1)),
        ["layers.2.ffn.gate.weight", "stored BF16, yet has a scale layers.2.ffn.gate.scale"],
    ),
    (
        "two spellings",
        _put("model.embed_tokens.weight", torch.zeros(256, 64)),
        ["embed.weight (model-00001", "model.embed_tokens.weight", "hold the same tensor"],
    ),
    (
        "vocab",
        _config("vocab_size", 300),
        ["config.json: vocab_size is 300, the model (tiny) has 256"],
    ),
    (
        "ratios",
        _config("compress_ratios", [0, 4, 4, 4, 16, 4, 0]),
        ["config.json: compress ratios", "(0, 4, 4, 4, 16, 4)"],
    ),
]


@pytest.mark.parametrize(("mutate", "expected"), [pytest.param(m, e, id=i) for i, m, e in REFUSALS])
def test_a_bad_checkpoint_is_refused_naming_the_tensor_and_file(
    tmp_path: Path,
    weights: dict[str, torch.Tensor],
    mutate: Callable[[Stored, Config], None],
    expected: list[str],
) -> None:
    stored = encode(weights, quant="fp4", float_dtype=torch.bfloat16)
    config = published_config(MODEL, "fp4")
    mutate(stored, config)
    save_sharded(tmp_path, stored, 3, config)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path, MODEL)
    assert isinstance(info.value, WeightsError)
    for text in expected:
        assert text in str(info.value)


def _index_edit(edit: Callable[[dict[str, str]], None]) -> Callable[[Path], None]:
    def apply(root: Path) -> None:
        doc = json.loads((root / C.INDEX).read_text())
        edit(doc["weight_map"])
        (root / C.INDEX).write_text(json.dumps(doc))

    return apply


FILE_REFUSALS = [
    (
        "shard missing",
        _index_edit(lambda m: m.__setitem__("norm.weight", "model-00009-of-00009.safetensors")),
        ["norm.weight is in model-00009-of-00009.safetensors, which does not exist"],
    ),
    (
        "tensor not in its shard",
        _index_edit(lambda m: m.__setitem__("embed.weight", "model-00003-of-00003.safetensors")),
        ["embed.weight: the index puts it in model-00003-of-00003.safetensors, which does not"],
    ),
    (
        "shard outside the directory",
        _index_edit(lambda m: m.__setitem__("norm.weight", "../model.safetensors")),
        ["norm.weight is in '../model.safetensors', not a file name"],
    ),
    (
        "corrupt shard",
        lambda r: (r / "model-00002-of-00003.safetensors").write_bytes(b"\x10\x00garbage"),
        ["model-00002-of-00003.safetensors: not a readable safetensors file"],
    ),
    ("no config", lambda r: (r / "config.json").unlink(), ["config.json: missing"]),
    ("bad index", lambda r: (r / C.INDEX).write_text("{"), [C.INDEX, "not readable JSON"]),
]


@pytest.mark.parametrize(
    ("damage", "expected"), [pytest.param(d, e, id=i) for i, d, e in FILE_REFUSALS]
)
def test_a_damaged_model_directory_is_refused_naming_the_file(
    tmp_path: Path,
    weights: dict[str, torch.Tensor],
    damage: Callable[[Path], None],
    expected: list[str],
) -> None:
    write_checkpoint(tmp_path, weights, published_config(MODEL))
    damage(tmp_path)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path, MODEL)
    for text in expected:
        assert text in str(info.value)


def test_layers_outside_the_model_are_a_caller_error(
    tmp_path: Path, weights: dict[str, torch.Tensor]
) -> None:
    write_checkpoint(tmp_path, weights, published_config(MODEL))
    with pytest.raises(ValueError, match="not a slice of 6 layers"):
        load_checkpoint(tmp_path, MODEL, layers=range(4, 8))


def test_is_model_dir(tmp_path: Path, weights: dict[str, torch.Tensor]) -> None:
    assert not is_model_dir(tmp_path / "absent")
    write_checkpoint(tmp_path / "sharded", weights, published_config(MODEL))
    write_checkpoint(tmp_path / "single", weights, published_config(MODEL), shards=None)
    assert is_model_dir(tmp_path / "sharded") and is_model_dir(tmp_path / "single")
    assert not is_model_dir(tmp_path / "sharded" / "config.json")
    (tmp_path / "sharded" / "config.json").unlink()
    assert not is_model_dir(tmp_path / "sharded")
