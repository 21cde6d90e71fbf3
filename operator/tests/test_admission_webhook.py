"""The validating admission webhook, served by the real operator (kopf in a thread, our start-up
reading the chart's DSV4_WEBHOOK_* environment) over HTTPS on 127.0.0.1 with a certificate from
a throwaway CA, and called as the API server calls it:

  direct     an AdmissionReview v1 POSTed to kopf's server, its certificate verified against
             the CA: an unfit CR is refused (422) naming the largest context that fits, a
             fitting one admitted; a client that does not trust the CA gets no answer
  API        the loopback API server calls the webhook on create and update (`Webhook`, with
             the chart's matchConditions), so the official client's create (also with
             dryRun=All) of an unfit CR fails with the webhook's message, and nothing is
             stored; a fitting CR is created, reconciled, refused an unfit edit, and deleted;
             a configMapRef's ConfigMap is read through the API server during admission

Also the fake API server's side of it: the failure policy when the webhook cannot be called,
and dry runs that store nothing.
"""

from __future__ import annotations

import copy
import json
import logging
import socket
import ssl
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kopf
import kubernetes
import pytest
import yaml
from kubernetes.client.rest import ApiException
from model_samples import tiny_hf_config
from repo_paths import CRD_FILE, SAMPLES
from serve_support import free_port
from support import crd_support as S
from support.fake_apiserver import FakeApiServer, Webhook, load_crd
from support.live_operator import NS, OperatorThread
from support.tls import TlsFiles, make_tls, needs_openssl

from dsv4_operator import admission, settings
from dsv4_operator import labels as L

SCHEMA: dict[str, Any] = S.crd_schema()
TIMEOUT_S = 30.0
# The webhook's name in the chart's ValidatingWebhookConfiguration (what kubectl prints).
DENIED = f'admission webhook "{admission.WEBHOOK_NAME}" denied the request: '

pytestmark = needs_openssl


def _wait(what: str, check: Callable[[], Any], timeout: float = TIMEOUT_S) -> Any:
    deadline = time.monotonic() + timeout
    while (result := check()) in (None, False):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for: {what}")
        time.sleep(0.05)
    return result


def cr(name: str, sample: str = "tiny-cpu.yaml", **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = yaml.safe_load((SAMPLES / sample).read_text())
    body["metadata"].update({"name": name, "namespace": NS})
    body["spec"].update(spec)
    return body


def unfit(name: str) -> dict[str, Any]:
    """DeepSeek-V4-Flash on 52 GiB GPUs: decode's KV pool holds 215296 tokens, not 1M."""
    return cr(
        name, "flash-gpu.yaml", maxContextTokens=1_000_000, gpu={"memoryGiB": 52, "perPod": 4}
    )


LARGEST_FIT = "the largest context that fits is 215296 tokens"


# ---------------------------------------------------------------------------------------------
# The operator, serving its webhook


@dataclass
class Served:
    server: FakeApiServer
    tls: TlsFiles
    url: str  # the webhook's URL (kopf's server + the handler's path)
    api: kubernetes.client.CustomObjectsApi

    def cr(self, name: str) -> dict[str, Any] | None:
        return self.server.get(L.API_VERSION, L.KIND, NS, name)

    def create(self, body: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        created: dict[str, Any] = self.api.create_namespaced_custom_object(
            L.GROUP, L.VERSION, NS, L.PLURAL, body, **kwargs
        )
        return created

    def refusal(self, call: Callable[[], Any]) -> tuple[int, str]:
        """The status code and message of a call the API server refuses."""
        with pytest.raises(ApiException) as info:
            call()
        return info.value.status, json.loads(info.value.body)["message"]


def _listening(port: int, context: ssl.SSLContext) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
            context.wrap_socket(sock, server_hostname="127.0.0.1").close()
        return True
    except OSError:
        return False


@pytest.fixture
def served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> Iterator[Served]:
    threads_before = set(threading.enumerate())
    tls = make_tls(tmp_path / "webhook-tls")
    port = free_port()
    url = f"https://127.0.0.1:{port}{admission.WEBHOOK_PATH}"
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the DynamicClient's cache
    monkeypatch.setattr(kubernetes.client.Configuration, "_default", None)
    for var in ("DSV4_PEERING", "DSV4_WORKER_IMAGE", "KUBERNETES_SERVICE_HOST"):
        monkeypatch.delenv(var, raising=False)
    # What the chart sets (test_chart_webhook.py checks the chart sets these).
    monkeypatch.setenv("DSV4_WEBHOOK_PORT", str(port))
    monkeypatch.setenv("DSV4_WEBHOOK_HOST", "127.0.0.1")
    monkeypatch.setenv("DSV4_WEBHOOK_CERT_DIR", str(tls.folder))

    server = FakeApiServer([load_crd(CRD_FILE)])
    server.add_admission(L.API_VERSION, L.KIND, lambda obj: S.admit(obj, SCHEMA))
    match = S.admission_match(admission.MATCH_CONDITIONS)  # the chart's (test_chart_webhook.py)
    webhook = Webhook(admission.WEBHOOK_NAME, url, tls.ca_file, match=match)
    server.add_webhook(L.API_VERSION, L.KIND, webhook)
    server.start()
    kubeconfig = str(server.write_kubeconfig(tmp_path / "kubeconfig"))
    monkeypatch.setenv("KUBECONFIG", kubeconfig)
    monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", kubeconfig)
    operator = OperatorThread()
    client = kubernetes.config.new_client_from_config(config_file=kubeconfig)
    try:
        operator.start()
        # kopf listens once it has scanned the API for the resources it handles.
        _wait("the webhook listening", lambda: _listening(port, tls.client_context()))
        yield Served(server, tls, url, kubernetes.client.CustomObjectsApi(client))
    finally:
        client.close()
        try:
            operator.stop()
        finally:
            server.stop()
    assert operator.error is None, operator.error
    # kopf logs each refusal as its handler failing; nothing else may fail.
    refused = f"'{admission.WEBHOOK_ID}' failed permanently: "
    errors = [
        r.getMessage()
        for when in ("setup", "call", "teardown")
        for r in caplog.get_records(when)
        if r.levelno >= logging.ERROR and refused not in r.getMessage()
    ]
    assert not errors, errors
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    _wait("no threads left", lambda: not set(threading.enumerate()) - threads_before, 5)


# ---------------------------------------------------------------------------------------------
# Direct: AdmissionReview over HTTPS


def review_of(operation: str, obj: dict[str, Any], old: dict[str, Any] | None = None) -> Any:
    kind = {"group": L.GROUP, "version": L.VERSION, "kind": L.KIND}
    resource = {"group": L.GROUP, "version": L.VERSION, "resource": L.PLURAL}
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": str(uuid.uuid4()),
            "kind": kind,
            "resource": resource,
            "requestKind": kind,
            "requestResource": resource,
            "name": obj["metadata"]["name"],
            "namespace": NS,
            "operation": operation,
            "userInfo": {"username": "kubernetes-admin", "groups": ["system:masters"]},
            "object": obj,
            "oldObject": old,
            "dryRun": False,
        },
    }


def post(served: Served, review: Any, context: ssl.SSLContext) -> Any:
    request = urllib.request.Request(
        served.url,
        data=json.dumps(review).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10, context=context) as rsp:
        assert rsp.status == 200
        return json.loads(rsp.read())


def test_the_webhook_over_https_refuses_an_unfit_cr_with_the_largest_fit_and_admits_a_fit(
    served: Served,
) -> None:
    context = served.tls.client_context()  # trusts only the CA: the caBundle's role
    review = review_of("CREATE", unfit("flash"))
    answer = post(served, review, context)
    assert answer["apiVersion"] == "admission.k8s.io/v1" and answer["kind"] == "AdmissionReview"
    response = answer["response"]
    assert response["uid"] == review["request"]["uid"]
    assert response["allowed"] is False
    assert response["status"]["code"] == 422
    message = response["status"]["message"]
    assert message.startswith("ContextTooLong: maxContextTokens 1000000 does not fit: ")
    assert LARGEST_FIT in message

    fitting = review_of("CREATE", cr("tiny"))
    response = post(served, fitting, context)["response"]
    assert response == {"uid": fitting["request"]["uid"], "allowed": True}

    # An update that changes no spec (kopf's finalizer) passes even for an unfit CR.
    old = unfit("flash")
    new = copy.deepcopy(old)
    new["metadata"]["finalizers"] = [f"{L.GROUP}/finalizer"]
    assert post(served, review_of("UPDATE", new, old), context)["response"]["allowed"] is True

    # A client that does not trust the webhook's CA gets no answer at all.
    with pytest.raises(urllib.error.URLError) as info:
        post(served, fitting, ssl.create_default_context())
    assert isinstance(info.value.reason, ssl.SSLCertVerificationError)


# ---------------------------------------------------------------------------------------------
# Through the API server


def test_the_api_server_refuses_an_unfit_cr_with_the_webhooks_message_also_on_dry_run(
    served: Served,
) -> None:
    for kwargs in ({}, {"dry_run": "All"}):
        code, message = served.refusal(lambda k=kwargs: served.create(unfit("flash"), **k))
        assert code == 422, kwargs
        assert message.startswith(f"{DENIED}ContextTooLong: maxContextTokens 1000000 does not fit")
        assert LARGEST_FIT in message
    assert served.cr("flash") is None
    posts = served.server.requests_to("POST", f"/{L.PLURAL}")
    assert [(r.query.get("dryRun"), r.code) for r in posts] == [(None, 422), ("All", 422)]

    # The largest fit it named passes; as a dry run, nothing is stored.
    largest = unfit("flash")
    largest["spec"]["maxContextTokens"] = 215296
    created = served.create(largest, dry_run="All")
    assert created["spec"]["maxContextTokens"] == 215296
    assert served.cr("flash") is None


def test_the_api_server_refuses_an_owned_pod_template_field_naming_it(served: Served) -> None:
    template = {"spec": {"containers": [{"name": "worker", "command": ["sh"]}]}}
    code, message = served.refusal(
        lambda: served.create(cr("tiny", decode={"podTemplate": template}))
    )
    assert code == 422
    assert message == (
        f"{DENIED}InvalidSpec: spec.decode.podTemplate.spec.containers[worker].command: owned by "
        "the operator"
    )
    assert served.cr("tiny") is None


def test_a_fitting_cr_is_created_reconciled_guarded_against_unfit_edits_and_deleted(
    served: Served,
) -> None:
    served.create(cr("tiny"))

    # The operator reconciles it (kopf's finalizer and annotation writes change no spec: the
    # matchConditions skip the webhook for them).
    def planned() -> bool:
        body = served.cr("tiny") or {}
        conds = (body.get("status") or {}).get("conditions") or []
        valid = any(c["type"] == "PlanValid" and c["status"] == "True" for c in conds)
        return valid and body["metadata"].get("finalizers") == [f"{L.GROUP}/finalizer"]

    _wait("the CR reconciled", planned)
    generation = served.cr("tiny")["metadata"]["generation"]  # type: ignore[index]

    # An edit to a context that does not fit is refused; the stored spec is untouched.
    code, message = served.refusal(
        lambda: served.api.patch_namespaced_custom_object(
            L.GROUP, L.VERSION, NS, L.PLURAL, "tiny", {"spec": {"maxContextTokens": 100_000}}
        )
    )
    assert code == 422
    assert message.startswith(f"{DENIED}ContextTooLong: maxContextTokens 100000 does not fit")
    assert "the largest context that fits is 4096 tokens" in message
    stored = served.cr("tiny")
    assert stored is not None
    assert (stored["spec"]["maxContextTokens"], stored["metadata"]["generation"]) == (
        4096,
        generation,
    )
    # A fitting edit passes.
    served.api.patch_namespaced_custom_object(
        L.GROUP, L.VERSION, NS, L.PLURAL, "tiny", {"spec": {"maxContextTokens": 2048}}
    )

    # Deleting: kopf releases its finalizer through the webhook, and the CR goes.
    served.api.delete_namespaced_custom_object(L.GROUP, L.VERSION, NS, L.PLURAL, "tiny")
    _wait("the CR gone", lambda: served.cr("tiny") is None)


def test_a_config_map_model_is_read_at_admission_and_a_missing_one_only_warns(
    served: Served,
) -> None:
    """The webhook reads a configMapRef's ConfigMap through the API server while that server
    waits for its answer, as the reconcile reads it."""
    served.server.create(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "tiny-model", "namespace": NS},
            "data": {"config.json": tiny_hf_config(max_position_embeddings=8192)},
        }
    )
    gpu = {"type": "h100-80gb", "perPod": 1}
    code, message = served.refusal(
        lambda: served.create(
            cr("tiny", model={"configMapRef": {"name": "tiny-model"}}, gpu=gpu,
               maxContextTokens=100_000)
        )
    )  # fmt: skip
    assert code == 422
    assert message.startswith(f"{DENIED}ContextTooLong: ")
    assert "the model's context is 8192 tokens" in message

    # A ConfigMap that does not exist yet refuses nothing: a warning, and the status says why.
    served.create(cr("later", model={"configMapRef": {"name": "later-model"}}, gpu=gpu))
    (created,) = [r for r in served.server.requests_to("POST", f"/{L.PLURAL}") if r.code == 201]
    (warning,) = created.warnings
    assert warning.startswith(f"spec.model.configMapRef: ConfigMap {NS}/later-model not found")

    def plan_failed() -> dict[str, Any] | None:
        conds = ((served.cr("later") or {}).get("status") or {}).get("conditions") or []
        return next((c for c in conds if c["type"] == "PlanValid" and c["status"] == "False"), None)

    assert _wait("PlanValid False", plan_failed)["reason"] == "PlanFailed"


# ---------------------------------------------------------------------------------------------
# The fake API server's side: failure policy, dry run


@pytest.mark.parametrize(("policy", "created"), [("Fail", False), ("Ignore", True)])
def test_a_webhook_that_cannot_be_called_follows_the_failure_policy(
    tmp_path: Path, policy: str, created: bool
) -> None:
    tls = make_tls(tmp_path / "tls")
    url = f"https://127.0.0.1:{free_port()}{admission.WEBHOOK_PATH}"  # nobody listens
    with FakeApiServer([load_crd(CRD_FILE)]) as server:
        webhook = Webhook("down.example.com", url, tls.ca_file, failure_policy=policy)
        server.add_webhook(L.API_VERSION, L.KIND, webhook)
        client = kubernetes.config.new_client_from_config(
            config_file=str(server.write_kubeconfig(tmp_path / "kubeconfig"))
        )
        with client:
            api = kubernetes.client.CustomObjectsApi(client)
            call = lambda: api.create_namespaced_custom_object(  # noqa: E731
                L.GROUP, L.VERSION, NS, L.PLURAL, cr("tiny")
            )
            if created:
                call()
            else:
                with pytest.raises(ApiException) as info:
                    call()
                assert info.value.status == 500
                message = json.loads(info.value.body)["message"]
                assert 'failed calling webhook "down.example.com": ' in message
        assert (server.get(L.API_VERSION, L.KIND, NS, "tiny") is not None) is created


def test_a_dry_run_writes_nothing(tmp_path: Path) -> None:
    with FakeApiServer([load_crd(CRD_FILE)]) as server:
        client = kubernetes.config.new_client_from_config(
            config_file=str(server.write_kubeconfig(tmp_path / "kubeconfig"))
        )
        with client:
            api = kubernetes.client.CustomObjectsApi(client)

            def version() -> str:
                listed = api.list_namespaced_custom_object(L.GROUP, L.VERSION, NS, L.PLURAL)
                return str(listed["metadata"]["resourceVersion"])

            empty = version()
            api.create_namespaced_custom_object(
                L.GROUP, L.VERSION, NS, L.PLURAL, cr("tiny"), dry_run="All"
            )
            assert server.get(L.API_VERSION, L.KIND, NS, "tiny") is None
            assert version() == empty  # no write: no new version, no watch event
            api.create_namespaced_custom_object(L.GROUP, L.VERSION, NS, L.PLURAL, cr("tiny"))
            before, written = server.get(L.API_VERSION, L.KIND, NS, "tiny"), version()
            for call in (
                lambda: api.patch_namespaced_custom_object(
                    L.GROUP, L.VERSION, NS, L.PLURAL, "tiny", {"spec": {"maxContextTokens": 1}},
                    dry_run="All",
                ),
                lambda: api.delete_namespaced_custom_object(
                    L.GROUP, L.VERSION, NS, L.PLURAL, "tiny", dry_run="All"
                ),
            ):  # fmt: skip
                call()
                assert server.get(L.API_VERSION, L.KIND, NS, "tiny") == before
                assert version() == written


# ---------------------------------------------------------------------------------------------
# Start-up settings


def test_the_webhook_server_comes_from_the_environment(tmp_path: Path) -> None:
    off = kopf.OperatorSettings()
    settings.configure(off, {})
    assert isinstance(off.admission.server, settings.WebhookOff)
    assert off.admission.managed is None  # the chart owns the ValidatingWebhookConfiguration

    on = kopf.OperatorSettings()
    env = {"DSV4_WEBHOOK_PORT": "9443", "DSV4_WEBHOOK_CERT_DIR": "/etc/dsv4-operator/webhook"}
    settings.configure(on, env)
    server = on.admission.server
    assert isinstance(server, kopf.WebhookServer)
    assert (server.addr, server.port) == ("0.0.0.0", 9443)
    assert str(server.certfile) == "/etc/dsv4-operator/webhook/tls.crt"
    assert str(server.pkeyfile) == "/etc/dsv4-operator/webhook/tls.key"
    assert on.admission.managed is None

    with pytest.raises(ValueError, match="DSV4_WEBHOOK_CERT_DIR"):
        settings.webhook_server({"DSV4_WEBHOOK_PORT": "9443"})
    assert settings.webhook_server({"DSV4_WEBHOOK_PORT": "0"}) is None
