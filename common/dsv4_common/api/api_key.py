"""API keys: which HTTP paths need `Authorization: Bearer <key>`, and whether a request has it.
Pure, except `read_api_key_file` (one file). The worker's apps and the router's (aiohttp glue:
`dsv4_router.http_auth`) and the router's fast completion path all decide here.

With no key configured every path is open. With one:

| path                                     | API port | status port           |
| ---------------------------------------- | -------- | --------------------- |
| `/live`, `/health`, `/ready`             | open     | open                  |
| `/metrics`, `/status`, `/instances`      | the key  | open if `open_status` |
| anything else (`/v1/*`, unknown paths)   | the key  | the key               |

A deployed process (`--config-dir`) serves its status port open: the NetworkPolicy admits only
the router, the operator (which cannot read Secrets) and the metrics namespace there. The quick
form's single port is its status port too, closed unless `--open-status`.

NOTE: the key is compared with `hmac.compare_digest` (time independent of where it differs);
the scheme `Bearer` is case-insensitive (RFC 7235). A refusal never echoes what was sent.
"""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from dsv4_common.api.http_rules import error_document

API_KEY_ENV: Final = "DSV4_API_KEY"  # `dsv4 up`: the key when the CR names a Secret
OPEN_PATHS: Final = frozenset({"/live", "/health", "/ready"})
STATUS_PATHS: Final = frozenset({"/metrics", "/status", "/instances"})
MAX_API_KEY_BYTES: Final = 4096
UNAUTHORIZED_CODE: Final = "invalid_api_key"
WWW_AUTHENTICATE: Final = ("WWW-Authenticate", "Bearer")
_BEARER: Final = b"bearer"
MISSING_MESSAGE: Final = (
    "no API key: send it in an Authorization header (Authorization: Bearer <key>)"
)
WRONG_MESSAGE: Final = "incorrect API key"


class ApiKeyError(ValueError):
    """A key (or key file) that cannot be used; the message starts with the flag or field."""


@dataclass(frozen=True, slots=True)
class ApiKeyRule:
    """One server's rule. `key` None: every path is open."""

    key: bytes | None = None
    open_status: bool = False  # the status port serves STATUS_PATHS without the key

    @property
    def enabled(self) -> bool:
        return self.key is not None

    def needs_key(self, path: str, *, status_port: bool) -> bool:
        if self.key is None or path in OPEN_PATHS:
            return False
        return not (status_port and self.open_status and path in STATUS_PATHS)

    def allows(self, authorization: bytes | str | None) -> bool:
        """Whether an Authorization header value carries the key (always, with no key)."""
        if self.key is None:
            return True
        if authorization is None:
            return False
        raw = authorization.encode("latin-1") if isinstance(authorization, str) else authorization
        if hmac.compare_digest(raw, b"Bearer " + self.key):  # as clients send it: no parsing
            return True
        token = bearer_token(raw)
        return token is not None and hmac.compare_digest(token, self.key)

    def credential(self) -> str | None:
        """The Authorization value this process sends to the servers behind it."""
        return None if self.key is None else f"Bearer {self.key.decode('ascii')}"


NO_API_KEY: Final = ApiKeyRule()


def bearer_token(authorization: bytes | str | None) -> bytes | None:
    """The token of `Bearer <token>` (the scheme in any case), or None for anything else."""
    if authorization is None:
        return None
    raw = authorization.encode("latin-1") if isinstance(authorization, str) else authorization
    scheme, _, token = raw.strip(b" \t").partition(b" ")
    if scheme.lower() != _BEARER:
        return None
    token = token.strip(b" \t")
    return token or None


def unauthorized_document(authorization: bytes | str | None) -> dict[str, Any]:
    """OpenAI's 401 body: no key given, or the wrong one (never echoed)."""
    message = MISSING_MESSAGE if bearer_token(authorization) is None else WRONG_MESSAGE
    return error_document(message, "invalid_request_error", code=UNAUTHORIZED_CODE)


def parse_api_key(text: str, where: str) -> bytes:
    """A key as written in a flag, file or environment variable (surrounding whitespace, such
    as a file's last newline, dropped): printable ASCII without spaces, so that it travels in
    a header as it is, at most MAX_API_KEY_BYTES."""
    key = text.strip()
    if not key:
        raise ApiKeyError(f"{where}: the API key is empty")
    if len(key) > MAX_API_KEY_BYTES:
        raise ApiKeyError(f"{where}: the API key is longer than {MAX_API_KEY_BYTES} characters")
    if any(not 0x21 <= ord(c) <= 0x7E for c in key):
        raise ApiKeyError(
            f"{where}: the API key must be printable ASCII without spaces or control characters"
        )
    return key.encode("ascii")


def read_api_key_file(path: str, where: str) -> bytes:
    """The key in file `path` (`where` names the flag or field that gave it)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ApiKeyError(f"{where}: cannot read {path} ({exc.strerror or exc})") from exc
    except UnicodeDecodeError as exc:
        raise ApiKeyError(f"{where}: {path} is not UTF-8 text") from exc
    return parse_api_key(text, f"{where} ({path})")


def resolve_api_key(
    key: str | None,
    key_file: str | None,
    configured_file: str | None = None,
    *,
    config_field: str = "api_key_file",
) -> bytes | None:
    """The key: `--api-key`, else `--api-key-file`, else the config's file; None: no key."""
    if key is not None and key_file is not None:
        raise ApiKeyError("--api-key: give the key or --api-key-file, not both")
    if key is not None:
        return parse_api_key(key, "--api-key")
    if key_file is not None:
        return read_api_key_file(key_file, "--api-key-file")
    if configured_file is not None:
        return read_api_key_file(configured_file, config_field)
    return None


def exposed_without_key(host: str, rule: ApiKeyRule) -> str | None:
    """The warning a server logs once at start when it listens beyond loopback with no key."""
    if rule.enabled or _loopback(host):
        return None
    return (
        f"listening on {host or 'every address'} without an API key: anyone who can reach "
        "this port may use it (set --api-key-file, or spec.apiKey.secretRef in a deployment)"
    )


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name other than localhost may resolve anywhere
