"""What an SGLang server realized, read from its `GET /server_info` document (SGLang 0.5.23,
`sglang.srt.entrypoints.http_server.server_info`). Pure.

The fields used, and where SGLang sets them:
- `max_total_num_tokens` (top level, the scheduler's start-up info): the full KV pool in
  tokens. With PP, every rank takes the least over the ranks (an all-reduce MIN when the pools
  are sized), so rank 0's figure is every rank's.
- `context_length` (top level, the resolved server arguments): SGLang serves requests up to
  min(context_length, max_total_num_tokens) tokens (`TpModelWorker`: max_req_len + 1).
- `internal_states[]` (one per data-parallel scheduler): `memory_usage.token_capacity_swa`
  (the SWA pool in tokens; null where SGLang keeps no paged SWA pool) and
  `effective_max_running_requests_per_dp` (after SGLang's own clamp to half the pool).
Only PP rank 0 runs the HTTP server; ranks > 0 answer nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

SERVER_INFO_PATH: Final = "/server_info"


class ServerInfoError(ValueError):
    """A /server_info document without a field the operator reads (names the field)."""


@dataclass(frozen=True, slots=True)
class ServerInfo:
    full_tokens: int
    context_tokens: int
    swa_tokens: int | None = None  # least over DP schedulers; None: not reported
    max_running_requests: int | None = None  # summed over DP schedulers; None: not reported
    version: str | None = None

    @property
    def max_context_tokens(self) -> int:
        return min(self.context_tokens, self.full_tokens)


def _count(doc: Mapping[str, Any], key: str, where: str) -> int:
    value = doc.get(key)
    # bool is an int subclass; a count never is one.
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ServerInfoError(f"{where}{key}: expected a count, got {value!r}")
    return value


def _optional_count(doc: Mapping[str, Any], key: str, where: str) -> int | None:
    return None if doc.get(key) is None else _count(doc, key, where)


def parse_server_info(doc: object) -> ServerInfo:
    """Parse a /server_info document; raises ServerInfoError naming the first bad field."""
    if not isinstance(doc, Mapping):
        raise ServerInfoError(f"expected a JSON object, got {type(doc).__name__}")
    full = _count(doc, "max_total_num_tokens", "")
    context = _count(doc, "context_length", "")
    states = doc.get("internal_states")
    if states is None:
        states = []
    if not isinstance(states, list) or not all(isinstance(s, Mapping) for s in states):
        raise ServerInfoError("internal_states: expected a list of objects")
    swa: list[int] = []
    requests: list[int] = []
    for i, state in enumerate(states):
        where = f"internal_states[{i}]."
        usage = state.get("memory_usage")
        if usage is not None:
            if not isinstance(usage, Mapping):
                raise ServerInfoError(f"{where}memory_usage: expected an object")
            n = _optional_count(usage, "token_capacity_swa", f"{where}memory_usage.")
            if n is not None:
                swa.append(n)
        per_dp = _optional_count(state, "effective_max_running_requests_per_dp", where)
        if per_dp is not None:
            requests.append(per_dp)
    version = doc.get("version")
    return ServerInfo(
        full_tokens=full,
        context_tokens=context,
        swa_tokens=min(swa) if swa else None,
        # A request runs on one DP scheduler: the server's total is the sum; partial reports
        # (some schedulers without the field) would undercount, so they count as none.
        max_running_requests=sum(requests) if requests and len(requests) == len(states) else None,
        version=version if isinstance(version, str) else None,
    )


def parse_server_infos(
    raw: Mapping[str, Mapping[str, Any]],
) -> tuple[dict[str, ServerInfo], dict[str, str]]:
    """(parsed documents, why the others were refused), both by pod name."""
    parsed: dict[str, ServerInfo] = {}
    refused: dict[str, str] = {}
    for name, doc in raw.items():
        try:
            parsed[name] = parse_server_info(doc)
        except ServerInfoError as exc:
            refused[name] = f"/server_info: {exc}"
    return parsed, refused
