"""Engine sglang's children: valid Kubernetes objects (strict schemas), SGLang's server and
sglang-router in the pods the operator generates (same Services, ports and hardening), exec
probes that ask rank 0 only, podTemplate merging without command-line bypasses, a router that
lists the groups that exist through a rollout, and a reconcile that reaches Ready without any
worker report."""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from typing import Any, ClassVar

import kubernetes_validate
import pytest
import yaml
from repo_paths import SAMPLES
from support.fake_kube import FakeKube

from dsv4_cli.main import main
from dsv4_common.api.deployment import plan_memory
from dsv4_common.api.spec import SpecError, parse_meta, parse_spec
from dsv4_operator import labels as L
from dsv4_operator.flavors.sglang.command import (
    LAYER_PARTITION_ENV,
    ROUTER_COMMAND,
    SERVER_COMMAND,
    router_args,
    server_args,
)
from dsv4_operator.flavors.sglang.flags import SGLANG_VERSION
from dsv4_operator.flavors.sglang.workloads import DEFAULT_SGLANG_IMAGE
from dsv4_operator.objects import DesiredState, build_desired_state
from dsv4_operator.observe import PodState
from dsv4_operator.reconcile import reconcile

KUBERNETES_VERSIONS = ("1.30", "1.37")
SAMPLE = "sglang-flash-pd.yaml"
NOW = datetime(2026, 1, 1, tzinfo=UTC)
Body = dict[str, Any]


def desired(body: Body) -> DesiredState:
    spec = parse_spec(body)
    return build_desired_state(spec, parse_meta(body), plan_memory(spec))


def named(state: DesiredState, kind: str) -> dict[str, Body]:
    return {o["metadata"]["name"]: o for o in state.objects if o["kind"] == kind}


def container(obj: Body, name: str) -> Body:
    containers = obj["spec"]["template"]["spec"]["containers"]
    found: Body = next(c for c in containers if c["name"] == name)
    return found


def env_of(c: Body) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


def pro_pp4(make_body: Callable[..., Body]) -> Body:
    """Pro at PP 4 over H200 TP 8, nixl, with a podTemplate and engineArgs on decode."""
    body = make_body(
        SAMPLE,
        model={
            "preset": "deepseek-v4-pro",
            "weights": {"persistentVolumeClaim": "pro-weights", "path": "/models/pro"},
        },
        gpu={"type": "h200", "perPod": 8},
        kv={"transfer": "nixl"},
        maxContextTokens=65536,
        prefill={"pipelineParallel": 4, "tensorParallel": 8},
        decode={
            "pipelineParallel": 4,
            "tensorParallel": 8,
            "engineArgs": ["--decode-log-interval", "50"],
            "podTemplate": {
                "metadata": {"labels": {"team": "a"}},
                "spec": {"nodeSelector": {"pool": "h200"}},
            },
        },
    )
    return body


@pytest.mark.parametrize("variant", ["sample", "pro-pp4", "surge"])
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_passes_strict_schema_validation(
    make_body: Callable[..., Body], variant: str, version: str
) -> None:
    body = pro_pp4(make_body) if variant == "pro-pp4" else make_body(SAMPLE)
    state = desired(body)
    objects = state.with_surge({"prefill": 1, "decode": 1}).objects if variant == "surge" else ()
    for obj in objects or state.objects:
        kubernetes_validate.validate(obj, version, strict=True)


def test_the_worker_runs_sglangs_server_with_the_rendered_command_line(
    make_body: Callable[..., Body],
) -> None:
    body = make_body(SAMPLE)
    spec, meta = parse_spec(body), parse_meta(body)
    memory = plan_memory(spec)
    statefulsets = named(desired(body), "StatefulSet")
    assert set(statefulsets) == {"flash-sgl-prefill-0", "flash-sgl-decode-0", "flash-sgl-decode-1"}
    for name, sts in statefulsets.items():
        role, replica = sts["metadata"]["labels"][L.ROLE_LABEL], int(name.rsplit("-", 1)[1])
        worker = container(sts, "worker")
        assert worker["image"] == "lmsysorg/sglang:v0.5.23"
        assert worker["command"] == list(SERVER_COMMAND)
        assert worker["args"] == list(server_args(spec, meta, memory, role, replica))
        # The sample's spec.model.servedModelNames, as SGLang's one served name.
        served = worker["args"].index("--served-model-name")
        assert worker["args"][served + 1] == "deepseek-v4-flash"
        env = env_of(worker)
        assert env["DSV4_PP_RANK"]["fieldRef"]["fieldPath"].endswith("pod-index']")
        assert env["SGLANG_HOST_IP"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert env["HOME"] == "/tmp" and env["HF_HUB_OFFLINE"] == "1"
        split = [r.layers[1] - r.layers[0] for r in memory.role(role).ranks]
        assert env.get(LAYER_PARTITION_ENV) == (
            ",".join(map(str, split)) if len(split) > 1 else None
        )
        assert [p["name"] for p in worker["ports"]] == ["http", "status", "pp", "kv"]
        security = worker["securityContext"]
        assert security["readOnlyRootFilesystem"] and security["runAsNonRoot"]
        assert sts["spec"]["replicas"] == spec.role(role).pipeline_parallel


def test_the_default_image_is_the_snapshots_version(make_body: Callable[..., Body]) -> None:
    body = make_body(SAMPLE)
    del body["spec"]["engine"]["image"]
    state = desired(body)
    assert f"lmsysorg/sglang:v{SGLANG_VERSION}" == DEFAULT_SGLANG_IMAGE
    images = {container(s, "worker")["image"] for s in named(state, "StatefulSet").values()}
    assert images == {DEFAULT_SGLANG_IMAGE}
    router = named(state, "Deployment")["flash-sgl-router"]
    assert container(router, "router")["image"] == DEFAULT_SGLANG_IMAGE


def test_the_router_runs_sglang_router_in_pd_mode(make_body: Callable[..., Body]) -> None:
    body = make_body(SAMPLE, engine={"name": "sglang", "image": "s:1", "routerImage": "r:1"})
    state = desired(body)
    router = container(named(state, "Deployment")["flash-sgl-router"], "router")
    assert router["image"] == "r:1"
    assert router["command"] == list(ROUTER_COMMAND)
    assert router["args"] == list(router_args(parse_spec(body), parse_meta(body)))
    assert router["readinessProbe"]["httpGet"] == {"path": "/readiness", "port": "http"}
    assert {p["name"]: p["containerPort"] for p in router["ports"]} == {
        "http": 8000,
        "status": 8081,
    }
    images = {container(s, "worker")["image"] for s in named(state, "StatefulSet").values()}
    assert images == {"s:1"}


def _as_our_engine(body: Body) -> Body:
    """The same deployment served by our engine (whose KV transfer is NIXL, not mooncake)."""
    kv = {**body["spec"].get("kv", {}), "transfer": "nixl"}
    ours = {**body, "spec": {**body["spec"], "engine": {"name": "dsv4"}, "kv": kv}}
    for role in ("prefill", "decode"):
        ours["spec"][role] = {k: v for k, v in body["spec"][role].items() if k != "engineArgs"}
    return ours


def test_services_are_those_of_our_engine(make_body: Callable[..., Body]) -> None:
    """Same ports by the same names and the same selectors."""
    sgl = make_body(SAMPLE)
    for kind in ("Service", "PodDisruptionBudget"):
        mine = {n: o["spec"] for n, o in named(desired(sgl), kind).items()}
        theirs = {n: o["spec"] for n, o in named(desired(_as_our_engine(sgl)), kind).items()}
        assert mine == theirs, kind


def _network_policy(body: Body) -> Body:
    spec = parse_spec(body)
    state = build_desired_state(
        spec, parse_meta(body), plan_memory(spec), metrics_scrape_namespace="monitoring"
    )
    policy = named(state, "NetworkPolicy")[f"{body['metadata']['name']}-workers"]
    rules: Body = policy["spec"]
    return rules


def test_network_policy_admits_the_operator_and_scrapers_on_http(
    make_body: Callable[..., Body],
) -> None:
    """SGLang serves nothing on `status`: the operator (/server_info) and the metrics scrapers
    (/metrics) reach PP rank 0's HTTP server. Peers and the router as with our engine."""
    sgl = make_body(SAMPLE)
    mine, theirs = _network_policy(sgl), _network_policy(_as_our_engine(sgl))
    peers, router, operator, scrapers = mine["ingress"]
    assert [peers, router] == theirs["ingress"][:2]
    assert operator["from"][0]["podSelector"]["matchLabels"] == L.OPERATOR_POD_LABELS
    assert operator["ports"] == [{"protocol": "TCP", "port": 8080}]
    assert theirs["ingress"][2]["ports"] == [{"protocol": "TCP", "port": 8081}]
    assert scrapers["from"] == theirs["ingress"][3]["from"]
    assert scrapers["ports"] == [{"protocol": "TCP", "port": "http"}]
    assert theirs["ingress"][3]["ports"] == [{"protocol": "TCP", "port": "status"}]
    assert {k: v for k, v in mine.items() if k != "ingress"} == {
        k: v for k, v in theirs.items() if k != "ingress"
    }


def test_only_sglangs_worker_pods_carry_the_engine_label(make_body: Callable[..., Body]) -> None:
    """The PodMonitor tells SGLang's workers apart by it; routers and our engine's pods (whose
    template hash it would change) carry none, and no selector names it (they are immutable)."""
    sgl = desired(make_body(SAMPLE)).with_surge({"prefill": 1, "decode": 1})
    for state, expected in ((sgl, "sglang"), (desired(_as_our_engine(make_body(SAMPLE))), None)):
        workloads = [o for o in state.objects if o["kind"] in ("StatefulSet", "Deployment")]
        assert len(workloads) == (6 if expected else 4)
        for obj in workloads:
            labels = obj["spec"]["template"]["metadata"]["labels"]
            worker = obj["kind"] == "StatefulSet"
            assert labels.get(L.ENGINE_LABEL) == (expected if worker else None), obj["kind"]
            assert L.ENGINE_LABEL not in obj["spec"]["selector"]["matchLabels"]
            assert L.ENGINE_LABEL not in obj["metadata"]["labels"]
        selectors = [
            o["spec"][k]
            for o in state.objects
            for k in ("selector", "podSelector")
            if k in o.get("spec", {})
        ]
        assert len(selectors) > len(workloads)  # Services, PDBs and the NetworkPolicy too
        assert not [s for s in selectors if L.ENGINE_LABEL in str(s)]


def test_a_pod_template_cannot_set_the_engine_label(make_body: Callable[..., Body]) -> None:
    """Else our engine's pods could pass for SGLang's and go unscraped."""
    body = make_body("tiny-cpu.yaml")
    body["spec"]["prefill"]["podTemplate"] = {"metadata": {"labels": {L.ENGINE_LABEL: "sglang"}}}
    with pytest.raises(SpecError) as info:
        desired(body)
    needle = f"spec.prefill.podTemplate.metadata.labels[{L.ENGINE_LABEL}]: owned by the operator"
    assert needle in str(info.value), info.value.errors


# --- probes ----------------------------------------------------------------------------------


class _Health(http.server.BaseHTTPRequestHandler):
    codes: ClassVar[dict[str, int]] = {}

    def do_GET(self) -> None:
        self.send_response(self.codes.get(self.path, 404))
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def sglang_http() -> Iterator[tuple[int, dict[str, int]]]:
    """A stand-in for SGLang's HTTP server: path -> status code (set by the test)."""
    codes: dict[str, int] = {}
    handler = type("H", (_Health,), {"codes": codes})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1], codes
    server.shutdown()
    server.server_close()


def _run_probe(probe: Body, port: int, rank: str) -> int:
    """The exec probe as the kubelet runs it, against `port` instead of SGLang's 8080."""
    command = [c.replace("127.0.0.1:8080", f"127.0.0.1:{port}") for c in probe["exec"]["command"]]
    assert command[0] == "python3"
    env = {**os.environ, "DSV4_PP_RANK": rank}
    done = subprocess.run([sys.executable, *command[1:]], env=env, capture_output=True, timeout=30)
    return done.returncode


def test_probes_ask_sglang_on_rank_0_and_pass_on_other_ranks(
    make_body: Callable[..., Body], sglang_http: tuple[int, dict[str, int]]
) -> None:
    port, codes = sglang_http
    worker = container(
        named(desired(make_body(SAMPLE)), "StatefulSet")["flash-sgl-prefill-0"], "worker"
    )
    startup, liveness, readiness = (
        worker["startupProbe"],
        worker["livenessProbe"],
        worker["readinessProbe"],
    )
    assert startup["exec"]["command"][-2:] == ["/health", "25"]
    assert liveness["exec"]["command"][-2:] == ["/health", "25"]
    assert readiness["exec"]["command"][-2:] == ["/ready", "2"]
    assert startup["periodSeconds"] * startup["failureThreshold"] == 3600
    assert all(p["timeoutSeconds"] > int(p["exec"]["command"][-1]) for p in (startup, readiness))
    codes.update({"/health": 503, "/ready": 503})
    assert _run_probe(readiness, port, "0") != 0 and _run_probe(startup, port, "0") != 0
    assert _run_probe(readiness, port, "1") == 0 and _run_probe(liveness, port, "3") == 0
    codes.update({"/health": 200, "/ready": 200})
    assert _run_probe(readiness, port, "0") == 0 and _run_probe(liveness, port, "0") == 0


def test_a_probe_fails_on_rank_0_when_nothing_listens() -> None:
    body = yaml.safe_load((SAMPLES / SAMPLE).read_text())
    worker = container(named(desired(body), "StatefulSet")["flash-sgl-decode-0"], "worker")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])  # bound, not listening: connections are refused
        assert _run_probe(worker["readinessProbe"], port, "0") != 0


# --- podTemplate -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("role", "patch", "needle"),
    [
        (
            "decode",
            {"spec": {"containers": [{"name": "worker", "args": ["--log-level", "debug"]}]}},
            "spec.decode.podTemplate.spec.containers[worker].args: not supported with engine "
            "sglang: put SGLang flags in spec.<role>.engineArgs",
        ),
        (
            "router",
            {"spec": {"containers": [{"name": "router", "args": ["--policy", "random"]}]}},
            "spec.router.podTemplate.spec.containers[router].args: not supported with engine "
            "sglang",
        ),
        (
            "prefill",
            {
                "spec": {
                    "containers": [
                        {"name": "worker", "env": [{"name": LAYER_PARTITION_ENV, "value": "1,42"}]}
                    ]
                }
            },
            f"spec.prefill.podTemplate.spec.containers[worker].env[{LAYER_PARTITION_ENV}]: set "
            "by the operator",
        ),
        (
            "decode",
            {"spec": {"containers": [{"name": "worker", "readinessProbe": {}}]}},
            "spec.decode.podTemplate.spec.containers[worker].readinessProbe: owned by the operator",
        ),
    ],
)
def test_a_pod_template_cannot_bypass_the_command_line(
    make_body: Callable[..., Body], role: str, patch: Body, needle: str
) -> None:
    body = make_body(SAMPLE)
    body["spec"][role]["podTemplate"] = patch
    with pytest.raises(SpecError) as info:
        desired(body)
    assert needle in str(info.value), info.value.errors


def test_a_pod_template_still_merges(make_body: Callable[..., Body]) -> None:
    state = desired(pro_pp4(make_body))
    sts = named(state, "StatefulSet")["flash-sgl-decode-0"]
    assert sts["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "h200"}
    assert sts["spec"]["template"]["metadata"]["labels"]["team"] == "a"
    assert container(sts, "worker")["args"][-2:] == ["--decode-log-interval", "50"]


# --- the router through a rollout ------------------------------------------------------------


def test_the_router_lists_surge_groups_only_while_they_run(make_body: Callable[..., Body]) -> None:
    state = desired(make_body(SAMPLE))
    steady = named(state, "Deployment")["flash-sgl-router"]
    assert named(state.with_surge({}), "Deployment")["flash-sgl-router"] == steady
    rolled = named(state.with_surge({"decode": 1}), "Deployment")["flash-sgl-router"]
    args = container(rolled, "router")["args"]
    assert args.count("--decode") == 3 and args.count("--prefill") == 1
    assert "http://flash-sgl-decode-2-0.flash-sgl-decode-2.ns.svc:8080" in args
    hash_key = L.TEMPLATE_HASH_ANNOTATION
    before = steady["spec"]["template"]["metadata"]["annotations"][hash_key]
    after = rolled["spec"]["template"]["metadata"]["annotations"][hash_key]
    assert before != after  # the router rolls to the new list
    assert [o["kind"] for o in state.with_surge({"decode": 1}).objects].count("Deployment") == 1


def test_our_engines_router_does_not_depend_on_surge(make_body: Callable[..., Body]) -> None:
    state = desired(make_body("tiny-cpu.yaml"))
    assert state.router_with_surge is None
    router = named(state, "Deployment")["tiny-router"]
    assert named(state.with_surge({"decode": 1}), "Deployment")["tiny-router"] == router


# --- reconcile -------------------------------------------------------------------------------


class _NoStatusProbe:
    """SGLang workers have no /status document: the reconcile must not ask. Their /server_info
    does not answer here (test_sglang_observed.py has workers that do)."""

    def fetch(self, pods: Sequence[PodState]) -> dict[str, Any]:
        raise AssertionError(f"fetched /status of {[p.name for p in pods]}")

    def server_info(self, pods: Sequence[PodState]) -> dict[str, Any]:
        return {}


def _conditions(kube: FakeKube) -> dict[str, Body]:
    return {c["type"]: c for c in kube.cr["status"]["conditions"]}


def test_reconcile_reaches_ready_without_worker_reports(make_body: Callable[..., Body]) -> None:
    kube, probe = FakeKube(make_body(SAMPLE)), _NoStatusProbe()
    first = reconcile(kube.cr, kube, probe, clock=lambda: NOW)
    assert first.problem is None and {k[1] for k in first.applied} >= {"StatefulSet", "Deployment"}
    assert _conditions(kube)["Ready"]["reason"] == "PrefillNotReady"
    kube.run_controllers()
    reconcile(kube.cr, kube, probe, clock=lambda: NOW)
    cond = _conditions(kube)
    assert (cond["Ready"]["status"], cond["Ready"]["reason"]) == ("True", "Serving")
    kv = cond["KVTransferReady"]
    assert (kv["status"], kv["reason"]) == ("Unknown", "NotReported")
    assert (cond["Degraded"]["status"], cond["Progressing"]["status"]) == ("False", "False")
    assert all("observed" not in entry for entry in kube.cr["status"]["plan"])
    assert kube.cr["status"]["endpoint"] == "http://flash-sgl-router.ns.svc:8000"


def test_reconcile_waits_for_the_router(make_body: Callable[..., Body]) -> None:
    kube, probe = FakeKube(make_body(SAMPLE)), _NoStatusProbe()
    reconcile(kube.cr, kube, probe, clock=lambda: NOW)
    kube.run_controllers()
    for deployment in kube.of_kind("Deployment").values():
        deployment["status"] = {"readyReplicas": 0}
    reconcile(kube.cr, kube, probe, clock=lambda: NOW)
    assert _conditions(kube)["Ready"]["reason"] == "RouterNotReady"


def test_a_rollout_rolls_the_router_to_the_surge_group_and_back(
    make_body: Callable[..., Body],
) -> None:
    body = make_body(SAMPLE)
    body["spec"]["decode"]["replicas"] = 1
    kube, probe = FakeKube(body), _NoStatusProbe()
    reconcile(kube.cr, kube, probe, clock=lambda: NOW)
    kube.run_controllers()
    reconcile(kube.cr, kube, probe, clock=lambda: NOW)
    kube.cr["spec"]["decode"]["engineArgs"] = ["--decode-log-interval", "7"]
    kube.cr["metadata"]["generation"] = 2
    decode_urls: list[int] = []
    for _ in range(20):
        reconcile(kube.cr, kube, probe, clock=lambda: NOW)
        args = container(kube.of_kind("Deployment")["flash-sgl-router"], "router")["args"]
        decode_urls.append(args.count("--decode"))
        assert _conditions(kube)["Ready"]["status"] == "True", decode_urls
        if _conditions(kube)["Progressing"]["reason"] == "Complete":
            break
        kube.run_controllers()
    else:
        raise AssertionError(f"the roll did not finish: {decode_urls}")
    assert 2 in decode_urls and decode_urls[-1] == 1


def test_an_invalid_engine_arg_is_an_invalid_spec_and_applies_nothing(
    make_body: Callable[..., Body],
) -> None:
    body = make_body(SAMPLE)
    body["spec"]["decode"]["engineArgs"] = ["--tp-size", "8"]
    kube = FakeKube(body)
    result = reconcile(kube.cr, kube, _NoStatusProbe(), clock=lambda: NOW)
    assert (
        result.problem is not None and result.problem.reason == "InvalidSpec" and result.permanent
    )
    assert (
        "spec.decode.engineArgs[0]: --tp-size is computed by the operator" in result.problem.message
    )
    assert kube.objects == {}
    assert _conditions(kube)["PlanValid"]["reason"] == "InvalidSpec"


# --- dsv4 render -----------------------------------------------------------------------------


def test_cli_render_shows_the_sglang_objects(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render", str(SAMPLES / SAMPLE), "--namespace", "demo"]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    workers = [d for d in docs if d["kind"] == "StatefulSet"]
    assert len(workers) == 3
    assert all(container(w, "worker")["command"] == list(SERVER_COMMAND) for w in workers)
    (router,) = [d for d in docs if d["kind"] == "Deployment"]
    args = container(router, "router")["args"]
    assert "http://flash-sgl-prefill-0-0.flash-sgl-prefill-0.demo.svc:8080" in args


def test_the_e2e_sample_renders() -> None:
    """e2e/sglang-flash-gpu.yaml (the opt-in GPU variant) is a CR the operator would run."""
    body = yaml.safe_load((SAMPLES.parent.parent / "e2e" / "sglang-flash-gpu.yaml").read_text())
    kinds = [o["kind"] for o in desired(body).objects]
    assert kinds.count("StatefulSet") == 2 and kinds.count("Deployment") == 1
