"""Fuzz: config.json fields, CR fields and CLI numbers. Every run ends in a plan or one of the
project's named errors, never another exception type (no ZeroDivisionError, OverflowError,
TypeError, ... escaping to the user)."""

from __future__ import annotations

import contextlib
import copy
import io
import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from repo_paths import MODEL_DATA
from test_bad_inputs import dsv4_hf, hybrid_hf

from dsv4_cli.main import main
from dsv4_common.api.deployment import MemoryPlanError, plan_memory
from dsv4_common.api.spec import SpecError, parse_spec
from dsv4_common.core.hf import from_hf_config
from dsv4_common.core.model import ModelConfigError
from dsv4_common.core.units import GIB
from dsv4_common.plan.inputs import PlanError, PlanInputs
from dsv4_common.plan.planner import plan

FUZZ = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)

# Values a hand-edited JSON or YAML file can hold.
JSON_SCALARS = st.one_of(
    st.integers(-(2**70), 2**70),
    st.integers(-3, 300),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=8),
)
JSON_VALUES = st.one_of(
    JSON_SCALARS,
    st.lists(JSON_SCALARS, max_size=8),
    st.dictionaries(st.text(max_size=4), JSON_SCALARS, max_size=3),
)


@st.composite
def mutated(draw: st.DrawFn, base: dict[str, Any], extra_keys: tuple[str, ...]) -> dict[str, Any]:
    raw = copy.deepcopy(base)
    keys = sorted(raw) + list(extra_keys)
    for key in draw(st.lists(st.sampled_from(keys), min_size=1, max_size=4)):
        if draw(st.booleans()) and key in raw:
            del raw[key]
        else:
            raw[key] = draw(JSON_VALUES)
    return raw


HF_EXTRA = ("head_dim", "layer_types", "first_k_dense_replace", "n_routed_experts", "index_topk")
# The published DeepSeek-V4-Flash config.json in both forms, and keys either may carry.
FLASH = {
    form: json.loads((MODEL_DATA / f"deepseek-v4-flash{form}" / "config.json").read_text())
    for form in ("", "-transformers")
}
DSV4_EXTRA = (
    "compress_ratios",
    "layer_types",
    "compress_rates",
    "mlp_layer_types",
    "num_hash_layers",
    "rope_parameters",
    "rope_scaling",
    "partial_rotary_factor",
    "qk_nope_head_dim",
    "quantization_config",
    "expert_dtype",
    "dtype",
)


@st.composite
def mutated_nested(draw: st.DrawFn, base: dict[str, Any]) -> dict[str, Any]:
    """`base` with one value inside a nested object or list replaced."""
    raw = copy.deepcopy(base)
    key = draw(st.sampled_from(sorted(k for k, v in raw.items() if isinstance(v, dict | list))))
    target = raw[key]
    if isinstance(target, dict) and target:
        inner = draw(st.sampled_from(sorted(target)))
        if isinstance(target[inner], dict) and target[inner] and draw(st.booleans()):
            target = target[inner]
            inner = draw(st.sampled_from(sorted(target)))
        target[inner] = draw(JSON_VALUES)
    elif isinstance(target, list) and target:
        target[draw(st.integers(0, len(target) - 1))] = draw(JSON_VALUES)
    return raw


@FUZZ
@given(
    raw=st.one_of(
        mutated(hybrid_hf(), HF_EXTRA),
        mutated(dsv4_hf(), HF_EXTRA),
        *(mutated(doc, DSV4_EXTRA) for doc in FLASH.values()),
        *(mutated_nested(doc) for doc in FLASH.values()),
    ),
    tp=st.sampled_from([1, 2, 3, 8]),
    pp=st.integers(1, 8),
    memory_gib=st.sampled_from([0.01, 1.0, 80.0, 1e5]),
)
def test_config_json_ends_in_a_plan_or_a_named_error(
    raw: dict[str, Any], tp: int, pp: int, memory_gib: float
) -> None:
    try:
        model = from_hf_config(raw, name="fuzz")
        plan(
            PlanInputs(
                model=model,
                role="decode",
                gpu_memory_bytes=int(memory_gib * GIB),
                tp_size=tp,
                pp_size=pp,
            )
        )
    except (ModelConfigError, PlanError):
        pass


TINY_CR: dict[str, Any] = {
    "model": {"preset": "tiny"},
    "maxContextTokens": 4096,
    "gpu": {"memoryGiB": 0, "perPod": 0},
    "kv": {"pageSize": 32, "swaRatio": "auto", "transfer": "nixl"},
    "prefill": {"pipelineParallel": 2, "chunkedPrefillTokens": 256},
    "decode": {"maxRunningRequests": 64},
}
ROLE_KEYS = ("pipelineParallel", "tensorParallel", "chunkedPrefillTokens", "maxRunningRequests")


@st.composite
def mutated_cr(draw: st.DrawFn) -> dict[str, Any]:
    spec = copy.deepcopy(TINY_CR)
    sections = {
        "": ("maxContextTokens", "speculativeDraftTokens", "memFraction", "model"),
        "gpu": ("type", "memoryGiB", "perPod"),
        "kv": ("pageSize", "swaRatio", "transfer"),
        "prefill": ROLE_KEYS,
        "decode": ROLE_KEYS,
        "model": ("preset", "configPath"),
    }
    for _ in range(draw(st.integers(1, 4))):
        section = draw(st.sampled_from(sorted(sections)))
        key = draw(st.sampled_from(sections[section]))
        target = spec if not section else spec.setdefault(section, {})
        if not isinstance(target, dict):
            continue
        value = draw(
            st.one_of(
                JSON_VALUES,
                st.sampled_from(
                    ["h100-80gb", "h200", "deepseek-v4-pro", "hybrid-tiny", "0.5", "auto", 16]
                ),
            )
        )
        target[key] = value
    return {"apiVersion": "serving.dsv4.io/v1alpha1", "kind": "DSV4Deployment", "spec": spec}


@FUZZ
@given(body=mutated_cr())
def test_cr_fields_end_in_a_plan_or_a_named_error(body: dict[str, Any]) -> None:
    try:
        memory = plan_memory(parse_spec(body))
    except (SpecError, MemoryPlanError):
        return
    memory.context_message()  # a plan always explains its context fit


NUMBER_TEXT = st.one_of(
    st.integers(-5, 10**20).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["", "x", "1e400", "-0", "0x10", "1,2", "1.5e-300", "nan", "-inf"]),
)
CLI_FLAGS = (
    "--pp",
    "--tp",
    "--gpu-memory-gib",
    "--mem-fraction",
    "--swa-ratio",
    "--max-running-requests",
    "--chunked-prefill-size",
    "--speculative-draft-tokens",
    "--page-size",
    "--context-len",
    "--layer-split",
)


@FUZZ
@given(
    model=st.sampled_from(["tiny", "hybrid-tiny", "deepseek-v4-flash", "deepseek-v4-pro"]),
    values=st.dictionaries(st.sampled_from(CLI_FLAGS), NUMBER_TEXT, min_size=1, max_size=4),
)
def test_cli_numbers_end_in_a_plan_or_exit_2(model: str, values: dict[str, str]) -> None:
    argv = ["plan", "--model", model]
    if "--gpu-memory-gib" not in values:
        argv += ["--gpu", "h200"]
    for flag, text in values.items():
        argv.append(f"{flag}={text}")
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's own usage errors
            code = int(exc.code or 0)
    assert code in (0, 2), err.getvalue()
    if code == 2:
        assert "error:" in err.getvalue() and "Traceback" not in err.getvalue()
