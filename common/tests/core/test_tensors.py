"""The checkpoint's tensor list (`core/tensors.py`) against what the releases publish: tensor
counts, stored elements and bytes equal the published checkpoints exactly, the parameter
counts are the announced 284B and 1.6T, and storage follows the quantization."""

from __future__ import annotations

import dataclasses
import math

import pytest

from dsv4_common.core.model import DSV4Config, Quantization
from dsv4_common.core.presets import deepseek_v4_flash, deepseek_v4_pro, tiny
from dsv4_common.core.tensors import (
    Tensor,
    checkpoint_params,
    embedding_params,
    head_params,
    layer_params,
    mtp_params,
    stored_tensors,
)

# Published checkpoint figures (common/tests/data/README.md says where each comes from):
# DeepSeek-V4-Flash's model.safetensors.index.json: 69,187 tensors, total_size 159,609,485,896;
# DeepSeek-V4-Pro's 64 shards: 145,116 tensors, 861,608,274,846 stored elements, 805.32 GiB.
FLASH_TENSORS, FLASH_BYTES = 69_187, 159_609_485_896
PRO_TENSORS, PRO_ELEMENTS, PRO_GIB = 145_116, 861_608_274_846, 805.32


def checkpoint(m: DSV4Config) -> tuple[Tensor, ...]:
    return stored_tensors(m, checkpoint_params(m))


def target(m: DSV4Config) -> tuple[Tensor, ...]:
    """Without the MTP layers: what serving without speculation loads."""
    params = [*embedding_params(m), *head_params(m)]
    for layer in range(m.num_hidden_layers):
        params += layer_params(m, layer)
    return stored_tensors(m, tuple(params))


def count(tensors: tuple[Tensor, ...]) -> int:
    return sum(t.copies for t in tensors)


def nbytes(tensors: tuple[Tensor, ...]) -> int:
    return sum(t.nbytes for t in tensors)


def params(tensors: tuple[Tensor, ...]) -> int:
    return sum(t.params for t in tensors)


def test_flash_checkpoint_is_the_published_one() -> None:
    flash = checkpoint(deepseek_v4_flash())
    assert (count(flash), nbytes(flash)) == (FLASH_TENSORS, FLASH_BYTES)


def test_pro_checkpoint_is_the_published_one() -> None:
    pro = checkpoint(deepseek_v4_pro())
    assert count(pro) == PRO_TENSORS
    assert sum(t.copies * math.prod(t.shape) for t in pro) == PRO_ELEMENTS
    assert round(nbytes(pro) / 2**30, 2) == PRO_GIB


def test_parameter_counts_are_the_announced_ones() -> None:
    """284B (Flash) and 1.6T (Pro) parameters; FP4 experts make Flash ~156 GB, Pro ~851 GB."""
    flash, pro = deepseek_v4_flash(), deepseek_v4_pro()
    assert params(target(flash)) == pytest.approx(284e9, rel=0.01)
    assert params(checkpoint(pro)) == pytest.approx(1.6e12, rel=0.01)
    assert 150e9 < nbytes(target(flash)) < 160e9
    assert 840e9 < nbytes(target(pro)) < 860e9


def test_release_storage_per_tensor() -> None:
    """Layer 2 of Flash (CSA): the dtypes and shapes the published checkpoint lists."""
    stored = {
        t.name: t for t in stored_tensors(deepseek_v4_flash(), layer_params(deepseek_v4_flash(), 2))
    }
    expected = {
        "layers.2.attn.wq_a.weight": ((1024, 4096), "F8_E4M3"),
        "layers.2.attn.wq_a.scale": ((8, 32), "F8_E8M0"),
        "layers.2.attn.wo_a.weight": ((8192, 4096), "F8_E4M3"),
        "layers.2.attn.q_norm.weight": ((1024,), "BF16"),
        "layers.2.attn.attn_sink": ((64,), "F32"),
        "layers.2.attn.compressor.wkv.weight": ((1024, 4096), "BF16"),
        "layers.2.attn.compressor.ape": ((4, 1024), "F32"),
        "layers.2.attn.indexer.weights_proj.weight": ((64, 4096), "BF16"),
        "layers.2.attn.indexer.compressor.ape": ((4, 256), "F32"),
        "layers.2.ffn.gate.weight": ((256, 4096), "BF16"),
        "layers.2.ffn.gate.tid2eid": ((129280, 6), "I64"),
        "layers.2.ffn.experts.{e}.w1.weight": ((2048, 2048), "I8"),
        "layers.2.ffn.experts.{e}.w1.scale": ((2048, 128), "F8_E8M0"),
        "layers.2.ffn.shared_experts.w1.scale": ((16, 32), "F8_E8M0"),
        "layers.2.hc_attn_fn": ((24, 16384), "F32"),
        "layers.2.hc_attn_scale": ((3,), "F32"),
    }
    assert {n: (stored[n].shape, stored[n].dtype) for n in expected} == expected
    assert "layers.2.ffn.gate.bias" not in stored  # a hash-routed layer has no bias
    assert stored["layers.2.ffn.experts.{e}.w1.weight"].copies == 256


def test_mtp_layer_is_topk_routed_and_window_only() -> None:
    names = {n for p in mtp_params(deepseek_v4_flash(), 0) for n in p.names()}
    assert "mtp.0.ffn.gate.bias" in names and "mtp.0.ffn.gate.tid2eid" not in names
    assert not any(".compressor." in n for n in names)
    assert {"mtp.0.e_proj.weight", "mtp.0.h_proj.weight", "mtp.0.hc_head_fn"} <= names


def test_unquantized_storage_is_torch_dtype_except_f32_and_the_hash_table() -> None:
    """Without a quantization_config every weight is in torch_dtype (BF16 here); the tensors
    the release keeps in F32 stay F32 and the hash table stays I64."""
    plain = dataclasses.replace(deepseek_v4_flash(), quantization=None)
    tensors = checkpoint(plain)
    assert not any(t.name.endswith(".scale") for t in tensors)
    assert {t.dtype for t in tensors} == {"BF16", "F32", "I64"}
    bf16 = sum(t.params for t in tensors if t.dtype == "BF16")
    assert nbytes(tensors) == 2 * bf16 + sum(t.nbytes for t in tensors if t.dtype != "BF16")
    assert params(tensors) == params(checkpoint(deepseek_v4_flash()))


def test_fp8_experts_and_float_scales() -> None:
    fp8 = Quantization(scale_fmt="float", expert_dtype="fp8")
    flash = dataclasses.replace(deepseek_v4_flash(), quantization=fp8)
    experts = [t for t in checkpoint(flash) if ".experts.{e}." in t.name]
    assert {t.dtype for t in experts} == {"F8_E4M3", "F32"}  # FP8 + float32 block scales
    w1 = next(t for t in experts if t.name == "layers.0.ffn.experts.{e}.w1.scale")
    assert w1.shape == (16, 32)  # one scale per 128x128 block of [2048, 4096]


def test_tiny_has_every_kind_of_layer() -> None:
    m = tiny()
    names = {n for p in checkpoint_params(m) for n in p.names()}
    assert "layers.0.ffn.gate.tid2eid" in names and "layers.1.ffn.gate.bias" in names
    assert "layers.1.attn.indexer.wq_b.weight" in names  # ratio 4: CSA
    assert (
        "layers.2.attn.compressor.ape" in names and "layers.2.attn.indexer.wq_b.weight" not in names
    )
    assert {t.dtype for t in checkpoint(m)} == {"F32", "I64"}  # tiny stores float32
