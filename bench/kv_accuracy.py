"""The release's fp8 KV rows against transformers (#38 item 4): teacher-forced top-1 agreement
and |logprob difference| of our paged engine (pools in the release's fp8 format, the default
compute dtype) with transformers 5.24's DeepseekV4ForCausalLM (float64, float KV) on the same
dequantized weights; beside it, the same engine with float32 KV rows (what fp8 costs, apart
from everything else). Prints a table; not a test (test_fp8_kv_accuracy.py asserts the
threshold on a smaller sample).

    .venv/bin/python bench/kv_accuracy.py [--positions N] [--cases a,b,...] [--raw] [--json]

Configs (worker/tests/model/kv_accuracy_support.py): Flash- and Pro-shaped layers (the real
448 + 64 KV head and 128-wide indexer keys, window 128, their first four layers' c4/c128
order, small hidden size), `tiny` and a 64 + 64-head mix with random weights (GPT-2's scaled
init of the residual branches' output projections, lm_head gain 4), and the shipped tiny
model trained on English, on English text. `--raw` draws the random configs' branch outputs
without the GPT-2 scaling (hf_support's plain draw) to show how much more sensitive that is.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from benchjson import Figure, emit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "worker" / "tests" / "engine"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "worker" / "tests" / "model"))
from kv_accuracy_support import CASES, DEFAULT_DTYPE, Figures, float32_kv, measure


def _row(f: Figures, f32: Figures) -> str:
    return (
        f"| {f.name} | {f.positions} | {f.agreement:.2%} | {f.mean_abs_dlogprob:.4f} | "
        f"{f.max_abs_dlogprob:.3f} | {f.median_margin:.2f} | {f32.agreement:.2%} | "
        f"{f32.max_abs_dlogprob:.1e} |"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--positions", type=int, default=500, help="per config")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated")
    parser.add_argument("--raw", action="store_true", help="random branches without GPT-2 scale")
    parser.add_argument("--json", action="store_true", help="add a @bench-json line")
    parser.add_argument(
        "--dtype",
        default=str(DEFAULT_DTYPE).removeprefix("torch."),
        choices=("bfloat16", "float32", "float64"),
        help="our compute dtype (default: a CPU worker's)",
    )
    args = parser.parse_args(argv)
    names = args.cases.split(",")
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        parser.error(f"--cases: unknown {unknown}; choose from {sorted(CASES)}")
    torch.set_grad_enabled(False)
    scale = 1.0 if args.raw else None
    dtype = getattr(torch, args.dtype)
    print(f"compute dtype {args.dtype}, torch threads {torch.get_num_threads()}")
    print(
        "| config | positions | top-1 agreement (fp8) | mean abs dlogprob | max abs dlogprob "
        "| median top-2 margin | agreement (fp32 rows) | max abs dlogprob (fp32 rows) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    rows: list[tuple[Figures, Figures]] = []
    start = time.perf_counter()
    for name in names:
        case = CASES[name]
        fp8 = measure(case, args.positions, branch_scale=scale, dtype=dtype)
        f32 = measure(case, args.positions, kv=float32_kv, branch_scale=scale, dtype=dtype)
        rows.append((fp8, f32))
        print(_row(fp8, f32), flush=True)
    positions = sum(f.positions for f, _ in rows)
    agree = sum(f.agree for f, _ in rows)
    mean = sum(f.mean_abs_dlogprob * (f.positions - 1) for f, _ in rows) / (positions - len(rows))
    worst = max(f.max_abs_dlogprob for f, _ in rows)
    print(
        f"all: {agree}/{positions} = {agree / positions:.2%} top-1 agreement, "
        f"|dlogprob| mean {mean:.4f} max {worst:.3f} ({time.perf_counter() - start:.0f} s)"
    )
    if args.json:
        emit(
            "kv_accuracy",
            [
                Figure("fp8 top-1 agreement", agree / positions, "fraction", "higher"),
                Figure("fp8 mean abs dlogprob", mean, "nats", "lower"),
                Figure("fp8 max abs dlogprob", worst, "nats", "lower"),
            ],
        )


if __name__ == "__main__":
    main()
