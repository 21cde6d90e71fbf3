"""The layer split of a PP group: the even split, SGLang's, and the capacity-balanced search.

Pure and generic: a split is the number of target layers per PP rank (contiguous, in rank
order), judged by the caller's `key_of(split)`: the plan's bottleneck, larger is better, None
when the split cannot be planned. `balanced_split`:
  1. a DP over prefixes (`max_min_split`) per segment value the caller gives: the split whose
     worst rank is best. Exact for that value; pruned because a rank's value never rises as
     its segment grows (more layers: more KV bytes per page, more weights).
  2. steepest-ascent hill climbing on `key_of` (`climb`) from every DP optimum, the even split
     and SGLang's split: move one boundary by one layer while the bottleneck improves.
  3. the best local optimum; ties keep the earlier start, the even split first.
So by construction the result is never worse than the even split or SGLang's (when they can be
planned), strictly better than the even split when one boundary move improves it, and no
single boundary move improves the result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

Split = tuple[int, ...]  # target layers per PP rank
# (max context tokens, max running requests, full tokens) of the worst rank: `Plan.bottleneck_key`.
BottleneckKey = tuple[int, int, int]
KeyOf = Callable[[Split], BottleneckKey | None]
# (rank, start, end) -> the value of that rank holding target layers [start, end); None: it
# cannot. Must not rise as the segment grows.
SegmentValue = Callable[[int, int, int], tuple[int, ...] | None]
SplitMode = Literal["balanced", "fixed"]
# The DP costs O(n^2) segment values for n layers (~0.8 s at 512); past this, only the climb
# from the even and SGLang splits runs (real models have well under 200 layers).
MAX_DP_LAYERS = 512


@dataclass(frozen=True, slots=True)
class SplitChoice:
    """The split a plan uses and what it is compared against."""

    layers_per_rank: Split
    mode: SplitMode  # balanced: searched (the default); fixed: given (`layer_split`)
    even: Split
    even_key: BottleneckKey | None  # the even split's bottleneck; None: it cannot be planned


def even_split(num_layers: int, pp_size: int) -> Split:
    """Contiguous and even; the first `num_layers % pp_size` ranks get one more."""
    base, extra = divmod(num_layers, pp_size)
    return tuple(base + (1 if i < extra else 0) for i in range(pp_size))


def sglang_split(num_layers: int, pp_size: int) -> Split:
    """SGLang's default (`get_pp_indices`): even, the last `num_layers % pp_size` ranks get one
    more."""
    return even_split(num_layers, pp_size)[::-1]


def format_split(split: Split) -> str:
    return "/".join(str(n) for n in split)


def boundary_moves(split: Split) -> list[Split]:
    """Every split one boundary away (one layer moved between neighbours), each rank >= 1."""
    moves = []
    for b in range(len(split) - 1):
        for delta in (-1, 1):  # -1: rank b gives its last layer to b + 1; +1: takes b + 1's first
            left, right = split[b] + delta, split[b + 1] - delta
            if left >= 1 and right >= 1:
                moves.append((*split[:b], left, right, *split[b + 2 :]))
    return moves


def climb(start: Split, key_of: KeyOf) -> tuple[Split, BottleneckKey] | None:
    """Steepest ascent over boundary moves to a local optimum; None when `start` cannot be
    planned. Terminates: the key strictly rises at every step."""
    key = key_of(start)
    if key is None:
        return None
    split = start
    while True:
        best: tuple[Split, BottleneckKey] | None = None
        for move in boundary_moves(split):
            k = key_of(move)
            if k is not None and k > key and (best is None or k > best[1]):
                best = (move, k)
        if best is None:
            return split, key
        split, key = best


def max_min_split(num_layers: int, pp_size: int, value: SegmentValue) -> Split | None:
    """The contiguous split (each rank >= 1 layer) maximizing its smallest rank value; None
    when no split gives every rank a value. `value` must not grow as a segment grows (a layer
    costs memory): the scan of rank k's starts stops at the first value that cannot improve."""
    n, pp = num_layers, pp_size
    # best[k][j]: (smallest value of ranks 0..k, start of rank k) when they hold layers [0, j).
    best: list[list[tuple[tuple[int, ...], int] | None]] = [[None] * (n + 1) for _ in range(pp)]
    for j in range(1, n - pp + 2):
        v = value(0, 0, j)
        best[0][j] = None if v is None else (v, 0)
    for k in range(1, pp):
        ends = [n] if k == pp - 1 else range(k + 1, n - pp + k + 2)  # later ranks keep >= 1
        for j in ends:
            here: tuple[tuple[int, ...], int] | None = None
            for i in range(j - 1, k - 1, -1):  # rank k holds [i, j), growing as i drops
                v = value(k, i, j)
                if v is None or (here is not None and v <= here[0]):
                    break  # a larger segment is worth no more
                prev = best[k - 1][i]
                if prev is not None:
                    m = min(prev[0], v)
                    if here is None or m > here[0]:
                        here = (m, i)
            best[k][j] = here
    split: list[int] = []
    end = n
    for k in range(pp - 1, -1, -1):
        cell = best[k][end]
        if cell is None:
            return None
        split.append(end - cell[1])
        end = cell[1]
    return tuple(reversed(split))


def balanced_split(
    num_layers: int, pp_size: int, key_of: KeyOf, values: Sequence[SegmentValue]
) -> tuple[Split, BottleneckKey] | None:
    """The best local optimum climbed from the even split, SGLang's and each DP optimum of
    `values` (up to MAX_DP_LAYERS layers); None when no start can be planned."""
    starts = [even_split(num_layers, pp_size), sglang_split(num_layers, pp_size)]
    for value in values if num_layers <= MAX_DP_LAYERS else ():
        found = max_min_split(num_layers, pp_size, value)
        if found is not None:
            starts.append(found)
    best: tuple[Split, BottleneckKey] | None = None
    for start in dict.fromkeys(starts):  # distinct, in order
        climbed = climb(start, key_of)
        if climbed is not None and (best is None or climbed[1] > best[1]):
            best = climbed
    return best
