"""The router's settings, from `dsv4 serve --role router` arguments.

Two forms: deployed (`--config-dir DIR` holding `router.json`, the router-config document) and
quick (`--instance ROLE=HOST:HTTP:STATUS:KV`, repeated). Both need the deployment's PD secret
(`--pd-secret-file`, the router config's `pd_secret_file`, or DSV4_PD_SECRET): the router signs
each request's `X-DSV4-Prefill` with it, and decode workers honor only a signed one. Every bad
input raises `ConfigError` whose message names the flag or the document field. Reads
router.json, the API key's and the PD secret's files; otherwise pure.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Final

from dsv4_common.api.api_key import NO_API_KEY, ApiKeyError, ApiKeyRule, resolve_api_key
from dsv4_common.api.documents import DocumentError
from dsv4_common.api.http_rules import HttpLimits, http_limits
from dsv4_common.api.lifecycle import ROUTER_DRAIN_S
from dsv4_common.api.names import WORKER_ROLES, WorkerRole
from dsv4_common.api.pd_secret import (
    PD_SECRET_FLAG,
    PDSecretError,
    load_pd_secret,
    require_pd_secret,
)
from dsv4_common.api.rank_config import (
    ROUTER_CONFIG_KEY,
    Instance,
    RouterConfig,
    parse_router_config,
)
from dsv4_router.liveness import LivenessRule, StallRule, liveness_rule

QUICK_HOST: Final = "127.0.0.1"
DEPLOYED_HOST: Final = "0.0.0.0"
INSTANCE_FORM: Final = "ROLE=HOST:HTTP:STATUS:KV"
MAX_PORT: Final = 65535
MAX_DEFAULT_PROCESSES: Final = 4
# `busy_poll`'s window after a write: it covers a loopback exchange's round trip (25 us did
# not, 100 us gained nothing more: bench/README.md) and costs nothing worth a line at one
# request a second.
DEFAULT_BUSY_POLL_S: Final = 50e-6
MAX_BUSY_POLL_US: Final = 10_000  # past this, polling is spinning
_ROLE_NAMES: Final[dict[str, WorkerRole]] = {role: role for role in WORKER_ROLES}


class ConfigError(ValueError):
    """A bad argument or config field; the message starts with its name."""


@dataclass(frozen=True, slots=True)
class RoleTargets:
    """Where one role's instances are: fixed, or every address `service` resolves to."""

    instances: tuple[Instance, ...] = ()
    service: str | None = None  # DNS name (used when `instances` is empty)
    http_port: int = 0
    status_port: int = 0
    kv_port: int = 0

    def from_address(self, host: str) -> Instance:
        return Instance(host, self.http_port, self.status_port, self.kv_port)


@dataclass(frozen=True, slots=True)
class RouterSettings:
    host: str
    port: int  # the API (0: any free port)
    status_port: int | None  # probes and metrics also here (deployed form); None: API port only
    roles: Mapping[WorkerRole, RoleTargets]
    poll_interval_s: float = 0.5
    # Stale (ineligible) once `stale_after_misses` status probes in a row gave no status AND
    # none came for max(stale_after_s, stale_after_polls x poll_interval_s) (`liveness`).
    stale_after_misses: int = 3
    stale_after_s: float = 3.0
    stale_after_polls: float = 8.0
    status_timeout_s: float = 1.0  # per /status or /ready probe
    connect_timeout_s: float = 3.0  # to a decode's API
    # Decode sends its headers with the first token, so this covers the whole prefill.
    # Checked at the stall watch's looks (every stall_after_s / 5): up to one look late.
    first_byte_timeout_s: float = 600.0
    # An open request's decode silent this long with its latest probe missed: frozen
    # (`liveness.frozen_reason`); the relay ends the request or retries it elsewhere.
    stall_after_s: float = 1.0
    max_attempts: int = 3  # pairs tried per request
    shutdown_timeout_s: float = ROUTER_DRAIN_S  # open streams get this long after SIGTERM
    http: HttpLimits = field(default_factory=HttpLimits)  # timeouts, body size, connections
    processes: int | None = None  # router processes on the port (None: `default_processes`)
    busy_poll_s: float = DEFAULT_BUSY_POLL_S  # polling after a write before sleeping (`busy_poll`)
    # The API key clients must send and the router sends to the workers (`api_key`).
    auth: ApiKeyRule = NO_API_KEY
    # What set the ports, for errors ("--port", "<dir>/router.json: router_config.port").
    port_name: str = "--port"
    status_port_name: str = "router_config.status_port"
    # The deployment's PD secret: signs each request's choice of prefill for its decode (None:
    # unsigned, which real decode workers refuse; only tests against stubs build it so).
    route_key: bytes | None = field(default=None, repr=False)
    secret_file: str | None = None  # the router config's `pd_secret_file` (read by from_args)
    # router.json when deployed: its roles are read again when it changes (`reload`).
    config_path: str | None = None

    @property
    def liveness(self) -> LivenessRule:
        return liveness_rule(
            poll_interval_s=self.poll_interval_s,
            min_grace_s=self.stale_after_s,
            misses=self.stale_after_misses,
            grace_polls=self.stale_after_polls,
        )

    @property
    def stall(self) -> StallRule:
        return StallRule(silence_s=self.stall_after_s)


def default_processes(cpus: float) -> int:
    """Router processes when `--router-processes` is not given: one per whole CPU this
    process may use, at most MAX_DEFAULT_PROCESSES (each process costs a discovery loop and
    its memory; past a few, the workers, not the router, are the limit)."""
    return max(1, min(MAX_DEFAULT_PROCESSES, int(cpus)))


def settings_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> RouterSettings:
    """The router's settings; `environ` (default: the process's) may hold DSV4_PD_SECRET."""
    settings = _settings(args)
    flag: str | None = getattr(args, "pd_secret_file", None)
    path, where = flag, PD_SECRET_FLAG
    if flag is None and settings.secret_file is not None:
        path, where = settings.secret_file, "router_config.pd_secret_file"
    try:
        found = load_pd_secret(path, os.environ if environ is None else environ, where=where)
        secret = require_pd_secret(found, "router")
    except PDSecretError as exc:
        raise ConfigError(str(exc)) from exc
    return replace(settings, route_key=secret.key, secret_file=None)


def _settings(args: argparse.Namespace) -> RouterSettings:
    config_dir: str | None = getattr(args, "config_dir", None)
    flags: Sequence[str] = getattr(args, "instance", None) or []
    host: str | None = getattr(args, "host", None)
    http = _http_limits(args)
    processes: int | None = getattr(args, "router_processes", None)
    if processes is not None and processes < 1:
        raise ConfigError(f"--router-processes: must be >= 1, got {processes}")
    busy_poll_us = getattr(args, "router_busy_poll_us", None)
    if busy_poll_us is not None and not 0 <= busy_poll_us <= MAX_BUSY_POLL_US:
        raise ConfigError(
            f"--router-busy-poll-us: must be in 0..{MAX_BUSY_POLL_US}, got {busy_poll_us}"
        )
    busy_poll_s = DEFAULT_BUSY_POLL_S if busy_poll_us is None else busy_poll_us / 1e6
    key, key_file = getattr(args, "api_key", None), getattr(args, "api_key_file", None)
    if config_dir is not None:
        if flags:
            raise ConfigError("--instance: not with --config-dir (router.json lists the roles)")
        deployed, configured = _deployed(Path(config_dir), host or DEPLOYED_HOST)
        auth = _auth(key, key_file, configured, open_status=True)  # the status port: open
        return replace(
            deployed,
            http=http,
            processes=processes,
            busy_poll_s=busy_poll_s,
            auth=auth,
            config_path=str(Path(config_dir) / ROUTER_CONFIG_KEY),
        )
    port = getattr(args, "port", 8000)
    if not isinstance(port, int) or not 0 <= port <= MAX_PORT:
        raise ConfigError(f"--port: must be in 0..{MAX_PORT}, got {port!r}")
    return RouterSettings(
        host=host or QUICK_HOST,
        port=port,
        status_port=None,
        roles=_quick_roles(flags),
        http=http,
        processes=processes,
        busy_poll_s=busy_poll_s,
        auth=_auth(key, key_file, None, open_status=bool(getattr(args, "open_status", False))),
    )


def _auth(
    key: str | None, key_file: str | None, configured: tuple[str, str] | None, *, open_status: bool
) -> ApiKeyRule:
    """--api-key, --api-key-file, else router.json's api_key_file (`configured`: (path,
    where)); the file is read here."""
    try:
        path, where = configured if configured is not None else (None, "")
        resolved = resolve_api_key(key, key_file, path, config_field=where)
    except ApiKeyError as exc:
        raise ConfigError(str(exc)) from exc
    return ApiKeyRule(resolved, open_status=open_status)


def _http_limits(args: argparse.Namespace) -> HttpLimits:
    """The `dsv4 serve` HTTP flags (argparse checked their ranges)."""
    return http_limits(
        body_timeout_s=getattr(args, "http_body_timeout_s", None),
        idle_timeout_s=getattr(args, "http_idle_timeout_s", None),
        max_connections=getattr(args, "max_connections", None),
    )


def parse_instance(text: str) -> tuple[WorkerRole, Instance]:
    """`prefill=127.0.0.1:9001:9002:9003` (an IPv6 host in brackets: `[::1]:...`)."""
    name, sep, address = text.partition("=")
    role = _ROLE_NAMES.get(name)
    if not sep or role is None:
        raise ConfigError(
            f"--instance: expected {INSTANCE_FORM} with ROLE prefill or decode, got {text!r}"
        )
    parts = address.rsplit(":", 3)
    host = parts[0].removeprefix("[").removesuffix("]") if len(parts) == 4 else ""
    if not host:
        raise ConfigError(f"--instance: expected {INSTANCE_FORM}, got {text!r}")
    ports = []
    for name, value in zip(("HTTP", "STATUS", "KV"), parts[1:], strict=True):
        if not value.isdigit() or not 1 <= int(value) <= MAX_PORT:
            raise ConfigError(f"--instance: {name} port must be in 1..{MAX_PORT}, got {text!r}")
        ports.append(int(value))
    return role, Instance(host, ports[0], ports[1], ports[2])


def _quick_roles(flags: Sequence[str]) -> dict[WorkerRole, RoleTargets]:
    found: dict[WorkerRole, list[Instance]] = {role: [] for role in WORKER_ROLES}
    for text in flags:
        role, instance = parse_instance(text)
        if instance in found[role]:
            raise ConfigError(f"--instance: {text!r} is given twice")
        found[role].append(instance)
    for role in WORKER_ROLES:
        if not found[role]:
            raise ConfigError(f"--instance: needs at least one {role} instance, got none")
    return {role: RoleTargets(instances=tuple(found[role])) for role in WORKER_ROLES}


def _deployed(config_dir: Path, host: str) -> tuple[RouterSettings, tuple[str, str] | None]:
    """The settings of router.json, and its api_key_file (with the field naming it)."""
    path = config_dir / ROUTER_CONFIG_KEY
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"--config-dir: cannot read {path}: {exc.strerror or exc}") from exc
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from exc
    try:
        config = parse_router_config(doc)
    except DocumentError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    _check_router_config(config, str(path))
    roles = {role: _role_targets(config, role) for role in WORKER_ROLES}
    settings = RouterSettings(
        host=host,
        port=config.port,
        status_port=config.status_port,
        roles=roles,
        secret_file=config.pd_secret_file,
        port_name=f"{path}: router_config.port",
        status_port_name=f"{path}: router_config.status_port",
    )
    key_file = config.api_key_file
    return settings, (
        None if key_file is None else (key_file, f"{path}: router_config.api_key_file")
    )


def read_roles(path: Path) -> dict[WorkerRole, RoleTargets]:
    """The roles of the router.json at `path` (what changes while a router runs)."""
    settings, _ = _deployed(path.parent, DEPLOYED_HOST)
    return dict(settings.roles)


def _role_targets(config: RouterConfig, role: WorkerRole) -> RoleTargets:
    endpoint = config.roles[role]
    return RoleTargets(
        instances=endpoint.instances,
        service=endpoint.service,
        http_port=endpoint.port,
        status_port=config.status_port,
        kv_port=endpoint.bootstrap_port,
    )


def _check_router_config(config: RouterConfig, where: str) -> None:
    ports: dict[str, int] = {"port": config.port, "status_port": config.status_port}
    for role in WORKER_ROLES:
        endpoint = config.roles[role]
        base = f"roles.{role}"
        if not endpoint.instances and not endpoint.service:
            raise ConfigError(
                f"{where}: router_config.{base}.service: empty and no instances are listed"
            )
        ports[f"{base}.port"] = endpoint.port
        ports[f"{base}.bootstrap_port"] = endpoint.bootstrap_port
        for i, inst in enumerate(endpoint.instances):
            if not inst.host:
                raise ConfigError(f"{where}: router_config.{base}.instances[{i}].host: empty")
            for name in ("http_port", "status_port", "kv_port"):
                ports[f"{base}.instances[{i}].{name}"] = getattr(inst, name)
    for name, value in ports.items():
        if not 1 <= value <= MAX_PORT:
            raise ConfigError(
                f"{where}: router_config.{name}: must be in 1..{MAX_PORT}, got {value}"
            )
