"""bench/moe.py times one MoE layer's routed experts under each dispatch (its GPU figures go in
bench/README.md; here a small CPU run proves the script works and that the dispatches it
compares agree)."""

from __future__ import annotations

import json

import moe
import pytest
from benchjson import PREFIX


def test_a_small_cpu_run_times_every_dispatch_and_they_agree(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["moe.py", "--experts", "8", "--hidden", "256", "--inter", "128", "--k", "2"]
    argv += ["--tokens", "1", "6", "--rounds", "1", "--json"]
    monkeypatch.setattr("sys.argv", argv)
    moe.main()
    out = capsys.readouterr().out
    lines = [ln.split() for ln in out.splitlines()]
    rows = [r for r in lines if len(r) == 6 and r[0].isdigit()]  # tokens, 3 times, ratio, diff
    assert [r[0] for r in rows] == ["1", "6"], out  # 2 pairs: by_slot; 12 pairs: grouped
    for r in rows:
        assert float(r[-1]) < 1e-4, out  # every dispatch within float32 rounding of by_expert
    (line,) = [ln for ln in out.splitlines() if ln.startswith(PREFIX)]
    names = {f["name"] for f in json.loads(line[len(PREFIX) :])["figures"]}
    dispatches = ("every_expert", "on_device", "by_expert")
    assert names == {f"{d} ms, {t} tokens" for d in dispatches for t in (1, 6)}
