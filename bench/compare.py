"""A regression guard: one bench, two trees, interleaved rounds, HEAD/BASE ratios.

    .venv/bin/python bench/compare.py BASE [HEAD] --bench alloc [--rounds 3] [-- BENCH ARGS]

BASE and HEAD are git revisions; HEAD defaults to `worktree`, the checkout as it is (uncommitted
changes included). Each revision is checked out with `git worktree add --detach` into a
temporary directory, removed afterwards even when a bench fails. Every run uses this checkout's
bench script (bench/NAME.py, so both sides are measured the same way) and the same Python, with
PYTHONPATH pointing at the tree's package directories (pyproject.toml's
`[tool.setuptools.packages.find] where`), which come before the editable install. Rounds
alternate the order (BASE first, then HEAD first, ...) so both share the machine's noise.

The bench must print a `@bench-json` line (`bench/benchjson.py`); `--json` is passed to it.
Printed per figure: the median over rounds of each side and the median of the per-round
HEAD/BASE ratios, with "better" or "worse" when the ratio moved past --threshold.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from benchjson import Figure, parse

WORKTREE = "worktree"  # the HEAD revision that means "this checkout, as it is"
BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_PACKAGE_DIRS = ("common", "worker", "operator", "router", "local")


class CompareError(RuntimeError):
    """A revision, a tree or a bench run that cannot be compared; the message says which."""


@dataclass(frozen=True, slots=True)
class Row:
    name: str
    unit: str
    base: float  # median over rounds
    head: float
    ratio: float  # median of the per-round HEAD/BASE ratios
    verdict: str  # "better", "worse" or ""


def package_dirs(tree: Path) -> list[Path]:
    """The directories that hold a tree's import packages (pyproject's packages.find where)."""
    try:
        project = tomllib.loads((tree / "pyproject.toml").read_text())
        where = project["tool"]["setuptools"]["packages"]["find"]["where"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        where = list(DEFAULT_PACKAGE_DIRS)
    return [tree / w for w in where if (tree / w).is_dir()]


def bench_env(tree: Path, base_env: Mapping[str, str]) -> dict[str, str]:
    """`base_env` with PYTHONPATH leading with `tree`'s package directories."""
    env = dict(base_env)
    paths = [str(p) for p in package_dirs(tree)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def round_order(labels: Sequence[str], round_index: int) -> list[str]:
    """BASE then HEAD on even rounds, HEAD then BASE on odd ones."""
    return list(labels) if round_index % 2 == 0 else list(reversed(labels))


def ratio_rows(
    runs: Mapping[str, Sequence[Mapping[str, Figure]]], threshold: float = 0.05
) -> list[Row]:
    """The table of figures both sides reported in every round, in BASE's order. `runs` maps
    "base" and "head" to one parsed @bench-json per round (same number of rounds each)."""
    base_runs, head_runs = runs["base"], runs["head"]
    if len(base_runs) != len(head_runs) or not base_runs:
        raise CompareError("both sides need the same, non-zero number of rounds")
    names = [n for n in base_runs[0] if all(n in r for r in (*base_runs, *head_runs))]
    rows = []
    for name in names:
        base = [r[name].value for r in base_runs]
        head = [r[name].value for r in head_runs]
        ratios = [h / b if b else float("inf") for b, h in zip(base, head, strict=True)]
        ratio = statistics.median(ratios)
        better = base_runs[0][name].better
        improved = ratio < 1 - threshold if better == "lower" else ratio > 1 + threshold
        regressed = ratio > 1 + threshold if better == "lower" else ratio < 1 - threshold
        verdict = "better" if improved else "worse" if regressed else ""
        rows.append(
            Row(
                name,
                base_runs[0][name].unit,
                statistics.median(base),
                statistics.median(head),
                ratio,
                verdict,
            )
        )
    return rows


def format_table(rows: Sequence[Row], base_label: str, head_label: str) -> str:
    width = max([len("figure"), *(len(r.name) for r in rows)])
    lines = [
        f"{'figure':<{width}}  {'unit':>5}  {'BASE ' + base_label[:7]:>12}  "
        f"{'HEAD ' + head_label[:7]:>12}  {'HEAD/BASE':>9}"
    ]
    for r in rows:
        lines.append(
            f"{r.name:<{width}}  {r.unit:>5}  {r.base:>12.4g}  {r.head:>12.4g}  "
            f"{r.ratio:>8.3f}x  {r.verdict}".rstrip()
        )
    return "\n".join(lines)


def _git(repo: Path, *args: str) -> str:
    proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise CompareError(f"git {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout.strip()


@contextmanager
def checked_out(repo: Path, revision: str) -> Iterator[Path]:
    """The tree of `revision`: `repo` itself for WORKTREE, else a temporary detached worktree
    that is removed on the way out (also on errors)."""
    if revision == WORKTREE:
        yield repo
        return
    commit = _git(repo, "rev-parse", "--verify", f"{revision}^{{commit}}")
    parent = Path(tempfile.mkdtemp(prefix="dsv4-compare-"))
    path = parent / commit[:12]
    try:
        _git(repo, "worktree", "add", "--detach", str(path), commit)
        yield path
    finally:
        subprocess.run(
            ["git", "-C", str(repo), "worktree", "remove", "--force", str(path)],
            capture_output=True,
        )
        shutil.rmtree(parent, ignore_errors=True)
        # After the rmtree: also forgets a worktree whose `add` was cut short (remove fails).
        subprocess.run(["git", "-C", str(repo), "worktree", "prune"], capture_output=True)


def run_bench(script: Path, tree: Path, args: Sequence[str], timeout_s: float) -> dict[str, Figure]:
    env = bench_env(tree, os.environ)
    cmd = [sys.executable, str(script), "--json", *args]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise CompareError(f"{script.name} on {tree} ran past {timeout_s:.0f} s") from exc
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise CompareError(f"{script.name} on {tree} exited {proc.returncode}: " + " | ".join(tail))
    return parse(proc.stdout)


def bench_script(name: str) -> Path:
    """bench/NAME.py of this checkout, or a path to a script."""
    path = Path(name)
    if path.suffix == ".py" and path.is_file():
        return path.resolve()
    script = BENCH_DIR / f"{name}.py"
    if not script.is_file():
        raise CompareError(f"--bench {name}: no {script}")
    return script


def compare(
    repo: Path,
    base: str,
    head: str,
    script: Path,
    bench_args: Sequence[str],
    rounds: int,
    timeout_s: float,
    threshold: float,
    side_args: Mapping[str, Sequence[str]] | None = None,
) -> list[Row]:
    """`side_args`: extra bench arguments of "base" or "head" only (e.g. the same revision
    twice, one side with a setting changed)."""
    runs: dict[str, list[dict[str, Figure]]] = {"base": [], "head": []}
    extra = side_args or {}
    with checked_out(repo, base) as base_tree, checked_out(repo, head) as head_tree:
        trees = {"base": base_tree, "head": head_tree}
        for i in range(rounds):
            for side in round_order(["base", "head"], i):
                side_argv = [*bench_args, *extra.get(side, ())]
                runs[side].append(run_bench(script, trees[side], side_argv, timeout_s))
                print(f"round {i + 1}/{rounds}: {side} done", file=sys.stderr, flush=True)
    return ratio_rows(runs, threshold)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", help="git revision of the baseline")
    parser.add_argument(
        "head", nargs="?", default=WORKTREE, help=f"git revision, or {WORKTREE} (default)"
    )
    parser.add_argument("--bench", required=True, help="bench/NAME.py (alloc, serve, engine)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repo", type=Path, default=BENCH_DIR.parent, help="the git checkout")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per bench run")
    parser.add_argument(
        "--threshold", type=float, default=0.05, help="ratio change that counts (0.05: 5%%)"
    )
    parser.add_argument(
        "--base-arg", action="append", default=[], help="a bench argument for BASE only"
    )
    parser.add_argument(
        "--head-arg", action="append", default=[], help="a bench argument for HEAD only"
    )
    args, bench_args = parser.parse_known_args(argv)
    # SIGTERM (a timeout, a kill) unwinds like an exception, so the worktrees are removed.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    bench_args = [a for a in bench_args if a != "--"]
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    try:
        script = bench_script(args.bench)
        rows = compare(
            args.repo.resolve(),
            args.base,
            args.head,
            script,
            bench_args,
            args.rounds,
            args.timeout_s,
            args.threshold,
            side_args={"base": args.base_arg, "head": args.head_arg},
        )
    except CompareError as exc:
        print(f"compare: error: {exc}", file=sys.stderr)
        return 2
    print(f"{script.name}: HEAD={args.head} vs BASE={args.base}, {args.rounds} interleaved rounds")
    print(format_table(rows, args.base, args.head))
    return 0


if __name__ == "__main__":
    sys.exit(main())
