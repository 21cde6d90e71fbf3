"""`ServeOptions`: which value a worker uses, decided once. The quick form takes every value
from the flags; the deployed form takes the rank config's, keeps the flags the config does
not hold, and lets a flag given override the config's field where both exist."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from rank_configs import HOST_TEMPLATE, PORTS, rank_config

from dsv4_cli.main import build_parser
from dsv4_common.api.http_rules import HttpLimits
from dsv4_common.api.lifecycle import DRAIN_S
from dsv4_common.api.names import WorkerRole
from dsv4_common.api.pd_secret import PDSecret
from dsv4_common.api.rank_config import rank_config_to_dict
from dsv4_common.api.serve_flags import SERVE_FLAGS
from dsv4_common.core.presets import tiny
from dsv4_common.core.units import GIB
from dsv4_worker.options import (
    CPU_MEMORY_GIB,
    DeployedSizing,
    Listen,
    QuickSizing,
    ServeError,
    ServeOptions,
    load_options,
    served_names,
)
from dsv4_worker.pp.spec import PPSpec


def args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def quick(*argv: str) -> ServeOptions:
    return ServeOptions.from_args(args(*argv))


def deployed(*argv: str, **config: Any) -> ServeOptions:
    role = config.pop("role", "decode")
    return ServeOptions.from_rank_config(
        rank_config(role, **config), args("--role", role, *argv), group="g0"
    )


def test_the_quick_form_defaults() -> None:
    opts = quick()
    assert (opts.role, opts.device, opts.model_source) == ("colocated", "cpu", "tiny")
    assert (opts.host, opts.listen) == ("127.0.0.1", (Listen(8000, "--port"),))
    assert opts.pp is None and opts.transfer is None and not opts.deployed
    assert (opts.max_queue_requests, opts.queue_timeout_s) == (None, None)
    assert (opts.served_model_names, opts.drain_timeout_s) == ((), DRAIN_S)
    assert (opts.kv_port, opts.default_prefill, opts.transfer_timeout_s) == (0, None, 60.0)
    assert opts.http == HttpLimits()
    assert (opts.torch_threads, opts.configured_torch_threads) == (None, None)
    assert opts.dtype == "auto"


# (flags, option, value): one flag of the quick form and the option it sets.
QUICK_CASES = [
    (("--model", "/m"), "model_source", "/m"),
    (("--device", "cuda"), "device", "cuda"),
    (("--dtype", "float64"), "dtype", "float64"),
    (("--host", "0.0.0.0"), "host", "0.0.0.0"),
    (("--port", "0"), "listen", (Listen(0, "--port"),)),
    (("--role", "decode"), "transfer", "nixl"),
    (("--role", "prefill", "--transfer", "zmq"), "transfer", "zmq"),
    (("--role", "colocated", "--transfer", "zmq"), "transfer", None),
    (("--tokenizer", "t.json"), "tokenizer", "t.json"),
    (("--weights", "w.safetensors"), "weights_path", "w.safetensors"),
    (("--seed", "3"), "seed", 3),
    (("--torch-threads", "2"), "torch_threads", 2),
    (("--max-queue-requests", "5"), "max_queue_requests", 5),
    (("--queue-timeout-s", "0.5"), "queue_timeout_s", 0.5),
    (("--served-model-name", "a", "b", "a"), "served_model_names", ("a", "b")),
    (("--http-idle-timeout-s", "9"), "http", HttpLimits(idle_timeout_s=9.0)),
    (("--http-body-timeout-s", "8"), "http", HttpLimits(body_timeout_s=8.0)),
    (("--max-connections", "7"), "http", HttpLimits(max_connections=7)),
    (("--kv-port", "7001"), "kv_port", 7001),
    (("--prefill", "p:7001"), "default_prefill", "p:7001"),
    (("--transfer-timeout-s", "3"), "transfer_timeout_s", 3.0),
    (("--transfer-threads", "4"), "transfer_threads", 4),
    (("--drain-timeout-s", "2"), "drain_timeout_s", 2.0),
]


@pytest.mark.parametrize(("flags", "option", "value"), QUICK_CASES)
def test_a_quick_flag_sets_its_option(flags: tuple[str, ...], option: str, value: object) -> None:
    assert getattr(quick(*flags), option) == value


def test_the_quick_sizing_takes_the_flags() -> None:
    opts = quick(
        "--role", "prefill", "--gpu-memory-gib", "2", "--page-size", "32",
        "--chunked-prefill-size", "64", "--max-running-requests", "3", "--context-len", "512",
        "--request-state", "online",
    )  # fmt: skip
    assert opts.sizing == QuickSizing("prefill", 2.0, 32, 64, 3, 512, "online", 1)
    inputs, measured = opts.sizing.plan(tiny(), 80 * GIB)
    assert measured is None  # the inputs hold the memory: no re-solve
    assert inputs.gpu_memory_bytes == 2 * GIB  # the flag beats the measured device
    assert (inputs.role, inputs.page_size, inputs.chunked_prefill_tokens) == ("prefill", 32, 64)
    assert (inputs.max_running_requests, inputs.context_len) == (3, 512)
    assert inputs.request_state == "online"


@pytest.mark.parametrize(
    ("flag_gib", "measured", "planned"),
    [(None, 80 * GIB, 80 * GIB), (None, None, int(CPU_MEMORY_GIB * GIB)), (0.5, None, GIB // 2)],
)
def test_the_quick_form_plans_with_the_flag_else_the_device_else_the_cpu_default(
    flag_gib: float | None, measured: int | None, planned: int
) -> None:
    flags = ("--gpu-memory-gib", str(flag_gib)) if flag_gib is not None else ()
    inputs, _ = quick(*flags).sizing.plan(tiny(), measured)
    assert inputs.gpu_memory_bytes == planned


def test_a_quick_pp_stage_meets_at_the_address_and_listens_on_its_host() -> None:
    opts = quick(
        "--pp-size", "2", "--pp-rank", "1", "--pp-addr", "10.0.0.2:7000", "--host", "10.0.0.1",
        "--pp-timeout-s", "4",
    )  # fmt: skip
    assert opts.pp == PPSpec(1, 2, "10.0.0.2", 7000, timeout_s=4.0, listen_host="10.0.0.1")
    assert opts.sizing.pp_size == 2  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--pp-size", "2", "--pp-rank", "2", "--pp-addr", "h:1"), "--pp-rank 2: must be below"),
        (("--pp-size", "2"), "--pp-addr HOST:PORT is required"),
        (("--pp-size", "2", "--pp-addr", "h"), "--pp-addr h: expected HOST:PORT"),
        (("--pp-size", "2", "--pp-addr", ":1"), "--pp-addr :1: expected HOST:PORT"),
        (("--pp-size", "2", "--pp-addr", "h:0"), "--pp-addr h:0: expected HOST:PORT"),
        (("--pp-size", "2", "--pp-addr", "h:65536"), "--pp-addr h:65536: expected HOST:PORT"),
        (("--served-model-name", "ok", " "), "--served-model-name: a name must not be empty"),
    ],
)
def test_bad_quick_flags_are_named(flags: tuple[str, ...], message: str) -> None:
    with pytest.raises(ServeError, match=message):
        quick(*flags)


def test_the_deployed_form_takes_the_rank_configs_values() -> None:
    config = rank_config("decode", torch_threads=3, max_queue_requests=9, queue_timeout_s=1.5)
    opts = ServeOptions.from_rank_config(config, args("--role", "decode"))
    assert opts.deployed and opts.sizing == DeployedSizing(config)
    assert (opts.role, opts.model_source, opts.weights_path) == ("decode", "tiny", "/models/tiny")
    assert opts.host == "0.0.0.0"
    assert opts.listen == (
        Listen(PORTS.http, "rank config ports.http"),
        Listen(PORTS.status, "rank config ports.status"),
    )
    assert (opts.transfer, opts.kv_port) == ("zmq", PORTS.kv)
    assert opts.default_prefill == f"prefill.svc:{PORTS.kv}"
    assert (opts.torch_threads, opts.configured_torch_threads) == (None, 3)
    assert (opts.max_queue_requests, opts.queue_timeout_s) == (9, 1.5)
    assert opts.pp is None


def test_the_deployed_sizing_is_the_configs_plan_re_solved_with_the_measured_memory() -> None:
    config = rank_config("prefill")
    inputs, measured = DeployedSizing(config).plan(tiny(), 7 * GIB)
    assert (inputs, measured) == (config.plan_inputs(tiny()), 7 * GIB)


# (flags, option, value, config fields): a flag given wins over the rank config's field.
OVERRIDES = [
    (("--host", "127.0.0.1"), "host", "127.0.0.1", {}),
    (("--prefill", "p:1"), "default_prefill", "p:1", {}),
    (("--max-queue-requests", "3"), "max_queue_requests", 3, {"max_queue_requests": 9}),
    (("--queue-timeout-s", "0.5"), "queue_timeout_s", 0.5, {"queue_timeout_s": 1.5}),
    (("--torch-threads", "2"), "torch_threads", 2, {"torch_threads": 3}),
    (("--served-model-name", "x"), "served_model_names", ("x",), {}),
]


@pytest.mark.parametrize(("flags", "option", "value", "fields"), OVERRIDES)
def test_a_flag_given_overrides_the_rank_config(
    flags: tuple[str, ...], option: str, value: object, fields: dict[str, Any]
) -> None:
    assert getattr(deployed(*flags, **fields), option) == value


def test_the_configs_compute_dtype_is_the_workers() -> None:
    config = rank_config("decode")
    assert config.model.dtype == "auto"
    typed = replace(config, model=replace(config.model, dtype="float32"))
    assert ServeOptions.from_rank_config(typed, args("--role", "decode")).dtype == "float32"


def test_the_configs_served_names_are_kept_without_the_flag() -> None:
    config = rank_config("decode")
    named = replace(config, model=replace(config.model, served_model_names=("n",)))
    opts = ServeOptions.from_rank_config(named, args("--role", "decode"))
    assert opts.served_model_names == ("n",)


# Flags the rank config does not hold: the deployed form takes them as the quick form does.
KEPT = [case for case in QUICK_CASES if case[1] in {
    "device", "tokenizer", "seed", "http", "transfer_timeout_s", "transfer_threads",
    "drain_timeout_s",
}]  # fmt: skip


@pytest.mark.parametrize(("flags", "option", "value"), KEPT)
def test_a_flag_the_config_does_not_hold_is_kept(
    flags: tuple[str, ...], option: str, value: object
) -> None:
    assert getattr(deployed(*flags), option) == value


# Flags the rank config holds (the operator refuses them in a pod's args): the config wins.
IGNORED = [
    ("--model", "/other", "model_source", "tiny"),
    ("--weights", "/other", "weights_path", "/models/tiny"),
    ("--port", "1", "listen", (Listen(PORTS.http, "rank config ports.http"),
                               Listen(PORTS.status, "rank config ports.status"))),
    ("--transfer", "nixl", "transfer", "zmq"),
    ("--kv-port", "1", "kv_port", PORTS.kv),
    ("--dtype", "float64", "dtype", "auto"),
]  # fmt: skip


@pytest.mark.parametrize(("flag", "value", "option", "kept"), IGNORED)
def test_a_flag_the_config_holds_is_ignored(
    flag: str, value: str, option: str, kept: object
) -> None:
    assert getattr(deployed(flag, value), option) == kept


@pytest.mark.parametrize(
    ("cpu_mode", "flags", "device"),
    [(True, (), "cpu"), (False, (), "cuda"), (False, ("--device", "cpu"), "cpu")],
)
def test_a_deployed_worker_runs_where_its_rank_config_was_planned(
    cpu_mode: bool, flags: tuple[str, ...], device: str
) -> None:
    """A GPU deployment's pods (and `dsv4 up` workers) run on CUDA, a CPU-mode one on the CPU;
    `--device` given wins."""
    config = rank_config("decode")
    config = replace(config, plan=replace(config.plan, cpu_mode=cpu_mode))
    opts = ServeOptions.from_rank_config(config, args("--role", "decode", *flags))
    assert opts.device == device


def test_a_deployed_pp_stage_meets_at_rank_zero_of_its_group() -> None:
    opts = deployed("--pp-timeout-s", "4", pp_size=2, pp_rank=1)
    host = HOST_TEMPLATE.format(group="g0", rank=0)
    assert opts.pp == PPSpec(1, 2, host, PORTS.pp, timeout_s=4.0, listen_host="0.0.0.0")


def test_a_deployed_colocated_rank_has_no_transfer() -> None:
    config = replace(rank_config("decode"), role="colocated")
    assert ServeOptions.from_rank_config(config, args("--role", "colocated")).transfer is None


def test_a_transfer_this_worker_lacks_is_named() -> None:
    config = rank_config("decode")
    config = replace(config, kv=replace(config.kv, transfer="mooncake"))
    with pytest.raises(ServeError, match=r"rank config kv\.transfer: mooncake is not available"):
        ServeOptions.from_rank_config(config, args("--role", "decode"))


def test_served_names_are_checked_and_deduplicated() -> None:
    assert served_names(None) == () and served_names([]) == ()
    assert served_names(["a", "b", "a"]) == ("a", "b")


def write(directory: Path, role: WorkerRole, pp_rank: int, file_rank: int | None = None) -> None:
    """PP rank `pp_rank`'s config of a 2-stage group, in the file of `file_rank` (default: its
    own)."""
    config = rank_config(role, pp_rank, pp_size=2)
    path = directory / f"{role}-rank-{pp_rank if file_rank is None else file_rank}.json"
    path.write_text(json.dumps(rank_config_to_dict(config)))


def test_load_options_reads_the_config_of_the_pods_pp_rank(tmp_path: Path) -> None:
    write(tmp_path, "prefill", 0)
    write(tmp_path, "prefill", 1)
    flags = args("--role", "prefill", "--config-dir", str(tmp_path))
    opts = load_options(flags, {"DSV4_PP_RANK": "1", "DSV4_GROUP": "grp", **SECRET_ENV})
    assert opts.pp == PPSpec(
        1, 2, HOST_TEMPLATE.format(group="grp", rank=0), PORTS.pp, listen_host="0.0.0.0"
    )
    assert load_options(flags, SECRET_ENV).pp.rank == 0  # type: ignore[union-attr]
    assert load_options(args("--model", "m"), {"DSV4_PP_RANK": "1"}) == quick("--model", "m")


def test_load_options_names_a_missing_or_mismatched_config(tmp_path: Path) -> None:
    with pytest.raises(ServeError, match="--config-dir: cannot read"):
        load_options(args("--role", "decode", "--config-dir", str(tmp_path)), {})
    write(tmp_path, "decode", 1, file_rank=0)
    with pytest.raises(
        ServeError, match="holds role decode PP rank 1, not --role decode PP rank 0"
    ):
        load_options(args("--role", "decode", "--config-dir", str(tmp_path)), SECRET_ENV)


SECRET_ENV = {"DSV4_PD_SECRET": "s" * 32}


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_pd_role_refuses_to_start_without_a_secret(role: str, tmp_path: Path) -> None:
    """Fail closed: an unauthenticated PD channel would let any peer write decode's KV. The
    secret comes from --pd-secret-file, else the rank config's field, else DSV4_PD_SECRET."""
    with pytest.raises(ServeError, match=f"--role {role}: no PD secret: set --pd-secret-file"):
        load_options(args("--role", role), {})
    assert load_options(args("--role", "colocated"), {}).pd_secret is None
    assert load_options(args("--role", role), SECRET_ENV).pd_secret == PDSecret(b"s" * 32)
    short = tmp_path / "short"
    short.write_text("0123456789\n")
    with pytest.raises(ServeError, match=f"--pd-secret-file {short}: PD secret: 10 bytes"):
        load_options(args("--role", role, "--pd-secret-file", str(short)), SECRET_ENV)
    good = tmp_path / "good"
    good.write_text("f" * 40 + "\n")  # the file wins over the environment
    opts = load_options(args("--role", role, "--pd-secret-file", str(good)), SECRET_ENV)
    assert opts.pd_secret == PDSecret(b"f" * 40)
    assert "f" * 40 not in repr(opts)  # never printed


def test_the_rank_configs_secret_file_is_read_unless_the_flag_names_one(tmp_path: Path) -> None:
    secret = tmp_path / "mounted"
    secret.write_text("m" * 32)
    config = replace(rank_config("decode", 0), pd_secret_file=str(secret))
    (tmp_path / "decode-rank-0.json").write_text(json.dumps(rank_config_to_dict(config)))
    flags = args("--role", "decode", "--config-dir", str(tmp_path))
    assert load_options(flags, {}).pd_secret == PDSecret(b"m" * 32)
    secret.unlink()
    with pytest.raises(ServeError, match=r"rank config pd_secret_file .*mounted: cannot read"):
        load_options(flags, SECRET_ENV)


class Reads:
    """A parsed namespace that records which flags are read."""

    def __init__(self, parsed: argparse.Namespace) -> None:
        self.values = vars(parsed)
        self.names: set[str] = set()

    def __getattr__(self, name: str) -> object:
        self.names.add(name)
        return self.values[name]


WORKER_DESTS = {f.dest for f in SERVE_FLAGS if f.reader in ("worker", "both")} - {"config_dir"}


def test_the_quick_form_reads_every_worker_flag_of_the_table() -> None:
    reads = Reads(args("--pp-size", "2", "--pp-addr", "h:1"))  # PP flags: read with PP only
    load_options(reads, {})  # type: ignore[arg-type]
    assert reads.names >= WORKER_DESTS  # a row no option reads would be a flag that does nothing


def test_the_deployed_form_reads_the_flags_the_operator_leaves_to_users() -> None:
    reads = Reads(args("--role", "decode"))
    ServeOptions.from_rank_config(rank_config("decode", pp_size=2), reads)  # type: ignore[arg-type]
    user_flags = {
        f.dest for f in SERVE_FLAGS if f.reader in ("worker", "both") and f.operator is None
    }
    assert reads.names >= user_flags
