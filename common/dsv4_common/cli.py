"""The `dsv4` command line. Parses arguments, calls pure functions, prints; no decisions here."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from dsv4_common.core.layout import LayoutError
from dsv4_common.core.model import ModelConfigError
from dsv4_common.core.presets import PRESETS, load_model_config
from dsv4_common.plan.inputs import GIB, ROLES, PlanError, PlanInputs
from dsv4_common.plan.planner import plan
from dsv4_common.plan.report import format_table, plan_to_dict


def _bounded(kind: type[int] | type[float], minimum: float, *, inclusive: bool) -> Any:
    """An argparse type: parse `kind` and require value >= minimum (or > when not inclusive)."""
    noun = "an integer" if kind is int else "a number"
    bound = f">= {minimum:g}" if inclusive else f"> {minimum:g}"

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}") from None
        if not (value >= minimum if inclusive else value > minimum):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    return parse


_positive_int = _bounded(int, 1, inclusive=True)
_non_negative_int = _bounded(int, 0, inclusive=True)
_positive_float = _bounded(float, 0, inclusive=False)


def _layer_split(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated layer counts such as 16,15,15,15, got {text!r}"
        ) from None


def _add_plan_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    p.add_argument("--pp", type=_positive_int, default=1, help="pipeline-parallel size")
    p.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel size")
    p.add_argument(
        "--gpu-memory-gib",
        type=_positive_float,
        required=True,
        help="memory per device in GiB (H200: 141 GB = 131.3 GiB)",
    )
    p.add_argument(
        "--mem-fraction",
        type=_positive_float,
        default=0.9,
        help="fraction of device memory for weights + KV (rest: activations)",
    )
    p.add_argument(
        "--swa-ratio",
        type=_positive_float,
        default=None,
        help="SWA tokens per full token; default: sized from what the role needs",
    )
    p.add_argument("--max-running-requests", type=_positive_int, default=None)
    p.add_argument(
        "--chunked-prefill-size",
        type=_positive_int,
        default=None,
        help="prefill chunk in tokens (default: 32 pages)",
    )
    p.add_argument(
        "--speculative-draft-tokens",
        type=_non_negative_int,
        default=0,
        help="MTP draft tokens per step (0 = no speculative decoding)",
    )
    p.add_argument(
        "--page-size",
        type=_positive_int,
        default=None,
        help="tokens per page (default: 256, tiny models 16)",
    )
    p.add_argument(
        "--context-len",
        type=_positive_int,
        default=None,
        help="cap on context length (default: the model's max_position_embeddings)",
    )
    p.add_argument(
        "--layer-split",
        type=_layer_split,
        default=None,
        help="target layers per PP rank, e.g. 16,15,15,15 (default: even)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def _add_render_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "render",
        help="print every object the operator would apply for a DSV4Deployment",
        description="Render a DSV4Deployment file to the Kubernetes objects the operator "
        "applies, as a YAML stream (for GitOps). Invalid specs and contexts that do not fit "
        "the memory plan are errors (exit 2).",
    )
    p.add_argument("file", help="YAML file holding one or more DSV4Deployment documents")
    p.add_argument("--namespace", "-n", default=None, help="namespace when the file has none")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsv4", description="dsv4-serve command line")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_plan_parser(sub)
    _add_render_parser(sub)
    return parser


def _run_plan(args: argparse.Namespace) -> int:
    model = load_model_config(args.model)
    inputs = PlanInputs(
        model=model,
        role=args.role,
        gpu_memory_bytes=int(args.gpu_memory_gib * GIB),
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
    )
    result = plan(inputs)
    if args.json:
        print(json.dumps(plan_to_dict(result), indent=2))
    else:
        print(format_table(result))
    return 0


def _run_render(args: argparse.Namespace) -> int:
    # The only place the worker package reaches into the operator, and only when asked.
    from pathlib import Path

    import yaml

    from dsv4_common.api.deployment import MemoryPlanError
    from dsv4_common.api.spec import SpecError
    from dsv4_operator.render import render_file

    try:
        sys.stdout.write(render_file(Path(args.file), namespace=args.namespace))
    except (SpecError, MemoryPlanError, OSError, yaml.YAMLError) as exc:
        print(f"dsv4 render: error: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "plan":
            return _run_plan(args)
        if args.command == "render":
            return _run_render(args)
    except (PlanError, LayoutError, ModelConfigError) as exc:
        print(f"dsv4 {args.command}: error: {exc}", file=sys.stderr)
        return 2
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
