"""bench/profile_step.py runs the engine as `dsv4 serve` builds it and reports per-step counts
(its GPU figures are in bench/README.md; here the CPU run proves the script still works)."""

from __future__ import annotations

import re

import profile_step
import pytest


def test_a_cpu_profile_reports_a_step_and_its_operators(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.argv", ["profile_step.py", "--steps", "2", "--top", "5"])
    profile_step.main()
    out = capsys.readouterr().out
    step_ms = re.search(r"device=cpu, running=1, .*: ([0-9.]+) ms/step", out)
    assert step_ms is not None and float(step_ms.group(1)) > 0, out
    calls = re.search(r"aten calls per step \(all levels\): (\d+)", out)
    assert calls is not None and int(calls.group(1)) > 100, out  # a real forward ran
    assert "launches per step: 0.0" in out  # no kernel launches on CPU
    rows = out.split("self CPU us/step\n", 1)[1].strip().splitlines()
    assert len(rows) == 5 and all(r.startswith("aten::") or r[0].isalpha() for r in rows)


def test_bad_counts_are_refused_naming_the_flags(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.argv", ["profile_step.py", "--steps", "0"])
    with pytest.raises(SystemExit) as stop:
        profile_step.main()
    assert stop.value.code == 2
    assert "--steps and --running must be >= 1" in capsys.readouterr().err
