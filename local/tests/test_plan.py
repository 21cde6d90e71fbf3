"""The launch plan (pure, with a fake port allocator): the documents the workers and the router
read parse back, every port is distinct, the router lists exactly the serving ranks, argv and
environment are as `dsv4 serve --config-dir` expects; PP > 1 is refused naming the field."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from dsv4_common.api.rank_config import RouterConfig, parse_rank_config, parse_router_config
from dsv4_common.api.spec import SpecError
from dsv4_local.deployment import Deployment, parse_deployment
from dsv4_local.plan import LaunchPlan, build_launch_plan
from dsv4_local.workdir import write_workdir

WORKDIR = Path("/w")
FIRST_PORT = 30000


def body(**spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"model": {"preset": "tiny"}, "maxContextTokens": 2048}
    return {
        "apiVersion": "serving.dsv4.io/v1alpha1",
        "kind": "DSV4Deployment",
        "metadata": {"name": "tiny"},
        "spec": {**base, **spec},
    }


def deployment(**spec: Any) -> Deployment:
    return parse_deployment(yaml.safe_dump(body(**spec)), "t.yaml")


class FakePorts:
    """Consecutive ports from FIRST_PORT, skipping `exclude`; records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, frozenset[int]]] = []

    def __call__(self, count: int, exclude: frozenset[int]) -> tuple[int, ...]:
        self.calls.append((count, exclude))
        candidates = (p for p in range(FIRST_PORT, FIRST_PORT + 1000) if p not in exclude)
        return tuple(next(candidates) for _ in range(count))


def launch_plan(d: Deployment, router_port: int | None = None) -> LaunchPlan:
    return build_launch_plan(
        d, WORKDIR, router_port=router_port, allocate_ports=FakePorts(), python="/py"
    )


@pytest.fixture(scope="module")
def plan() -> LaunchPlan:
    """Prefill replicas 2, decode replicas 1, PP=1."""
    return launch_plan(deployment(prefill={"replicas": 2}, decode={"replicas": 1}))


def router_of(plan: LaunchPlan) -> RouterConfig:
    return parse_router_config(plan.documents[WORKDIR / "router" / "router.json"])


class TestTwoPrefillOneDecode:
    def test_workers_first_then_the_router(self, plan: LaunchPlan) -> None:
        names = [p.name for p in plan.processes]
        assert names == ["prefill-0", "prefill-1", "decode-0", "router"]
        assert [(p.role, p.replica, p.pp_rank) for p in plan.processes] == [
            ("prefill", 0, 0),
            ("prefill", 1, 0),
            ("decode", 0, 0),
            ("router", 0, 0),
        ]

    def test_argv_and_env_are_what_serve_config_dir_reads(self, plan: LaunchPlan) -> None:
        for p in plan.processes:
            config_dir = WORKDIR / ("router" if p.role == "router" else f"{p.role}-{p.replica}")
            assert p.config_dir == config_dir
            base = (
                "/py",
                "-m",
                "dsv4_cli",
                "serve",
                "--role",
                p.role,
                "--config-dir",
                str(config_dir),
                "--host",
                "127.0.0.1",
            )
            if p.role == "decode":  # handshakes at start with the first prefill's KV socket
                first = plan.documents[WORKDIR / "prefill-0" / "prefill-rank-0.json"]
                base += ("--prefill", f"127.0.0.1:{first['ports']['kv']}")
            assert p.argv == base
        workers = plan.processes[:-1]
        assert [p.env for p in workers] == [
            {"DSV4_PP_RANK": "0", "DSV4_GROUP": group, "PYTHONUNBUFFERED": "1"}
            for group in ("tiny-prefill-0", "tiny-prefill-1", "tiny-decode-0")
        ]
        assert "DSV4_PP_RANK" not in plan.processes[-1].env

    def test_documents_parse_back_and_sit_where_each_process_reads_them(
        self, plan: LaunchPlan
    ) -> None:
        assert set(plan.documents) == {
            WORKDIR / "prefill-0" / "prefill-rank-0.json",
            WORKDIR / "prefill-1" / "prefill-rank-0.json",
            WORKDIR / "decode-0" / "decode-rank-0.json",
            WORKDIR / "router" / "router.json",
        }
        for p in plan.processes[:-1]:
            config = parse_rank_config(plan.documents[p.config_dir / f"{p.role}-rank-0.json"])
            assert (config.deployment, config.role, config.pp_rank) == ("tiny", p.role, 0)
            assert config.serving_rank and config.pp_size == 1
            assert config.peers.host_template == "127.0.0.1"
            assert config.role_services == {"prefill": "127.0.0.1", "decode": "127.0.0.1"}
            assert p.ready_url == f"http://127.0.0.1:{config.ports.status}/ready"
            assert p.status_url == f"http://127.0.0.1:{config.ports.status}/status"

    def test_every_port_is_distinct(self, plan: LaunchPlan) -> None:
        ports = [router_of(plan).port, router_of(plan).status_port]
        for path, doc in plan.documents.items():
            if path.name != "router.json":
                ports += parse_rank_config(doc).ports.by_name().values()
        assert len(ports) == 4 * 3 + 2 == len(set(ports))

    def test_the_router_lists_exactly_the_serving_instances(self, plan: LaunchPlan) -> None:
        router = router_of(plan)
        for role, replicas in (("prefill", 2), ("decode", 1)):
            ranks = [
                parse_rank_config(plan.documents[WORKDIR / f"{role}-{i}" / f"{role}-rank-0.json"])
                for i in range(replicas)
            ]
            endpoint = router.roles[role]
            assert [
                (i.host, i.http_port, i.status_port, i.kv_port) for i in endpoint.instances
            ] == [("127.0.0.1", r.ports.http, r.ports.status, r.ports.kv) for r in ranks]
            assert endpoint.service == "127.0.0.1"
        assert plan.processes[-1].ready_url == f"http://127.0.0.1:{router.status_port}/ready"

    def test_the_router_port_defaults_to_the_spec(self, plan: LaunchPlan) -> None:
        assert router_of(plan).port == 8000
        assert plan.router_url == "http://127.0.0.1:8000"


@pytest.mark.parametrize(("flag", "expected"), [(9000, 9000), (0, FIRST_PORT + 9)])
def test_port_flag_overrides_the_spec_and_0_takes_a_free_port(flag: int, expected: int) -> None:
    ports = FakePorts()
    plan = build_launch_plan(deployment(), WORKDIR, router_port=flag, allocate_ports=ports)
    router = router_of(plan)
    assert router.port == expected and plan.router_url == f"http://127.0.0.1:{expected}"
    # 4 ports per worker rank, the router's status port, and its API port when 0.
    assert ports.calls == [(4 * 2 + 1 + (flag == 0), frozenset({flag} - {0}))]


def test_the_fixed_router_port_is_never_handed_to_a_worker() -> None:
    ports = FakePorts()
    d = deployment(router={"port": FIRST_PORT + 1})
    plan = build_launch_plan(d, WORKDIR, router_port=None, allocate_ports=ports)
    worker_ports = [
        port
        for path, doc in plan.documents.items()
        if path.name != "router.json"
        for port in parse_rank_config(doc).ports.by_name().values()
    ]
    assert FIRST_PORT + 1 not in worker_ports


def test_a_bad_allocator_is_refused() -> None:
    with pytest.raises(ValueError, match="distinct free ports"):
        build_launch_plan(
            deployment(), WORKDIR, router_port=None, allocate_ports=lambda n, _: (31000,) * n
        )


def test_a_prefill_pp_group_shares_rank_0s_pp_port() -> None:
    plan = launch_plan(deployment(prefill={"pipelineParallel": 2}))
    assert [p.name for p in plan.processes] == [
        "prefill-0-rank-0",
        "prefill-0-rank-1",
        "decode-0",
        "router",
    ]
    assert [p.env["DSV4_PP_RANK"] for p in plan.processes[:2]] == ["0", "1"]
    assert {p.config_dir for p in plan.processes[:2]} == {WORKDIR / "prefill-0"}
    router = router_of(plan)
    rank0, rank1 = (
        parse_rank_config(plan.documents[WORKDIR / "prefill-0" / f"prefill-rank-{r}.json"])
        for r in (0, 1)
    )
    assert [i.http_port for i in router.roles["prefill"].instances] == [rank0.ports.http]
    assert rank1.ports.pp == rank0.ports.pp  # where the group meets
    others = [p for c in (rank0, rank1) for n, p in c.ports.by_name().items() if n != "pp"]
    assert len(others) == len(set(others)) and rank0.ports.pp not in others


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "t.yaml: no DSV4Deployment documents; dsv4 up runs exactly one"),
        (
            yaml.safe_dump_all([body(), body()]),
            "t.yaml: 2 DSV4Deployment documents; dsv4 up runs exactly one",
        ),
    ],
)
def test_exactly_one_deployment_document(text: str, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        parse_deployment(text, "t.yaml")


def test_other_documents_are_skipped() -> None:
    other = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}}
    d = parse_deployment(yaml.safe_dump_all([other, body()]), "t.yaml")
    assert d.meta.name == "tiny"


def test_write_workdir_writes_every_document_and_the_log_dir(tmp_path: Path) -> None:
    plan = build_launch_plan(
        deployment(), tmp_path, router_port=None, allocate_ports=FakePorts(), python=sys.executable
    )
    write_workdir(plan)
    assert plan.log_dir.is_dir()
    for path, doc in plan.documents.items():
        assert json.loads(path.read_text()) == doc


def test_each_run_gets_a_new_pd_secret_that_every_config_names(tmp_path: Path) -> None:
    """The router, prefill and decode of one run share a secret no other run knows; only
    this user can read it."""
    plan = build_launch_plan(
        deployment(), tmp_path, router_port=None, allocate_ports=FakePorts(), python=sys.executable
    )
    named = {doc["pd_secret_file"] for doc in plan.documents.values()}
    assert named == {str(plan.secret_path)}
    write_workdir(plan)
    first = plan.secret_path.read_text().strip()
    assert len(first) == 64 and plan.secret_path.stat().st_mode & 0o777 == 0o600
    write_workdir(plan)  # the next run in the same workdir
    assert plan.secret_path.read_text().strip() != first


@pytest.mark.parametrize(("cpus", "expected"), [(None, None), (2, 1), (16, 4), (64, 20)])
def test_every_rank_gets_the_threads_of_an_equal_share_of_the_cores(
    cpus: float | None, expected: int | None
) -> None:
    """3 worker ranks (2 prefill, 1 decode) side by side on one machine: each gets the torch
    threads of cpus / 3 (one core of each share kept for its own threads), not all it sees."""
    d = deployment(prefill={"replicas": 2}, decode={"replicas": 1})
    plan = build_launch_plan(
        d, WORKDIR, router_port=None, allocate_ports=FakePorts(), python="/py", cpus=cpus
    )
    configs = [
        parse_rank_config(doc)
        for path, doc in plan.documents.items()
        if path.parent.name != "router"
    ]
    assert len(configs) == 3
    assert {c.torch_threads for c in configs} == {expected}


def test_the_ready_summary_labels_api_only_what_takes_completions() -> None:
    """The router and each decode group's serving rank take completions (`api:`); a prefill's
    HTTP port and a later PP stage's answer the probes only, so they get a `status:` line and
    no `api:` one (a prefill's `api:` URL used to answer completions with 404)."""
    from dsv4_local.up import format_ready

    pp = launch_plan(deployment(prefill={"pipelineParallel": 2}, decode={"pipelineParallel": 2}))
    text = format_ready(pp, 1.0)
    api = [line.split()[1] for line in text.splitlines() if line.startswith("api:")]
    assert api == ["router", "decode-0-rank-0"]
    assert "send requests here" in next(ln for ln in text.splitlines() if " router " in ln)
    status = [line.split()[1] for line in text.splitlines() if line.startswith("status:")]
    assert sorted(status) == sorted(p.name for p in pp.processes)
