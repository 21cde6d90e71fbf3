"""A throwaway CA and a serving certificate for 127.0.0.1, made with the openssl command line
(the `cryptography` package is not a dependency), laid out as a kubernetes.io/tls Secret
mounts them: tls.crt, tls.key and ca.crt in one folder."""

from __future__ import annotations

import shutil
import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

OPENSSL = shutil.which("openssl")
needs_openssl = pytest.mark.skipif(OPENSSL is None, reason="the openssl command is missing")

_LEAF_EXTENSIONS = """\
subjectAltName=IP:127.0.0.1
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=serverAuth
subjectKeyIdentifier=hash
authorityKeyIdentifier=keyid
"""


@dataclass(frozen=True)
class TlsFiles:
    folder: Path  # what DSV4_WEBHOOK_CERT_DIR names

    @property
    def ca_file(self) -> Path:
        return self.folder / "ca.crt"

    @property
    def cert_file(self) -> Path:
        return self.folder / "tls.crt"

    @property
    def key_file(self) -> Path:
        return self.folder / "tls.key"

    def client_context(self) -> ssl.SSLContext:
        """What a client that trusts only this CA uses (the API server with the caBundle)."""
        return ssl.create_default_context(cafile=str(self.ca_file))


def _openssl(*args: str, cwd: Path) -> None:
    assert OPENSSL is not None
    result = subprocess.run(
        [OPENSSL, *args], cwd=cwd, capture_output=True, text=True, check=False, timeout=60
    )
    assert result.returncode == 0, result.stderr


def make_tls(folder: Path, common_name: str = "dsv4-test-ca") -> TlsFiles:
    """A CA (ca.crt) and a certificate for IP 127.0.0.1 that it signed (tls.crt, tls.key)."""
    folder.mkdir(parents=True, exist_ok=True)
    key = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl(
        "req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1",
        "-subj", f"/CN={common_name}", cwd=folder,
    )  # fmt: skip
    _openssl(
        "req", *key, "-keyout", "tls.key", "-out", "tls.csr", "-subj", "/CN=127.0.0.1",
        cwd=folder,
    )  # fmt: skip
    (folder / "leaf.ext").write_text(_LEAF_EXTENSIONS)
    _openssl(
        "x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-set_serial",
        "1", "-days", "1", "-extfile", "leaf.ext", "-out", "tls.crt", cwd=folder,
    )  # fmt: skip
    return TlsFiles(folder)
