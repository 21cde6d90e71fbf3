"""`spec.<role>.engineArgs` against SGLang's flags: every refusal names the entry and the flag,
all at once, and reaches the user as an invalid spec (desired state, reconcile, admission)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from dsv4_common.api.deployment import plan_memory
from dsv4_common.api.spec import SpecError, parse_meta, parse_spec
from dsv4_operator.admission import AdmissionRequest, review
from dsv4_operator.flavors.sglang.command import SERVER_FLAGS
from dsv4_operator.flavors.sglang.engine_args import REFUSED, check_sglang_spec, engine_args_errors
from dsv4_operator.flavors.sglang.flags import SGLANG_VERSION
from dsv4_operator.objects import build_desired_state

SAMPLE = "sglang-flash-pd.yaml"
Body = dict[str, Any]


def errors_of(body: Body, role: str = "decode") -> list[str]:
    spec = parse_spec(body)
    return engine_args_errors(spec, parse_meta(body), plan_memory(spec), role)  # type: ignore[arg-type]


def with_args(make_body: Callable[..., Body], role: str, args: list[str], **spec: Any) -> Body:
    body = make_body(SAMPLE, **spec)
    body["spec"][role]["engineArgs"] = args
    return body


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["--decode-log-interval=40", "--enable-cache-report"],
        ["--watchdog-timeout", "-1"],
        ["--log-level", "debug", "--enable-dp-attention"],  # decode runs PP 1 in the sample
    ],
)
def test_sglang_flags_the_operator_leaves_alone_pass(
    make_body: Callable[..., Body], args: list[str]
) -> None:
    assert errors_of(with_args(make_body, "decode", args)) == []


@pytest.mark.parametrize("flag", sorted(SERVER_FLAGS))
def test_every_flag_the_operator_computes_is_refused_naming_it(
    make_body: Callable[..., Body], flag: str
) -> None:
    args = ["--log-level", "info", f"{flag}=1"]
    assert errors_of(with_args(make_body, "decode", args)) == [
        f"spec.decode.engineArgs[2]: {flag} is computed by the operator (from {SERVER_FLAGS[flag]})"
    ]


def test_served_model_name_is_the_specs_when_it_names_the_model(
    make_body: Callable[..., Body],
) -> None:
    """The sample names its model (spec.model.servedModelNames): the operator passes it, so
    engineArgs may not; without servedModelNames engineArgs may name it."""
    body = with_args(make_body, "decode", ["--served-model-name", "flash"])
    assert errors_of(body) == [
        "spec.decode.engineArgs[0]: --served-model-name is computed by the operator "
        "(from spec.model.servedModelNames)"
    ]
    del body["spec"]["model"]["servedModelNames"]
    assert errors_of(body) == []


@pytest.mark.parametrize(
    ("alias", "source"),
    [("--tensor-parallel-size", "--tp-size"), ("--model", "--model-path")],
)
def test_an_alias_of_a_computed_flag_is_refused_too(
    make_body: Callable[..., Body], alias: str, source: str
) -> None:
    (error,) = errors_of(with_args(make_body, "decode", [alias, "8"]))
    assert error == (
        f"spec.decode.engineArgs[0]: {alias} (an alias of {source}) is computed by the operator "
        f"(from {SERVER_FLAGS[source]})"
    )


@pytest.mark.parametrize("flag", ["--no-such-flag", "--tp", "-x"])
def test_a_flag_sglang_does_not_know_is_refused_naming_it(
    make_body: Callable[..., Body], flag: str
) -> None:
    assert errors_of(with_args(make_body, "decode", ["--log-level", "info", flag, "4"])) == [
        f"spec.decode.engineArgs[2]: {flag} is not an SGLang {SGLANG_VERSION} flag"
    ]


@pytest.mark.parametrize("flag", sorted(REFUSED))
def test_flags_that_would_undo_the_plan_are_refused(
    make_body: Callable[..., Body], flag: str
) -> None:
    (error,) = errors_of(with_args(make_body, "decode", [flag, "x"]))
    assert error.startswith(f"spec.decode.engineArgs[0]: {flag} is refused: ")


def test_dp_attention_is_refused_only_with_pipeline_parallelism(
    make_body: Callable[..., Body],
) -> None:
    body = with_args(make_body, "prefill", ["--enable-dp-attention"])  # prefill runs PP 2
    (error,) = errors_of(body, "prefill")
    assert error.startswith("spec.prefill.engineArgs[0]: --enable-dp-attention is refused: ")
    assert "bootstrap port" in error
    assert errors_of(with_args(make_body, "decode", ["--enable-dp-attention"])) == []


@pytest.mark.parametrize(
    "args",
    [["--decode-log-interval", "often"], ["--log-level"], ["--schedule-policy", "nope"]],
)
def test_a_command_line_sglangs_parser_rejects_is_refused(
    make_body: Callable[..., Body], args: list[str]
) -> None:
    (error,) = errors_of(with_args(make_body, "decode", args))
    assert error.startswith(f"spec.decode.engineArgs: SGLang {SGLANG_VERSION} rejects the command")


def test_every_problem_of_both_roles_is_reported_at_once(make_body: Callable[..., Body]) -> None:
    body = make_body(SAMPLE)
    body["spec"]["prefill"]["engineArgs"] = ["--pp-size", "2", "--nope"]
    body["spec"]["decode"]["engineArgs"] = ["--max-total-tokens", "1"]
    spec = parse_spec(body)
    with pytest.raises(SpecError) as info:
        check_sglang_spec(spec, parse_meta(body), plan_memory(spec))
    assert [e.split(":", 1)[0] for e in info.value.errors] == [
        "spec.prefill.engineArgs[0]",
        "spec.prefill.engineArgs[2]",
        "spec.decode.engineArgs[0]",
    ]


def test_the_desired_state_refuses_them_with_the_pod_templates_problems(
    make_body: Callable[..., Body],
) -> None:
    body = with_args(make_body, "decode", ["--context-length", "1"])
    body["spec"]["prefill"]["podTemplate"] = {
        "spec": {"containers": [{"name": "worker", "image": "x"}]}
    }
    spec = parse_spec(body)
    with pytest.raises(SpecError) as info:
        build_desired_state(spec, parse_meta(body), plan_memory(spec))
    fields = [e.split(":", 1)[0] for e in info.value.errors]
    assert fields == [
        "spec.decode.engineArgs[0]",
        "spec.prefill.podTemplate.spec.containers[worker].image",
    ]


def test_the_admission_webhook_refuses_them(make_body: Callable[..., Body]) -> None:
    body = with_args(make_body, "decode", ["--mem-fraction-static", "0.99"])
    verdict = review(AdmissionRequest("CREATE", body))
    assert not verdict.allowed and verdict.reason == "InvalidSpec"
    assert "spec.decode.engineArgs[0]: --mem-fraction-static is computed by the operator" in (
        verdict.message
    )
    assert review(AdmissionRequest("CREATE", make_body(SAMPLE))).allowed


@pytest.mark.parametrize(
    ("decode_split", "ok"), [([21, 22], False), ([22, 21], True), (None, True)]
)
def test_decode_stages_must_hold_the_layers_of_prefills(
    make_body: Callable[..., Body], decode_split: list[int] | None, ok: bool
) -> None:
    """Prefill PP 2 is planned 22/21 (balanced); decode PP 2 must match it."""
    decode: Body = {"tensorParallel": 4, "pipelineParallel": 2}
    if decode_split is not None:
        decode["layerSplit"] = decode_split
    body = make_body(SAMPLE, decode=decode)
    spec = parse_spec(body)
    memory = plan_memory(spec)
    assert [r.layers[1] - r.layers[0] for r in memory.prefill.ranks] == [22, 21]
    if ok:
        check_sglang_spec(spec, parse_meta(body), memory)
        return
    with pytest.raises(SpecError) as info:
        check_sglang_spec(spec, parse_meta(body), memory)
    assert list(info.value.errors) == [
        "spec.decode.layerSplit: with engine sglang each decode PP stage takes the KV of the "
        "prefill stage of its rank, so both roles need one split; the plan gives prefill "
        "[22, 21] and decode [21, 22]: set layerSplit to the same on both"
    ]
