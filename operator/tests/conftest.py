"""Fixtures for the operator tests: CR bodies built from the committed samples, an in-memory
cluster holding one of them (`support.fake_kube`), and the real operator running against the
loopback fake API server (`live`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from repo_paths import SAMPLES
from support.fake_kube import FakeKube, FakeProbe
from support.live_operator import Live, running_operator


@pytest.fixture
def make_body() -> Callable[..., dict[str, Any]]:
    """A CR as the API server returns it: sample + uid, namespace, generation."""

    def make(sample: str = "tiny-cpu.yaml", **spec_overrides: Any) -> dict[str, Any]:
        body: dict[str, Any] = yaml.safe_load((SAMPLES / sample).read_text())
        body["metadata"].update({"namespace": "ns", "uid": "cr-uid-1", "generation": 1})
        body["spec"].update(spec_overrides)
        return body

    return make


@pytest.fixture
def make_cluster(
    make_body: Callable[..., dict[str, Any]],
) -> Callable[..., tuple[FakeKube, FakeProbe]]:
    """An empty fake cluster holding one CR (sample + spec overrides) and a fake probe."""

    def make(sample: str = "tiny-cpu.yaml", **spec_overrides: Any) -> tuple[FakeKube, FakeProbe]:
        return FakeKube(make_body(sample, **spec_overrides)), FakeProbe()

    return make


@pytest.fixture
def cluster(make_cluster: Callable[..., tuple[FakeKube, FakeProbe]]) -> tuple[FakeKube, FakeProbe]:
    return make_cluster()


@pytest.fixture
def live(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> Iterator[Live]:
    """The real operator against the loopback fake API server (support/live_operator.py)."""
    with running_operator(tmp_path, monkeypatch, caplog) as running:
        yield running
