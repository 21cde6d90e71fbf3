"""The deployment's PD secret and what it signs outside the PD control channel. Pure (stdlib
hmac; reading the secret's file is the one side effect, in `load_pd_secret`).

One secret per deployment, shared by its router, prefill and decode workers: the operator
keeps it in a Secret mounted into their pods (rank config `pd_secret_file`), `dsv4 up`
writes one per run into its workdir, and a hand-made PD pair reads it from `--pd-secret-file`
or the environment (`DSV4_PD_SECRET`). Prefill and decode roles refuse to start without one,
and so does a router that has PD instances: an unauthenticated PD channel lets any peer write
a decode's KV (issue #37).

It authenticates (see `dsv4_worker.pd.auth`) the PD control handshake and every transfer
session, and here: the router's choice of prefill. A decode dials the prefill named in
`X-DSV4-Prefill` only when `X-DSV4-Prefill-Auth` carries the router's signature over the
request id, that address and an expiry (`sign_route` / `check_route`), so a client cannot make
a decode dial (and hand its transfer descriptor to) a prefill of its choosing.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

PD_SECRET_ENV: Final = "DSV4_PD_SECRET"
PD_SECRET_FLAG: Final = "--pd-secret-file"
PREFILL_HEADER: Final = "X-DSV4-Prefill"
PREFILL_AUTH_HEADER: Final = "X-DSV4-Prefill-Auth"
MIN_SECRET_BYTES: Final = 32
ROUTE_TTL_S: Final = 120.0  # a signed route's life; workers' clocks must agree within it
_ROUTE_DOMAIN: Final = b"dsv4-pd-route-v1\0"


class PDSecretError(ValueError):
    """No usable PD secret; the message names the flag, file or variable to set."""


@dataclass(frozen=True, slots=True, repr=False)
class PDSecret:
    """The deployment's secret (never printed: `repr` hides it)."""

    key: bytes

    def __post_init__(self) -> None:
        if len(self.key) < MIN_SECRET_BYTES:
            raise PDSecretError(
                f"PD secret: {len(self.key)} bytes, at least {MIN_SECRET_BYTES} are needed"
            )

    def __repr__(self) -> str:
        return "PDSecret(<hidden>)"


def load_pd_secret(
    path: str | None, environ: Mapping[str, str], *, where: str = PD_SECRET_FLAG
) -> PDSecret | None:
    """The secret from the file at `path` (`where` names the flag or field that gave it),
    else from `DSV4_PD_SECRET`, else None. Surrounding whitespace is dropped (a file written
    with a newline). PDSecretError naming the source when it cannot be read or is short."""
    if path:
        try:
            raw = Path(path).read_bytes().strip()
        except OSError as exc:
            raise PDSecretError(f"{where} {path}: cannot read ({exc.strerror or exc})") from exc
        return _secret(raw, f"{where} {path}")
    value = environ.get(PD_SECRET_ENV, "").strip()
    return _secret(value.encode(), PD_SECRET_ENV) if value else None


def require_pd_secret(secret: PDSecret | None, role: str) -> PDSecret:
    """The secret a PD role needs; PDSecretError saying how to give one."""
    if secret is None:
        raise PDSecretError(
            f"--role {role}: no PD secret: set {PD_SECRET_FLAG} FILE or {PD_SECRET_ENV} "
            f"(at least {MIN_SECRET_BYTES} bytes, the same for the router, prefill and decode "
            "workers of one deployment; `dsv4 up` and the operator make one)"
        )
    return secret


def _secret(raw: bytes, source: str) -> PDSecret:
    try:
        return PDSecret(raw)
    except PDSecretError as exc:
        raise PDSecretError(f"{source}: {exc}") from exc


def sign_route(key: bytes, request_id: str, target: str, now_s: float) -> str:
    """`X-DSV4-Prefill-Auth` for `X-DSV4-Prefill: target` on request `request_id`, valid for
    ROUTE_TTL_S from `now_s` (wall clock): `<expiry>.<hex mac>`."""
    expiry = int(now_s + ROUTE_TTL_S)
    return f"{expiry}.{_route_mac(key, request_id, target, expiry)}"


def check_route(
    key: bytes, request_id: str, target: str, signature: str | None, now_s: float
) -> str | None:
    """Why the route is refused (None: the router signed it and it has not expired)."""
    if not signature:
        return f"{PREFILL_HEADER} is honored only with the router's {PREFILL_AUTH_HEADER}"
    expiry_text, _, mac = signature.partition(".")
    if not expiry_text.isdigit() or not mac:
        return f"{PREFILL_AUTH_HEADER}: expected <expiry>.<mac>"
    expiry = int(expiry_text)
    if not hmac.compare_digest(mac, _route_mac(key, request_id, target, expiry)):
        return f"{PREFILL_AUTH_HEADER}: not signed by this deployment's router"
    if now_s > expiry:
        return f"{PREFILL_AUTH_HEADER}: expired"
    if expiry > now_s + 2 * ROUTE_TTL_S:  # a clock far ahead: refuse a long-lived signature
        return f"{PREFILL_AUTH_HEADER}: expiry too far ahead (clocks disagree?)"
    return None


def _route_mac(key: bytes, request_id: str, target: str, expiry: int) -> str:
    msg = b"\0".join((_ROUTE_DOMAIN, request_id.encode(), target.encode(), str(expiry).encode()))
    return hmac.new(key, msg, hashlib.sha256).hexdigest()
