"""The `dsv4` command line. Parses arguments, calls pure functions, prints; no decisions here.

`plan` is pure (this package); `render` imports the operator package, and only when run, so
the command works in the operator image (no torch) and in the worker image alike. Every bad
input exits 2 with a message naming the flag or field, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dsv4_common.api.names import namespace_error
from dsv4_common.core.gpus import GPU_TYPE_NAMES, gpu_type
from dsv4_common.core.layout import REQUEST_STATES
from dsv4_common.core.model import ModelConfig, ModelConfigError
from dsv4_common.core.presets import PRESETS, load_model_config
from dsv4_common.core.units import GIB
from dsv4_common.plan.inputs import DEFAULT_MEM_FRACTION, ROLES, PlanError, PlanInputs
from dsv4_common.plan.planner import Plan, plan
from dsv4_common.plan.report import format_table, plan_to_dict


def _bounded(
    kind: type[int] | type[float],
    minimum: float,
    *,
    inclusive: bool,
    maximum: float | None = None,
) -> Any:
    """An argparse type: parse `kind`, require a finite value >= minimum (> when not
    inclusive) and <= maximum."""
    noun = "an integer" if kind is int else "a number"
    bound = f">= {minimum:g}" if inclusive else f"> {minimum:g}"

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if not (value >= minimum if inclusive else value > minimum):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value:g}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum:g}, got {value:g}")
        return value

    return parse


# Far above any device or deployment; low enough that byte arithmetic stays exact.
MAX_GPU_MEMORY_GIB = 1 << 20
MAX_COUNT = 1 << 40
_positive_int = _bounded(int, 1, inclusive=True, maximum=MAX_COUNT)
_non_negative_int = _bounded(int, 0, inclusive=True, maximum=MAX_COUNT)
_gpu_memory_gib = _bounded(float, 0, inclusive=False, maximum=MAX_GPU_MEMORY_GIB)
_fraction = _bounded(float, 0, inclusive=False, maximum=1)
_positive_float = _bounded(float, 0, inclusive=False, maximum=MAX_COUNT)

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
    gpu = p.add_mutually_exclusive_group(required=True)
    gpu.add_argument(
        "--gpu",
        choices=GPU_TYPE_NAMES,
        help="device type: its memory as the device reports it (h200: 143,771 MiB = 140.4 GiB)",
    )
    gpu.add_argument(
        "--gpu-memory-gib",
        type=_gpu_memory_gib,
        help="memory per device in GiB, for a device without a --gpu type",
    )
    p.add_argument(
        "--mem-fraction",
        type=_fraction,
        default=DEFAULT_MEM_FRACTION,
        help="fraction of device memory for weights + KV (rest: activations)",
    )
    p.add_argument(
        "--swa-ratio",
        type=_fraction,
        default=None,
        help="SWA tokens per full token; default: sized from what the role needs",
    )
    _add_sizing_args(p)
    p.add_argument(
        "--speculative-draft-tokens",
        type=_non_negative_int,
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


def _add_sizing_args(p: argparse.ArgumentParser) -> None:
    """The planner inputs `plan` and `serve` both take."""
    p.add_argument("--max-running-requests", type=_positive_int, default=None)
    p.add_argument(
        "--chunked-prefill-size",
        type=_positive_int,
        default=None,
        help="prefill chunk in tokens (default: 32 pages)",
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
        "--request-state",
        choices=REQUEST_STATES,
        default="ring",
        help="DSV4 HCA compressor state per request: a ring of the block's tokens (ring) or "
        "3 exact streaming rows (online)",
    )


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
    p.add_argument(
        "--model-config",
        default=None,
        metavar="FILE",
        help="the config.json that spec.model.configMapRef names (render reads no cluster)",
    )


def _add_serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="run a worker: the OpenAI-compatible API over the paged engine",
        description="Serve a model. Quick form: dsv4 serve --model tiny (colocated, one "
        "process; --role prefill|decode|router for a hand-made PD deployment). Deployed form: "
        "dsv4 serve --role R --config-dir DIR (the rank or router config the operator or "
        "dsv4 up renders).",
    )
    p.add_argument(
        "--model",
        default="tiny",
        help="a preset, a config.json, or a HuggingFace model directory (its config.json, "
        "safetensors weights and tokenizer are used)",
    )
    p.add_argument("--role", choices=(*ROLES, "router"), default="colocated")
    p.add_argument("--config-dir", default=None, help="the rank config the operator renders")
    p.add_argument(
        "--host",
        default=None,
        help="address to listen on (default: 127.0.0.1; 0.0.0.0 with --config-dir)",
    )
    p.add_argument(
        "--port",
        type=_bounded(int, 0, inclusive=True, maximum=65535),
        default=8000,
        help="API port (0: any free port; the one taken is printed)",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--weights",
        default=None,
        help="a .safetensors file or a model directory (default: --model's directory, else "
        "seeded random)",
    )
    p.add_argument(
        "--seed",
        type=_non_negative_int,
        default=None,
        help="random weights of this seed (default: the preset's shipped weights when it has "
        "them, as tiny does, else seed 0)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer.json, or a HuggingFace model directory with one and its "
        "tokenizer_config.json (default: bytes, for tiny)",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the names the API serves the model under (`model` in requests, /v1/models); "
        "answers carry the one a request names, else the first (default: the model's name: "
        "its preset or its directory's name)",
    )
    p.add_argument(
        "--gpu-memory-gib",
        type=_gpu_memory_gib,
        default=None,
        help="memory to plan with (default: the device's; 1 GiB on CPU)",
    )
    p.add_argument(
        "--torch-threads",
        type=_positive_int,
        default=None,
        help="torch intra-op threads (default: the rank config's, else the CPUs this process "
        "may use less one for its own threads; see dsv4_common.plan.threads)",
    )
    p.add_argument(
        "--drain-timeout-s",
        type=_positive_float,
        default=None,
        help="worker: after SIGTERM, requests in flight get this long to finish before they "
        "are aborted with an error (default 20; a second signal ends the drain at once)",
    )
    _add_sizing_args(p)
    queue = p.add_argument_group("admission (worker)")
    queue.add_argument(
        "--max-queue-requests",
        type=_positive_int,
        default=None,
        help="requests that may wait for the engine at once; past it a request gets 503 + "
        "Retry-After at once (default: the rank config's, else 2 x max running requests)",
    )
    queue.add_argument(
        "--queue-timeout-s",
        type=_positive_float,
        default=None,
        help="a request not scheduled this long after it arrived is removed and answered "
        "503 + Retry-After (default: the rank config's, else 5)",
    )
    http = p.add_argument_group("HTTP clients (worker and router)")
    http.add_argument(
        "--http-idle-timeout-s",
        type=_positive_float,
        default=None,
        help="close a connection that has sent no whole request's headers this long after "
        "connecting or its last answer (keep-alive and header timeout; default 75)",
    )
    http.add_argument(
        "--http-body-timeout-s",
        type=_positive_float,
        default=None,
        help="answer 408 when a request's body has not fully arrived this long after its "
        "headers (default 60)",
    )
    http.add_argument(
        "--max-connections",
        type=_positive_int,
        default=None,
        help="open client connections per port; past it the oldest one without a whole "
        "request is closed, or the new one refused when all are busy (default: from the "
        "open-file limit, at most 4096)",
    )
    pd = p.add_argument_group("PD disaggregation (quick form)")
    pd.add_argument(
        "--transfer",
        choices=("nixl", "zmq"),
        default="nixl",
        help="KV transfer backend of prefill and decode (default: nixl)",
    )
    pd.add_argument(
        "--kv-port",
        type=_bounded(int, 0, inclusive=True, maximum=65535),
        default=0,
        help="prefill: port of the KV control socket decode workers connect to (0: any free)",
    )
    pd.add_argument(
        "--prefill",
        default=None,
        metavar="HOST:PORT",
        help="decode: the prefill KV control address used when a request names none",
    )
    pd.add_argument(
        "--transfer-timeout-s",
        type=_positive_float,
        default=60.0,
        help="decode: fail a request (and free its preallocation) when its prefill has not "
        "delivered by then; prefill: give up on it after this long",
    )
    pd.add_argument(
        "--transfer-threads",
        type=_bounded(int, 0, inclusive=True, maximum=64),
        default=None,
        help="prefill, nixl: threads that post a big write's byte shares at once, each on "
        "its own UCX worker (default 2; writes under 256 KiB per thread stay on the engine "
        "thread; 0 or 1: the engine thread posts everything)",
    )
    pp = p.add_argument_group("pipeline parallelism (quick form)")
    pp.add_argument("--pp-size", type=_positive_int, default=1, help="stages in the PP group")
    pp.add_argument("--pp-rank", type=_non_negative_int, default=0, help="this stage's rank")
    pp.add_argument(
        "--pp-addr",
        default=None,
        metavar="HOST:PORT",
        help="where the group meets: rank 0 listens on PORT (on --host only), the others "
        "connect to HOST:PORT",
    )
    pp.add_argument(
        "--pp-timeout-s",
        type=_positive_float,
        default=30.0,
        help="a stage that does not answer within this long fails the group",
    )
    pd.add_argument(
        "--instance",
        action="append",
        default=[],
        metavar="ROLE=HOST:HTTP:STATUS:KV",
        help="router: a prefill or decode instance (repeat for each)",
    )
    pd.add_argument(
        "--router-processes",
        type=_positive_int,
        default=None,
        metavar="N",
        help="router: N processes serving one port, each with its own event loop (default: "
        "one per CPU this process may use, at most 4)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsv4", description="dsv4-serve command line")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_plan_parser(sub)
    _add_render_parser(sub)
    _add_serve_parser(sub)
    _add_up_parser(sub)
    return parser


def _gpu_memory_bytes(args: argparse.Namespace) -> int:
    if args.gpu is not None:
        return gpu_type(args.gpu).memory_bytes
    return int(args.gpu_memory_gib * GIB)


def _run_plan(args: argparse.Namespace) -> int:
    try:
        model = load_model_config(args.model)
    except ModelConfigError as exc:
        raise _Usage(f"--model: {exc}") from exc
    try:
        inputs = _plan_inputs(args, model)
        result = plan(inputs)
    except PlanError as exc:
        flag = PLAN_FLAGS.get(exc.input_name or "")
        raise _Usage(f"{flag}: {exc}" if flag else str(exc)) from exc
    balanced = _balanced_alternative(inputs) if inputs.layer_split is not None else None
    if args.json:
        _write(json.dumps(plan_to_dict(result, balanced), indent=2))
    else:
        _write(format_table(result, balanced))
    return 0


def _balanced_alternative(inputs: PlanInputs) -> Plan | None:
    """With a fixed --layer-split: the plan the balanced split would give (None: none fits)."""
    try:
        return plan(dataclasses.replace(inputs, layer_split=None))
    except PlanError:
        return None


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


def _run_render(args: argparse.Namespace) -> int:
    try:
        from dsv4_operator.render import render_file
    except ImportError as exc:
        raise _Usage(
            f"needs the operator package ({exc}): pip install 'dsv4-serve[operator]'"
        ) from exc
    import yaml

    from dsv4_common.api.deployment import MemoryPlanError
    from dsv4_common.api.spec import SpecError

    if args.namespace is not None and (why := namespace_error(args.namespace)):
        raise _Usage(f"--namespace: {why}")
    try:
        model_config = Path(args.model_config).read_text() if args.model_config else None
    except (OSError, UnicodeDecodeError) as exc:
        raise _Usage(f"--model-config {args.model_config}: {exc}") from exc
    try:
        text = render_file(Path(args.file), namespace=args.namespace, model_config=model_config)
    except (SpecError, MemoryPlanError, yaml.YAMLError) as exc:
        raise _Usage(str(exc)) from exc
    except OSError as exc:
        raise _Usage(f"{args.file}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise _Usage(f"{args.file}: not UTF-8 text (byte {exc.start})") from exc
    _write(text, newline=False)
    return 0


class _Usage(Exception):
    """A bad input: printed as `dsv4 <command>: error: ...`, exit code 2."""


def _write(text: str, *, newline: bool = True) -> None:
    sys.stdout.write(text + ("\n" if newline else ""))
    sys.stdout.flush()


# Exit code of a process killed by SIGPIPE, as shells report it (`yes | head -1`).
EXIT_BROKEN_PIPE = 128 + 13


def _run_serve(args: argparse.Namespace) -> int:
    if args.role == "router":  # the router never imports torch
        try:
            from dsv4_router.serve import run as run_router
        except ImportError as exc:
            raise _Usage(f"needs the router package ({exc}): pip install dsv4-serve") from exc
        return run_router(args)
    try:
        from dsv4_worker.serve import run
    except ImportError as exc:
        raise _Usage(f"needs the worker package ({exc}): pip install 'dsv4-serve[worker]'") from exc
    return run(args)


def _add_up_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "up",
        help="run a DSV4Deployment as local processes (router, prefill, decode) on 127.0.0.1",
        description="Plan a DSV4Deployment with the shared planner, render the same rank "
        "configs the operator would, start one process per replica and PP rank on "
        "127.0.0.1, wait until every one is ready, print every API and status URL, restart "
        "a process that exits (its whole PP group) with backoff within a budget, and stop "
        "them all on Ctrl-C / SIGTERM.",
    )
    p.add_argument("file", help="YAML file holding one DSV4Deployment")
    p.add_argument(
        "--port",
        type=_bounded(int, 0, inclusive=True, maximum=65535),
        default=None,
        help="router port (default: the CR's spec.router.port)",
    )
    p.add_argument(
        "--timeout-s",
        type=_positive_float,
        default=300.0,
        help="how long to wait for every process to be ready",
    )
    p.add_argument(
        "--workdir",
        default=None,
        help="where configs and logs go (default: a fresh temporary directory)",
    )
    p.add_argument(
        "--request",
        default=None,
        metavar="PROMPT",
        help="once ready, send one completion with this prompt, print it and stop",
    )
    p.add_argument("--max-tokens", type=_positive_int, default=16, help="with --request")


def _run_up(args: argparse.Namespace) -> int:
    try:
        from dsv4_local.up import run as run_up
    except ImportError as exc:
        raise _Usage(f"needs the local launcher package ({exc}): pip install dsv4-serve") from exc
    return run_up(args)


COMMANDS = {"plan": _run_plan, "render": _run_render, "serve": _run_serve, "up": _run_up}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except _Usage as exc:
        print(f"dsv4 {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`dsv4 plan --json | head -1`): stop quietly, as Unix tools do.
        # Point stdout at /dev/null so the interpreter's final flush cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
