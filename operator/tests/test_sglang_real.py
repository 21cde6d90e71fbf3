"""Opt-in (marker `sglang`): the flag snapshots and the representative command lines against
the real sglang 0.5.23 and sglang-router 0.3.2 packages.

Skipped when they do not import (always so in .venv, which must not get sglang). Set
DSV4_SGLANG_TESTS=1 to make a missing package an error instead, DSV4_SGLANG_TESTS=full to
make the resolution tier's missing packages one too.

Parse tier (the snapshots are current; argparse parse + `ServerArgs.from_cli_args` via
`prepare_server_args`; the router's `parse_router_args` + `RouterArgs.from_cli_args` +
`Router.from_args`). CPU torch, about 2.5 GB, 1-2 minutes:

    python3 -m venv /tmp/sglenv
    /tmp/sglenv/bin/pip install torch==2.13.0 numpy orjson psutil pybase64 requests tqdm \\
        triton packaging pillow starlette msgspec pyzmq ipython pydantic aiohttp \\
        setproctitle uvicorn fastapi pytest pyyaml
    /tmp/sglenv/bin/pip install --no-deps sglang==0.5.23 sglang-router==0.3.2
    DSV4_SGLANG_TESTS=1 PYTHONPATH=common:operator \\
        /tmp/sglenv/bin/python -m pytest -p no:cacheprovider --noconftest \\
        operator/tests/test_sglang_real.py

Modules `import sglang.srt.server_args` needs beyond the stdlib: numpy, orjson, psutil,
pybase64, requests, tqdm, torch, triton, packaging, PIL (pillow), starlette, msgspec, zmq (pyzmq),
IPython, pydantic, aiohttp; `sglang_router.launch_router` adds setproctitle, uvicorn, fastapi
(and the wheel's own Rust extension). pytest and pyyaml run this test; --noconftest
skips operator/tests/conftest.py, which needs the operator's own dependencies (kopf, ...).

Resolution tier (`ServerArgs.resolve_once`, SGLang's post-processing: ~60 hooks). It imports
sglang.srt.configs, hence transformers, which imports torchvision; PyPI's torchvision is
built against CUDA torch and does not load with the CPU wheel, so this tier takes sglang's own
torch pin (CUDA wheels, several GB) in a second venv:

    python3 -m venv /tmp/sglfull
    /tmp/sglfull/bin/pip install torch==2.14.1 torchvision <the parse-tier list> \\
        transformers==5.19.0 tokenizers==0.23.2 apache-tvm-ffi==0.1.11 sentencepiece==0.2.1 \\
        compressed-tensors==0.18.0 gguf dill
    /tmp/sglfull/bin/pip install --no-deps sglang==0.5.23 sglang-router==0.3.2
    DSV4_SGLANG_TESTS=full PYTHONPATH=common:operator \\
        /tmp/sglfull/bin/python -m pytest -p no:cacheprovider --noconftest \\
        operator/tests/test_sglang_real.py

What resolution runs here: with `--model-path dummy` (the command line otherwise unchanged)
only the model-independent checks before SGLang's dummy-model return. With a DeepSeek-V4
config.json (written to tmp_path) the whole pipeline runs, PD, parallel, memory, page and
DeepSeek-V4 hooks included, but only with `--device cpu` appended: without an accelerator
`get_device()` raises in handle_missing_default_values. Resolution reads no weights.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import sglang_cmdlines as C
from repo_paths import ROOT

from dsv4_operator.flavors.sglang import flags as F
from dsv4_operator.flavors.sglang.info import parse_server_info
from dsv4_operator.flavors.sglang.snapshot import SglangArgsError

pytestmark = pytest.mark.sglang
OPT_IN = os.environ.get("DSV4_SGLANG_TESTS", "")
DATA = ROOT / "operator" / "dsv4_operator" / "data"


def need(module: str, demanded: bool) -> ModuleType:
    """Import `module`, or skip (fail when the opt-in demands it) saying why."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        message = f"{module} does not import ({err}); see test_sglang_real.py's doc"
        if demanded:
            pytest.fail(f"DSV4_SGLANG_TESTS={OPT_IN}: {message}")
        pytest.skip(message)


@pytest.fixture(scope="module")
def server_args() -> ModuleType:
    return need("sglang.srt.server_args", OPT_IN in ("1", "full"))


@pytest.fixture(scope="module")
def launch_router() -> ModuleType:
    return need("sglang_router.launch_router", OPT_IN in ("1", "full"))


@pytest.fixture
def generator(
    server_args: ModuleType, launch_router: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> ModuleType:
    for key in [k for k in os.environ if k.startswith("SGLANG_")]:
        monkeypatch.delenv(key)  # as the generator does: some choices read them
    return C.load_generator()


@pytest.fixture
def sealed_process() -> Iterator[None]:
    """SGLang writes os.environ (resolution) and the root logger (prepare_server_args'
    basicConfig(force=True)): put both back."""
    environ, root = dict(os.environ), logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    os.environ.clear()
    os.environ.update(environ)
    root.handlers[:], root.level = handlers, level


# ---- the snapshots ---------------------------------------------------------------------


def test_snapshots_are_what_the_generator_writes(generator: ModuleType) -> None:
    for name, doc in generator.snapshots().items():
        assert generator.render(doc) == (DATA / name).read_text("utf-8"), (
            f"{name} is stale: run scripts/sglang_flags.py in an sglang {F.SGLANG_VERSION} env"
        )


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_real_server_parser_agrees_with_the_snapshot(generator: ModuleType, role: str) -> None:
    argv = C.server_argv(role)
    real = vars(generator.real_server_parser().parse_args(argv))
    assert vars(F.parse_server_args(argv)) == real  # every dest, defaults included
    assert {k: real[k] for k in C.SERVER_VALUES} == {**C.SERVER_VALUES, "disaggregation_mode": role}


@pytest.mark.parametrize(("argv", "flag"), C.BAD_SERVER)
def test_real_server_parser_refuses_the_same(
    generator: ModuleType, capsys: pytest.CaptureFixture[str], argv: list[str], flag: str
) -> None:
    with pytest.raises(SystemExit):
        generator.real_server_parser().parse_args(argv)
    assert flag in capsys.readouterr().err
    with pytest.raises(SglangArgsError):
        F.parse_server_args(argv)


def test_real_server_args_from_the_command_line(
    server_args: ModuleType, sealed_process: None
) -> None:
    record = server_args.prepare_server_args(C.server_argv("prefill"))  # parse + from_cli_args
    assert {k: getattr(record, k) for k in C.SERVER_VALUES} == C.SERVER_VALUES


# ---- /server_info (what the operator reads of it: flavors/sglang/info.py) --------------------


def _source(server_args: ModuleType, relative: str) -> str:
    """A module's source text from the installed package (importing the scheduler would start
    CUDA-only imports)."""
    return (Path(server_args.__file__).parent / relative).read_text("utf-8")


def test_real_server_info_carries_the_fields_the_operator_reads(
    server_args: ModuleType, sealed_process: None
) -> None:
    """The document's layout in this version: http_server.server_info spreads the resolved
    server arguments (context_length among them) and the scheduler's start-up info
    (max_total_num_tokens) and lists one internal state per DP scheduler, built with
    build_memory_usage (token_capacity_swa) and effective_max_running_requests_per_dp."""
    record = server_args.prepare_server_args(C.server_argv("decode"))
    assert record.context_length == C.SERVER_VALUES["context_length"]
    http = _source(server_args, "entrypoints/http_server.py")
    assert '"internal_states": internal_states' in http and "build_server_info(" in http
    assert '"max_total_num_tokens": self.max_total_num_tokens' in _source(
        server_args, "managers/scheduler.py"
    )
    internal = _source(server_args, "managers/scheduler_components/internal_state.py")
    assert 'state["effective_max_running_requests_per_dp"]' in internal
    assert 'state["memory_usage"] = build_memory_usage(' in internal
    usage = need(
        "sglang.srt.managers.scheduler_components.memory_usage", OPT_IN in ("1", "full")
    ).build_memory_usage(
        weight_gb=38.1,
        kv_cache_gb=61.7,
        startup_available_gb=139.5,
        token_capacity=491_520,
        token_capacity_swa=49_152,
        target_graph_memory_usage=None,
        draft_graph_memory_usage=None,
    )
    doc = {
        "context_length": record.context_length,
        "max_total_num_tokens": 491_520,
        "internal_states": [
            {"memory_usage": usage, "effective_max_running_requests_per_dp": 128},
            {"memory_usage": usage, "effective_max_running_requests_per_dp": 128},
        ],
    }
    info = parse_server_info(doc)
    assert (info.full_tokens, info.swa_tokens, info.max_running_requests) == (491_520, 49_152, 256)


# ---- resolution (SGLang's post-processing) ----------------------------------------------

# A DeepSeek-V4-shaped config.json with 6 layers (PP 2 -> 3 each); resolution reads no weights.
DSV4_CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "torch_dtype": "bfloat16",
    "num_hidden_layers": 6,
    "max_position_embeddings": 65536,
    "vocab_size": 129280,
    "hidden_size": 4096,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1024,
    "o_lora_rank": 1024,
    "o_groups": 8,
    "sliding_window": 128,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "index_topk": 512,
    "compress_ratios": [0, 4, 128, 4, 128, 0, 0],
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 6,
    "num_nextn_predict_layers": 1,
    "hc_mult": 4,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
}


def resolved(server_args: ModuleType, argv: list[str]) -> dict[str, Any]:
    need("sglang.srt.arg_groups.pipeline", OPT_IN == "full")
    record = server_args.prepare_server_args(argv)
    record.resolve_once()
    values: dict[str, Any] = record.resolved_dict()
    return values


def with_model(argv: list[str], model_path: str) -> list[str]:
    i = argv.index("--model-path")
    return [*argv[: i + 1], model_path, *argv[i + 2 :]]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_resolution_model_independent_checks(
    server_args: ModuleType, sealed_process: None, role: str
) -> None:
    values = resolved(server_args, with_model(C.server_argv(role), "dummy"))
    assert (values["tp_size"], values["pp_size"], values["disaggregation_mode"]) == (8, 2, role)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_resolution_with_a_deepseek_v4_config(
    server_args: ModuleType, sealed_process: None, tmp_path: Path, role: str
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(DSV4_CONFIG))
    argv = [*with_model(C.server_argv(role), str(tmp_path)), "--device", "cpu"]
    values = resolved(server_args, argv)
    want = {**C.SERVER_VALUES, "model_path": str(tmp_path), "disaggregation_mode": role}
    want.pop("page_size")
    assert {k: values[k] for k in want} == want
    # SGLang's DeepSeek-V4 override: page size 256 (128 on NPU) whatever --page-size says.
    assert values["page_size"] == 256
    assert values["attention_backend"] == "dsv4"
    assert values["disable_radix_cache"] is (role == "decode")


# ---- the router -------------------------------------------------------------------------


def test_real_router_parses_the_pd_command_line(
    generator: ModuleType, launch_router: ModuleType
) -> None:
    real = vars(generator.real_router_parser().parse_args(C.ROUTER_ARGV))
    ours = F.parse_router_args(C.ROUTER_ARGV)
    assert vars(ours) == real
    router_args = launch_router.parse_router_args(list(C.ROUTER_ARGV))  # + from_cli_args
    assert router_args.pd_disaggregation is True
    assert router_args.prefill_urls == C.ROUTER_PREFILL_URLS == F.router_prefill_urls(ours)
    assert router_args.decode_urls == C.ROUTER_DECODE_URLS
    assert (router_args.host, router_args.port) == ("0.0.0.0", 8000)
    router_args._validate_router_args()
    router = need("sglang_router.router", True).Router.from_args(router_args)  # built, not run
    assert router is not None


def test_real_router_refuses_a_bad_bootstrap_port(launch_router: ModuleType) -> None:
    argv = ["--pd-disaggregation", "--prefill", "http://p:30000", "port"]
    with pytest.raises(ValueError, match="Invalid bootstrap port"):
        launch_router.parse_router_args(argv)
    with pytest.raises(SglangArgsError, match="bootstrap port"):
        F.parse_router_args(argv)


def test_real_router_refuses_a_server_flag(
    generator: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        generator.real_router_parser().parse_args(["--disaggregation-mode", "prefill"])
    assert "--disaggregation-mode" in capsys.readouterr().err
    assert isinstance(F.parse_router_args([]), argparse.Namespace)
