"""The routed experts of one MoE layer under the device's dispatches, side by side (prints a
table; not a test): `every_expert` (every expert over every token: E / k times the expert
FLOPs, every expert dequantized each call) against `on_device` (`by_slot` while tokens x k <=
E, `grouped` beyond), and the host's `by_expert` for scale. Experts are held as the release
stores them (packed FP4 with E8M0 scales, `--experts-format fp8` for FP8 blocks), drawn at
random; Flash's shapes by default (hidden 4096, 256 experts of 2048, 6 per token), which on a
CPU want `--experts 32` or fewer.

    .venv/bin/python bench/moe.py [--device cpu|cuda] [--tokens 1 16 64 256] [--experts 256]
        [--hidden 4096] [--inter 2048] [--k 6] [--dtype auto] [--rounds 5] [--json]

Per token count: the median time (ms) of each dispatch over `--rounds` interleaved rounds after
a warm-up (device synchronized around each call), the ratio every_expert / on_device, and the
largest |difference| from by_expert. On a CPU the device's dispatches run as CUDA runs them
(DSV4_EMULATE_DEVICE semantics: nothing read back); by_expert reads the choice on the host.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchjson import Figure, emit
from flash_layers import device_and_sync

from dsv4_common.core.model import DSV4Config, Quantization
from dsv4_common.core.presets import deepseek_v4_flash
from dsv4_worker.model.moe import by_expert, every_expert, on_device, route
from dsv4_worker.model.params import Params
from dsv4_worker.model.random_stored import random_weights

Dispatch = Callable[
    [DSV4Config, Params, int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]
LAYER = 3  # a top-k layer (Flash routes its first three by hash)


def model_of(args: argparse.Namespace) -> DSV4Config:
    """Flash with 4 layers and the experts, hidden and expert sizes asked for."""
    flash = deepseek_v4_flash()
    weights = dataclasses.replace(
        flash.weights,
        hidden_size=args.hidden,
        num_routed_experts=args.experts,
        moe_intermediate_size=args.inter,
        num_experts_per_token=args.k,
    )
    quant = Quantization(expert_dtype=args.experts_format)
    return dataclasses.replace(
        flash,
        weights=weights,
        num_hidden_layers=LAYER + 1,
        compress_ratios=flash.compress_ratios[: LAYER + 1] + flash.compress_ratios[-1:],
        quantization=quant,
    )


def timed(
    fn: Dispatch,
    args: tuple[DSV4Config, Params, int, torch.Tensor, torch.Tensor, torch.Tensor],
    sync: Callable[[], None],
) -> tuple[float, torch.Tensor]:
    """(ms, result) of fn(*args), the device synchronized before and after."""
    sync()
    t0 = time.perf_counter()
    out = fn(*args)
    sync()
    return (time.perf_counter() - t0) * 1e3, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--dtype", default="auto", help="compute dtype (auto: bf16 on cuda)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--k", type=int, default=6)
    ap.add_argument("--experts-format", default="fp4", choices=("fp4", "fp8"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    dtype, sync = device_and_sync(args.device, args.dtype)
    model = model_of(args)
    prefix = f"layers.{LAYER}.ffn"
    names = {f"{prefix}.gate.weight", f"{prefix}.gate.bias"}
    names |= {
        f"{prefix}.experts.{e}.{w}.weight" for e in range(args.experts) for w in ("w1", "w3", "w2")
    }
    p = Params(random_weights(model, 0, names, args.device), dtype)
    print(
        f"{args.experts} experts of [{args.inter}, {args.hidden}] ({args.experts_format}, "
        f"{p.nbytes / (1 << 20):.0f} MiB held), {args.k} per token, compute {dtype}, "
        f"device {args.device}, {torch.get_num_threads()} torch threads, {args.rounds} rounds"
    )
    dispatches: dict[str, Dispatch] = {"every_expert": every_expert, "on_device": on_device}
    if args.device == "cpu":
        dispatches["by_expert"] = by_expert
    gen = torch.Generator().manual_seed(0)
    header = " ".join(f"{n + ' ms':>16}" for n in dispatches)
    print(f"{'tokens':>6} {header}  ratio  max|diff|")
    figures: list[Figure] = []
    for tokens in args.tokens:
        x = torch.randn(tokens, args.hidden, generator=gen).to(args.device, dtype)
        ids = torch.zeros(tokens, dtype=torch.long, device=args.device)
        chosen, weights = route(model, p, LAYER, x, ids)
        times: dict[str, list[float]] = {n: [] for n in dispatches}
        outs: dict[str, torch.Tensor] = {}
        for rnd in range(args.rounds + 1):  # round 0 warms up (and stacks the experts)
            for name, fn in dispatches.items():
                ms, outs[name] = timed(fn, (model, p, LAYER, x, chosen, weights), sync)
                if rnd:
                    times[name].append(ms)
        med = {n: statistics.median(t) for n, t in times.items()}
        ref = outs.get("by_expert", outs["every_expert"]).float()
        diff = max(float((o.float() - ref).abs().max()) for o in outs.values())
        ratio = med["every_expert"] / med["on_device"]
        cells = " ".join(f"{med[n]:>16.2f}" for n in dispatches)
        print(f"{tokens:>6} {cells} {ratio:>6.1f}x  {diff:.2e}")
        for n, v in med.items():
            figures.append(Figure(f"{n} ms, {tokens} tokens", v, "ms", "lower"))
    if args.json:
        emit("moe", figures)


if __name__ == "__main__":
    main()
