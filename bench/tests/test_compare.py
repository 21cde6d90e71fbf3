"""bench/compare.py: parsing the benches' figures, the ratio table, the interleaved order, the
package paths a tree runs with, and a real comparison of two commits (temporary worktrees,
removed afterwards, also when the bench fails)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from benchjson import PREFIX, BenchParseError, Figure, parse
from compare import (
    WORKTREE,
    CompareError,
    bench_env,
    compare,
    format_table,
    package_dirs,
    ratio_rows,
    round_order,
)
from hypothesis import given
from hypothesis import strategies as st


def _line(*figures: Figure) -> str:
    import json

    return PREFIX + json.dumps({"bench": "x", "figures": [f._asdict() for f in figures]})


def test_parse_takes_the_last_json_line_among_other_output() -> None:
    old = _line(Figure("t", 1.0, "us", "lower"))
    new = _line(Figure("t", 2.0, "us", "lower"), Figure("tps", 9.5, "tok/s", "higher"))
    figures = parse(f"table...\n{old}\nmore text\n{new}\n")
    assert figures["t"].value == 2.0
    assert figures["tps"] == Figure("tps", 9.5, "tok/s", "higher")


@pytest.mark.parametrize(
    "text",
    ["no line at all", PREFIX + "{not json", PREFIX + '{"figures": [{"name": "a"}]}'],
)
def test_parse_refuses_output_without_a_well_formed_line(text: str) -> None:
    with pytest.raises(BenchParseError):
        parse(text)


def _runs(values: list[tuple[float, float]], better: str = "lower") -> dict[str, list[dict]]:
    unit = "us"
    return {
        side: [{"f": Figure("f", pair[i], unit, better)} for pair in values]  # type: ignore[arg-type]
        for i, side in enumerate(("base", "head"))
    }


@given(st.lists(st.tuples(st.floats(0.1, 1e6), st.floats(0.1, 1e6)), min_size=1, max_size=7))
def test_the_ratio_is_the_median_of_per_round_ratios(values: list[tuple[float, float]]) -> None:
    (row,) = ratio_rows(_runs(values))
    ratios = sorted(h / b for b, h in values)
    n = len(ratios)
    want = ratios[n // 2] if n % 2 else (ratios[n // 2 - 1] + ratios[n // 2]) / 2
    assert row.ratio == pytest.approx(want)
    assert min(b for b, _ in values) <= row.base <= max(b for b, _ in values)


@pytest.mark.parametrize(
    ("better", "head", "verdict"),
    [
        ("lower", 5.0, "better"),
        ("lower", 20.0, "worse"),
        ("higher", 20.0, "better"),
        ("higher", 5.0, "worse"),
        ("lower", 10.2, ""),
    ],
)
def test_the_verdict_follows_which_way_is_better(better: str, head: float, verdict: str) -> None:
    (row,) = ratio_rows(_runs([(10.0, head)], better), threshold=0.05)
    assert row.verdict == verdict
    assert "HEAD/BASE" in format_table([row], "base", "head")


def test_figures_missing_on_one_side_are_left_out() -> None:
    base = [{"a": Figure("a", 1, "us", "lower"), "b": Figure("b", 1, "us", "lower")}]
    head = [{"a": Figure("a", 2, "us", "lower")}]
    assert [r.name for r in ratio_rows({"base": base, "head": head})] == ["a"]
    with pytest.raises(CompareError):
        ratio_rows({"base": base, "head": []})


def test_rounds_alternate_which_side_goes_first() -> None:
    assert [round_order(["base", "head"], i)[0] for i in range(4)] == [
        "base",
        "head",
        "base",
        "head",
    ]


def test_a_tree_runs_with_its_own_package_dirs_first(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools.packages.find]\nwhere = ["pkg", "absent"]\n'
    )
    (tmp_path / "pkg").mkdir()
    assert package_dirs(tmp_path) == [tmp_path / "pkg"]
    env = bench_env(tmp_path, {"PYTHONPATH": "/elsewhere", "HOME": "/h"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path / "pkg"), "/elsewhere"]
    assert env["HOME"] == "/h"


# -- a real comparison of two commits ----------------------------------------------------------

BENCH = f"""
import json, value_pkg
print("table")
print({PREFIX!r} + json.dumps({{"bench": "fake", "figures": [
    {{"name": "t", "value": value_pkg.VALUE, "unit": "us", "better": "lower"}}]}}))
"""


def _git(repo: Path, *args: str) -> str:
    cmd = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


def _repo(tmp_path: Path) -> tuple[Path, str, str]:
    repo = tmp_path / "repo"
    (repo / "pkg" / "value_pkg").mkdir(parents=True)
    (repo / "pyproject.toml").write_text('[tool.setuptools.packages.find]\nwhere = ["pkg"]\n')
    _git(repo.parent, "init", "-q", str(repo))
    init = repo / "pkg" / "value_pkg" / "__init__.py"
    shas = []
    for value in (10, 20):
        init.write_text(f"VALUE = {value}\n")
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "-m", f"value {value}")
        shas.append(_git(repo, "rev-parse", "HEAD"))
    return repo, shas[0], shas[1]


def _worktrees(repo: Path) -> int:
    return _git(repo, "worktree", "list").count("\n") + 1


def test_two_commits_are_compared_in_worktrees_that_are_removed(tmp_path: Path) -> None:
    repo, first, second = _repo(tmp_path)
    script = tmp_path / "fake_bench.py"
    script.write_text(BENCH)
    (row,) = compare(repo, first, second, script, [], rounds=2, timeout_s=60, threshold=0.05)
    assert (row.base, row.head, row.ratio, row.verdict) == (10, 20, 2.0, "worse")
    (repo / "pkg" / "value_pkg" / "__init__.py").write_text("VALUE = 5\n")  # uncommitted
    (row,) = compare(repo, second, WORKTREE, script, [], rounds=1, timeout_s=60, threshold=0.05)
    assert (row.head, row.verdict) == (5, "better")
    assert _worktrees(repo) == 1


def test_a_failing_bench_still_removes_the_worktrees(tmp_path: Path) -> None:
    repo, first, second = _repo(tmp_path)
    script = tmp_path / "broken_bench.py"
    script.write_text("import sys; sys.exit(3)\n")
    with pytest.raises(CompareError, match="exited 3"):
        compare(repo, first, second, script, [], rounds=1, timeout_s=60, threshold=0.05)
    assert _worktrees(repo) == 1
    with pytest.raises(CompareError, match="no-such-rev"):
        compare(repo, "no-such-rev", second, script, [], 1, 60, 0.05)
    assert _worktrees(repo) == 1
    assert sys.executable  # the benches run with this interpreter


def test_a_terminated_comparison_removes_its_worktrees(tmp_path: Path) -> None:
    repo, first, second = _repo(tmp_path)
    script = tmp_path / "slow_bench.py"
    started = tmp_path / "started"
    script.write_text(
        f"import pathlib, time\npathlib.Path({str(started)!r}).touch()\ntime.sleep(60)\n"
    )
    compare_py = Path(__file__).resolve().parents[1] / "compare.py"
    cmd = [sys.executable, str(compare_py), first, second, "--bench", str(script)]
    proc = subprocess.Popen([*cmd, "--repo", str(repo)], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not started.exists():  # both sides are checked out and a bench runs
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        proc.terminate()
        assert proc.wait(timeout=30) != 0
    finally:
        proc.kill()
        proc.wait()
    assert _worktrees(repo) == 1
