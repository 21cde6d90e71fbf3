"""`dsv4 serve --role R --config-dir DIR`: the deployed form reads the rank config, serves the
API and the probes on the config's ports, and reports the capacity it realized from the
weights it loaded; the PD roles and bad configs exit 2 naming the problem."""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from serve_support import free_port, wait_ready

from dsv4_common.api.rank_config import (
    KVSettings,
    ModelRef,
    Peers,
    PlanSettings,
    RankConfig,
    WorkerPorts,
    planned_rank,
    rank_config_to_dict,
)
from dsv4_common.api.worker_status import parse_worker_status
from dsv4_common.core.presets import tiny
from dsv4_common.core.units import MIB
from dsv4_common.plan.inputs import PlanInputs
from dsv4_common.plan.planner import plan
from dsv4_common.plan.threads import INTEROP_THREADS, torch_threads
from dsv4_worker.pp.group import realized_plan

CLI = [sys.executable, "-m", "dsv4_cli", "serve"]


def inputs_of(settings: PlanSettings) -> PlanInputs:
    """The planner inputs of the colocated tiny config (what the worker re-solves with)."""
    return PlanInputs(
        model=tiny(),
        role="colocated",
        gpu_memory_bytes=settings.device_memory_bytes,
        page_size=16,
        chunked_prefill_tokens=settings.chunked_prefill_tokens,
        max_running_requests=settings.max_running_requests,
        context_len=settings.context_len,
    )


def colocated_config(http_port: int, status_port: int) -> RankConfig:
    settings = PlanSettings(
        device_memory_bytes=64 * MIB,
        cpu_mode=True,
        mem_fraction=0.9,
        chunked_prefill_tokens=128,
        max_running_requests=8,
        speculative_draft_tokens=0,
        context_len=4096,
        layer_split=(6,),
    )
    return RankConfig(
        version=1,
        deployment="local",
        namespace="default",
        role="colocated",
        pp_rank=0,
        pp_size=1,
        tp_size=1,
        serving_rank=True,
        model=ModelRef(preset="tiny", config_path=None),
        max_context_tokens=4096,
        kv=KVSettings(page_size=16, swa_ratio=None, transfer="nixl"),
        plan=settings,
        planned=planned_rank(plan(inputs_of(settings)).ranks[0]),
        ports=WorkerPorts(http=http_port, status=status_port, pp=0, kv=0),
        peers=Peers(host_template="", pp_size=1),
        role_services={"prefill": "prefill.local", "decode": "decode.local"},
    )


def write(tmp_path: Path, config: RankConfig, name: str = "colocated-rank-0.json") -> Path:
    (tmp_path / name).write_text(json.dumps(rank_config_to_dict(config)))
    return tmp_path


def test_realized_capacity_follows_the_measured_weights() -> None:
    inputs = inputs_of(colocated_config(1, 2).plan)
    estimate = plan(inputs).ranks[0]
    same = realized_plan(inputs, (estimate.weight_bytes,)).ranks[0]
    assert same.pools == estimate.pools
    heavier = realized_plan(inputs, (estimate.weight_bytes + 55 * MIB,)).ranks[0]  # KV squeezed
    assert heavier.capacity.full_tokens < estimate.capacity.full_tokens


def test_the_deployed_form_serves_on_the_config_ports(tmp_path: Path) -> None:
    http_port, status_port = free_port(), free_port()
    config = colocated_config(http_port, status_port)
    cmd = [*CLI, "--role", "colocated", "--config-dir", str(write(tmp_path, config))]
    cmd += ["--host", "127.0.0.1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_ready(proc, status_port)
        c = http.client.HTTPConnection("127.0.0.1", status_port, timeout=5)
        c.request("GET", "/status")
        report = parse_worker_status(json.loads(c.getresponse().read()))
        # Weights held as stored (tiny's float32): exactly what the planner counts for it.
        held = report.weights
        assert held.held_bytes == held.planned_bytes > 0
        assert held.compute_dtype == "float32"  # auto, on CPU
        realized = realized_plan(inputs_of(config.plan), (held.held_bytes,)).ranks[0]
        assert (report.capacity.full_tokens, report.capacity.swa_tokens) == (
            realized.capacity.full_tokens,
            realized.capacity.swa_tokens,
        )
        assert report.capacity.max_running_requests == realized.capacity.max_running_requests == 8
        threads = report.threads  # no flag, none in the rank config: from the CPUs it may use
        assert threads.source == "auto" and threads.intra_op == torch_threads(threads.cpus)
        c = http.client.HTTPConnection("127.0.0.1", http_port, timeout=60)
        c.request("POST", "/v1/completions", body=json.dumps({"prompt": "hi", "max_tokens": 2}))
        assert c.getresponse().status == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize(("flag", "want"), [(None, (3, "rank_config")), ("2", (2, "flag"))])
def test_torch_threads_come_from_the_flag_then_the_rank_config(
    tmp_path: Path, flag: str | None, want: tuple[int, str]
) -> None:
    status_port = free_port()
    config = dataclasses.replace(colocated_config(free_port(), status_port), torch_threads=3)
    cmd = [*CLI, "--role", "colocated", "--config-dir", str(write(tmp_path, config))]
    cmd += ["--host", "127.0.0.1", *(["--torch-threads", flag] if flag else [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_ready(proc, status_port)
        c = http.client.HTTPConnection("127.0.0.1", status_port, timeout=5)
        c.request("GET", "/status")
        threads = parse_worker_status(json.loads(c.getresponse().read())).threads
        assert (threads.intra_op, threads.source) == want
        assert threads.inter_op == INTEROP_THREADS and threads.cpus > 0
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize(
    ("flag", "want"),
    [([], ["chat", "tiny"]), (["--served-model-name", "cli"], ["cli"])],
    ids=["rank-config", "flag"],
)
def test_served_model_names_come_from_the_flag_then_the_rank_config(
    tmp_path: Path, flag: list[str], want: list[str]
) -> None:
    http_port, status_port = free_port(), free_port()
    config = colocated_config(http_port, status_port)
    model = dataclasses.replace(config.model, served_model_names=("chat", "tiny"))
    config = dataclasses.replace(config, model=model)
    cmd = [*CLI, "--role", "colocated", "--config-dir", str(write(tmp_path, config))]
    proc = subprocess.Popen([*cmd, "--host", "127.0.0.1", *flag], stdout=subprocess.DEVNULL)
    try:
        wait_ready(proc, status_port)
        c = http.client.HTTPConnection("127.0.0.1", http_port, timeout=60)
        c.request("GET", "/v1/models")
        assert [m["id"] for m in json.loads(c.getresponse().read())["data"]] == want
        for name, status in ((want[-1], 200), ("other", 404)):
            body = {"model": name, "prompt": "hi", "max_tokens": 1}
            c.request("POST", "/v1/completions", body=json.dumps(body))
            answer = c.getresponse()
            document = json.loads(answer.read())
            assert answer.status == status, document
            if status == 404:
                assert document["error"]["code"] == "model_not_found"
            else:
                assert document["model"] == name
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize(
    ("role", "files", "needle"),
    [
        ("prefill", True, "prefill-rank-0.json"),  # a colocated config is not a prefill's
        ("decode", True, "decode-rank-0.json"),
        ("router", True, "router.json"),
        ("colocated", False, "cannot read"),
    ],
)
def test_roles_and_configs_that_cannot_run_exit_2(
    tmp_path: Path, role: str, files: bool, needle: str
) -> None:
    if files:
        write(tmp_path, colocated_config(1, 2))
    proc = subprocess.run(
        [*CLI, "--role", role, "--config-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "DSV4_PP_RANK": "0"},
    )
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr and "Traceback" not in proc.stderr


def test_a_malformed_rank_config_names_the_field(tmp_path: Path) -> None:
    doc = rank_config_to_dict(colocated_config(1, 2))
    del doc["plan"]["layer_split"]
    (tmp_path / "colocated-rank-0.json").write_text(json.dumps(doc))
    proc = subprocess.run(
        [*CLI, "--role", "colocated", "--config-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert "rank_config.plan.layer_split: required" in proc.stderr
