"""The fake hub for every fetch test, and a fetch environment that reads no token or cache of
this machine's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_hub import FakeHub


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[FakeHub]:
    with FakeHub(tmp_path / "hub") as h:
        yield h


@pytest.fixture(autouse=True)
def _no_machine_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
