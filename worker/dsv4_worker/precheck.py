"""`dsv4 serve`'s checks before torch is imported (that import alone takes 1.5-2 s here, the
weights as long again): the model, the device, the files, the prefill address, the plan and
the ports. Each failure is a ServeError naming the flag (or the rank config field) and the
fix, under a second after the command starts.

What it decides is what `serve.build` then uses, so nothing is checked twice or differently:
the model config, the weights to load, and the HTTP sockets, bound here and handed on (a
busy port fails now, and no other process can take it in between). The KV and PP ports are
only probed (another library binds them later). Side effects: files, sockets, the NVIDIA
driver (`devices`); no torch, enforced by import-linter.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from dsv4_common.core.model import ModelConfig, ModelConfigError
from dsv4_common.core.presets import PRESETS, load_model_config
from dsv4_common.core.units import format_bytes
from dsv4_common.plan.inputs import PlanError
from dsv4_common.plan.planner import plan
from dsv4_router.listen_sockets import ListenError, bind
from dsv4_worker.devices import CudaDevices, cuda_devices, torch_cuda_problem
from dsv4_worker.model.files import INDEX, SINGLE, is_model_dir, missing_shards
from dsv4_worker.options import QuickSizing, ServeError, ServeOptions

__all__ = ["PACKAGED_MODELS", "Prechecked", "packaged_weights", "precheck"]

PACKAGED_MODELS: Final = Path(__file__).resolve().parent / "models"  # a preset's shipped weights
WEIGHTS_FILE: Final = SINGLE  # what a --weights directory without an index holds

# PlanInputs fields -> the `dsv4 serve` flag that sets them (the quick form).
PLAN_FLAGS: Final[dict[str, str]] = {
    "role": "--role",
    "gpu_memory_bytes": "--gpu-memory-gib (default: the device's memory; 1 GiB on CPU)",
    "pp_size": "--pp-size",
    "page_size": "--page-size",
    "chunked_prefill_tokens": "--chunked-prefill-size",
    "max_running_requests": "--max-running-requests",
    "context_len": "--context-len",
    "request_state": "--request-state",
}


@dataclass(frozen=True, slots=True)
class Prechecked:
    model: ModelConfig
    weights_path: str | None  # a model directory or a .safetensors file; None: seeded random
    listeners: tuple[list[socket.socket], ...]  # the API's (deployed: then the status port's)


def precheck(opts: ServeOptions, devices: Callable[[], CudaDevices] = cuda_devices) -> Prechecked:
    """Every check that needs no torch, cheapest first; raises ServeError. `devices`: the CUDA
    probe (read only for `--device cuda`)."""
    model = _model(opts)
    memory_bytes = _device(opts, devices)
    weights_path = _weights(opts)
    _tokenizer(opts.tokenizer)
    _prefill(opts)
    _plan(opts, model, memory_bytes)
    _probe_ports(opts)
    return Prechecked(model, weights_path, _bind(opts))


def packaged_weights(preset: str) -> str | None:
    """The model directory shipped for a preset (dsv4_worker/models/NAME: tiny's is trained by
    scripts/train_tiny.py), or None (random weights)."""
    root = PACKAGED_MODELS / preset
    return str(root) if preset in PRESETS and is_model_dir(root) else None


def _where(opts: ServeOptions) -> str:
    return "rank config model.source" if opts.deployed else "--model"


def _model(opts: ServeOptions) -> ModelConfig:
    try:
        return load_model_config(opts.model_source)
    except ModelConfigError as exc:
        raise ServeError(f"{_where(opts)}: {exc}") from exc


def _device(opts: ServeOptions, devices: Callable[[], CudaDevices]) -> int | None:
    """The memory of the device the worker will use (None: the CPU)."""
    if opts.device != "cuda":
        return None
    where = "--device cuda" + (" (a GPU deployment's rank config)" if opts.deployed else "")
    found = devices()
    if not found.count:
        raise ServeError(f"{where}: {found.missing}; --device cpu serves on the CPU")
    if problem := torch_cuda_problem():
        raise ServeError(f"{where}: {problem}; install a CUDA build of torch")
    return found.memory_bytes[0]  # `cuda` is device 0, as torch takes it


def _weights(opts: ServeOptions) -> str | None:
    """What the worker loads: --weights (the rank config's model.weights), else `--model DIR`'s
    checkpoint, else a preset's shipped weights (unless --seed), else seeded random weights."""
    source = opts.model_source
    if opts.weights_path is not None:
        where = "rank config model.weights_path" if opts.deployed else "--weights"
        _check_weights(Path(opts.weights_path), where)
        return opts.weights_path
    if is_model_dir(source):
        _check_weights(Path(source), _where(opts))
        return source
    if Path(source).is_dir() and opts.seed is None:
        raise ServeError(
            f"{_where(opts)} {source}: the directory holds config.json but no weights (neither "
            f"{SINGLE} nor {INDEX} and its shards); --weights PATH names them elsewhere, "
            "--seed N serves random weights"
        )
    return packaged_weights(source) if opts.seed is None else None


def _check_weights(path: Path, where: str) -> None:
    if not path.exists():
        raise ServeError(f"{where} {path}: no such file or directory")
    if path.is_dir():
        if not (path / INDEX).is_file() and not (path / WEIGHTS_FILE).is_file():
            raise ServeError(f"{where} {path}: the directory holds neither {SINGLE} nor {INDEX}")
        if missing := missing_shards(path):
            listed = ", ".join(missing[:4]) + (
                f" and {len(missing) - 4} more" if len(missing) > 4 else ""
            )
            raise ServeError(f"{where} {path}: {INDEX} names shards that are not there: {listed}")


def _tokenizer(path: str | None) -> None:
    if path is not None and not Path(path).exists():
        raise ServeError(f"--tokenizer {path}: no such file or directory")


def _prefill(opts: ServeOptions) -> None:
    """A decode worker needs a prefill to send it every prompt: without one, each request
    would fail (the router's 502)."""
    if opts.role != "decode":
        return
    address = opts.default_prefill
    if address is None:
        raise ServeError(
            "--role decode needs --prefill HOST:PORT, the KV control address of a prefill "
            "worker (its --kv-port): a decode worker computes no prompt itself"
        )
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ServeError(f"--prefill {address}: expected HOST:PORT")


def _plan(opts: ServeOptions, model: ModelConfig, memory_bytes: int | None) -> None:
    """The quick form's plan, as `pp.group.build_stage` first solves it (before any weight
    loads): a flag the model or the memory cannot honor fails here, naming the flag. (The
    deployed form's plan is the operator's or `dsv4 up`'s, already solved.)"""
    if not isinstance(opts.sizing, QuickSizing):
        return
    try:
        inputs, _ = opts.sizing.plan(model, memory_bytes)
    except PlanError as exc:
        raise ServeError(f"{PLAN_FLAGS.get(exc.input_name or '', 'plan')}: {exc}") from exc
    try:
        plan(inputs)
    except PlanError as exc:
        flag = PLAN_FLAGS.get(exc.input_name or "")
        if flag is None:  # a limit of the whole plan: the memory it was made for
            memory = format_bytes(inputs.gpu_memory_bytes)
            flag = f"plan for {memory} of memory (--gpu-memory-gib; 1 GiB on CPU by default)"
        raise ServeError(f"{flag}: {exc}") from exc


def _bind(opts: ServeOptions) -> tuple[list[socket.socket], ...]:
    """The HTTP sockets, bound (all or none)."""
    bound: list[list[socket.socket]] = []
    try:
        for port, name in opts.listen:
            bound.append(bind(opts.host, port, name))
    except ListenError as exc:
        for sockets in bound:
            for sock in sockets:
                sock.close()
        in_use = isinstance(exc.__cause__, OSError) and exc.__cause__.errno == errno.EADDRINUSE
        hint = "; --port 0 takes any free port" if in_use and not opts.deployed else ""
        raise ServeError(f"{exc}{hint}") from exc
    return tuple(bound)


def _probe_ports(opts: ServeOptions) -> None:
    """The ports another library binds later: a prefill's KV control port, a PP group's
    rendezvous port on rank 0. Bound and released here, so that a busy one is named now."""
    probes: list[tuple[str, int, str]] = []  # (host, port, what names it)
    if opts.role == "prefill" and opts.kv_port:
        name = "rank config ports.kv" if opts.deployed else "--kv-port"
        probes.append((opts.host, opts.kv_port, name))
    if opts.pp is not None and opts.pp.rank == 0:
        name = "rank config ports.pp" if opts.deployed else "--pp-addr"
        probes.append((opts.pp.listen_host or opts.pp.host, opts.pp.port, name))
    for host, port, name in probes:
        try:
            for sock in bind(host, port, name):
                sock.close()
        except ListenError as exc:
            raise ServeError(str(exc)) from exc
