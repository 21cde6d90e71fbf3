"""One-row products in the two memory layouts of a weight, and split over torch's threads
(prints a table; not a test).

    .venv/bin/python bench/layout.py [--config tiny|medium|PATH] [--threads N] [--rows 1 16]
                                     [--rounds R] [--json]

`Params.linear` holds a float weight W [out, in] column-major (W.T contiguous) on a CPU when
out > in, row-major otherwise, and multiplies a few rows by it through `cpu_linear` (W's rows
cut into one block per thread, one batched product, when `cpu_linear.parts` says so). This
prints, for every distinct linear shape of the model, microseconds per `F.linear(x, W)` with x
[rows, in] in each layout, and per `cpu_linear.linear` in the layout Params holds ("split";
the plain product where it does not split), medians over `--rounds` rounds, each cycling over
enough copies of the matrix to keep it out of the caches, as a decode step meets its weights.
row/col above 1: column-major is faster ("held": the layout Params picks); held/split above 1:
the split is faster than F.linear in the held layout. `--threads` 0 is torch's default (every
CPU); the split needs two or more.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchjson import Figure, emit
from hf import model_of  # tiny, medium or a config path, as bench/hf.py reads --config

from dsv4_common.core.model import DSV4Config
from dsv4_worker.model import cpu_linear
from dsv4_worker.model.params import Params
from dsv4_worker.model.weights import init_weights

CACHE_BYTES = 96 << 20  # more than the L3 of the machines we run on: every call reads DRAM


def _linear_shapes(model: DSV4Config) -> list[tuple[int, int]]:
    """The distinct [out, in] shapes of the 2-D float weights a forward reads with `linear`
    (everything 2-D but the embedding and the grouped output projection)."""
    values = init_weights(model, seed=0, dtype=torch.float32)
    shapes = {
        (int(t.shape[0]), int(t.shape[1]))
        for name, t in values.items()
        if t.dim() == 2 and t.is_floating_point() and "embed" not in name and "wo_a" not in name
    }
    return sorted(shapes, key=lambda s: -s[0] * s[1])


def _time_us(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e6


def _round(
    out: int, inp: int, rows: int, repeats: int, held_col_major: bool
) -> tuple[float, float, float]:
    """Microseconds per F.linear row-major, F.linear column-major, cpu_linear held."""
    copies = max(2, CACHE_BYTES // (out * inp * 4))
    row_major = [torch.randn(out, inp) for _ in range(copies)]
    col_major = [w.t().contiguous().t() for w in row_major]
    held = col_major if held_col_major else row_major
    caches: list[dict[str, torch.Tensor]] = [{} for _ in range(copies)]  # as Params keeps
    x = torch.randn(rows, inp)
    turn = [0]

    def call(ws: list[torch.Tensor], split: bool) -> Callable[[], object]:
        def run() -> object:
            turn[0] = (turn[0] + 1) % copies
            if split:
                return cpu_linear.linear(x, ws[turn[0]], caches[turn[0]], "w")
            return F.linear(x, ws[turn[0]])

        return run

    return (
        _time_us(call(row_major, False), repeats),
        _time_us(call(col_major, False), repeats),
        _time_us(call(held, True), repeats),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="medium", help="tiny, medium, or a config path")
    parser.add_argument("--threads", type=int, default=0, help="0: torch's default")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--json", action="store_true", help="also print a @bench-json line")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = model_of(args.config)
    print(f"model {model.name}, torch threads {torch.get_num_threads()}, {args.rounds} rounds")
    print(
        f"{'[out, in]':>14} {'rows':>5} {'row-major us':>13} {'col-major us':>13} "
        f"{'row/col':>8} {'held':>10} {'split us':>9} {'held/split':>11}"
    )
    figures: list[Figure] = []
    for out, inp in _linear_shapes(model):
        probe = Params({"w": torch.zeros(out, inp)}, torch.float32)
        probe.linear(torch.zeros(1, inp), "w")
        col = not probe.held("w").is_contiguous()
        held = "col-major" if col else "row-major"
        for rows in args.rows:
            runs = [_round(out, inp, rows, args.repeats, col) for _ in range(args.rounds)]
            a, b, c = (statistics.median(r[i] for r in runs) for i in range(3))
            plain = b if col else a
            print(
                f"{[out, inp]!s:>14} {rows:5d} {a:13.1f} {b:13.1f} {a / b:8.2f} {held:>10} "
                f"{c:9.1f} {plain / c:11.2f}"
            )
            figures.append(Figure(f"linear {out}x{inp} rows {rows} row/col", a / b, "x", "higher"))
            figures.append(
                Figure(f"linear {out}x{inp} rows {rows} held/split", plain / c, "x", "higher")
            )
    if args.json:
        emit("layout", figures)


if __name__ == "__main__":
    main()
