"""A stand-in for SGLang 0.5.23's `GET /server_info`: the document's shape (the fields the
operator reads, among a few it does not) and what a server started with a given command line
realizes when its GPU has the memory the plan assumed. Written from SGLang's source
(entrypoints/http_server.py `server_info`, utils/common.py `build_server_info`,
managers/scheduler.py `get_init_info`, scheduler_components/internal_state.py and
memory_usage.py, mem_cache/kv_cache_configurator.py `resolve_max_num_reqs`), not from the
operator's code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def server_info_doc(
    *,
    full_tokens: int,
    context_tokens: int,
    swa_tokens: int | None = None,
    requests_per_dp: int | None = 256,
    dp: int = 1,
    page_size: int = 256,
) -> dict[str, Any]:
    state = {
        "page_size": page_size,
        "context_length": context_tokens,
        "world_size": 4,
        "effective_max_running_requests_per_dp": requests_per_dp,
        "last_gen_throughput": 0.0,
        "memory_usage": {
            "weight": 38.125,
            "kvcache": 61.75,
            "startup_available": 139.5,
            "token_capacity": full_tokens,
            "token_capacity_swa": swa_tokens,
            "graph": {"decode": 1.5},
        },
    }
    if requests_per_dp is None:
        del state["effective_max_running_requests_per_dp"]
    return {
        # server_args.resolved_dict() (a few of its fields)
        "model_path": "/models/DeepSeek-V4-Flash",
        "page_size": page_size,
        "context_length": context_tokens,
        "max_total_tokens": full_tokens,
        "disaggregation_mode": "decode",
        "launch_command": "python3 -m sglang.launch_server ...",
        # the scheduler's start-up info
        "status": "ready",
        "max_total_num_tokens": full_tokens,
        "max_req_input_len": min(context_tokens - 1, full_tokens - 1) - 5,
        "startup_time": 1700000000.0,
        "kv_events": None,
        "internal_states": [dict(state) for _ in range(dp)],
        "version": "0.5.23",
        "frontend": "python",
    }


def flag(args: Sequence[str], name: str) -> str:
    return args[list(args).index(name) + 1]


def realized(args: Sequence[str]) -> dict[str, Any]:
    """What SGLang realizes from its command line with enough memory: the pool it is capped
    to, the SWA pool of the ratio (int(full * ratio) rounded down to a page), the requested
    requests (at most half the pool) and the context it was given."""
    full = int(flag(args, "--max-total-tokens"))
    page = int(flag(args, "--page-size"))
    swa = int(full * float(flag(args, "--swa-full-tokens-ratio"))) // page * page
    requests = min(int(flag(args, "--max-running-requests")), full // 2)
    return server_info_doc(
        full_tokens=full,
        context_tokens=int(flag(args, "--context-length")),
        swa_tokens=swa,
        requests_per_dp=requests,
        page_size=page,
    )
