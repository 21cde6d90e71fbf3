"""An hf:// source in a cluster, decided purely (`weights.decide`) and reconciled on the in-memory
API with a hub port that answers from a table: the shared download objects (claim, policy, Job),
WeightsReady and status.weights through every phase (pending, downloading with progress,
complete, failed), the Events, the status write throttle, and the gate: no worker object until
the weights are complete and match the plan; then the pods mount the cache read-only and the
rank configs point at the snapshot."""

from __future__ import annotations

import base64
import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.fake_kube import FakeKube, FakeProbe, conditions

from dsv4_common.api.fetch_status import (
    FetchStatus,
    fetch_status_to_dict,
    parse_fetch_status,
    termination_text,
)
from dsv4_common.api.model_source import HfSource
from dsv4_common.api.rank_config import parse_rank_config
from dsv4_common.api.spec import parse_meta, parse_spec
from dsv4_common.core.presets import load_model_config
from dsv4_operator import labels as L
from dsv4_operator import weights as W
from dsv4_operator.reconcile import reconcile
from dsv4_operator.weights import HubError, Resolved, Seen

ROOT = Path(__file__).resolve().parents[2]
TINY_CONFIG = (ROOT / "worker/dsv4_worker/models/tiny/config.json").read_text()
COMMIT = "a" * 40
NEWER = "b" * 40
T0 = datetime(2026, 1, 1, tzinfo=UTC)
GIB = 1 << 30
CR: dict[str, Any] = {
    "apiVersion": "serving.dsv4.io/v1alpha1",
    "kind": "DSV4Deployment",
    "metadata": {"name": "hf-tiny", "namespace": "ns", "uid": "uid-a", "generation": 1},
    "spec": {
        "model": {"source": "hf://acme/tiny@main"},
        "maxContextTokens": 1024,
        "kv": {"pageSize": 16},
    },
}


class TableHub:
    """The Hub port: answers by (repo, revision) from a table; records the calls."""

    def __init__(self) -> None:
        self.refs = {("acme/tiny", "main"): COMMIT}
        self.calls: list[tuple[str, str, str | None]] = []
        self.error: HubError | None = None

    def resolve(self, source: HfSource, *, endpoint: str | None, token: str | None) -> Resolved:
        self.calls.append((source.repo_id, source.revision, token))
        if self.error is not None:
            raise self.error
        commit = self.refs.get((source.repo_id, source.revision), source.revision)
        return Resolved(source, commit, 3 * GIB, 5, TINY_CONFIG)


def cr(**model: Any) -> dict[str, Any]:
    body = json.loads(json.dumps(CR))
    body["spec"]["model"].update(model)
    return body


def progress(done: int, *, phase: str = "downloading", rate: float = 1e8) -> dict[str, Any]:
    status = FetchStatus(
        version=1,
        source=f"hf://acme/tiny@{COMMIT}",
        phase=phase,  # type: ignore[arg-type]
        commit=COMMIT,
        bytes_done=done,
        bytes_total=3 * GIB,
        files_done=done * 5 // (3 * GIB),
        files_total=5,
        bytes_per_second=rate,
        eta_seconds=(3 * GIB - done) / rate,
    )
    return fetch_status_to_dict(status)


# --- the decision, purely ----------------------------------------------------------------------


def decide(
    body: dict[str, Any], seen: Seen, *, previous: dict[str, Any] | None = None, now: datetime = T0
) -> W.WeightsDecision:
    spec, meta = parse_spec(body), parse_meta(body)
    resolved = Resolved(HfSource("acme/tiny"), COMMIT, 3 * GIB, 5, TINY_CONFIG)
    return W.decide(
        spec,
        meta,
        resolved,
        seen,
        owners=[W.Owner("b", "uid-b"), W.Owner("hf-tiny", "uid-a")],
        previous=previous or {},
        now=now,
        image="ghcr.io/dsv4-serve/worker:test",
        endpoint="http://hub.local",
    )


def test_a_first_decision_creates_the_shared_download() -> None:
    d = decide(cr(hub={"tokenSecretRef": {"name": "hf"}}), Seen())
    assert not d.ready and d.condition.status == "False" and d.condition.reason == "Downloading"
    assert [o["kind"] for o in d.objects] == ["PersistentVolumeClaim", "NetworkPolicy", "Job"]
    claim, policy, job = d.objects
    key = W.weights_key("acme/tiny", COMMIT, None)
    assert (
        claim["metadata"]["name"] == f"dsv4-hf-{key}"
        and job["metadata"]["name"] == f"dsv4-fetch-{key}"
    )
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "5Gi"  # 3 GiB + 5% + 1 GiB, up
    for obj in d.objects:
        assert obj["metadata"]["labels"][L.WEIGHTS_KEY_LABEL] == key
        assert L.DEPLOYMENT_LABEL not in obj["metadata"]["labels"]  # shared: no CR prunes it
        refs = obj["metadata"]["ownerReferences"]
        assert [r["uid"] for r in refs] == ["uid-a", "uid-b"]
        assert not any(r["controller"] or r["blockOwnerDeletion"] for r in refs)
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["dsv4", "fetch"]
    assert container["args"][0] == f"hf://acme/tiny@{COMMIT}"  # the resolved commit, pinned
    env = {e["name"]: e for e in container["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "HF_TOKEN"}
    assert env["HF_ENDPOINT"]["value"] == "http://hub.local"
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert rules[0]["action"] == "FailJob" and rules[0]["onExitCodes"]["values"] == [3]
    assert job["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"] == {
        "claimName": claim["metadata"]["name"]
    }
    assert policy["spec"]["podSelector"]["matchLabels"][L.WEIGHTS_KEY_LABEL] == key
    assert d.status is not None and d.status["revision"] == COMMIT and d.status["progress"] == "0%"
    assert [e.reason for e in d.events] == ["WeightsDownloading"]


def _running(job: dict[str, Any], ip: str = "10.0.0.9") -> Seen:
    pod = {"metadata": {"name": "p"}, "status": {"phase": "Running", "podIP": ip}}
    return Seen(job={**job, "status": {"active": 1}}, pods=(pod,))


def test_progress_shows_in_status_with_an_event_each_ten_percent() -> None:
    first = decide(cr(), Seen())
    seen = _running(first.objects[-1])

    def at(done: int) -> Seen:
        return replace(seen, progress=parse_fetch_status(progress(done)))

    d1 = decide(
        cr(), at(GIB // 2), previous={"weights": first.status}, now=T0 + timedelta(seconds=5)
    )
    assert d1.status is not None and d1.status["phase"] == "Downloading"
    assert d1.status["progress"] == "16%" and d1.status["bytesDone"] == GIB // 2
    assert d1.status["etaSeconds"] == round((3 * GIB - GIB // 2) / 1e8)
    assert "16% (512.0 MiB of 3.0 GiB, 0/5 files), 100.0 MB/s, ETA 27 s" in d1.condition.message
    assert [e.reason for e in d1.events] == ["WeightsProgress"]
    d2 = decide(
        cr(), at(GIB // 2 + 10), previous={"weights": d1.status}, now=T0 + timedelta(seconds=10)
    )
    assert d2.events == ()  # same decile
    d3 = decide(cr(), at(2 * GIB), previous={"weights": d2.status}, now=T0 + timedelta(seconds=15))
    assert [e.reason for e in d3.events] == ["WeightsProgress"] and d3.status["progress"] == "66%"


def test_status_figures_move_at_most_once_per_two_seconds() -> None:
    first = decide(cr(), Seen())
    seen = _running(first.objects[-1])
    a = decide(
        cr(),
        replace(seen, progress=parse_fetch_status(progress(GIB))),
        previous={"weights": first.status},
        now=T0 + timedelta(seconds=10),
    )
    b = decide(
        cr(),
        replace(seen, progress=parse_fetch_status(progress(GIB + 99))),
        previous={"weights": a.status},
        now=T0 + timedelta(seconds=11),
    )
    assert b.status == a.status and b.condition == a.condition  # within 2 s: nothing to write
    c = decide(
        cr(),
        replace(seen, progress=parse_fetch_status(progress(GIB + 99))),
        previous={"weights": b.status},
        now=T0 + timedelta(seconds=12),
    )
    assert c.status is not None and c.status["bytesDone"] == GIB + 99 and c.status != b.status


def _finished(job: dict[str, Any], ok: bool, doc: FetchStatus) -> Seen:
    kind = "Complete" if ok else "Failed"
    pod = {
        "metadata": {"name": "p"},
        "status": {
            "phase": "Succeeded" if ok else "Failed",
            "containerStatuses": [
                {
                    "name": "fetch",
                    "state": {
                        "terminated": {
                            "exitCode": 0 if ok else 3,
                            "finishedAt": "2026-01-01T00:10:00Z",
                            "message": termination_text(doc),
                        }
                    },
                }
            ],
        },
    }
    return Seen(
        job={**job, "status": {"conditions": [{"type": kind, "status": "True"}]}}, pods=(pod,)
    )


def _doc(**fields: Any) -> FetchStatus:
    base = FetchStatus(
        version=1, source=f"hf://acme/tiny@{COMMIT}", phase="complete", commit=COMMIT
    )
    return replace(base, **fields)


def test_a_complete_job_makes_the_weights_ready() -> None:
    first = decide(cr(), Seen())
    doc = _doc(message="283 tensors match the plan of tiny", draft_layers=True)
    d = decide(cr(), _finished(first.objects[-1], True, doc), previous={"weights": first.status})
    assert (
        d.ready
        and d.condition.reason == "Downloaded"
        and "283 tensors match" in d.condition.message
    )
    assert d.status is not None and d.status["progress"] == "100%" and d.status["filesDone"] == 5
    assert [e.reason for e in d.events] == ["WeightsReady"]
    # Speculation needs the MTP layers the checkpoint lacks.
    spec_draft = cr()
    spec_draft["spec"]["speculativeDraftTokens"] = 1
    d = decide(spec_draft, _finished(first.objects[-1], True, _doc(draft_layers=False)))
    assert not d.ready and d.condition.reason == "TensorMismatch" and "MTP" in d.condition.message


@pytest.mark.parametrize(
    ("reason", "message"),
    [
        (
            "HashMismatch",
            "hf://acme/tiny: model-00001.safetensors: downloaded 2 times, its sha256 is 00, "
            "the hub lists ff",
        ),
        ("VolumeTooSmall", "3.0 GiB left to download but the cache volume has 0.5 GiB free"),
        ("TensorMismatch", "layers.2.attn.wkv.weight: missing (the plan counts F32 [32, 64])"),
    ],
)
def test_a_failed_job_names_why(reason: str, message: str) -> None:
    first = decide(cr(), Seen())
    doc = _doc(phase="failed", reason=reason, message=message)
    d = decide(cr(), _finished(first.objects[-1], False, doc), previous={"weights": first.status})
    assert not d.ready and d.condition.reason == reason and message in d.condition.message
    assert "delete the Job to try again" in d.condition.message
    assert d.status is not None and d.status["phase"] == "Failed" and d.status["reason"] == reason
    assert [(e.type, e.reason) for e in d.events] == [("Warning", "WeightsFailed")]


def test_a_users_claim_must_exist_and_hold_the_files() -> None:
    body = cr(cache={"persistentVolumeClaim": "models"})
    d = decide(body, Seen())
    assert d.condition.reason == "ClaimNotFound" and d.objects == ()
    small = {"status": {"capacity": {"storage": "2Gi"}}}
    d = decide(body, Seen(claim=small))
    assert d.condition.reason == "VolumeTooSmall" and "holds 2Gi" in d.condition.message
    d = decide(body, Seen(claim={"status": {"capacity": {"storage": "1Ti"}}}))
    assert [o["kind"] for o in d.objects] == ["NetworkPolicy", "Job"]  # never writes your claim
    assert (
        d.objects[-1]["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"][
            "claimName"
        ]
        == "models"
    )
    d = decide(cr(cache={"size": "1Gi"}), Seen())
    assert (
        d.condition.reason == "VolumeTooSmall"
        and "spec.model.cache.size 1Gi" in d.condition.message
    )


def test_a_running_job_whose_template_changed_is_recreated() -> None:
    first = decide(cr(), Seen())
    job = json.loads(json.dumps(first.objects[-1]))
    job["spec"]["template"]["metadata"]["annotations"][L.TEMPLATE_HASH_ANNOTATION] = "old"
    d = decide(cr(), _running(job))
    assert d.recreate_job and "Job" not in [o["kind"] for o in d.objects]


def test_a_preset_that_is_not_the_repos_model_is_named() -> None:
    spec = parse_spec(cr(preset="tiny"))
    repo = load_model_config("tiny")
    assert W.config_mismatch(spec, repo, repo) is None
    other = json.loads(TINY_CONFIG)
    other["hidden_size"] = 128
    from dsv4_common.core.hf import parse_hf_config

    message = W.config_mismatch(spec, repo, parse_hf_config(json.dumps(other), name="x"))
    assert message is not None and message.startswith(
        "embed.weight: the checkpoint holds F32 [256, 128]"
    )


# --- reconciled on the in-memory API -----------------------------------------------------------


def run(kube: FakeKube, probe: FakeProbe, hub: TableHub, now: datetime = T0) -> Any:
    return reconcile(kube.cr, kube, probe, clock=lambda: now, hub=hub)


def test_no_worker_object_until_the_weights_are_complete(tmp_path: Path) -> None:
    kube, probe, hub = FakeKube(cr()), FakeProbe(), TableHub()
    result = run(kube, probe, hub)
    assert {k[1] for k in result.applied} == {"PersistentVolumeClaim", "NetworkPolicy", "Job"}
    assert kube.of_kind("StatefulSet") == {} and kube.of_kind("ConfigMap") == {}
    cond = conditions(kube)
    assert (
        cond["WeightsReady"]["status"] == "False" and cond["Ready"]["reason"] == "WeightsNotReady"
    )
    assert cond["PlanValid"]["status"] == "True" and cond["ContextFits"]["status"] == "True"
    assert cond["Progressing"]["reason"] == "DownloadingWeights"
    weights = kube.cr["status"]["weights"]
    assert weights["revision"] == COMMIT and weights["source"] == "hf://acme/tiny@main"
    assert kube.cr["status"]["maxContextTokens"] >= 1024  # planned from the hub's config.json
    assert [e.reason for e in result.events] == ["WeightsDownloading"]
    # The Job runs and reports; main moves on the hub, but the pinned commit stays.
    hub.refs[("acme/tiny", "main")] = NEWER
    (job,) = kube.of_kind("Job").values()
    pod_key = ("v1", "Pod", "ns", "fetch-pod")
    kube.objects[pod_key] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "fetch-pod",
            "namespace": "ns",
            "labels": job["spec"]["template"]["metadata"]["labels"],
        },
        "status": {"phase": "Running", "podIP": "10.0.0.9"},
    }
    probe.progress_docs["10.0.0.9"] = progress(GIB)
    result = run(kube, probe, hub, T0 + timedelta(seconds=10))
    assert kube.cr["status"]["weights"]["progress"] == "33%"
    assert kube.cr["status"]["weights"]["revision"] == COMMIT
    assert hub.calls[-1] == ("acme/tiny", COMMIT, None)  # asked at the pinned commit
    assert kube.of_kind("StatefulSet") == {}
    # Complete: the workers are built, mounting the cache read-only at the snapshot.
    job["status"] = {"conditions": [{"type": "Complete", "status": "True"}]}
    kube.objects[pod_key]["status"] = {
        "phase": "Succeeded",
        "containerStatuses": [
            {
                "name": "fetch",
                "state": {
                    "terminated": {
                        "exitCode": 0,
                        "message": termination_text(
                            _doc(message="242 tensors match the plan of tiny")
                        ),
                    }
                },
            }
        ],
    }
    result = run(kube, probe, hub, T0 + timedelta(seconds=20))
    assert conditions(kube)["WeightsReady"]["reason"] == "Downloaded"
    assert "WeightsReady" in [e.reason for e in result.events]
    sts = kube.of_kind("StatefulSet")
    assert set(sts) == {"hf-tiny-prefill-0", "hf-tiny-decode-0"}
    pod = sts["hf-tiny-decode-0"]["spec"]["template"]["spec"]
    claim = W.target_of(
        parse_spec(kube.cr), Resolved(HfSource("acme/tiny"), COMMIT, 0, 0, None)
    ).claim
    assert {
        "name": "weights",
        "persistentVolumeClaim": {"claimName": claim, "readOnly": True},
    } in pod["volumes"]
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "weights")
    assert mount == {"name": "weights", "mountPath": "/var/lib/dsv4/hf", "readOnly": True}
    (cm,) = kube.of_kind("ConfigMap").values()
    rank = parse_rank_config(yaml.safe_load(cm["data"]["decode-rank-0.json"]))
    snapshot = f"/var/lib/dsv4/hf/models--acme--tiny/snapshots/{COMMIT}"
    assert rank.model.weights_path == snapshot and rank.model.config_path == snapshot
    assert rank.model.served_model_names == ("acme/tiny",)


def test_a_token_is_read_from_an_opted_in_secret_and_a_refusal_is_named() -> None:
    kube, probe, hub = (
        FakeKube(cr(hub={"tokenSecretRef": {"name": "hf", "key": "token"}})),
        FakeProbe(),
        TableHub(),
    )
    run(kube, probe, hub)
    cond = conditions(kube)
    assert (
        cond["WeightsReady"]["reason"] == "SecretNotFound"
        and "Secret ns/hf not found" in cond["WeightsReady"]["message"]
    )
    assert (
        cond["PlanValid"]["status"] == "False"
        and "spec.model.source" in cond["PlanValid"]["message"]
    )
    assert hub.calls == []
    secret: dict[str, Any] = {
        "metadata": {"name": "hf", "labels": {L.HUB_TOKEN_LABEL: "false"}},
        "data": {"token": base64.b64encode(b"hf_abc\n").decode()},
    }
    kube.objects[("v1", "Secret", "ns", "hf")] = secret
    run(kube, probe, hub, T0 + timedelta(seconds=2))
    # Not opted in (no label, or another value): the key goes to no hub and into no Job.
    cond = conditions(kube)
    assert cond["WeightsReady"]["reason"] == "TokenSecretNotAllowed"
    message = cond["WeightsReady"]["message"]
    assert "spec.model.hub.tokenSecretRef" in message and "Secret ns/hf" in message
    assert f"{L.HUB_TOKEN_LABEL}=true" in message
    assert hub.calls == [] and kube.of_kind("Job") == {}
    assert kube.cr["status"]["weights"]["phase"] == "Failed"
    secret["metadata"]["labels"] = {L.HUB_TOKEN_LABEL: L.HUB_TOKEN_LABEL_VALUE}
    hub.error = HubError("Unauthorized", "hf://acme/tiny@main: 401 Unauthorized: the repo is gated")
    run(kube, probe, hub, T0 + timedelta(seconds=5))
    assert hub.calls[-1] == ("acme/tiny", "main", "hf_abc")
    cond = conditions(kube)
    assert (
        cond["WeightsReady"]["reason"] == "Unauthorized"
        and "401" in cond["WeightsReady"]["message"]
    )
    assert kube.cr["status"]["weights"]["phase"] == "Failed"
    assert kube.of_kind("Job") == {}


def test_the_download_gauges_follow_status() -> None:
    from dsv4_operator.metrics import weights_series

    status = {"weights": {"bytesDone": 5, "bytesTotal": 9, "filesDone": 1, "filesTotal": 2}}
    series = {(s.name, s.labels[2]): s.value for s in weights_series("ns", "x", status)}
    assert series == {
        ("dsv4_operator_weights_bytes", "done"): 5,
        ("dsv4_operator_weights_bytes", "total"): 9,
        ("dsv4_operator_weights_files", "done"): 1,
        ("dsv4_operator_weights_files", "total"): 2,
    }
    assert weights_series("ns", "x", {}) == ()


# --- admission and render ----------------------------------------------------------------------


def test_admission_admits_a_model_the_hub_brings_with_a_warning_and_refuses_a_local_path() -> None:
    from dsv4_operator.admission import AdmissionRequest, review

    verdict = review(AdmissionRequest("CREATE", cr()))
    assert verdict.allowed and "spec.model.source" in verdict.warnings[0]
    with_preset = review(AdmissionRequest("CREATE", cr(preset="tiny")))
    assert with_preset.allowed and not with_preset.warnings
    local = review(AdmissionRequest("CREATE", cr(source="/srv/models/tiny")))
    assert not local.allowed and local.reason == "InvalidSpec"
    assert "a local path is read by dsv4 up only" in local.message


def test_render_needs_a_commit_and_mounts_its_snapshot(tmp_path: Path) -> None:
    from dsv4_common.api.spec import SpecError
    from dsv4_operator.render import desired_state_for

    with pytest.raises(SpecError, match="--revision COMMIT"):
        desired_state_for(cr(preset="tiny"))
    state = desired_state_for(cr(preset="tiny"), revision=COMMIT)
    (cm,) = [o for o in state.objects if o["kind"] == "ConfigMap"]
    rank = parse_rank_config(yaml.safe_load(cm["data"]["decode-rank-0.json"]))
    assert rank.model.weights_path == f"/var/lib/dsv4/hf/models--acme--tiny/snapshots/{COMMIT}"
    assert rank.model.preset == "tiny"
    state = desired_state_for(cr(), revision=COMMIT, model_config=TINY_CONFIG)
    (cm,) = [o for o in state.objects if o["kind"] == "ConfigMap"]
    rank = parse_rank_config(yaml.safe_load(cm["data"]["decode-rank-0.json"]))
    assert rank.model.config_path == rank.model.weights_path
    assert not any(o["kind"] in ("Job", "PersistentVolumeClaim") for o in state.objects)
