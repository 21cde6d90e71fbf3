"""bench/transfer.py's driver: a target process that dies is reported at once, naming its exit,
instead of the bench waiting out its whole timeout (the first GPU check's dry run lost 40 s to
a target that failed to register an empty region)."""

from __future__ import annotations

import pytest
import torch
import transfer as transfer_bench

from dsv4_worker.pd.transfer import TransferError


def test_a_target_that_dies_is_reported_with_its_exit() -> None:
    src = torch.empty((0, 64), dtype=torch.uint8)  # the target refuses an empty region
    with pytest.raises(TransferError, match=r"target process exited \(1\) before its descriptor"):
        transfer_bench.bench_backend("zmq", [None], src, torch.arange(0), 1, "")


def test_a_region_without_a_page_is_refused_naming_the_flags(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.argv", ["transfer.py", "--total-mib", "1", "--page-kib", "2048"])
    with pytest.raises(SystemExit) as stop:
        transfer_bench.main()
    assert stop.value.code == 2
    assert "--total-mib 1 holds no page of --page-kib 2048" in capsys.readouterr().err
