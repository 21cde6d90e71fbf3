"""`dsv4 plan`: the per-PP-rank KV capacity plan of one role. Pure (the shared package)."""

from __future__ import annotations

import argparse
import dataclasses
import json

from dsv4_cli.flags import add_flags, bounded
from dsv4_cli.usage import Usage, write
from dsv4_common.api.serve_flags import (
    FRACTION,
    GPU_MEMORY_GIB,
    NON_NEGATIVE_INT,
    POSITIVE_INT,
    SIZING_FLAGS,
)
from dsv4_common.core.gpus import GPU_TYPE_NAMES, gpu_type
from dsv4_common.core.model import ModelConfig, ModelConfigError
from dsv4_common.core.presets import PRESETS, load_model_config
from dsv4_common.core.units import GIB
from dsv4_common.plan.inputs import DEFAULT_MEM_FRACTION, ROLES, PlanError, PlanInputs
from dsv4_common.plan.planner import Plan, plan
from dsv4_common.plan.report import format_table, plan_to_dict

# PlanInputs fields -> the flag that sets them (errors name the flag).
PLAN_FLAGS: dict[str, str] = {
    "role": "--role",
    "gpu_memory_bytes": "--gpu/--gpu-memory-gib",
    "pp_size": "--pp",
    "tp_size": "--tp",
    "mem_fraction": "--mem-fraction",
    "speculative_draft_tokens": "--speculative-draft-tokens",
    "page_size": "--page-size",
    "chunked_prefill_tokens": "--chunked-prefill-size",
    "max_running_requests": "--max-running-requests",
    "swa_ratio": "--swa-ratio",
    "context_len": "--context-len",
    "layer_split": "--layer-split",
    "request_state": "--request-state",
}


def _layer_split(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated layer counts such as 16,15,15,15, got {text!r}"
        ) from None


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "plan",
        help="per-PP-rank KV capacity plan",
        description="Plan per-PP-rank KV pools (full, SWA, request state) for one role.",
    )
    p.add_argument(
        "--model",
        required=True,
        help=f"preset ({', '.join(sorted(PRESETS))}) or a HuggingFace config.json path",
    )
    p.add_argument("--role", choices=ROLES, default="colocated")
    p.add_argument("--pp", type=bounded(POSITIVE_INT), default=1, help="pipeline-parallel size")
    p.add_argument("--tp", type=bounded(POSITIVE_INT), default=1, help="tensor-parallel size")
    gpu = p.add_mutually_exclusive_group(required=True)
    gpu.add_argument(
        "--gpu",
        choices=GPU_TYPE_NAMES,
        help="device type: its memory as the device reports it (h200: 143,771 MiB = 140.4 GiB)",
    )
    gpu.add_argument(
        "--gpu-memory-gib",
        type=bounded(GPU_MEMORY_GIB),
        help="memory per device in GiB, for a device without a --gpu type",
    )
    p.add_argument(
        "--mem-fraction",
        type=bounded(FRACTION),
        default=DEFAULT_MEM_FRACTION,
        help="fraction of device memory for weights + KV (rest: activations)",
    )
    p.add_argument(
        "--swa-ratio",
        type=bounded(FRACTION),
        default=None,
        help="SWA tokens per full token; default: sized from what the role needs",
    )
    add_flags(p, SIZING_FLAGS)
    p.add_argument(
        "--speculative-draft-tokens",
        type=bounded(NON_NEGATIVE_INT),
        default=0,
        help="MTP draft tokens per step (0 = no speculative decoding)",
    )
    p.add_argument(
        "--layer-split",
        type=_layer_split,
        default=None,
        help="target layers per PP rank, e.g. 16,15,15,15 (default: the capacity-balanced "
        "split, whose worst rank holds the most)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(args: argparse.Namespace) -> int:
    try:
        model = load_model_config(args.model)
    except ModelConfigError as exc:
        raise Usage(f"--model: {exc}") from exc
    try:
        inputs = _plan_inputs(args, model)
        result = plan(inputs)
    except PlanError as exc:
        flag = PLAN_FLAGS.get(exc.input_name or "")
        raise Usage(f"{flag}: {exc}" if flag else str(exc)) from exc
    balanced = _balanced_alternative(inputs) if inputs.layer_split is not None else None
    if args.json:
        write(json.dumps(plan_to_dict(result, balanced), indent=2))
    else:
        write(format_table(result, balanced))
    return 0


def _balanced_alternative(inputs: PlanInputs) -> Plan | None:
    """With a fixed --layer-split: the plan the balanced split would give (None: none fits)."""
    try:
        return plan(dataclasses.replace(inputs, layer_split=None))
    except PlanError:
        return None


def _gpu_memory_bytes(args: argparse.Namespace) -> int:
    if args.gpu is not None:
        return gpu_type(args.gpu).memory_bytes
    return int(args.gpu_memory_gib * GIB)


def _plan_inputs(args: argparse.Namespace, model: ModelConfig) -> PlanInputs:
    return PlanInputs(
        model=model,
        role=args.role,
        gpu_memory_bytes=_gpu_memory_bytes(args),
        pp_size=args.pp,
        layer_split=args.layer_split,
        tp_size=args.tp,
        page_size=args.page_size,
        chunked_prefill_tokens=args.chunked_prefill_size,
        max_running_requests=args.max_running_requests,
        swa_ratio=args.swa_ratio,
        mem_fraction=args.mem_fraction,
        speculative_draft_tokens=args.speculative_draft_tokens,
        context_len=args.context_len,
        request_state=args.request_state,
    )
