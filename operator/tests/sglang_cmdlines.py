"""Representative SGLang 0.5.23 / sglang-router 0.3.2 command lines, shared by the CI test of
the flag snapshot (test_sglang_flags.py) and the opt-in test against the real packages
(test_sglang_real.py), so both parse exactly the same words (`import sglang_cmdlines`); and
the snapshot generator, scripts/sglang_flags.py, loaded as a module."""

from __future__ import annotations

import importlib.util
from types import ModuleType
from typing import Final

from repo_paths import ROOT


def load_generator() -> ModuleType:
    """scripts/sglang_flags.py as a module (it imports sglang only inside its functions)."""
    path = ROOT / "scripts" / "sglang_flags.py"
    spec = importlib.util.spec_from_file_location("sglang_flags_script", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def server_argv(role: str = "prefill", node_rank: int = 1) -> list[str]:
    """argv after `python3 -m sglang.launch_server`: one PP rank (node) of a TP 8 x PP 2 role."""
    return [
        "--model-path", "/models/x",
        "--tp-size", "8",
        "--pp-size", "2",
        "--nnodes", "2",
        "--node-rank", str(node_rank),
        "--dist-init-addr", "host:5000",
        "--disaggregation-mode", role,
        "--disaggregation-transfer-backend", "nixl",
        "--disaggregation-bootstrap-port", "8998",
        "--page-size", "64",
        "--chunked-prefill-size", "8192",
        "--max-running-requests", "64",
        "--context-length", "65536",
        "--max-total-tokens", "123456",
        "--swa-full-tokens-ratio", "0.1",
        "--mem-fraction-static", "0.85",
        "--host", "0.0.0.0",
        "--port", "30000",
        "--enable-metrics",
    ]  # fmt: skip


# What server_argv("prefill") parses to, for the flags it sets (dest -> value).
SERVER_VALUES: Final = {
    "model_path": "/models/x",
    "tp_size": 8,
    "pp_size": 2,
    "nnodes": 2,
    "node_rank": 1,
    "dist_init_addr": "host:5000",
    "disaggregation_mode": "prefill",
    "disaggregation_transfer_backend": "nixl",
    "disaggregation_bootstrap_port": 8998,
    "page_size": 64,
    "chunked_prefill_size": 8192,
    "max_running_requests": 64,
    "context_length": 65536,
    "max_total_tokens": 123456,
    "swa_full_tokens_ratio": 0.1,
    "mem_fraction_static": 0.85,
    "host": "0.0.0.0",
    "port": 30000,
    "enable_metrics": True,
}

# argv after `python3 -m sglang_router.launch_router`: PD mode, two prefills (one with a
# bootstrap port, one explicitly without), two decodes.
ROUTER_ARGV: Final = [
    "--pd-disaggregation",
    "--prefill", "http://sgl-prefill-0.sgl.ns.svc:30000", "8998",
    "--prefill", "http://sgl-prefill-1.sgl.ns.svc:30000", "none",
    "--decode", "http://sgl-decode-0.sgl.ns.svc:30000",
    "--decode", "http://sgl-decode-1.sgl.ns.svc:30000",
    "--host", "0.0.0.0",
    "--port", "8000",
    "--policy", "round_robin",
    "--prometheus-host", "0.0.0.0",
    "--prometheus-port", "29000",
]  # fmt: skip

ROUTER_PREFILL_URLS: Final = [
    ("http://sgl-prefill-0.sgl.ns.svc:30000", 8998),
    ("http://sgl-prefill-1.sgl.ns.svc:30000", None),
]
ROUTER_DECODE_URLS: Final = [
    "http://sgl-decode-0.sgl.ns.svc:30000",
    "http://sgl-decode-1.sgl.ns.svc:30000",
]

# Server command lines both parsers must refuse, with the flag the error names.
BAD_SERVER: Final = [
    (["--model-path", "/m", "--no-such-flag", "1"], "--no-such-flag"),
    (["--model-path", "/m", "--disaggregation-mode", "both"], "--disaggregation-mode"),
    (["--model-path", "/m", "--disaggregation-transfer-backend", "rdma"],
     "--disaggregation-transfer-backend"),
    (["--model-path", "/m", "--tp-size", "eight"], "--tp-size"),
    (["--model-path", "/m", "--max-total-tokens", "1.5Ki"], "--max-total-tokens"),
    (["--model-path", "/m", "--pp-size"], "--pp-size"),
    (["--model-path", "/m", "--enable-"], "--enable-"),
    (["--tp-size", "8"], "--model-path"),
]  # fmt: skip
