"""SGLang's command lines (engine sglang), table-driven over Pro and Flash, PP 1/2/4, prefill and
decode, nixl and mooncake: the flags carry the planner's figures exactly, the PP layer partition
is the plan's split, the rank wiring points at PP rank 0, and every command line, as the kubelet
expands it on each rank, parses with SGLang's parser (the committed flag snapshot)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from functools import cache
from typing import Any

import pytest

from dsv4_common.api.deployment import MemoryPlan, plan_memory
from dsv4_common.api.names import SGLANG_TRANSFERS, WORKER_ROLES, Transfer, WorkerRole
from dsv4_common.api.spec import DeploymentMeta, DeploymentSpec, parse_meta, parse_spec
from dsv4_operator.flavors.sglang.command import (
    LAYER_PARTITION_ENV,
    PARSER_FLAGS,
    PP_RANK_ENV,
    SERVER_FLAGS,
    expand,
    group_figures,
    router_args,
    server_args,
    server_env,
    sglang_swa_tokens,
    swa_ratio_text,
)
from dsv4_operator.flavors.sglang.flags import parse_router_args, parse_server_args, server_flag

TP_ON_H200 = {"deepseek-v4-pro": 8, "deepseek-v4-flash": 4}
WEIGHTS = "/models/weights"
Case = tuple[str, int, WorkerRole, Transfer]  # preset, PP, role, transfer backend
CASES: list[Case] = list(itertools.product(TP_ON_H200, (1, 2, 4), WORKER_ROLES, SGLANG_TRANSFERS))


def case_id(case: Case) -> str:
    preset, pp, role, transfer = case
    return f"{preset.removeprefix('deepseek-v4-')}-pp{pp}-{role}-{transfer}"


def sglang_body(preset: str, pp: int, transfer: str = "nixl", **spec: Any) -> dict[str, Any]:
    tp = TP_ON_H200[preset]
    role = {"tensorParallel": tp, "pipelineParallel": pp, "replicas": 2}
    return {
        "apiVersion": "serving.dsv4.io/v1alpha1",
        "kind": "DSV4Deployment",
        "metadata": {"name": "sgl", "namespace": "ns"},
        "spec": {
            "engine": {"name": "sglang"},
            "model": {
                "preset": preset,
                "weights": {"persistentVolumeClaim": "weights", "path": WEIGHTS},
            },
            "maxContextTokens": 65536,
            "gpu": {"type": "h200", "perPod": tp},
            "kv": {"transfer": transfer},
            "prefill": dict(role),
            "decode": dict(role),
            **spec,
        },
    }


@cache
def planned(
    preset: str, pp: int, transfer: str
) -> tuple[DeploymentSpec, DeploymentMeta, MemoryPlan]:
    body = sglang_body(preset, pp, transfer)
    spec = parse_spec(body)
    return spec, parse_meta(body), plan_memory(spec)


def values(argv: Sequence[str]) -> dict[str, str | None]:
    """`--flag value` and bare `--flag` of a server command line (each flag set once)."""
    out: dict[str, str | None] = {}
    for i, arg in enumerate(argv):
        if arg.startswith("--"):
            assert arg not in out, f"{arg} set twice"
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            out[arg] = None if nxt is None or nxt.startswith("--") else nxt
    return out


def sglang_pp_indices(num_layers: int, rank: int, pp: int, partition: str | None) -> range:
    """sglang.srt.distributed.utils.get_pp_indices (0.5.23), restated: the env's layers per
    rank, else the extra layers on the last ranks."""
    if partition is not None and pp > 1:
        parts = [int(n) for n in partition.split(",")]
        assert len(parts) == pp and sum(parts) == num_layers
        start = sum(parts[:rank])
        return range(start, start + parts[rank])
    base, extra = divmod(num_layers, pp)
    if rank >= pp - extra:
        start = rank * (base + 1) - (pp - extra)
        return range(start, start + base + 1)
    return range(rank * base, rank * base + base)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_the_flags_carry_the_plans_figures_exactly(case: Case) -> None:
    preset, pp, role, transfer = case
    spec, meta, memory = planned(preset, pp, transfer)
    plan = memory.role(role)
    v = values(server_args(spec, meta, memory, role, 0))
    full = min(r.capacity.full_tokens for r in plan.ranks)
    swa = min(r.capacity.swa_tokens for r in plan.ranks)
    page = plan.inputs.resolved_page_size
    assert v["--max-total-tokens"] == str(full)
    ratio = v["--swa-full-tokens-ratio"]
    assert ratio is not None and sglang_swa_tokens(full, ratio, page) == swa
    assert {r.capacity.max_running_requests for r in plan.ranks} == {plan.max_running_requests}
    assert v["--max-running-requests"] == str(plan.max_running_requests)
    assert float(v["--mem-fraction-static"] or "nan") == plan.inputs.mem_fraction
    assert v["--page-size"] == str(page) == "256"
    assert v["--chunked-prefill-size"] == str(plan.inputs.resolved_chunk_tokens)
    assert v["--context-length"] == "65536"
    assert v["--tp-size"] == str(TP_ON_H200[preset]) and v["--pp-size"] == str(pp)
    assert v["--disaggregation-mode"] == role
    assert v["--disaggregation-transfer-backend"] == transfer
    assert v["--disaggregation-bootstrap-port"] == "8083" and v["--port"] == "8080"
    assert v["--model-path"] == WEIGHTS and v["--host"] == "0.0.0.0"
    assert "--enable-metrics" in v and v["--enable-metrics"] is None
    assert v["--tool-call-parser"] == "deepseekv4" and v["--reasoning-parser"] == "deepseek-v4"
    # Everything rendered is documented: refused in engineArgs, or (the parsers) theirs to set.
    assert set(v) <= set(SERVER_FLAGS) | {flag for flag, _ in PARSER_FLAGS}


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_pp_ranks_find_rank_0_through_the_groups_service(case: Case) -> None:
    preset, pp, role, transfer = case
    spec, meta, memory = planned(preset, pp, transfer)
    for replica in (0, 1):
        v = values(server_args(spec, meta, memory, role, replica))
        if pp == 1:
            assert not {"--nnodes", "--node-rank", "--dist-init-addr"} & set(v)
            continue
        group = f"sgl-{role}-{replica}"
        assert v["--nnodes"] == str(pp)
        assert v["--node-rank"] == f"$({PP_RANK_ENV})"
        assert v["--dist-init-addr"] == f"{group}-0.{group}.ns.svc:8082"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_the_layer_partition_is_the_plans_split(case: Case) -> None:
    preset, pp, role, transfer = case
    _, _, memory = planned(preset, pp, transfer)
    plan = memory.role(role)
    env = server_env(memory, role)
    partition = env.get(LAYER_PARTITION_ENV)
    assert (partition is None) == (pp == 1)
    layers = plan.inputs.model.num_hidden_layers
    for r in plan.ranks:
        got = sglang_pp_indices(layers, r.pp_rank, pp, partition)
        assert (got.start, got.stop) == r.layers  # each rank holds the layers it was priced for


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_every_rank_parses_with_sglangs_parser(case: Case) -> None:
    preset, pp, role, transfer = case
    spec, meta, memory = planned(preset, pp, transfer)
    argv = server_args(spec, meta, memory, role, 1)
    for rank in range(pp):
        args = parse_server_args(list(expand(argv, {PP_RANK_ENV: str(rank)})))
        assert int(args.node_rank) == rank
        assert int(args.max_total_tokens) == int(values(argv)["--max-total-tokens"] or 0)
        assert args.disaggregation_mode == role


def test_a_given_layer_split_reaches_sglang() -> None:
    body = sglang_body(
        "deepseek-v4-pro", 4, decode={"tensorParallel": 8, "pipelineParallel": 4,
                                      "layerSplit": [15, 16, 15, 15]},
    )  # fmt: skip
    spec = parse_spec(body)
    memory = plan_memory(spec)
    assert server_env(memory, "decode")[LAYER_PARTITION_ENV] == "15,16,15,15"
    assert memory.decode.ranks[1].layers == (15, 31)


def test_a_group_runs_with_its_least_figures() -> None:
    """Pro at PP 2: the ranks' pools differ; every rank gets the smaller one."""
    _, _, memory = planned("deepseek-v4-pro", 2, "nixl")
    ranks = memory.decode.ranks
    assert len({r.capacity.full_tokens for r in ranks}) == 2
    figures = group_figures(memory.decode)
    assert figures.full_tokens == min(r.capacity.full_tokens for r in ranks)
    assert figures.swa_tokens == min(r.capacity.swa_tokens for r in ranks)
    assert figures.layer_split == (31, 30)


def test_engine_args_follow_the_operators_flags_as_written() -> None:
    extra = ["--served-model-name", "pro", "--decode-log-interval=40", "--enable-cache-report"]
    body = sglang_body("deepseek-v4-pro", 1)
    body["spec"]["decode"]["engineArgs"] = extra
    spec = parse_spec(body)
    argv = server_args(spec, parse_meta(body), plan_memory(spec), "decode", 0)
    assert list(argv[-len(extra) :]) == extra
    assert argv[: -len(extra)] == server_args(
        parse_spec(sglang_body("deepseek-v4-pro", 1)),
        parse_meta(body),
        plan_memory(spec),
        "decode",
        0,
    )
    parse_server_args(list(argv))


def test_the_specs_served_name_is_sglangs_served_model_name() -> None:
    body = sglang_body("deepseek-v4-flash", 2)
    body["spec"]["model"]["servedModelNames"] = ["flash"]
    spec, meta = parse_spec(body), parse_meta(body)
    for role in ("prefill", "decode"):
        argv = server_args(spec, meta, plan_memory(spec), role, 0)  # type: ignore[arg-type]
        assert parse_server_args(list(expand(argv, {PP_RANK_ENV: "0"}))).served_model_name == (
            "flash"
        )
    plain, _, memory = planned("deepseek-v4-flash", 2, "nixl")
    assert "--served-model-name" not in server_args(plain, meta, memory, "decode", 0)


def test_deepseek_v4_tool_and_reasoning_parsers_unless_engine_args_choose() -> None:
    body = sglang_body("deepseek-v4-flash", 1)
    spec, meta = parse_spec(body), parse_meta(body)
    for role in ("prefill", "decode"):
        argv = server_args(spec, meta, plan_memory(spec), role, 0)  # type: ignore[arg-type]
        args = parse_server_args(list(argv))  # the snapshot's choices hold both names
        assert (args.tool_call_parser, args.reasoning_parser) == ("deepseekv4", "deepseek-v4")
    body["spec"]["decode"]["engineArgs"] = ["--tool-call-parser=deepseekv41"]
    spec = parse_spec(body)
    argv = server_args(spec, meta, plan_memory(spec), "decode", 0)
    args = parse_server_args(list(argv))
    assert (args.tool_call_parser, args.reasoning_parser) == ("deepseekv41", "deepseek-v4")
    assert sum(a.startswith("--tool-call-parser") for a in argv) == 1


def test_every_operator_flag_is_an_sglang_flag() -> None:
    for flag in SERVER_FLAGS:
        assert server_flag(flag) is not None, flag


@pytest.mark.parametrize(
    ("full", "swa", "page"),
    [
        (16_777_216, 74_240, 256),
        (22_278_656, 131_072, 256),
        (67_108_864, 524_288, 256),
        (1_962_752, 245_248, 256),
        (256, 256, 256),
        (3_000_000_000 // 256 * 256, 2_560, 256),
        (40_724_480, 4_072_448, 256),
        (1_000, 16, 16),
    ],
)
def test_the_ratio_gives_sglang_exactly_the_planned_swa_pool(
    full: int, swa: int, page: int
) -> None:
    text = swa_ratio_text(full, swa, page)
    assert sglang_swa_tokens(full, text, page) == swa
    assert 0 < float(text) <= 1
    digits = len(text.partition(".")[2])
    if digits > 1:  # the shortest: no ratio with one digit fewer gives it
        scale = 10 ** (digits - 1)
        shorter = [f"{n / scale:.{digits - 1}f}" for n in range(1, scale + 1)]
        assert not any(sglang_swa_tokens(full, t, page) == swa for t in shorter)


def test_expand_is_the_kubelets_variable_expansion() -> None:
    env = {"A": "1", "B": "two"}
    assert expand(["$(A)", "x$(B)y", "$(C)", "$$(A)", "$$", "--n=$(A)"], env) == (
        "1",
        "xtwoy",
        "$(C)",
        "$(A)",
        "$",
        "--n=1",
    )


def test_the_router_lists_each_groups_rank_0_and_parses() -> None:
    spec, meta, _ = planned("deepseek-v4-flash", 2, "mooncake")
    argv = router_args(spec, meta)
    parse_router_args(list(argv))
    prefill = [argv[i + 1 : i + 3] for i, a in enumerate(argv) if a == "--prefill"]
    decode = [argv[i + 1] for i, a in enumerate(argv) if a == "--decode"]
    host = "http://sgl-{r}-{i}-0.sgl-{r}-{i}.ns.svc:8080"
    assert prefill == [(host.format(r="prefill", i=i), "8083") for i in (0, 1)]
    assert decode == [host.format(r="decode", i=i) for i in (0, 1)]
    assert "--pd-disaggregation" in argv
    assert argv[argv.index("--port") + 1] == "8000"
    assert argv[argv.index("--prometheus-port") + 1] == "8081"


def test_the_router_lists_the_surge_groups_in_use() -> None:
    spec, meta, _ = planned("deepseek-v4-flash", 1, "nixl")
    argv = router_args(spec, meta, {"decode": 1})
    parse_router_args(list(argv))
    decode = [argv[i + 1] for i, a in enumerate(argv) if a == "--decode"]
    assert decode[-1] == "http://sgl-decode-2-0.sgl-decode-2.ns.svc:8080" and len(decode) == 3
    assert argv.count("--prefill") == 2
