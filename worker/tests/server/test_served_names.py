"""`--served-model-name`: the names the API answers to, checked before serving; the first is
what answers carry by default and /v1/models lists them all with the maximum context."""

from __future__ import annotations

import pytest

from dsv4_cli.main import build_parser
from dsv4_common.api import RankCapacity
from dsv4_common.api.worker_status import WorkerStatus
from dsv4_worker.options import ServeError
from dsv4_worker.options import served_names as _served_names
from dsv4_worker.server.app import ServeInfo, model_card


def test_the_flag_takes_several_names() -> None:
    args = build_parser().parse_args(["serve", "--served-model-name", "a", "b/c"])
    assert _served_names(args.served_model_name) == ("a", "b/c")
    assert _served_names(build_parser().parse_args(["serve"]).served_model_name) == ()
    assert _served_names(["a", "a", "b"]) == ("a", "b")


def test_an_empty_name_is_refused() -> None:
    with pytest.raises(ServeError, match="--served-model-name"):
        _served_names(["ok", " "])


def test_models_list_the_names_with_the_context() -> None:
    status = WorkerStatus(
        role="colocated",
        pp_rank=0,
        capacity=RankCapacity(
            full_tokens=64, swa_tokens=64, max_running_requests=1, max_context_tokens=64
        ),
    )
    info = ServeInfo("tiny", 256, 2048, status)
    assert info.names == ("tiny",)
    named = ServeInfo("tiny", 256, 2048, status, served_model_names=("x", "tiny"))
    card = model_card(named, "x")
    assert named.names == ("x", "tiny")
    assert (card["id"], card["root"], card["max_model_len"]) == ("x", "tiny", 2048)
