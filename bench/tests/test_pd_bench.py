"""bench/pd.py's machine-readable figures: each server's low-load TTFT median and each PD
stack's ratio to colocated, on one `@bench-json` line that bench/compare.py parses."""

from __future__ import annotations

import pytest
from benchjson import emit, parse
from pd import ttft_figures


def test_ttft_figures_give_each_median_and_each_pd_ratio_to_colocated(
    capsys: pytest.CaptureFixture[str],
) -> None:
    emit("pd", ttft_figures({"colocated": 20.0, "disaggregated": 23.0, "PD threads=4": 25.0}))
    figures = parse(capsys.readouterr().out)
    assert {name: f.value for name, f in figures.items()} == pytest.approx(
        {
            "ttft_ms.colocated": 20.0,
            "ttft_ms.disaggregated": 23.0,
            "ttft_ms.PD threads=4": 25.0,
            "ttft_ratio.disaggregated": 1.15,
            "ttft_ratio.PD threads=4": 1.25,
        }
    )
    assert all(f.better == "lower" for f in figures.values())
    assert figures["ttft_ratio.disaggregated"].unit == "x"
