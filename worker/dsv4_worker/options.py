"""`ServeOptions`: everything `dsv4 serve` needs to build a worker, decided once.

Two sources: the flags alone (the quick form, `from_args`) or a rank config plus the flags it
does not hold (the deployed form, `from_rank_config`: --device, --tokenizer, --seed, thread,
queue, HTTP and PD timeouts stay flags, and a flag given wins over the config's field where
both exist). Every "the config's value, else the flag's" decision is here; `serve.build`
reads only the options. Pure except `load_options`, which reads the rank config file and the
pod's environment, and the API key's file (`--api-key-file`, the rank config's api_key_file).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

from dsv4_common.api.api_key import NO_API_KEY, ApiKeyError, ApiKeyRule, resolve_api_key
from dsv4_common.api.documents import DocumentError
from dsv4_common.api.http_rules import HttpLimits, http_limits
from dsv4_common.api.lifecycle import DRAIN_S
from dsv4_common.api.names import DEFAULT_COMPUTE_DTYPE, DSV4_TRANSFERS
from dsv4_common.api.pd_secret import (
    PD_SECRET_FLAG,
    PDSecret,
    PDSecretError,
    load_pd_secret,
    require_pd_secret,
)
from dsv4_common.api.rank_config import RankConfig, parse_rank_config
from dsv4_common.core.layout import RequestState
from dsv4_common.core.model import ModelConfig
from dsv4_common.core.units import GIB
from dsv4_common.plan.inputs import PlanInputs, Role
from dsv4_worker.pp.spec import PPSpec
from dsv4_worker.server.api_options import ApiOptions

CPU_MEMORY_GIB = 1.0  # what a CPU worker plans with when no device size is given
QUICK_HOST = "127.0.0.1"
DEPLOYED_HOST = "0.0.0.0"  # a pod listens on every address
TRANSFERS = DSV4_TRANSFERS  # the KV transfer backends this worker has


class ServeError(Exception):
    """A bad serve argument, config or environment; the message names it (exit 2)."""


class Listen(NamedTuple):
    port: int  # 0: any free port
    name: str  # what a bind error names: the flag or the rank config field


@dataclass(frozen=True, slots=True)
class QuickSizing:
    """The quick form's planner inputs: the sizing flags, on the device's measured memory."""

    role: Role
    gpu_memory_gib: float | None  # None: the measured device memory, else CPU_MEMORY_GIB
    page_size: int | None
    chunked_prefill_tokens: int | None
    max_running_requests: int | None
    context_len: int | None
    request_state: RequestState
    pp_size: int

    def plan(self, model: ModelConfig, measured_bytes: int | None) -> tuple[PlanInputs, None]:
        memory = measured_bytes
        if self.gpu_memory_gib is not None:
            memory = int(self.gpu_memory_gib * GIB)
        inputs = PlanInputs(
            model=model,
            role=self.role,
            gpu_memory_bytes=memory or int(CPU_MEMORY_GIB * GIB),
            page_size=self.page_size,
            chunked_prefill_tokens=self.chunked_prefill_tokens,
            max_running_requests=self.max_running_requests,
            context_len=self.context_len,
            request_state=self.request_state,
            pp_size=self.pp_size,
        )
        return inputs, None


@dataclass(frozen=True, slots=True)
class DeployedSizing:
    """The deployed form's planner inputs: the rank config's plan, re-solved by `build_stage`
    with the device memory the worker measured."""

    config: RankConfig

    def plan(self, model: ModelConfig, measured_bytes: int | None) -> tuple[PlanInputs, int | None]:
        return self.config.plan_inputs(model), measured_bytes


@dataclass(frozen=True, slots=True)
class ServeOptions:
    role: Role
    device: str
    dtype: str  # the compute dtype's name (`--dtype`, else the rank config's): auto, ...
    model_source: str  # what `load_model_config` takes
    host: str  # where the HTTP ports (and PP rank 0's rendezvous) listen
    listen: tuple[Listen, ...]  # the API port; deployed, then the status port
    pp: PPSpec | None  # None: a single stage
    torch_threads: int | None  # --torch-threads
    configured_torch_threads: int | None  # the rank config's
    transfer: str | None  # the KV transfer backend; None when colocated
    tokenizer: str | None
    weights_path: str | None  # None: the model directory's, a preset's shipped, or random
    seed: int | None
    sizing: QuickSizing | DeployedSizing
    max_queue_requests: int | None  # None: derived from the request slots
    queue_timeout_s: float | None
    served_model_names: tuple[str, ...]  # empty: the model's own name
    http: HttpLimits
    kv_port: int  # prefill: the KV control socket's (0: any free)
    default_prefill: str | None  # decode: the prefill KV control address a request may omit
    transfer_timeout_s: float
    transfer_threads: int | None
    drain_timeout_s: float
    api: ApiOptions  # the OpenAI API's defaults (flags in both forms)
    auth: ApiKeyRule = NO_API_KEY  # the API key clients must send (`dsv4_common.api.api_key`)
    pd_secret: PDSecret | None = None  # a PD role's (required); None: colocated

    @property
    def deployed(self) -> bool:
        return isinstance(self.sizing, DeployedSizing)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeOptions:
        """The quick form: every value from the flags."""
        return cls(
            role=args.role,
            device=args.device or "cpu",
            dtype=args.dtype or DEFAULT_COMPUTE_DTYPE,
            model_source=args.model,
            host=args.host or QUICK_HOST,
            listen=(Listen(args.port, "--port"),),
            pp=_quick_pp(args, args.host or QUICK_HOST),
            torch_threads=args.torch_threads,
            configured_torch_threads=None,
            transfer=_transfer(args.role, args.transfer, "--transfer"),
            tokenizer=args.tokenizer,
            weights_path=args.weights,
            seed=args.seed,
            sizing=QuickSizing(
                role=args.role,
                gpu_memory_gib=args.gpu_memory_gib,
                page_size=args.page_size,
                chunked_prefill_tokens=args.chunked_prefill_size,
                max_running_requests=args.max_running_requests,
                context_len=args.context_len,
                request_state=args.request_state,
                pp_size=args.pp_size,
            ),
            max_queue_requests=args.max_queue_requests,
            queue_timeout_s=args.queue_timeout_s,
            served_model_names=served_names(args.served_model_name),
            http=_http(args),
            kv_port=args.kv_port,
            default_prefill=args.prefill,
            transfer_timeout_s=args.transfer_timeout_s,
            transfer_threads=args.transfer_threads,
            drain_timeout_s=args.drain_timeout_s or DRAIN_S,
            api=api_options(args),
            auth=_auth(args, None, open_status=args.open_status),
        )

    def with_secret(self, path: str | None, where: str, environ: Mapping[str, str]) -> ServeOptions:
        """The options with the PD secret a PD role needs: the file at `path` (`where` names
        the flag or field), else DSV4_PD_SECRET; ServeError naming how to give one."""
        if self.role == "colocated":
            return self
        try:
            secret = require_pd_secret(load_pd_secret(path, environ, where=where), self.role)
        except PDSecretError as exc:
            raise ServeError(str(exc)) from exc
        return replace(self, pd_secret=secret)

    @classmethod
    def from_rank_config(
        cls, config: RankConfig, args: argparse.Namespace, *, group: str = ""
    ) -> ServeOptions:
        """The deployed form: the rank config's values, with the flags it does not hold (and
        the flags given that override its fields). `group`: this pod's PP group name (its
        `DSV4_GROUP`), which names rank 0's host."""
        host = args.host or DEPLOYED_HOST
        pp = None
        if config.pp_size > 1:
            pp = PPSpec(
                config.pp_rank,
                config.pp_size,
                config.peers.host_template.format(group=group, rank=0),
                config.ports.pp,
                timeout_s=args.pp_timeout_s,
                listen_host=host,
            )
        return cls(
            role=config.role,
            device=args.device or ("cpu" if config.plan.cpu_mode else "cuda"),
            dtype=config.model.dtype,
            model_source=config.model.source,
            host=host,
            listen=(
                Listen(config.ports.http, "rank config ports.http"),
                Listen(config.ports.status, "rank config ports.status"),
            ),
            pp=pp,
            torch_threads=args.torch_threads,
            configured_torch_threads=config.torch_threads,
            transfer=_transfer(config.role, config.kv.transfer, "rank config kv.transfer"),
            tokenizer=args.tokenizer,
            weights_path=config.model.weights_path,
            seed=args.seed,
            sizing=DeployedSizing(config),
            max_queue_requests=args.max_queue_requests or config.max_queue_requests,
            queue_timeout_s=args.queue_timeout_s or config.queue_timeout_s,
            served_model_names=(
                served_names(args.served_model_name) or config.model.served_model_names
            ),
            http=_http(args),
            kv_port=config.ports.kv,
            default_prefill=(
                args.prefill
                if args.prefill is not None
                else f"{config.role_services['prefill']}:{config.ports.kv}"
            ),
            transfer_timeout_s=args.transfer_timeout_s,
            transfer_threads=args.transfer_threads,
            drain_timeout_s=args.drain_timeout_s or DRAIN_S,
            api=api_options(args),
            auth=_auth(args, config.api_key_file, open_status=True),  # the status port: open
        )


def load_options(args: argparse.Namespace, environ: Mapping[str, str]) -> ServeOptions:
    """The options of `dsv4 serve`: with --config-dir, from the rank config of this pod's PP
    rank (`DSV4_PP_RANK`), else from the flags."""
    flag = getattr(args, "pd_secret_file", None)
    if args.config_dir is None:
        return ServeOptions.from_args(args).with_secret(flag, PD_SECRET_FLAG, environ)
    pp_rank = int(environ.get("DSV4_PP_RANK", "0") or 0)
    config = read_rank_config(Path(args.config_dir), args.role, pp_rank)
    opts = ServeOptions.from_rank_config(config, args, group=environ.get("DSV4_GROUP", ""))
    if flag is None and config.pd_secret_file is not None:
        return opts.with_secret(config.pd_secret_file, "rank config pd_secret_file", environ)
    return opts.with_secret(flag, PD_SECRET_FLAG, environ)


def read_rank_config(config_dir: Path, role: str, pp_rank: int) -> RankConfig:
    path = config_dir / f"{role}-rank-{pp_rank}.json"
    try:
        config = parse_rank_config(json.loads(path.read_text()))
    except OSError as exc:
        raise ServeError(f"--config-dir: cannot read {path} ({exc.strerror or exc})") from exc
    except (json.JSONDecodeError, DocumentError) as exc:
        raise ServeError(f"{path}: {exc}") from exc
    if config.role != role or config.pp_rank != pp_rank:
        raise ServeError(
            f"{path}: holds role {config.role} PP rank {config.pp_rank}, not --role {role} "
            f"PP rank {pp_rank}"
        )
    return config


def api_options(args: argparse.Namespace) -> ApiOptions:
    """--max-tokens-default, --strict-fields, --thinking."""
    return ApiOptions(
        max_tokens_default=args.max_tokens_default,
        strict_fields=bool(args.strict_fields),
        thinking_default=args.thinking == "on",
    )


def served_names(names: list[str] | None) -> tuple[str, ...]:
    """--served-model-name, checked (empty: the rank config's names, else the model's own)."""
    if not names:
        return ()
    if any(not n.strip() for n in names):
        raise ServeError("--served-model-name: a name must not be empty")
    return tuple(dict.fromkeys(names))


def _transfer(role: str, backend: str, where: str) -> str | None:
    if role == "colocated":
        return None
    if backend not in TRANSFERS:
        raise ServeError(f"{where}: {backend} is not available in this worker; use nixl or zmq")
    return backend


def _quick_pp(args: argparse.Namespace, host: str) -> PPSpec | None:
    """Where this stage's PP group meets (rank 0's PP port), or None for a single stage."""
    if args.pp_size == 1:
        return None
    if args.pp_rank >= args.pp_size:
        raise ServeError(f"--pp-rank {args.pp_rank}: must be below --pp-size {args.pp_size}")
    if args.pp_addr is None:
        raise ServeError("--pp-addr HOST:PORT is required with --pp-size > 1 (rank 0 listens)")
    addr_host, _, port = args.pp_addr.rpartition(":")
    if not addr_host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ServeError(f"--pp-addr {args.pp_addr}: expected HOST:PORT")
    return PPSpec(
        args.pp_rank,
        args.pp_size,
        addr_host,
        int(port),
        timeout_s=args.pp_timeout_s,
        listen_host=host,  # rank 0 hosts the rendezvous on --host only
    )


def _auth(
    args: argparse.Namespace, configured_file: str | None, *, open_status: bool
) -> ApiKeyRule:
    """The API key: --api-key, --api-key-file, else the rank config's file (read here)."""
    try:
        key = resolve_api_key(
            args.api_key,
            args.api_key_file,
            configured_file,
            config_field="rank config api_key_file",
        )
    except ApiKeyError as exc:
        raise ServeError(str(exc)) from exc
    return ApiKeyRule(key, open_status=open_status)


def _http(args: argparse.Namespace) -> HttpLimits:
    return http_limits(
        body_timeout_s=args.http_body_timeout_s,
        idle_timeout_s=args.http_idle_timeout_s,
        max_connections=args.max_connections,
    )
