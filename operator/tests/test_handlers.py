"""kopf glue: error mapping and settings, without a cluster."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import kopf
import pytest

from dsv4_operator.handlers import run_reconcile
from dsv4_operator.kube import KubeError
from dsv4_operator.reconcile import OperatorConfig
from dsv4_operator.settings import configure

LOG = logging.getLogger("test")


class ConflictingKube:
    def __getattr__(self, name: str) -> Any:
        def fail(*_: Any, **__: Any) -> Any:
            raise KubeError("apply: 409 Conflict", retryable=True, status=409)

        return fail


def test_api_conflict_is_a_temporary_error(cluster: tuple[Any, Any]) -> None:
    kube, probe = cluster
    with pytest.raises(kopf.TemporaryError):
        run_reconcile(kube.cr, ConflictingKube(), probe, OperatorConfig(), LOG)


def test_invalid_spec_is_a_permanent_error_after_status_is_written(
    make_cluster: Callable[..., tuple[Any, Any]],
) -> None:
    kube, probe = make_cluster(maxContextTokens=0)
    with pytest.raises(kopf.PermanentError, match=r"spec\.maxContextTokens"):
        run_reconcile(kube.cr, kube, probe, OperatorConfig(), LOG)
    assert kube.writes == [("patch_status", "tiny")]


def test_context_too_long_is_reported_not_raised(
    make_cluster: Callable[..., tuple[Any, Any]],
) -> None:
    kube, probe = make_cluster(maxContextTokens=8192)
    result = run_reconcile(kube.cr, kube, probe, OperatorConfig(), LOG)
    assert result.problem is not None and result.problem.reason == "ContextTooLong"


@pytest.mark.parametrize(
    ("env", "standalone"), [({}, True), ({"DSV4_PEERING": "dsv4", "DSV4_PRIORITY": "5"}, False)]
)
def test_settings_from_environment(env: dict[str, str], standalone: bool) -> None:
    settings = kopf.OperatorSettings()
    configure(settings, env)
    assert settings.peering.standalone is standalone
    assert settings.persistence.finalizer == "serving.dsv4.io/finalizer"
    if not standalone:
        assert (settings.peering.name, settings.peering.priority) == ("dsv4", 5)
