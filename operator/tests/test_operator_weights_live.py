"""hf:// sources with the real operator (kopf, the chart's RBAC) on the strict fake API server,
the fake hub for the hub, and the test playing the Job controller and the kubelet by running
the download Job's container as a real `dsv4 fetch` process (support/job_runner.py): two
DSV4Deployments of one model share one download Job; no worker object exists until it is
complete; its progress reaches both statuses (at most one status write per 2 s each) and the
WEIGHTS printer column; Events mark start, progress and completion; the pods then mount the
claim read-only. A gated repo without a token fails with WeightsReady=False naming the 401; a
token Secret its owner did not label as one is refused before any hub request carries it; a
corrupted file and a checkpoint that is not the plan's fail the Job at once, naming the file or
the first differing tensor; a claim the CR names that is smaller than the files is named before
any Job; `@main` is resolved once and stays pinned when main moves.
"""

from __future__ import annotations

import base64
import itertools
import re
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
from fake_hub import FakeHub
from hub_models import synthetic_checkpoint, tiny_config
from repo_paths import TOOLS_BIN
from support.job_runner import JobRunner
from support.live_operator import Live, running_operator

from dsv4_common.plan.checkpoint_match import TensorEntry
from dsv4_operator import labels as L

pytestmark = pytest.mark.slow
REPO = "acme/big-vocab"
CHUNK = 10 << 20
SPEC: dict[str, Any] = {
    "maxContextTokens": 1024,
    "gpu": {"memoryGiB": 0, "perPod": 0},
    "kv": {"pageSize": 16, "swaRatio": "auto", "transfer": "nixl"},
    "prefill": {"replicas": 1, "pipelineParallel": 1, "tensorParallel": 1},
    "decode": {"replicas": 1, "pipelineParallel": 1, "tensorParallel": 1},
}
PROGRESS_IP = "127.0.0.9"
KUBECTL = TOOLS_BIN / "kubectl"


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[FakeHub]:
    with FakeHub(tmp_path / "hub") as h:
        yield h


@pytest.fixture
def port() -> int:
    return _free_port(PROGRESS_IP)


@pytest.fixture
def live(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    port: int,
) -> Iterator[Live]:
    with running_operator(tmp_path, monkeypatch, caplog, progress_port=port) as running:
        yield running


@pytest.fixture
def runner(live: Live, tmp_path: Path, port: int) -> Iterator[JobRunner]:
    r = JobRunner(live.server, live.namespace, tmp_path / "claims", PROGRESS_IP, port)
    try:
        yield r
    finally:
        r.stop()


def _create(live: Live, name: str, endpoint: str, **model: Any) -> dict[str, Any]:
    body = {
        "apiVersion": L.API_VERSION,
        "kind": L.KIND,
        "metadata": {"name": name, "namespace": live.namespace},
        "spec": {
            **SPEC,
            "model": {"source": f"hf://{REPO}", "hub": {"endpoint": endpoint}, **model},
        },
    }
    return live.server.create(body, keep_status=False)


def _patch_spec(tmp_path: Path, live: Live, name: str, spec: dict[str, Any]) -> None:
    """A spec edit as a user makes it (kubectl patch --type merge)."""
    client = kubernetes.config.new_client_from_config(config_file=str(tmp_path / "kubeconfig"))
    with client:
        kubernetes.client.CustomObjectsApi(client).patch_namespaced_custom_object(
            L.GROUP, L.VERSION, live.namespace, L.PLURAL, name, {"spec": spec}
        )


def _weights(live: Live, name: str) -> dict[str, Any]:
    return ((live.cr(name) or {}).get("status") or {}).get("weights") or {}


def _status_writes(live: Live, name: str) -> list[float]:
    path = f"/apis/{L.API_VERSION}/namespaces/{live.namespace}/{L.PLURAL}/{name}/status"
    return [r.at for r in live.server.requests if r.method == "PATCH" and r.path == path]


def _kubectl_get(live: Live, tmp_path: Path) -> dict[str, dict[str, str]]:
    """`kubectl get dsv4 -o wide` (the real kubectl, as a user runs it): each row's cells by
    column, cut at the header's column starts."""
    kubeconfig = live.server.write_kubeconfig(tmp_path / "user-kubeconfig", live.namespace)
    argv = [str(KUBECTL), "--kubeconfig", str(kubeconfig), "--cache-dir", str(tmp_path / "kc")]
    done = subprocess.run(
        [*argv, "get", "dsv4", "-o", "wide"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    header, *rows = done.stdout.splitlines()
    starts = [m.start() for m in re.finditer(r"\S+", header)]
    names = header.split()
    bounds = list(itertools.pairwise([*starts, None]))
    table = {}
    for row in rows:
        cells = {n: row[a:b].strip() for n, (a, b) in zip(names, bounds, strict=True)}
        table[cells["NAME"]] = cells
    return table


def test_two_deployments_share_one_download_and_start_when_it_completes(
    live: Live, runner: JobRunner, hub: FakeHub, tmp_path: Path
) -> None:
    files = synthetic_checkpoint(tmp_path / "model", tiny_config(vocab_size=65536))
    commit = hub.add_repo(REPO, files)
    shard = max(
        (n for n in files if n.endswith(".safetensors")), key=lambda n: files[n].stat().st_size
    )
    release = hub.stall(hub.file(REPO, shard).sha256 or "", CHUNK + (1 << 20))
    a = _create(live, "model-a", hub.endpoint)
    b = _create(live, "model-b", hub.endpoint)

    def polled(check: Any) -> Any:
        def step() -> Any:
            runner.poll()
            return check()

        return step

    jobs = live.wait(
        "one Job for both",
        polled(
            lambda: (
                live.children("Job", "batch/v1")
                if _weights(live, "model-a").get("key") and _weights(live, "model-b").get("key")
                else None
            )
        ),
    )
    (job_name,) = jobs
    assert _weights(live, "model-a")["key"] == _weights(live, "model-b")["key"]
    assert _weights(live, "model-a")["revision"] == commit
    # Progress in both statuses, while no worker object exists.
    for name in ("model-a", "model-b"):
        live.wait(
            f"{name} shows progress",
            polled(
                lambda name=name: re.fullmatch(
                    r"[1-9][0-9]?%", _weights(live, name).get("progress", "")
                )
            ),
        )
    w = _weights(live, "model-a")
    assert w["phase"] == "Downloading" and 0 < w["bytesDone"] < w["bytesTotal"]
    if KUBECTL.exists():  # the WEIGHTS printer column, as `kubectl get dsv4` shows it
        shown = _kubectl_get(live, tmp_path)
        assert re.fullmatch(r"[1-9][0-9]?%", shown["model-a"]["WEIGHTS"]), shown
        assert shown["model-b"]["REASON"] == "WeightsNotReady", shown
    assert live.condition("model-a", "WeightsReady")["reason"] == "Downloading"
    assert live.condition("model-a", "Ready")["reason"] == "WeightsNotReady"
    assert live.children("StatefulSet", "apps/v1") == {}
    job = live.server.get("batch/v1", "Job", live.namespace, job_name)
    assert job is not None
    uids = sorted(r["uid"] for r in job["metadata"]["ownerReferences"])
    live.wait(
        "both own the Job",
        polled(
            lambda: (
                sorted(
                    r["uid"]
                    for r in live.server.get("batch/v1", "Job", live.namespace, job_name)[
                        "metadata"
                    ]["ownerReferences"]
                )
                == sorted([a["metadata"]["uid"], b["metadata"]["uid"]])
            )
        ),
    )
    assert len(uids) >= 1
    # The node goes away mid-file: the Job's next pod resumes from the partial file.
    runner.kill(job_name)
    live.wait("a second pod", polled(lambda: len(runner.started) == 2))
    sha = hub.file(REPO, shard).sha256
    resumed = live.wait(
        "a Range request",
        polled(
            lambda: [
                r
                for r in hub.requests
                if r.path == f"/cdn/{sha}" and (r.range or "").startswith("bytes=")
            ]
        ),
    )
    held = int(resumed[0].range.removeprefix("bytes=").rstrip("-"))
    assert held >= CHUNK and resumed[0].status == 206
    # Complete: both start, their pods mounting the claim read-only.
    release.set()
    for name in ("model-a", "model-b"):
        live.wait(
            f"{name} builds its workers",
            polled(
                lambda name=name: (
                    f"{name}-decode-0" in live.children("StatefulSet", "apps/v1")
                    and live.condition(name, "WeightsReady")["status"] == "True"
                )
            ),
            timeout=90,
        )
        assert _weights(live, name)["progress"] == "100%"
        sts = live.children("StatefulSet", "apps/v1")[f"{name}-decode-0"]
        volumes = sts["spec"]["template"]["spec"]["volumes"]
        claim = _weights(live, name)["claim"]
        assert {
            "name": "weights",
            "persistentVolumeClaim": {"claimName": claim, "readOnly": True},
        } in volumes
        live.wait(
            f"{name}'s Events",
            lambda name=name: (
                {"WeightsDownloading", "WeightsProgress", "WeightsReady"}
                <= {e["reason"] for e in live.events(name)}
            ),
        )
    if KUBECTL.exists():
        assert {r["WEIGHTS"] for r in _kubectl_get(live, tmp_path).values()} == {"100%"}
    assert len(runner.started) == 2  # one download for both (its second pod resumed)
    assert len(live.children("Job", "batch/v1")) == 1
    claims = live.children("PersistentVolumeClaim", "v1")
    assert list(claims) == [_weights(live, "model-a")["claim"]]
    # Progress-only status writes come at most once per 2 s per CR (a write that moved a phase
    # or a condition may follow sooner).
    for name in ("model-a", "model-b"):
        progress_writes = [
            r.at
            for r in live.server.requests
            if r.method == "PATCH"
            and r.path.endswith(f"/{L.PLURAL}/{name}/status")
            and set((r.body or {}).get("status", {})) == {"weights"}
        ]
        gaps = [t2 - t1 for t1, t2 in itertools.pairwise(progress_writes)]
        assert all(gap >= 1.9 for gap in gaps), gaps
    text = live.metrics.render().decode()
    assert (
        'dsv4_operator_weights_bytes{deployment="model-a",namespace="default",state="total"}'
        in text
    )


def test_a_gated_repo_without_a_token_fails_naming_the_401_and_a_token_fixes_it(
    live: Live, runner: JobRunner, hub: FakeHub, tmp_path: Path
) -> None:
    files = synthetic_checkpoint(tmp_path / "model", tiny_config(), random=False)
    hub.add_repo(REPO, files, gated=True, tokens=("hf_granted",))
    _create(live, "gated", hub.endpoint)
    cond = live.wait(
        "WeightsReady names the 401",
        lambda: (
            (c := live.condition("gated", "WeightsReady")) and c["reason"] == "Unauthorized" and c
        ),
    )
    assert "401" in cond["message"] and "tokenSecretRef" in cond["message"]
    assert live.condition("gated", "PlanValid")["status"] == "False"  # config.json is gated too
    assert live.children("Job", "batch/v1") == {}
    _token_secret(live, "hf_granted", opted_in=True)
    hub_spec = {"endpoint": hub.endpoint, "tokenSecretRef": {"name": "hf"}}
    _patch_spec(tmp_path, live, "gated", {"model": {"hub": hub_spec}})

    def ready() -> bool:
        runner.poll()
        c = live.condition("gated", "WeightsReady")
        return bool(c and c["status"] == "True")

    live.wait("the token lets it through", ready, timeout=90)


def _token_secret(live: Live, token: str, *, opted_in: bool) -> None:
    labels = {L.HUB_TOKEN_LABEL: L.HUB_TOKEN_LABEL_VALUE} if opted_in else {}
    live.server.create(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "hf", "namespace": live.namespace, "labels": labels},
            "data": {"HF_TOKEN": base64.b64encode(token.encode()).decode()},
        }
    )


def test_a_secret_not_opted_in_is_refused_and_its_key_reaches_no_hub(
    live: Live, runner: JobRunner, hub: FakeHub, tmp_path: Path
) -> None:
    """Whoever may create a DSV4Deployment may name any Secret of the namespace: without its
    owner's label the operator sends its key nowhere and renders no Job that mounts it. The
    owner's label (`kubectl label secret`) lets it through at the next reconcile."""
    files = synthetic_checkpoint(tmp_path / "model", tiny_config(), random=False)
    hub.add_repo(REPO, files, gated=True, tokens=("hf_granted",))
    _token_secret(live, "hf_granted", opted_in=False)
    _create(
        live,
        "taker",
        hub.endpoint,
        hub={"endpoint": hub.endpoint, "tokenSecretRef": {"name": "hf"}},
    )
    cond = live.wait(
        "WeightsReady refuses the Secret",
        lambda: (
            (c := live.condition("taker", "WeightsReady"))
            and c["reason"] == "TokenSecretNotAllowed"
            and c
        ),
    )
    message = cond["message"]
    assert "spec.model.hub.tokenSecretRef" in message and f"{live.namespace}/hf" in message
    assert f"{L.HUB_TOKEN_LABEL}={L.HUB_TOKEN_LABEL_VALUE}" in message
    assert _weights(live, "taker")["phase"] == "Failed"
    assert live.children("Job", "batch/v1") == {}
    # Nothing asked the hub: the token never left, not even to resolve the revision.
    assert not any("hf_granted" in (r.auth or "") for r in hub.requests), hub.requests
    assert hub.requests == []

    # The Secret's owner opts it in, as the condition's message says (the real kubectl, with
    # the admin's credentials: the operator itself may not change a Secret).
    kubeconfig = live.server.write_kubeconfig(tmp_path / "owner-kubeconfig", live.namespace)
    label = f"{L.HUB_TOKEN_LABEL}={L.HUB_TOKEN_LABEL_VALUE}"
    argv = [str(KUBECTL), "--kubeconfig", str(kubeconfig), "--cache-dir", str(tmp_path / "kc")]
    subprocess.run([*argv, "label", "secret", "hf", label], check=True, capture_output=True)

    def ready() -> bool:
        runner.poll()
        c = live.condition("taker", "WeightsReady")
        return bool(c and c["status"] == "True")

    live.wait("the owner's label lets it through", ready, timeout=90)
    assert any(r.auth == "Bearer hf_granted" for r in hub.requests)
    (job,) = live.children("Job", "batch/v1").values()
    (container,) = job["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "HF_TOKEN"}


def test_a_corrupted_file_fails_the_job_naming_it(
    live: Live, runner: JobRunner, hub: FakeHub, tmp_path: Path
) -> None:
    files = synthetic_checkpoint(tmp_path / "model", tiny_config(), random=False)
    hub.add_repo(REPO, files)
    hub.corrupt(REPO, "model-00001-of-00002.safetensors")
    _create(live, "corrupt", hub.endpoint)

    def failed() -> Any:
        runner.poll()
        c = live.condition("corrupt", "WeightsReady")
        return c if c and c["reason"] == "HashMismatch" else None

    cond = live.wait("WeightsReady names the hash mismatch", failed, timeout=90)
    assert "model-00001-of-00002.safetensors" in cond["message"]
    assert "delete the Job to try again" in cond["message"]
    assert len(runner.started) == 1  # exit 3: the Job failed at once, no retry
    assert _weights(live, "corrupt")["phase"] == "Failed"
    assert live.children("StatefulSet", "apps/v1") == {}
    live.wait("a Warning Event", lambda: live.events("corrupt", reason="WeightsFailed"))


def test_a_checkpoint_that_is_not_the_plans_fails_naming_the_first_tensor(
    live: Live, runner: JobRunner, hub: FakeHub, tmp_path: Path
) -> None:
    """The Job's `dsv4 fetch` reads the downloaded checkpoint's tensor index against the
    planner's list: a shape the plan does not count is a condition naming that tensor (and no
    worker pod that would crash-loop on it)."""
    wrong = {"layers.2.attn.wkv.weight": TensorEntry("F32", (32, 65))}
    files = synthetic_checkpoint(tmp_path / "model", tiny_config(), change=wrong, random=False)
    hub.add_repo(REPO, files)
    _create(live, "mismatch", hub.endpoint)

    def failed() -> Any:
        runner.poll()
        c = live.condition("mismatch", "WeightsReady")
        return c if c and c["reason"] == "TensorMismatch" else None

    cond = live.wait("WeightsReady names the tensor", failed, timeout=90)
    assert (
        "layers.2.attn.wkv.weight: the checkpoint holds F32 [32, 65], the plan counts F32 [32, 64]"
        in cond["message"]
    )
    assert len(runner.started) == 1  # exit 3: no retry
    assert live.children("StatefulSet", "apps/v1") == {}
    live.wait("a Warning Event", lambda: live.events("mismatch", reason="WeightsFailed"))


def test_a_claim_smaller_than_the_files_is_named_before_any_download(
    live: Live, runner: JobRunner, hub: FakeHub, tmp_path: Path
) -> None:
    """A claim the CR names is measured against the hub's file list before a Job exists."""
    files = synthetic_checkpoint(tmp_path / "model", tiny_config(), random=False)
    hub.add_repo(REPO, files)
    live.server.create(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "models", "namespace": live.namespace},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "resources": {"requests": {"storage": "1Mi"}},
            },
            "status": {"phase": "Bound", "capacity": {"storage": "1Mi"}},
        }
    )
    _create(live, "small", hub.endpoint, cache={"persistentVolumeClaim": "models"})
    cond = live.wait(
        "WeightsReady names the claim's size",
        lambda: (
            (c := live.condition("small", "WeightsReady")) and c["reason"] == "VolumeTooSmall" and c
        ),
    )
    assert "claim models holds 1Mi" in cond["message"], cond
    assert live.children("Job", "batch/v1") == {}
    assert live.children("StatefulSet", "apps/v1") == {}


def test_main_is_resolved_once_and_stays_pinned_when_it_moves(
    live: Live, runner: JobRunner, hub: FakeHub, tmp_path: Path
) -> None:
    """`hf://ORG/NAME` (main) is resolved to a commit, recorded in status and downloaded at
    that commit; a new commit on main later changes nothing for this CR (a spec edit
    reconciles it again at the pinned commit)."""
    files = synthetic_checkpoint(tmp_path / "model", tiny_config(), random=False)
    first = hub.add_repo(REPO, files)
    _create(live, "pinned", hub.endpoint)

    def ready() -> bool:
        runner.poll()
        c = live.condition("pinned", "WeightsReady")
        return bool(c and c["status"] == "True")

    live.wait("downloaded", ready, timeout=90)
    assert _weights(live, "pinned")["revision"] == first
    (job,) = live.children("Job", "batch/v1").values()
    assert job["spec"]["template"]["spec"]["containers"][0]["args"][0] == f"hf://{REPO}@{first}"
    second = hub.commit(REPO, {**files, "README.md": b"a newer main\n"})
    assert second != first
    _patch_spec(tmp_path, live, "pinned", {"maxContextTokens": 512})
    live.wait(
        "the edit reconciled",
        lambda: ((live.cr("pinned") or {}).get("status") or {}).get("observedGeneration") == 2,
    )
    assert _weights(live, "pinned")["revision"] == first
    assert live.condition("pinned", "WeightsReady")["status"] == "True"
    assert [j["metadata"]["name"] for j in live.children("Job", "batch/v1").values()] == [
        job["metadata"]["name"]
    ]
