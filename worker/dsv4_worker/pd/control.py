"""The PD control messages between a decode and a prefill worker (pyzmq, two frames: the
message type, then its JSON body). Strict: a body that does not match its dataclass is refused
with an error naming the field (`dsv4_common.api.documents`).

    decode -> prefill   hello     its control protocol and a fresh nonce (nothing secret)
    prefill -> decode   challenge the session id it assigns, its instance, and its proof of the
                                  deployment's secret over the nonce (`auth`)
    decode -> prefill   join      (sealed from here on) its manifest, transfer backend and
                                  transfer descriptor, the sessions of this prefill instance it
                                  gave up on (`supersedes`: the prefill ends them)
    prefill -> decode   welcome   ok, or the first manifest field that differs; which of
                                  `supersedes` are closed now (nothing more is written for them)
    decode -> prefill   prefill   an admitted request: prompt, sampling (prefill starts computing)
    decode -> prefill   destination  its preallocated units (prefill writes only once it has them)
    prefill -> decode   done      the first token and every write's tag (complete once all landed)
    prefill -> decode   failed    the request cannot be served (the message says why)
    decode -> prefill   abort     stop and forget the request (client gone, timeout)
    prefill -> decode   aborted   nothing more will be written for it
    decode -> prefill   ping      every heartbeat interval (`liveness`), echoing the last pong
    prefill -> decode   pong      at once: its process instance, whether it knows this
                                  connection's session (a restarted prefill does not; such a
                                  pong is the one message not sealed), its number

`hello` carries the manifest (with its version) and the control protocol version (`PROTOCOL`);
prefill refuses either mismatch at handshake, naming it. Protocol 2 split protocol 1's
`prefill` (which carried the destination) in two, so prefill computes while decode allocates.
Protocol 3 carries every sampling parameter (penalties, logit bias, min_tokens, logprobs) to
prefill, which samples the first token as a colocated worker would, and the first token's
logprobs and the prompt's back in `done`. Protocol 4 adds the heartbeat (`ping`/`pong`) and
the prefill's process instance in `welcome`, so decode detects a dead, stopped or restarted
prefill within the heartbeat timeout and handshakes again. Protocol 5 authenticates the
channel with the deployment's PD secret (`auth`: a challenge both ways, then every message
sealed under the session's key, replays refused), assigns the session id at the prefill (no
self-declared peer ids), carries each destination's grant epoch (every write carries it: the
decode's target fences stale writes), and echoes pongs in pings, so a prefill measures its
decode's liveness on its own clock (a ping that waited in a queue while the prefill was
stopped is not fresh).
"""

from __future__ import annotations

import base64
import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from dsv4_common.api.documents import DocumentError, from_document, to_document
from dsv4_common.api.manifest import Manifest
from dsv4_worker.engine.logprobs import TokenLogprob
from dsv4_worker.engine.sampler import SamplingParams

T = TypeVar("T")

PROTOCOL: Final = 5  # this side's control protocol


@dataclass(frozen=True, slots=True)
class StageTarget:
    """One stage of a decode PP group: its transfer descriptor and manifest."""

    descriptor: str  # base64
    manifest: Manifest


@dataclass(frozen=True, slots=True)
class Hello:
    protocol: int
    nonce: str  # fresh for each connection: the challenge must answer it


@dataclass(frozen=True, slots=True)
class Challenge:
    session: str  # assigned by the prefill (its instance, then random)
    instance: str  # the prefill process
    proof: str  # `auth.SessionKeys.challenge_proof(nonce, session, instance)`


@dataclass(frozen=True, slots=True)
class Join:
    backend: str
    manifest: Manifest
    descriptor: str  # base64 of the transfer target's descriptor
    stages: tuple[StageTarget, ...] = ()  # a decode PP group: every stage, this one first
    supersedes: tuple[str, ...] = ()  # this decode's earlier sessions with the same instance


def join_targets(msg: Join) -> tuple[StageTarget, ...]:
    """The decode stages a prefill group writes into (one unless decode runs PP)."""
    return msg.stages or (StageTarget(msg.descriptor, msg.manifest),)


@dataclass(frozen=True, slots=True)
class Welcome:
    ok: bool
    message: str = ""
    manifest_hash: str = ""
    instance: str = ""  # the prefill process (a new one after a restart)
    closed: tuple[str, ...] = ()  # of the join's `supersedes`: nothing more is written for them


@dataclass(frozen=True, slots=True)
class Sampling:
    """How prefill samples the first token: the request's `SamplingParams` but its length."""

    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    min_p: float = 0.0
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    json_schema: str | None = None  # response_format: prefill masks the first token too


_LENGTH_FIELDS: Final = frozenset({"max_new_tokens", "stop_token_ids"})


def sampling_of(params: SamplingParams) -> Sampling:
    """The wire form of `params` (the stop ids travel beside it)."""
    return Sampling(
        **{
            f.name: getattr(params, f.name)
            for f in dataclasses.fields(SamplingParams)
            if f.name not in _LENGTH_FIELDS
        }
    )


def first_token_params(s: Sampling, stop_token_ids: tuple[int, ...]) -> SamplingParams:
    """What prefill samples the first token with: one token, and min_tokens as it stands
    before any token is out (more than one is the same as one there)."""
    fields = {f.name: getattr(s, f.name) for f in dataclasses.fields(Sampling)}
    fields["min_tokens"] = min(s.min_tokens, 1)
    return SamplingParams(max_new_tokens=1, stop_token_ids=stop_token_ids, **fields)


@dataclass(frozen=True, slots=True)
class PrefillRequest:
    room: str
    prompt: tuple[int, ...]
    sampling: Sampling
    stop_token_ids: tuple[int, ...]
    timeout_s: float  # the prefill side gives up (and frees) past this


@dataclass(frozen=True, slots=True)
class Destination:
    """Where a request's KV and state go: decode's units, sent once they are allocated on every
    decode stage. Prefill writes nothing for the request before this arrives."""

    room: str
    dst_full_pages: tuple[int, ...]  # one per page column of the prompt
    dst_swa_pages: tuple[int, ...]  # one per column of the window tail (`columns.tail_cols`)
    dst_slot: int
    epoch: int  # the grant: every write of the request carries it (the target's fence)


@dataclass(frozen=True, slots=True)
class Done:
    room: str
    first_token: int
    generator_state: str | None  # base64 of the sampler's generator state after the token
    tags: tuple[str, ...]  # every transfer tag decode must have seen land
    first_logprob: TokenLogprob | None = None  # when the request asks for logprobs
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # prompt[1:], when it asks for them


@dataclass(frozen=True, slots=True)
class Failed:
    room: str
    message: str


@dataclass(frozen=True, slots=True)
class Abort:
    room: str


@dataclass(frozen=True, slots=True)
class Aborted:
    room: str


@dataclass(frozen=True, slots=True)
class Ping:
    echo: int  # the number of the last pong this decode got (0: the welcome)


@dataclass(frozen=True, slots=True)
class Pong:
    instance: str  # the prefill process
    known: bool  # this connection's session is in force
    number: int = 0  # counts this session's pongs from 1 (a ping echoes it)


Message = (
    Hello
    | Challenge
    | Join
    | Welcome
    | PrefillRequest
    | Destination
    | Done
    | Failed
    | Abort
    | Aborted
    | Ping
    | Pong
)
TYPES: Final[dict[str, type[Any]]] = {
    "hello": Hello,
    "challenge": Challenge,
    "join": Join,
    "welcome": Welcome,
    "prefill": PrefillRequest,
    "destination": Destination,
    "done": Done,
    "failed": Failed,
    "abort": Abort,
    "aborted": Aborted,
    "ping": Ping,
    "pong": Pong,
}
_NAMES: Final = {cls: name for name, cls in TYPES.items()}


class ControlError(ValueError):
    """A control message that does not parse; the message names the field."""


def encode(msg: Message) -> list[bytes]:
    return [_NAMES[type(msg)].encode(), json.dumps(to_document(msg)).encode()]


def decode(frames: list[bytes]) -> Message:
    """The message of two frames (a sealed one is opened first: `auth.Opener`)."""
    if len(frames) != 2:
        raise ControlError(f"control message: expected 2 frames, got {len(frames)}")
    name = frames[0].decode(errors="replace")
    cls = TYPES.get(name)
    if cls is None:
        raise ControlError(f"control message: unknown type {name!r}")
    try:
        body = json.loads(frames[1])
        msg: Message = from_document(cls, body, name)
    except (json.JSONDecodeError, UnicodeDecodeError, DocumentError) as exc:
        raise ControlError(str(exc)) from exc
    return msg


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text.encode())
