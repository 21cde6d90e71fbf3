"""`dsv4 up`'s autoscaler (`dsv4_local.autoscaler`) with the supervisor and the workers stood in:
a queue grows decode (new groups' rank configs written, their processes started, router.json
listing their serving ranks); once quiet for the window, decode shrinks: router.json first,
the groups' SIGTERM only `retire_after_s` later (the router has read the file by then)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from dsv4_common.api.rank_config import ROUTER_CONFIG_KEY, parse_router_config
from dsv4_common.api.worker_status import Load, WorkerStatus
from dsv4_local.autoscaler import DECISIONS_FILE, LocalAutoscaler
from dsv4_local.deployment import Deployment, parse_deployment
from dsv4_local.plan import LaunchPlan, ProcessSpec, build_launch_plan
from dsv4_local.workdir import write_workdir

AUTOSCALING = {
    "minReplicas": 1,
    "maxReplicas": 3,
    "queueDepthPerReplica": 2,
    "stabilizationWindowSeconds": 10,
    "cooldownSeconds": 0,
}


def deployment() -> Deployment:
    body = {
        "apiVersion": "serving.dsv4.io/v1alpha1",
        "kind": "DSV4Deployment",
        "metadata": {"name": "tiny"},
        "spec": {
            "model": {"preset": "tiny"},
            "maxContextTokens": 2048,
            "decode": {"autoscaling": AUTOSCALING},
        },
    }
    return parse_deployment(yaml.safe_dump(body), "t.yaml")


class Ports:
    """Free ports from 30000 on; what `exclude` names is skipped (the autoscaler passes every
    port it handed out)."""

    def __init__(self) -> None:
        self.next = 30000
        self.excluded: list[frozenset[int]] = []

    def __call__(self, count: int, exclude: frozenset[int]) -> tuple[int, ...]:
        self.excluded.append(exclude)
        out = []
        while len(out) < count:
            if self.next not in exclude:
                out.append(self.next)
            self.next += 1
        return tuple(out)


class StandIn:
    """The supervisor's side: units added and retired, every unit ready."""

    def __init__(self, plan: LaunchPlan) -> None:
        self.units = {f"{p.role}-{p.replica}" for p in plan.processes if p.role != "router"}
        self.added: list[tuple[str, tuple[str, ...]]] = []
        self.retired: list[str] = []

    def add_unit(self, name: str, specs: Sequence[ProcessSpec]) -> None:
        self.added.append((name, tuple(s.name for s in specs)))
        self.units.add(name)

    def retire_unit(self, name: str) -> None:
        self.retired.append(name)
        self.units.discard(name)

    def unit_states(self) -> dict[str, Any]:
        return dict.fromkeys(self.units, "ready")


def test_a_queue_grows_decode_and_quiet_shrinks_it_router_first(tmp_path: Path) -> None:
    d = deployment()
    ports = Ports()  # as free_ports: never one bound now (the plan's are by the time we scale)
    plan = build_launch_plan(d, tmp_path, router_port=0, allocate_ports=ports, python="/py")
    write_workdir(plan)
    supervisor = StandIn(plan)
    queue = {"decode": 5}
    now = [0.0]

    def fetch(url: str) -> WorkerStatus | None:
        role = (
            "decode"
            if any(p.status_url == url and p.role == "decode" for p in every)
            else "prefill"
        )
        cap = d.memory.role(role).ranks[0].capacity
        waiting = queue["decode"] if role == "decode" else 0
        load = Load(cap.full_tokens, cap.swa_tokens, cap.max_running_requests, 0, waiting, True)
        return WorkerStatus(role=role, pp_rank=0, capacity=cap, load=load)

    every: list[ProcessSpec] = list(plan.processes)
    scaler = LocalAutoscaler(
        d,
        plan,
        supervisor,  # type: ignore[arg-type]
        out=open(tmp_path / "out.txt", "w"),  # noqa: SIM115
        interval_s=1.0,
        retire_after_s=2.0,
        clock=lambda: now[0],
        wall=lambda: 1000.0 + now[0],
        fetch=fetch,
        ports=lambda count, exclude: ports(count, exclude),
    )
    router_path = tmp_path / "router" / ROUTER_CONFIG_KEY

    def decodes() -> list[int]:
        config = parse_router_config(json.loads(router_path.read_text()))
        return [i.http_port for i in config.roles["decode"].instances]

    assert len(decodes()) == 1
    decisions = scaler.step()  # queue 5 at 2 per group: 3 groups
    assert decisions["decode"].replicas == 3
    assert [name for name, _ in supervisor.added] == ["decode-1", "decode-2"]
    every += [p for p in _specs(scaler)]
    assert (tmp_path / "decode-1" / "decode-rank-0.json").is_file()
    assert len(decodes()) == 3 and len(set(decodes())) == 3
    # The second new group's ports exclude the first's (not bound yet when it was planned).
    assert ports.excluded[-1] >= {decodes()[1]}
    doc = json.loads((tmp_path / DECISIONS_FILE).read_text())
    assert doc["decode"]["reason"] == "ScaledUp" and "queue depth 5" in doc["decode"]["message"]

    queue["decode"] = 0
    for t in (3.0, 8.0, 12.0):  # 3 was recommended until t=3: held until the window passed it
        now[0] = t
        assert scaler.step()["decode"].replicas == 3
    now[0] = 13.0
    assert scaler.step()["decode"].replicas == 1
    assert len(decodes()) == 1  # the router learns first ...
    assert supervisor.retired == []
    now[0] = 14.0
    scaler.tick()
    assert supervisor.retired == []
    now[0] = 15.5
    scaler.tick()  # ... the groups drain retire_after_s later
    assert sorted(supervisor.retired) == ["decode-1", "decode-2"]


def _specs(scaler: LocalAutoscaler) -> list[ProcessSpec]:
    return [p for groups in scaler._groups.values() for g in groups for p in g.processes]
