"""write_model_dir: a tiny model written in the published format loads back through
load_checkpoint exactly, its config.json parses to the model, and what it cannot write is
refused."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dsv4_common.core.model import Quantization
from dsv4_common.core.presets import load_model_config, tiny
from dsv4_worker.model.checkpoint import is_model_dir, load_checkpoint
from dsv4_worker.model.checkpoint_names import mtp_param_shapes
from dsv4_worker.model.export import plan_shards, write_model_dir
from dsv4_worker.model.weights import WeightsError, init_weights

MODEL = tiny()


@pytest.fixture(scope="module")
def params() -> dict[str, torch.Tensor]:
    return init_weights(MODEL, seed=3)


def _mtp(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        n: (torch.randn(s, generator=gen) / math.sqrt(s[-1])).to(torch.float64)
        for n, s in sorted(mtp_param_shapes(MODEL).items())
    }


def test_written_directory_loads_back_exactly(
    tmp_path: Path, params: dict[str, torch.Tensor]
) -> None:
    weight_map = write_model_dir(tmp_path, MODEL, params)
    assert is_model_dir(tmp_path)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == weight_map and set(weight_map) == set(params)
    ckpt = load_checkpoint(tmp_path, MODEL, dtype=torch.float64)
    assert ckpt.mtp == {}
    assert set(ckpt.params) == set(params)
    for name, t in params.items():
        assert ckpt.params[name].dtype == t.dtype, name
        assert torch.equal(ckpt.params[name], t), name
    loaded = load_model_config(str(tmp_path))
    assert loaded == dataclasses.replace(MODEL, name=loaded.name)


def test_floats_are_stored_as_the_dtype_and_hash_tables_as_int64(
    tmp_path: Path, params: dict[str, torch.Tensor]
) -> None:
    weight_map = write_model_dir(tmp_path, MODEL, params, shards=3, dtype=torch.bfloat16)
    assert len(set(weight_map.values())) == 3
    table = "layers.0.ffn.gate.tid2eid"
    with safe_open(str(tmp_path / weight_map[table]), framework="pt") as f:
        assert f.get_tensor(table).dtype == torch.int64
        assert torch.equal(f.get_tensor(table), params[table])
    with safe_open(str(tmp_path / weight_map["embed.weight"]), framework="pt") as f:
        assert f.get_tensor("embed.weight").dtype == torch.bfloat16
    loaded = load_model_config(str(tmp_path))
    # torch_dtype names the stored dtype; the KV cache dtype is kept as it was.
    assert loaded == dataclasses.replace(MODEL, name=loaded.name, weight_dtype="bf16")
    ckpt = load_checkpoint(tmp_path, MODEL, dtype=torch.float64)
    want = params["layers.2.attn.wq_a.weight"].to(torch.bfloat16).to(torch.float64)
    assert torch.equal(ckpt.params["layers.2.attn.wq_a.weight"], want)


def test_mtp_layers_are_written_and_stale_shards_removed(
    tmp_path: Path, params: dict[str, torch.Tensor]
) -> None:
    write_model_dir(tmp_path, MODEL, params, shards=4)
    mtp = _mtp(seed=4)
    weight_map = write_model_dir(tmp_path, MODEL, params | mtp, shards=2)
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert shards == sorted(set(weight_map.values())) and len(shards) == 2
    assert {weight_map[n] for n in mtp} == {"model-00002-of-00002.safetensors"}  # MTP last
    ckpt = load_checkpoint(tmp_path, MODEL, mtp=True, dtype=torch.float64)
    assert set(ckpt.mtp) == set(mtp)
    assert all(torch.equal(ckpt.mtp[n], t) for n, t in mtp.items())


def test_plan_shards_orders_globals_then_layers_numerically_and_numbers_without_gaps() -> None:
    sizes = {"layers.10.a": 10, "layers.2.a": 10, "embed.weight": 10, "mtp.0.a": 1000}
    plan = plan_shards(sizes, 4)
    assert list(plan) == ["embed.weight", "layers.2.a", "layers.10.a", "mtp.0.a"]
    # The MTP tensor's bytes dwarf the rest: two runs used out of four, named 1 and 2 of 2.
    assert set(plan.values()) == {"model-00001-of-00002.safetensors", plan["mtp.0.a"]}
    assert plan["mtp.0.a"] == "model-00002-of-00002.safetensors"


def test_what_cannot_be_written_is_refused(tmp_path: Path, params: dict[str, torch.Tensor]) -> None:
    with pytest.raises(WeightsError, match="missing"):
        write_model_dir(tmp_path, MODEL, {n: t for n, t in params.items() if n != "head.weight"})
    partial = dict(list(_mtp(seed=5).items())[:3])
    with pytest.raises(WeightsError, match="whole"):
        write_model_dir(tmp_path, MODEL, params | partial)
    quantized = dataclasses.replace(MODEL, quantization=Quantization())
    with pytest.raises(ValueError, match="quantized"):
        write_model_dir(tmp_path, quantized, params)
    with pytest.raises(ValueError, match="dtype"):
        write_model_dir(tmp_path, MODEL, params, dtype=torch.float64)
    assert not any(tmp_path.iterdir())
