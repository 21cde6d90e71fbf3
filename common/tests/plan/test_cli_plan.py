"""`dsv4 plan`: JSON shape, human table, errors that name the setting (exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dsv4_cli.main import main

PRO_H200 = ["--model", "deepseek-v4-pro", "--tp", "8", "--gpu", "h200"]


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        rc = main(args)
    except SystemExit as exc:  # argparse errors
        rc = int(exc.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("role", ["prefill", "decode", "colocated"])
def test_json_has_the_documented_keys(role: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_cli(["plan", *PRO_H200, "--role", role, "--pp", "4", "--json"], capsys)
    assert rc == 0
    doc = json.loads(out)
    assert [r["pp_rank"] for r in doc["ranks"]] == [0, 1, 2, 3]
    for r in doc["ranks"]:
        for key in (
            "layers",
            "bytes_per_full_token",
            "bytes_per_swa_token",
            "full_tokens",
            "swa_tokens",
            "max_running_requests",
            "max_context_tokens",
        ):
            assert key in r
        assert r["full_tokens"] % 256 == 0
    assert [r["layers"] for r in doc["ranks"]] == [[0, 16], [16, 31], [31, 46], [46, 61]]
    assert 0 <= doc["bottleneck_rank"] < 4
    assert doc["max_context_tokens"] == min(r["max_context_tokens"] for r in doc["ranks"])


def test_table_marks_the_bottleneck(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_cli(
        [
            "plan",
            "--model",
            "tiny",
            "--pp",
            "2",
            "--gpu-memory-gib",
            "0.002",
            "--max-running-requests",
            "4",
        ],
        capsys,
    )
    assert rc == 0
    assert "bottleneck rank (*): 1" in out
    assert "max context" in out.splitlines()[1]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--model", "nope", "--gpu-memory-gib", "1"], "neither a preset"),
        (["--model", "tiny", "--gpu-memory-gib", "1", "--pp", "9"], "pp_size=9 exceeds"),
        (
            ["--model", "tiny", "--gpu-memory-gib", "1", "--role", "decode", "--swa-ratio", "1e-6"],
            "cannot hold even one request's window",
        ),
        (["--model", "deepseek-v4-pro", "--gpu", "h200"], "weights need"),
        (
            ["--model", "tiny", "--gpu-memory-gib", "1", "--speculative-draft-tokens", "20"],
            "speculative_draft_tokens=20 exceeds",
        ),
    ],
)
def test_errors_exit_2_and_name_the_limit(
    args: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = run_cli(["plan", *args], capsys)
    assert rc == 2
    assert needle in err and out == ""


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--model", "tiny", "--gpu-memory-gib", "-1"], "--gpu-memory-gib: must be > 0"),
        (["--model", "tiny", "--gpu-memory-gib", "1", "--pp", "0"], "--pp: must be >= 1"),
        (["--model", "tiny", "--gpu-memory-gib", "1", "--role", "router"], "--role"),
        (["--model", "tiny", "--gpu-memory-gib", "1", "--layer-split", "a,b"], "--layer-split"),
    ],
)
def test_bad_arguments_name_the_flag(
    args: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, _, err = run_cli(["plan", *args], capsys)
    assert rc == 2 and needle in err


def test_console_script_runs_as_a_process() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsv4_cli",
            "plan",
            "--model",
            "tiny",
            "--role",
            "decode",
            "--gpu-memory-gib",
            "0.01",
            "--json",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert json.loads(out)["role"] == "decode"


# The issue's DSV4-Pro PP=4 decode settings (docs/planner.md, "The balanced layer split").
PRO_ISSUE = [
    *PRO_H200,
    "--pp",
    "4",
    "--role",
    "decode",
    "--swa-ratio",
    "0.1",
    "--mem-fraction",
    "0.88",
    "--request-state",
    "online",
]
# DSV4-Pro on H100 at TP=4, PP=3: weights dominate, and the even split is unbalanced.
PRO_TIGHT = ["--model", "deepseek-v4-pro", "--tp", "4", "--gpu", "h100-80gb", "--pp", "3"]


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            PRO_ISSUE,
            "layer split 16/15/15/15 (balanced): the even split 16/15/15/15 is already the best",
        ),
        (
            [*PRO_TIGHT, "--role", "decode"],
            "layer split 20/21/20 (balanced): bottleneck +14.6% max context over the even "
            "split 21/20/20",
        ),
        (
            [*PRO_ISSUE, "--layer-split", "15,15,15,16"],
            "layer split 15/15/15/16 (fixed): bottleneck -4.1% full tokens vs the even split "
            "16/15/15/15; the balanced split 16/15/15/15 would give +4.2% full tokens",
        ),
        (
            [*PRO_ISSUE, "--layer-split", "16,15,15,15"],
            "layer split 16/15/15/15 (fixed): the even split 16/15/15/15; the balanced split "
            "is the same",
        ),
        (
            [*PRO_H200, "--pp", "2", "--role", "decode", "--max-running-requests", "4000"],
            "layer split 30/31 (balanced): the even split 31/30 does not fit",
        ),
    ],
)
def test_table_states_the_split_and_its_gain(
    args: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, _ = run_cli(["plan", *args], capsys)
    assert rc == 0
    assert out.splitlines()[-1] == line


def test_single_rank_table_has_no_split_line(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_cli(["plan", "--model", "tiny", "--gpu-memory-gib", "1"], capsys)
    assert rc == 0 and "layer split" not in out


def test_json_reports_the_balanced_split_and_the_even_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rc, out, _ = run_cli(["plan", *PRO_TIGHT, "--role", "decode", "--json"], capsys)
    assert rc == 0
    split = json.loads(out)["layer_split"]
    assert split["layers_per_rank"] == [20, 21, 20] and split["mode"] == "balanced"
    assert split["even"]["layers_per_rank"] == [21, 20, 20]
    assert (
        split["bottleneck"]["max_context_tokens"]
        > split["even"]["bottleneck"]["max_context_tokens"]
    )
    assert split["gain_over_even"] == "+14.6% max context"
    assert "balanced" not in split  # only a fixed split is compared with the balanced one
    assert [r["layers"] for r in json.loads(out)["ranks"]] == [[0, 20], [20, 41], [41, 61]]


def test_json_compares_a_fixed_split_with_the_balanced_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rc, out, _ = run_cli(["plan", *PRO_ISSUE, "--layer-split", "15,15,15,16", "--json"], capsys)
    assert rc == 0
    split = json.loads(out)["layer_split"]
    assert (split["mode"], split["layers_per_rank"]) == ("fixed", [15, 15, 15, 16])
    assert split["bottleneck"]["full_tokens"] == 38_762_752
    assert split["even"]["bottleneck"]["full_tokens"] == 40_409_088
    assert split["balanced"] == {
        "layers_per_rank": [16, 15, 15, 15],
        "bottleneck": {
            "max_context_tokens": 1_048_576,
            "max_running_requests": 1024,
            "full_tokens": 40_409_088,
        },
        "gain_over_fixed": "+4.2% full tokens",
    }
