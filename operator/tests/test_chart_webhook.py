"""The chart's admission webhook options: lint and kubernetes-validate (strict) with each, and
the pieces wired to each other and to the operator: the Service reaches the container port
the operator serves on (DSV4_WEBHOOK_PORT), the pods mount the Secret that holds the
certificate (Helm-generated, or cert-manager's) where DSV4_WEBHOOK_CERT_DIR points, the
ValidatingWebhookConfiguration calls kopf's handler path and trusts the certificate's CA
(caBundle, or cert-manager's injection), its namespaceSelector matches the served namespaces,
and its matchConditions skip what the decision admits anyway."""

from __future__ import annotations

import base64
import socket
import ssl
import subprocess
import threading
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from support import crd_support as S
from support.chart_support import CHART, HELM, K8S_VERSIONS, helm, needs_helm, render
from support.tls import needs_openssl

from dsv4_operator import admission, settings
from dsv4_operator import labels as L

ON = ["--set", "webhook.enabled=true"]
CERT_MANAGER = [*ON, "--set", "webhook.certManager.enabled=true"]
VALUE_SETS: dict[str, list[str]] = {
    "self-signed": ON,
    "self-signed-watch-list": [*ON, "--set", "watch.namespaces={team-a,team-b}"],
    "self-signed-namespaced": [*ON, "--set", "rbac.namespaced=true"],
    "self-signed-ha": [*ON, "--set", "replicaCount=2"],
    "cert-manager": CERT_MANAGER,
    "cert-manager-cluster-issuer": [
        *CERT_MANAGER,
        *("--set", "webhook.certManager.issuerRef.name=corp-ca"),
        *("--set", "webhook.certManager.issuerRef.kind=ClusterIssuer"),
    ],
    "ignore-other-port": [
        *ON,
        *("--set", "webhook.failurePolicy=Ignore"),
        *("--set", "webhook.port=8443"),
        *("--set", "webhook.timeoutSeconds=5"),
    ],
}
SERVICE = "dsv4-dsv4-operator-webhook"
SECRET = "dsv4-dsv4-operator-webhook-tls"
SERVICE_DNS = f"{SERVICE}.dsv4-system.svc"
# What cert-manager's CRDs require of the two kinds the chart renders (no schema here).
CERT_MANAGER_REQUIRED = {"Issuer": ["spec"], "Certificate": ["spec.secretName", "spec.issuerRef"]}


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def only(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (obj,) = by_kind(objects, kind)
    return obj


def container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (main,) = only(objects, "StatefulSet")["spec"]["template"]["spec"]["containers"]
    return main  # type: ignore[no-any-return]


def env_of(objects: list[dict[str, Any]]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container(objects)["env"] if "value" in e}


def webhook_of(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (webhook,) = only(objects, "ValidatingWebhookConfiguration")["webhooks"]
    return webhook  # type: ignore[no-any-return]


@needs_helm
@pytest.mark.parametrize("name", VALUE_SETS)
def test_helm_lint_strict(name: str) -> None:
    helm("lint", "--strict", str(CHART), *VALUE_SETS[name])


@needs_helm
@pytest.mark.parametrize("name", VALUE_SETS)
def test_rendered_objects_are_valid(name: str) -> None:
    for obj in render(*VALUE_SETS[name]):
        if obj["apiVersion"] == "zalando.org/v1":
            continue  # kopf's peering object: test_chart_render.py checks it against its CRD
        if obj["apiVersion"] == "cert-manager.io/v1":
            for path in CERT_MANAGER_REQUIRED[obj["kind"]]:
                value: Any = obj
                for key in path.split("."):
                    value = value[key]
            continue
        for k8s in K8S_VERSIONS:
            kubernetes_validate.validate(obj, k8s, strict=True)


@needs_helm
def test_the_webhook_is_off_by_default() -> None:
    objects = render()
    kinds = {o["kind"] for o in objects}
    assert not kinds & {"ValidatingWebhookConfiguration", "Secret", "Certificate", "Issuer"}
    assert SERVICE not in {s["metadata"]["name"] for s in by_kind(objects, "Service")}
    main = container(objects)
    assert not [e for e in main["env"] if e["name"].startswith("DSV4_WEBHOOK_")]
    assert "webhook" not in {p["name"] for p in main["ports"]}
    assert main["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    # The operator then serves nothing (kopf needs a server object for its validate handler).
    assert settings.webhook_server(env_of(objects)) is None


@needs_helm
@pytest.mark.parametrize("name", VALUE_SETS)
def test_service_port_certificate_and_configuration_are_wired_together(name: str) -> None:
    objects = render(*VALUE_SETS[name])
    main, env = container(objects), env_of(objects)
    pod = only(objects, "StatefulSet")["spec"]["template"]
    # The operator serves HTTPS where the chart says, with the mounted certificate.
    server = settings.webhook_server(env)
    assert server is not None
    (port,) = [p for p in main["ports"] if p["name"] == "webhook"]
    assert port["containerPort"] == server.port == int(env["DSV4_WEBHOOK_PORT"])
    assert main["readinessProbe"]["tcpSocket"]["port"] == "webhook"
    (mount,) = [m for m in main["volumeMounts"] if m["name"] == "webhook-tls"]
    assert mount["readOnly"] is True
    assert Path(mount["mountPath"]) == Path(env["DSV4_WEBHOOK_CERT_DIR"])
    assert (server.certfile, server.pkeyfile) == (
        Path(mount["mountPath"], "tls.crt"),
        Path(mount["mountPath"], "tls.key"),
    )
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "webhook-tls"]
    assert volume["secret"]["secretName"] == SECRET
    # The Service reaches that port on the operator pods.
    (service,) = [s for s in by_kind(objects, "Service") if s["metadata"]["name"] == SERVICE]
    (service_port,) = service["spec"]["ports"]
    assert service_port["targetPort"] == "webhook"
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    # The API server calls that Service at kopf's path for the handler, for our resource.
    webhook = webhook_of(objects)
    assert webhook["name"] == admission.WEBHOOK_NAME
    assert webhook["clientConfig"]["service"] == {
        "name": SERVICE,
        "namespace": "dsv4-system",
        "path": admission.WEBHOOK_PATH,
        "port": service_port["port"],
    }
    assert webhook["rules"] == [
        {
            "apiGroups": [L.GROUP],
            "apiVersions": [L.VERSION],
            "operations": sorted(admission.CHECKED_OPERATIONS),
            "resources": [L.PLURAL],
            "scope": "Namespaced",
        }
    ]
    assert webhook["sideEffects"] == "None"  # so `kubectl apply --dry-run=server` calls it
    assert webhook["admissionReviewVersions"] == ["v1"]
    assert webhook["matchConditions"] == list(admission.MATCH_CONDITIONS)


@needs_helm
def test_failure_policy_timeout_and_port_follow_the_values() -> None:
    assert (
        webhook_of(render(*ON))["failurePolicy"],
        webhook_of(render(*ON))["timeoutSeconds"],
    ) == (
        "Fail",
        10,
    )
    objects = render(*VALUE_SETS["ignore-other-port"])
    webhook = webhook_of(objects)
    assert (webhook["failurePolicy"], webhook["timeoutSeconds"]) == ("Ignore", 5)
    assert env_of(objects)["DSV4_WEBHOOK_PORT"] == "8443"
    for bad in ("webhook.failurePolicy=Sometimes", "webhook.timeoutSeconds=31"):
        result = subprocess.run(
            [str(HELM), "template", "dsv4", str(CHART), *ON, "--set", bad],
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode != 0 and "webhook." in result.stderr, bad


@needs_helm
@pytest.mark.parametrize(
    ("name", "namespaces"),
    [
        ("self-signed", None),
        ("self-signed-watch-list", ["team-a", "team-b"]),
        ("self-signed-namespaced", ["dsv4-system"]),
    ],
)
def test_the_webhook_is_called_only_for_the_served_namespaces(
    name: str, namespaces: list[str] | None
) -> None:
    webhook = webhook_of(render(*VALUE_SETS[name]))
    if namespaces is None:
        assert "namespaceSelector" not in webhook  # cluster-wide, as the operator
        return
    assert webhook["namespaceSelector"] == {
        "matchExpressions": [
            {"key": L.NAMESPACE_NAME_LABEL, "operator": "In", "values": namespaces}
        ]
    }


def _request(operation: str, obj: dict[str, Any], old: dict[str, Any] | None) -> dict[str, Any]:
    return {"operation": operation, "object": obj, "oldObject": old}


@needs_helm
def test_match_conditions_skip_writes_that_change_no_spec() -> None:
    match = S.admission_match(webhook_of(render(*ON))["matchConditions"])
    cr = {"metadata": {"name": "tiny"}, "spec": {"maxContextTokens": 4096}}
    edited = {**cr, "spec": {"maxContextTokens": 100_000}}
    finalized = {**cr, "metadata": {"name": "tiny", "finalizers": ["x/y"]}}
    deleting = {**edited, "metadata": {"name": "tiny", "deletionTimestamp": "2026-01-01T00:00:00Z"}}
    assert match(_request("CREATE", cr, None))
    assert match(_request("UPDATE", edited, cr))
    assert not match(_request("UPDATE", finalized, cr))
    assert not match(_request("UPDATE", deleting, cr))


# --- certificates ----------------------------------------------------------------------------


def _serve_once(cert: Path, key: Path, sock: socket.socket) -> None:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    conn, _ = sock.accept()
    try:
        with context.wrap_socket(conn, server_side=True):
            pass
    except OSError:
        pass


def _handshake(cert: Path, key: Path, ca_bundle: bytes, hostname: str) -> dict[str, Any]:
    """A TLS handshake with a server on 127.0.0.1 holding `cert`, verified as the API server
    verifies the webhook: against the caBundle, for the Service's DNS name."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        thread = threading.Thread(target=_serve_once, args=(cert, key, listener))
        thread.start()
        try:
            client = ssl.create_default_context(cadata=ca_bundle.decode())
            with (
                socket.create_connection(listener.getsockname(), timeout=10) as raw,
                client.wrap_socket(raw, server_hostname=hostname) as tls,
            ):
                peer: dict[str, Any] = tls.getpeercert()  # type: ignore[assignment]
        finally:
            thread.join(10)
    return peer


@needs_helm
@needs_openssl
def test_self_signed_certificate_is_trusted_by_the_ca_bundle_for_the_service_name(
    tmp_path: Path,
) -> None:
    objects = render(*ON)
    secret = only(objects, "Secret")
    assert (secret["metadata"]["name"], secret["type"]) == (SECRET, "kubernetes.io/tls")
    data = {k: base64.b64decode(v) for k, v in secret["data"].items()}
    webhook = webhook_of(objects)
    ca_bundle = base64.b64decode(webhook["clientConfig"]["caBundle"])
    assert ca_bundle == data["ca.crt"]
    (tmp_path / "tls.crt").write_bytes(data["tls.crt"])
    (tmp_path / "tls.key").write_bytes(data["tls.key"])
    for name in (SERVICE_DNS, f"{SERVICE_DNS}.cluster.local"):
        peer = _handshake(tmp_path / "tls.crt", tmp_path / "tls.key", ca_bundle, name)
        assert ("DNS", name) in peer["subjectAltName"]
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(tmp_path / "tls.crt", tmp_path / "tls.key", ca_bundle, "elsewhere.svc")
    assert "cert-manager.io/inject-ca-from" not in (
        only(objects, "ValidatingWebhookConfiguration")["metadata"].get("annotations") or {}
    )


@needs_helm
@pytest.mark.parametrize("name", ["cert-manager", "cert-manager-cluster-issuer"])
def test_cert_manager_issues_the_mounted_secret_and_injects_its_ca(name: str) -> None:
    objects = render(*VALUE_SETS[name])
    assert not by_kind(objects, "Secret")  # cert-manager writes it
    certificate = only(objects, "Certificate")
    assert certificate["spec"]["secretName"] == SECRET
    assert certificate["spec"]["dnsNames"] == [SERVICE_DNS, f"{SERVICE_DNS}.cluster.local"]
    configuration = only(objects, "ValidatingWebhookConfiguration")
    assert configuration["metadata"]["annotations"] == {
        "cert-manager.io/inject-ca-from": f"dsv4-system/{certificate['metadata']['name']}"
    }
    assert "caBundle" not in webhook_of(objects)["clientConfig"]
    issuer_ref = certificate["spec"]["issuerRef"]
    if name == "cert-manager":
        issuer = only(objects, "Issuer")
        assert issuer["spec"] == {"selfSigned": {}}
        assert issuer_ref == {
            "name": issuer["metadata"]["name"],
            "kind": "Issuer",
            "group": "cert-manager.io",
        }
    else:
        assert not by_kind(objects, "Issuer")
        assert issuer_ref == {
            "name": "corp-ca",
            "kind": "ClusterIssuer",
            "group": "cert-manager.io",
        }
