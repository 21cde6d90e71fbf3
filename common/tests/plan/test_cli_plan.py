"""`dsv4 plan`: JSON shape, human table, errors that name the setting (exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dsv4_common.cli import main

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
            "dsv4_common.cli",
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
