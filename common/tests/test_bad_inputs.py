"""Every bad input a new user can type gets a clear error naming the flag or field (exit 2),
never a traceback and never silent acceptance: the CLI, config.json files and CR fields."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dsv4_cli.main import EXIT_BROKEN_PIPE, main
from dsv4_common.api.deployment import MemoryPlanError, plan_memory
from dsv4_common.api.spec import parse_spec
from dsv4_common.core.hf import from_hf_config
from dsv4_common.core.model import ModelConfigError

TINY = ["plan", "--model", "tiny"]


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """Exit code and stderr of `dsv4 argv` (argparse's own errors exit through SystemExit)."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--gpu-memory-gib", "inf"], "--gpu-memory-gib: expected a finite number, got 'inf'"),
        (["--gpu-memory-gib", "nan"], "--gpu-memory-gib: expected a finite number, got 'nan'"),
        (["--gpu-memory-gib", "-1"], "--gpu-memory-gib: must be > 0"),
        (["--gpu-memory-gib", "1e300"], "--gpu-memory-gib: must be <= 1.04858e+06"),
        (["--gpu", "h200", "--mem-fraction", "1.5"], "--mem-fraction: must be <= 1"),
        (["--gpu", "h200", "--swa-ratio", "nan"], "--swa-ratio: expected a finite number"),
        (["--gpu", "b9000"], "--gpu: invalid choice: 'b9000'"),
        ([], "one of the arguments --gpu --gpu-memory-gib is required"),
        (["--gpu", "h200", "--gpu-memory-gib", "80"], "not allowed with argument"),
        (["--gpu", "h200", "--tp", "3"], "--tp: tp_size=3 must divide the model's 4 attention"),
        (["--gpu", "h200", "--tp", "0"], "--tp: must be >= 1, got 0"),
        (["--gpu", "h200", "--pp", "7"], "--pp: pp_size=7 exceeds the model's 6 target layers"),
        (
            ["--gpu", "h200", "--context-len", "100000"],
            "--context-len: context_len=100000 exceeds the model's context of 4096 tokens",
        ),
        (["--gpu", "h200", "--page-size", "24"], "--page-size: page_size=24 must be divisible"),
        (
            ["--gpu", "h200", "--speculative-draft-tokens", "30"],
            "--speculative-draft-tokens: speculative_draft_tokens=30 exceeds",
        ),
        (["--gpu", "h200", "--layer-split", "4,x"], "--layer-split: expected comma-separated"),
        (["--gpu", "h200", "--pp", "2", "--layer-split", "5,2"], "--layer-split: layer_split="),
        (["--gpu-memory-gib", "0.001"], "weights need 1.46 MiB per GPU but only 943.7 KiB"),
    ],
)
def test_cli_bad_number_exits_2_naming_the_flag(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = run_cli([*TINY, *argv], capsys)
    assert code == 2, err
    assert needle in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--transfer-threads", "65"], "--transfer-threads: must be <= 64, got 65"),
        (["--transfer-threads", "-1"], "--transfer-threads: must be >= 0, got -1"),
        (["--transfer-timeout-s", "0"], "--transfer-timeout-s: must be > 0, got 0"),
    ],
)
def test_serve_bad_number_exits_2_naming_the_flag(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = run_cli(["serve", "--role", "prefill", *argv], capsys)
    assert code == 2 and needle in err and "Traceback" not in err


def test_cli_tp_256_on_128_heads_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "deepseek-v4-pro", "--gpu", "h200", "--tp", "256"]
    code, err = run_cli(argv, capsys)
    assert code == 2 and "--tp: tp_size=256 must divide the model's 128 attention heads" in err


# --- config.json -------------------------------------------------------------------------------


def hybrid_hf() -> dict[str, Any]:
    return {
        "num_hidden_layers": 6,
        "sliding_window_pattern": 3,
        "sliding_window": 16,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 64,
        "vocab_size": 256,
        "intermediate_size": 128,
        "max_position_embeddings": 4096,
    }


def dsv4_hf() -> dict[str, Any]:
    return {
        "model_type": "deepseek_v4",
        "num_hidden_layers": 4,
        "num_nextn_predict_layers": 1,
        "compress_ratios": [0, 4, 128, 4, 0],
        "window_size": 128,
        "qk_nope_head_dim": 448,
        "qk_rope_head_dim": 64,
        "hidden_size": 1024,
        "vocab_size": 1000,
        "num_attention_heads": 16,
        "max_position_embeddings": 65536,
        "index_head_dim": 128,
        "index_n_heads": 8,
        "index_topk": 512,
        "q_lora_rank": 256,
        "o_lora_rank": 256,
        "o_groups": 4,
        "hc_mult": 4,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 256,
        "num_hash_layers": 1,
    }


def _set(key: str, value: object) -> Callable[[dict[str, Any]], None]:
    return lambda raw: raw.__setitem__(key, value)


@pytest.mark.parametrize(
    ("base", "mutate", "needle"),
    [
        (hybrid_hf, _set("sliding_window_pattern", 0), "'sliding_window_pattern' must be >= 1"),
        (hybrid_hf, _set("head_dim", -8), "'head_dim' must be >= 1, got -8"),
        (hybrid_hf, _set("head_dim", 0), "'head_dim' must be >= 1, got 0"),
        (hybrid_hf, _set("hidden_size", 0), "'hidden_size' must be >= 1, got 0"),
        (hybrid_hf, _set("num_attention_heads", 0), "'num_attention_heads' must be >= 1"),
        (hybrid_hf, _set("num_hidden_layers", 0), "'num_hidden_layers' must be >= 1, got 0"),
        (hybrid_hf, _set("num_hidden_layers", -3), "'num_hidden_layers' must be >= 1, got -3"),
        (hybrid_hf, _set("num_hidden_layers", 10**9), "'num_hidden_layers' must be <= 4096"),
        (
            hybrid_hf,
            _set("layer_types", ["sliding_attention"] * 5),
            "'layer_types' has 5 entries but num_hidden_layers is 6",
        ),
        (hybrid_hf, _set("layer_types", ["linear"] * 6), "'layer_types[0]' must name sliding"),
        (hybrid_hf, _set("num_key_value_heads", 3), "'num_key_value_heads' (3) must divide"),
        (hybrid_hf, _set("max_position_embeddings", 0), "'max_position_embeddings' must be >= 1"),
        (hybrid_hf, _set("vocab_size", True), "'vocab_size' must be an integer, got True"),
        (dsv4_hf, _set("num_hidden_layers", 0), "'num_hidden_layers' must be >= 1"),
        (dsv4_hf, _set("qk_nope_head_dim", -1), "'qk_nope_head_dim' must be >= 1, got -1"),
        (dsv4_hf, _set("hidden_size", 0), "'hidden_size' must be >= 1, got 0"),
        (
            dsv4_hf,
            _set("compress_ratios", [0, 4, 128]),
            "'compress_ratios' has 3 entries; expected 4 (target layers) up to 5",
        ),
        (
            dsv4_hf,
            _set("compress_ratios", [0, 4, 128, 4, 0, 0, 0]),
            "'compress_ratios' has 7 entries",
        ),
        (dsv4_hf, _set("compress_ratios", [0, 4, True, 4]), "must be a list of integers"),
        (dsv4_hf, _set("max_position_embeddings", 0), "'max_position_embeddings' must be >= 1"),
        (dsv4_hf, _set("window_size", -128), "'window_size' must be >= 1"),
    ],
)
def test_bad_config_json_is_refused_naming_the_field(
    base: Callable[[], dict[str, Any]],
    mutate: Callable[[dict[str, Any]], None],
    needle: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    raw = base()
    mutate(raw)
    with pytest.raises(ModelConfigError) as info:
        from_hf_config(raw, name="m")
    assert needle in str(info.value)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    code, err = run_cli(["plan", "--model", str(path), "--gpu", "h200"], capsys)
    assert code == 2
    assert err.startswith("dsv4 plan: error: --model:") and needle in err


def test_bad_configs_plan_once_fixed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The bases above are valid: the errors come from the mutations, not the bases."""
    for i, raw in enumerate((hybrid_hf(), dsv4_hf())):
        path = tmp_path / f"c{i}.json"
        path.write_text(json.dumps(raw))
        code, err = run_cli(["plan", "--model", str(path), "--gpu", "h200"], capsys)
        assert code == 0, err


# --- the CR --------------------------------------------------------------------------------------


def test_cr_with_tp_16_on_tiny_is_refused_naming_the_field() -> None:
    spec = parse_spec(
        {
            "spec": {
                "model": {"preset": "tiny"},
                "maxContextTokens": 1024,
                "gpu": {"type": "h100-80gb", "perPod": 16},
                "prefill": {"tensorParallel": 16},
                "decode": {"tensorParallel": 16},
            }
        }
    )
    with pytest.raises(MemoryPlanError, match=r"^spec.prefill.tensorParallel: tp_size=16 must"):
        plan_memory(spec)


# --- output to a closed pipe -------------------------------------------------------------------


def test_plan_into_a_closed_pipe_exits_quietly() -> None:
    """`dsv4 plan --json | head -1`: no BrokenPipeError traceback, the SIGPIPE exit code."""
    read_fd, write_fd = os.pipe()
    os.close(read_fd)  # the reader is gone before the first byte
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "dsv4_cli", *TINY, "--gpu", "h200", "--json"],
            stdout=write_fd,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write_fd)
    assert proc.stderr == ""
    assert proc.returncode == EXIT_BROKEN_PIPE
