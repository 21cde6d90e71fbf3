"""Pipeline-parallel figures (prints tables; not a test).

    .venv/bin/python bench/pp.py [--device cpu|cuda] [--pp 1 2 4]

1. The planner: DSV4-Pro, decode and prefill roles, TP=8 on H200 with the settings that give
   the issue's PP=4 figure of 40.7M full tokens per rank (SWA ratio 0.1, memory
   fraction 0.88, online HCA state). Per PP rank: KV capacity (full tokens, max running
   requests, max context) and full tokens gained vs PP=1; then the bottleneck (the worst
   rank) of the even split, SGLang's default split (extra layers on the last ranks) and the
   balanced split, for DSV4-Pro and DSV4-Flash at PP=2..8, at those settings and at tighter
   memory (TP=4 on H100 with MTP: weights take most of the device).
2. Serving `tiny` over HTTP on loopback: generated tokens/s and TTFT of a PP=1 worker and of a
   PP=2 group (two stage processes), at 1 and 32 concurrent streaming clients, side by side in
   one run (medians over `--rounds`). `--skip-serving` prints the planner figures only.
The planner is pure arithmetic and runs on CPU whatever `--device` says; the serving figures
run on it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import serve as http_bench
import torch

from dsv4_common.core.gpus import gpu_type
from dsv4_common.core.presets import deepseek_v4_flash, deepseek_v4_pro
from dsv4_common.core.units import GIB
from dsv4_common.plan.inputs import PlanError, PlanInputs, Role
from dsv4_common.plan.planner import Plan, plan
from dsv4_common.plan.report import gain
from dsv4_common.plan.split import format_split, sglang_split

# The issue's settings: `dsv4 plan --model deepseek-v4-pro --gpu h200 --tp 8 --pp 4
# --role decode --swa-ratio 0.1 --mem-fraction 0.88 --request-state online`.
ISSUE: dict[str, object] = {"swa_ratio": 0.1, "mem_fraction": 0.88, "request_state": "online"}
TIGHT: dict[str, object] = {"speculative_draft_tokens": 2}


def _inputs(
    model: str, role: Role, pp: int, gpu: str, tp: int, kw: dict[str, object]
) -> PlanInputs:
    return PlanInputs(
        model=deepseek_v4_pro() if model == "pro" else deepseek_v4_flash(),
        role=role,
        gpu_memory_bytes=gpu_type(gpu).memory_bytes,
        tp_size=tp,
        pp_size=pp,
        **kw,  # type: ignore[arg-type]
    )


def _plan_or_none(inputs: PlanInputs) -> Plan | None:
    try:
        return plan(inputs)
    except PlanError:
        return None


def rank_table(role: Role, pps: Sequence[int]) -> None:
    base = plan(_inputs("pro", role, 1, "h200", 8, ISSUE)).ranks[0].capacity.full_tokens
    print(
        f"\nDSV4-Pro {role}: per-rank KV capacity, TP=8 on H200 "
        f"({gpu_type('h200').memory_bytes / GIB:.1f} GiB), SWA ratio 0.1, mem fraction 0.88, "
        "online HCA state"
    )
    print(
        f"{'PP':>3}  {'split':>12}  {'rank':>4}  {'layers':>7}  {'full tokens':>13}  "
        f"{'vs PP=1':>7}  {'max reqs':>8}  {'max context':>11}"
    )
    for pp in pps:
        p = plan(_inputs("pro", role, pp, "h200", 8, ISSUE))
        split = format_split(p.split.layers_per_rank)
        for r in p.ranks:
            mark = "*" if r.pp_rank == p.bottleneck_rank else " "
            c = r.capacity
            print(
                f"{pp:>3}  {split if r.pp_rank == 0 else '':>12}  {r.pp_rank:>3}{mark}  "
                f"{r.layers[0]:>3}-{r.layers[1] - 1:<3}  {c.full_tokens:>13,}  "
                f"{c.full_tokens / base:>6.2f}x  {c.max_running_requests:>8}  "
                f"{c.max_context_tokens:>11,}"
            )


def _cell(p: Plan | None) -> str:
    if p is None:
        return "does not fit"
    _ctx, running, full = p.bottleneck_key  # max context = min(model context, full)
    return f"{format_split(p.split.layers_per_rank)} {full / 1e6:.2f}M/{running}r"


def split_table(title: str, gpu: str, tp: int, kw: dict[str, object]) -> None:
    print(f"\n{title}: bottleneck full tokens (M) / running requests of the worst rank")
    print(
        f"{'model':>5}  {'role':>7}  {'PP':>2}  {'even':>30}  {'SGLang default':>30}  "
        f"{'balanced':>30}  {'vs even':>23}  {'vs SGLang':>23}"
    )
    for model in ("pro", "flash"):
        for role in ("decode", "prefill"):
            for pp in range(2, 9):
                inputs = _inputs(model, role, pp, gpu, tp, kw)
                balanced = _plan_or_none(inputs)
                if balanced is None:
                    print(f"{model:>5}  {role:>7}  {pp:>2}  no split fits")
                    continue
                n = inputs.model.num_hidden_layers
                even = _plan_or_none(dataclasses.replace(inputs, layer_split=balanced.split.even))
                sglang = _plan_or_none(dataclasses.replace(inputs, layer_split=sglang_split(n, pp)))
                gains = [
                    "(other fails)"
                    if other is None
                    else gain(balanced.bottleneck_key, other.bottleneck_key)
                    for other in (even, sglang)
                ]
                print(
                    f"{model:>5}  {role:>7}  {pp:>2}  {_cell(even):>30}  {_cell(sglang):>30}  "
                    f"{_cell(balanced):>30}  {gains[0]:>23}  {gains[1]:>23}"
                )


def plan_figures(pps: Sequence[int]) -> None:
    for role in ("decode", "prefill"):
        rank_table(role, pps)
    split_table("Issue settings (H200, TP=8, SWA 0.1, mem 0.88, online)", "h200", 8, ISSUE)
    split_table("Tight memory (H100, TP=4, MTP 2 draft tokens)", "h100-80gb", 4, TIGHT)


ENV = {
    **os.environ,
    "UCX_NET_DEVICES": "lo",
    "GLOO_SOCKET_IFNAME": "lo",
    "DSV4_PD_SECRET": "bench-pd-secret-" + "0" * 32,  # PD roles need one (older trees: ignored)
}
COMMON = http_bench.TINY


def _group(pp_size: int, device: str, procs: list[subprocess.Popen[bytes]]) -> int:
    """Start one colocated PP group (every stage at once: they meet before serving); the
    leader's port."""
    addr = f"127.0.0.1:{http_bench._free_port()}"
    ports = [http_bench._free_port() for _ in range(pp_size)]
    started = []
    for rank, port in enumerate(ports):
        argv = http_bench.serve_argv(*COMMON, "--device", device, "--port", str(port))
        if pp_size > 1:
            argv += ["--pp-size", str(pp_size), "--pp-rank", str(rank), "--pp-addr", addr]
        proc = subprocess.Popen(argv, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(proc)
        started.append(proc)
    for port, proc in zip(ports, started, strict=True):
        http_bench._wait_ready(port, proc)
    return ports[0]


def serving_figures(args: argparse.Namespace) -> None:
    """tiny over HTTP: PP=1 vs PP=2 groups side by side (medians over --rounds)."""
    if args.device == "cuda" and (n := torch.cuda.device_count()) < 2:
        # Every stage of a CUDA group needs its own device (NCCL); on one GPU the PP=2 group
        # starts, then fails every request.
        print(f"\ntiny over HTTP, device=cuda: PP=2 needs 2 CUDA devices, this machine has {n}")
        return
    procs: list[subprocess.Popen[bytes]] = []
    try:
        leaders = {pp: _group(pp, args.device, procs) for pp in (1, 2)}
        for port in leaders.values():
            http_bench._round(port, 1, 1, 4)  # warm-up
        print(
            f"\ntiny over HTTP, device={args.device}, {args.max_tokens} tokens/request, "
            f"{os.cpu_count()} CPUs; medians of {args.rounds} rounds"
        )
        print(f"{'clients':>8}  {'PP':>3}  {'tokens/s':>9}  {'TTFT ms':>8}  {'vs PP=1':>8}")
        for clients in args.clients:
            figures = http_bench.interleaved(
                leaders, clients, args.requests, args.max_tokens, args.rounds
            )
            base = figures[1][0]
            for pp, (tps, ttft) in figures.items():
                print(f"{clients:>8}  {pp:>3}  {tps:>9.1f}  {ttft:>8.1f}  {tps / base:>7.2f}x")
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--pp", type=int, nargs="*", default=[1, 2, 4], help="PP sizes per rank")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=2, help="requests per client per round")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--clients", type=int, nargs="*", default=[1, 32])
    parser.add_argument("--skip-serving", action="store_true", help="only the planner figures")
    args = parser.parse_args()
    plan_figures(args.pp)
    if not args.skip_serving:
        serving_figures(args)


if __name__ == "__main__":
    main()
