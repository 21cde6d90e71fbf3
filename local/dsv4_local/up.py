"""`dsv4 up FILE`: a DSV4Deployment as local processes on 127.0.0.1.

`run(args)` checks everything it can before any process starts (file, spec, memory plan,
what `dsv4 up` supports, a GPU for a GPU deployment, the router port, the work directory):
each problem is one line `dsv4 up: error: ...` naming the field or flag and the fix, exit 2.
Then `launch(plan)` starts the processes, waits until all are ready (a process that exits
first, or the timeout, ends it: exit 1), prints every API and status URL and serves until
SIGINT/SIGTERM (exit 0). While it serves, a process that exits is restarted with its PP
group, with backoff and within a budget (`supervise`); once every one has given up, exit 1.
With --request it sends one completion instead of serving (exit 0 when it succeeds). Every
path stops every process. Progress, events and errors go to stderr; the ready summary (or
the completion) to stdout. The work directory (configs, logs, status) is a fresh temporary
one, removed at a clean exit; it stays after a failure (its logs say why), with
`--keep-workdir`, and when `--workdir` names it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TextIO

import yaml

from dsv4_common.api.api_key import API_KEY_ENV, ApiKeyError, parse_api_key, read_api_key_file
from dsv4_common.api.deployment import MemoryPlanError
from dsv4_common.api.spec import SpecError
from dsv4_local.autoscaler import (
    DECISIONS_FILE,
    DEFAULT_INTERVAL_S,
    LocalAutoscaler,
    autoscale_every,
    scales,
)
from dsv4_local.completion import Completion, CompletionError, request_completion
from dsv4_local.deployment import Deployment, ModelFor, device_problem, parse_deployment
from dsv4_local.plan import LaunchPlan, ProcessSpec, build_launch_plan
from dsv4_local.ports import free_ports, port_is_free
from dsv4_local.signals import StopSignals
from dsv4_local.supervise import RestartPolicy, policy_line
from dsv4_local.supervisor import PREFIX, STOP_GRACE_S, Outcome, Supervisor
from dsv4_local.weights import LocalWeights, WeightsError
from dsv4_local.workdir import write_workdir

__all__ = ["CompletionRequest", "UpError", "format_ready", "launch", "load_deployment", "run"]

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2
REQUEST_TIMEOUT_S: Final = 300.0


class UpError(Exception):
    """A bad input found before anything starts; the message names the field or flag."""


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    prompt: str
    max_tokens: int
    timeout_s: float = REQUEST_TIMEOUT_S


def run(args: argparse.Namespace, *, missing_gpu: Callable[[], str] = lambda: "") -> int:
    """`missing_gpu`: why this machine has no CUDA device ("" when it has one), asked only
    for a deployment that needs one (the worker's probe, which `dsv4_cli` hands in)."""
    workdir: Path | None = None
    temporary = args.workdir is None
    weights = LocalWeights(offline=bool(getattr(args, "offline", False)))
    try:
        deployment = load_deployment(Path(args.file), model_for=weights.model_for)
        if not deployment.spec.gpu.cpu_mode and (why := missing_gpu()):
            raise UpError(device_problem(deployment.spec, why))
        _check_router_port(deployment, args.port)
        api_key = local_api_key(deployment, getattr(args, "api_key_file", None), os.environ)
    except UpError as exc:
        print(f"{PREFIX} error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:  # an hf:// source's files, after the plan: nothing moves for a spec that cannot run
        files = weights.files(deployment.spec, deployment.memory.prefill.inputs.model)
    except WeightsError as exc:
        print(f"{PREFIX} error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if files is not None:
        deployment = dataclasses.replace(deployment, files=files)
    try:
        workdir = _workdir(args.workdir)
        plan = build_launch_plan(
            deployment,
            workdir,
            router_port=args.port,
            allocate_ports=free_ports,
            cpus=len(os.sched_getaffinity(0)),  # shared out: the workers run side by side
            api_key=api_key,
        )
        write_workdir(plan)
    except (UpError, OSError) as exc:
        what = f"--workdir: {exc}" if isinstance(exc, OSError) else str(exc)
        print(f"{PREFIX} error: {what}", file=sys.stderr)
        if workdir is not None and temporary:
            shutil.rmtree(workdir, ignore_errors=True)
        return EXIT_USAGE
    request = None
    if args.request is not None:
        request = CompletionRequest(prompt=args.request, max_tokens=args.max_tokens)
    code = launch(plan, timeout_s=args.timeout_s, request=request, deployment=deployment)
    if temporary and not args.keep_workdir and code == EXIT_OK:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        why = "--keep-workdir" if code == EXIT_OK else "a process failed: its log says why"
        print(f"{PREFIX} configs and logs kept in {workdir} ({why})", file=sys.stderr)
    return code


def local_api_key(
    deployment: Deployment, key_file: str | None, environ: Mapping[str, str]
) -> bytes | None:
    """The key the processes want: --api-key-file, else $DSV4_API_KEY; required when the CR
    names a Secret (`spec.apiKey`), which `dsv4 up` cannot read."""
    try:
        if key_file is not None:
            return read_api_key_file(key_file, "--api-key-file")
        if (text := environ.get(API_KEY_ENV)) is not None:
            return parse_api_key(text, API_KEY_ENV)
    except ApiKeyError as exc:
        raise UpError(str(exc)) from exc
    if (ref := deployment.spec.api_key) is not None:
        raise UpError(
            f"spec.apiKey.secretRef: dsv4 up cannot read Secret {ref.name!r}; give its key "
            f"with --api-key-file FILE or ${API_KEY_ENV}"
        )
    return None


def load_deployment(path: Path, model_for: ModelFor | None = None) -> Deployment:
    """Read and check the file; every problem is an UpError naming the field. `model_for`: the
    model of an hf:// source (`weights.LocalWeights.model_for`)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UpError(f"{path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise UpError(f"{path}: not UTF-8 text (byte {exc.start})") from exc
    try:
        return parse_deployment(text, str(path), model_for)
    except yaml.YAMLError as exc:
        raise UpError(f"{path}: not valid YAML: {_yaml_problem(exc)}") from exc
    except (SpecError, MemoryPlanError) as exc:
        raise UpError(str(exc)) from exc


def launch(
    plan: LaunchPlan,
    *,
    timeout_s: float,
    request: CompletionRequest | None = None,
    out: TextIO = sys.stdout,
    err: TextIO = sys.stderr,
    stop_grace_s: float = STOP_GRACE_S,
    policy: RestartPolicy | None = None,
    deployment: Deployment | None = None,
    autoscale_interval_s: float = DEFAULT_INTERVAL_S,
) -> int:
    """Run the plan's processes (see the module docstring); call from the main thread. With
    the `deployment` and a role that autoscales, its groups scale while it serves
    (`autoscaler`)."""
    with StopSignals() as signals:
        with Supervisor(
            plan.processes,
            plan.log_dir,
            out=err,
            stop_requested=lambda: signals.requested,
            stop_signals=lambda: signals.count,
            stop_grace_s=stop_grace_s,
            policy=policy,
            status_path=plan.status_path,
        ) as supervisor:
            scaler = None
            if deployment is not None and scales(deployment):
                scaler = LocalAutoscaler(
                    deployment, plan, supervisor, out=err, interval_s=autoscale_interval_s
                )
            code = _supervise(supervisor, plan, timeout_s, request, out, err, scaler)
            received = signals.received
            why = f" ({signal.Signals(received).name})" if received is not None else ""
            print(f"{PREFIX} stopping{why}", file=err, flush=True)
        print(f"{PREFIX} stopped", file=err, flush=True)
    return code


def _supervise(
    supervisor: Supervisor,
    plan: LaunchPlan,
    timeout_s: float,
    request: CompletionRequest | None,
    out: TextIO,
    err: TextIO,
    scaler: LocalAutoscaler | None = None,
) -> int:
    """Start, wait until ready, then serve or send the request; the caller stops."""
    started_s = time.monotonic()
    print(
        f"{PREFIX} starting {len(plan.processes)} processes (configs and logs in {plan.workdir})",
        file=err,
        flush=True,
    )
    try:
        if not supervisor.start():
            return EXIT_OK  # stopped by a signal
    except OSError as exc:
        print(f"{PREFIX} cannot start a process: {exc}", file=err, flush=True)
        return EXIT_FAILED
    outcome = supervisor.wait_ready(timeout_s)
    if outcome is not Outcome.READY:
        return _exit_code(outcome)
    summary = format_ready(plan, time.monotonic() - started_s)
    if request is not None:
        print(summary, file=err, flush=True)
        return _send(supervisor, plan, request, out, err)
    print(summary, file=out, flush=True)
    print(f"{PREFIX} {policy_line(supervisor.policy)}", file=err, flush=True)
    print(f"{PREFIX} Ctrl-C stops every process (again: ends their drains)", file=err, flush=True)
    if scaler is not None:
        print(
            f"{PREFIX} autoscaling: decided every {autoscale_every(scaler):g} s from the "
            f"workers' /status (decisions in {plan.workdir / DECISIONS_FILE})",
            file=err,
            flush=True,
        )
        return _exit_code(supervisor.serve(every=scaler.tick))
    return _exit_code(supervisor.serve())


def _exit_code(outcome: Outcome) -> int:
    return EXIT_FAILED if outcome is Outcome.FAILED else EXIT_OK


def format_ready(plan: LaunchPlan, ready_s: float) -> str:
    """What `dsv4 up` prints once every process is ready: one labeled fact per line, the
    router first, then each process's API and status URLs."""
    lines = [f"{PREFIX} ready in {ready_s:.1f} s"]
    ordered = sorted(plan.processes, key=lambda p: p.role != "router")  # stable: plan order
    width = max(len(p.name) for p in plan.processes)
    for p in ordered:
        if serves := _serves(p):  # only a port that takes completions is an `api:`
            lines.append(f"api:    {p.name:<{width}}  {p.api_url}  ({serves})")
        lines.append(f"status: {p.name:<{width}}  {p.status_url}")
    if plan.api_key is not None:
        lines.append(f"api key: every API wants it ({plan.api_key_path}; probes need none)")
    lines.append(f"logs: {plan.log_dir}")
    lines.append(f"supervisor status: {plan.status_path}")
    return "\n".join(lines)


def _serves(process: ProcessSpec) -> str:
    """What a process's API port takes ("": no completions: a prefill worker's and a later
    PP stage's port answers the probes only, as its status URL does)."""
    if not process.api_url:
        return ""
    if process.role == "router":
        return "POST /v1/completions, /v1/chat/completions: send requests here"
    if process.role == "decode" and process.pp_rank == 0:
        return "this decode worker's own OpenAI API, past the router"
    return ""


def _send(
    supervisor: Supervisor,
    plan: LaunchPlan,
    request: CompletionRequest,
    out: TextIO,
    err: TextIO,
) -> int:
    """One completion through the router, in a thread so signals and exits still count."""
    results: list[Completion | CompletionError] = []

    def send() -> None:
        try:
            results.append(
                request_completion(
                    plan.router_url,
                    request.prompt,
                    request.max_tokens,
                    request.timeout_s,
                    plan.api_key,
                )
            )
        except CompletionError as exc:
            results.append(exc)

    sent_s = time.monotonic()
    thread = threading.Thread(target=send, name="dsv4-up-request", daemon=True)
    thread.start()
    outcome = supervisor.serve(until=lambda: not thread.is_alive())
    if outcome is not Outcome.DONE:
        return _exit_code(outcome)
    result = results[0] if results else CompletionError("the request thread failed (see above)")
    if isinstance(result, CompletionError):
        print(f"{PREFIX} request failed: {result} (logs: {plan.log_dir})", file=err)
        return EXIT_FAILED
    tokens = "?" if result.completion_tokens is None else str(result.completion_tokens)
    # JSON-quoted: a model with random weights (tiny) answers with arbitrary bytes.
    print(f"completion: {json.dumps(result.text)}", file=out, flush=True)
    print(
        f"{PREFIX} completion: {tokens} tokens in {time.monotonic() - sent_s:.1f} s",
        file=err,
        flush=True,
    )
    return EXIT_OK


def _check_router_port(deployment: Deployment, port: int | None) -> None:
    if port == 0:
        return
    if port is None:
        if not port_is_free(deployment.spec.router.port):
            raise UpError(
                f"spec.router.port: {deployment.spec.router.port} is in use on 127.0.0.1; "
                "pass --port P (0: any free port)"
            )
    elif not port_is_free(port):
        raise UpError(f"--port: {port} is in use on 127.0.0.1 (0: any free port)")


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """One line: where and what (PyYAML's own message spans several)."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        return f"line {mark.line + 1}, column {mark.column + 1}: {exc.problem}"
    return " ".join(str(exc).split())


def _workdir(flag: str | None) -> Path:
    """--workdir (created if missing) or a fresh temporary directory; absolute."""
    if flag is None:
        return Path(tempfile.mkdtemp(prefix="dsv4-up-"))
    path = Path(flag).resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path
