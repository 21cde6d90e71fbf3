"""The `dsv4 serve` flags as data: one row per flag, in `--help` order. Pure (no argparse).

The command line is built from these rows (`dsv4_cli.flags`); the worker (`dsv4_worker.options`)
and the router (`dsv4_router.config`) read the parsed values by `Flag.dest`; the operator
refuses a pod `args` entry naming a flag whose row says the operator computes it
(`operator_owned()`), with the row's `operator` text saying where to set it instead. A new
flag is a new row: the parser, `--help` and the operator's refusal follow from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from dsv4_common.api.names import COMPUTE_DTYPES
from dsv4_common.core.layout import REQUEST_STATES
from dsv4_common.plan.inputs import ROLES

# Far above any device or deployment; low enough that byte arithmetic stays exact.
MAX_GPU_MEMORY_GIB: Final = 1 << 20
MAX_COUNT: Final = 1 << 40
MAX_PORT: Final = 65535


@dataclass(frozen=True, slots=True)
class Bounds:
    """A number flag's type and range: finite, >= minimum (> when not inclusive), <= maximum."""

    kind: Literal["int", "float"]
    minimum: float
    inclusive: bool
    maximum: float


POSITIVE_INT: Final = Bounds("int", 1, True, MAX_COUNT)
NON_NEGATIVE_INT: Final = Bounds("int", 0, True, MAX_COUNT)
POSITIVE_FLOAT: Final = Bounds("float", 0, False, MAX_COUNT)
FRACTION: Final = Bounds("float", 0, False, 1)
GPU_MEMORY_GIB: Final = Bounds("float", 0, False, MAX_GPU_MEMORY_GIB)
PORT: Final = Bounds("int", 0, True, MAX_PORT)

# Who reads a flag: the worker's options, the router's, both, or `dsv4 serve` itself before it
# starts either (a model source to fetch).
Reader = Literal["worker", "router", "both", "cli"]


@dataclass(frozen=True, slots=True)
class Flag:
    name: str  # "--max-running-requests"
    help: str | None = None
    bounds: Bounds | None = None  # a number; None: text (or `choices`)
    default: object = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    many: Literal["one", "one_or_more", "repeat"] = "one"  # nargs="+" / action="append"
    switch: bool = False  # a flag without a value (action="store_true")
    group: str | None = None  # the `--help` section; None: the command's options
    reader: Reader = "worker"
    # What the operator computes the flag from (a pod's `args` may not set it); None: a user
    # may pass it in `spec.<role>.podTemplate...args`.
    operator: str | None = None

    @property
    def dest(self) -> str:
        """The parsed attribute: `--max-running-requests` -> `max_running_requests`."""
        return self.name.removeprefix("--").replace("-", "_")


# Sections of `dsv4 serve --help`, in the order they first appear below.
ADMISSION: Final = "admission (worker)"
HTTP: Final = "HTTP clients (worker and router)"
PD: Final = "PD disaggregation (quick form)"
PP: Final = "pipeline parallelism (quick form)"
API: Final = "OpenAI API defaults (worker)"

# The planner inputs `dsv4 plan` and `dsv4 serve` both take.
SIZING_FLAGS: Final = (
    Flag("--max-running-requests", bounds=POSITIVE_INT, operator="spec.<role>.maxRunningRequests"),
    Flag(
        "--chunked-prefill-size",
        "prefill chunk in tokens (default: 32 pages)",
        bounds=POSITIVE_INT,
        operator="spec.<role>.chunkedPrefillTokens",
    ),
    Flag(
        "--page-size",
        "tokens per page (default: 256, tiny models 16)",
        bounds=POSITIVE_INT,
        operator="spec.kv.pageSize",
    ),
    Flag(
        "--context-len",
        "cap on context length (default: the model's max_position_embeddings)",
        bounds=POSITIVE_INT,
        operator="spec.maxContextTokens",
    ),
    Flag(
        "--request-state",
        "DSV4 HCA compressor state per request: a ring of the block's tokens (ring) or 3 exact "
        "streaming rows (online)",
        choices=REQUEST_STATES,
        default="ring",
        operator="the rank config",
    ),
)

SERVE_FLAGS: Final = (
    Flag(
        "--model",
        "a preset, a config.json, a HuggingFace model directory (its config.json, "
        "safetensors weights and tokenizer are used), or hf://ORG/NAME[@REVISION] (fetched "
        "into the local Hugging Face cache first, verified; see dsv4 fetch)",
        default="tiny",
        operator="spec.model",
    ),
    Flag(
        "--offline",
        "with --model hf://...: take the model from the local Hugging Face cache only (a "
        "verified snapshot), never the network",
        switch=True,
        default=False,
        reader="cli",
    ),
    Flag(
        "--role",
        choices=(*ROLES, "router"),
        default="colocated",
        reader="both",
        operator="the pod's role",
    ),
    Flag(
        "--config-dir",
        "the rank config the operator renders",
        reader="both",
        operator="the mounted config",
    ),
    Flag(
        "--host",
        "address to listen on (default: 127.0.0.1; 0.0.0.0 with --config-dir)",
        reader="both",
        operator="the pod's address",
    ),
    Flag(
        "--port",
        "API port (0: any free port; the one taken is printed)",
        bounds=PORT,
        default=8000,
        reader="both",
        operator="the worker's ports",
    ),
    Flag(
        "--device",
        "where the engine runs (default: cpu; with --config-dir, cuda unless the rank config is "
        "CPU mode)",
        choices=("cpu", "cuda"),
    ),
    Flag(
        "--dtype",
        "compute dtype: auto (bfloat16 on cuda, float32 on cpu), bfloat16, float32, or float64 "
        "(the oracle tests'; slow). Weights stay as stored and KV rows as the plan's layout, "
        "whatever it is (default: auto; with --config-dir, the rank config's model.dtype)",
        choices=COMPUTE_DTYPES,
        operator="spec.model.dtype",
    ),
    Flag(
        "--weights",
        "a .safetensors file or a model directory (default: --model's directory, else seeded "
        "random)",
        operator="spec.model.weights",
    ),
    Flag(
        "--seed",
        "random weights of this seed (default: the preset's shipped weights when it has them, "
        "as tiny does, else seed 0)",
        bounds=NON_NEGATIVE_INT,
    ),
    Flag(
        "--tokenizer",
        "tokenizer.json, or a HuggingFace model directory with one and its "
        "tokenizer_config.json (default: bytes, for tiny)",
    ),
    Flag(
        "--served-model-name",
        "the names the API serves the model under (`model` in requests, /v1/models); answers "
        "carry the one a request names, else the first (default: the model's name: its preset "
        "or its directory's name)",
        metavar="NAME",
        many="one_or_more",
    ),
    Flag(
        "--gpu-memory-gib",
        "memory to plan with (default: the device's; 1 GiB on CPU)",
        bounds=GPU_MEMORY_GIB,
        operator="spec.gpu",
    ),
    Flag(
        "--torch-threads",
        "torch intra-op threads (default: the rank config's, else the CPUs this process may "
        "use less one for its own threads; see dsv4_common.plan.threads)",
        bounds=POSITIVE_INT,
    ),
    Flag(
        "--drain-timeout-s",
        "worker: after SIGTERM, requests in flight get this long to finish before they are "
        "aborted with an error (default 20; a second signal ends the drain at once)",
        bounds=POSITIVE_FLOAT,
    ),
    *SIZING_FLAGS,
    Flag(
        "--max-queue-requests",
        "requests that may wait for the engine at once; past it a request gets 503 + "
        "Retry-After at once (default: the rank config's, else 2 x max running requests)",
        bounds=POSITIVE_INT,
        group=ADMISSION,
    ),
    Flag(
        "--queue-timeout-s",
        "a request not scheduled this long after it arrived is removed and answered 503 + "
        "Retry-After (default: the rank config's, else 5)",
        bounds=POSITIVE_FLOAT,
        group=ADMISSION,
    ),
    Flag(
        "--max-tokens-default",
        "a chat request without max_tokens generates at most this many tokens (default: what "
        "the context leaves, vLLM's rule; completions keep OpenAI's 16)",
        bounds=POSITIVE_INT,
        group=API,
    ),
    Flag(
        "--strict-fields",
        "refuse (400) a request with an unknown top-level field (default: ignore it, log it and "
        "name it in the X-DSV4-Ignored-Fields answer header)",
        switch=True,
        default=False,
        group=API,
    ),
    Flag(
        "--thinking",
        "DeepSeek-V4's thinking mode for chat requests that do not choose one (thinking, "
        "chat_template_kwargs.thinking or reasoning_effort)",
        choices=("off", "on"),
        default="off",
        group=API,
    ),
    Flag(
        "--http-idle-timeout-s",
        "close a connection that has sent no whole request's headers this long after "
        "connecting or its last answer (keep-alive and header timeout; default 75)",
        bounds=POSITIVE_FLOAT,
        group=HTTP,
        reader="both",
    ),
    Flag(
        "--http-body-timeout-s",
        "answer 408 when a request's body has not fully arrived this long after its headers "
        "(default 60)",
        bounds=POSITIVE_FLOAT,
        group=HTTP,
        reader="both",
    ),
    Flag(
        "--max-connections",
        "open client connections per port; past it the oldest one without a whole request is "
        "closed, or the new one refused when all are busy (default: from the open-file limit, "
        "at most 4096)",
        bounds=POSITIVE_INT,
        group=HTTP,
        reader="both",
    ),
    Flag(
        "--api-key",
        "clients must send `Authorization: Bearer KEY` on every path but /live, /health and "
        "/ready (/metrics and /status: see --open-status); the router sends its own key to "
        "the workers. Visible in the process list: prefer --api-key-file",
        metavar="KEY",
        group=HTTP,
        reader="both",
        operator="spec.apiKey",
    ),
    Flag(
        "--api-key-file",
        "--api-key read from this file (its surrounding whitespace dropped; default: the rank "
        "or router config's api_key_file)",
        metavar="PATH",
        group=HTTP,
        reader="both",
        operator="spec.apiKey",
    ),
    Flag(
        "--open-status",
        "with an API key: /metrics and /status (the router's /instances too) answer without it "
        "on the status port, which the quick form's one port is too (a --config-dir process "
        "always serves its status port so; its API port always wants the key)",
        switch=True,
        default=False,
        group=HTTP,
        reader="both",
        operator="spec.apiKey (a deployed status port is open, its API port wants the key)",
    ),
    Flag(
        "--transfer",
        "KV transfer backend of prefill and decode (default: nixl)",
        choices=("nixl", "zmq"),
        default="nixl",
        group=PD,
        operator="spec.kv.transfer",
    ),
    Flag(
        "--kv-port",
        "prefill: port of the KV control socket decode workers connect to (0: any free)",
        bounds=PORT,
        default=0,
        group=PD,
        operator="the worker's ports",
    ),
    Flag(
        "--prefill",
        "decode: the prefill KV control address used when a request names none",
        metavar="HOST:PORT",
        group=PD,
        operator="the router config",
    ),
    Flag(
        "--transfer-timeout-s",
        "decode: fail a request (and free its preallocation) when its prefill has not "
        "delivered by then; prefill: give up on it after this long",
        bounds=POSITIVE_FLOAT,
        default=60.0,
        group=PD,
    ),
    Flag(
        "--pd-secret-file",
        "prefill, decode and router: the file holding this deployment's PD secret (at least "
        "32 bytes; the same file for all of them), which authenticates the PD channels and the "
        "router's choice of prefill; else DSV4_PD_SECRET; required by the PD roles",
        metavar="FILE",
        group=PD,
        reader="both",
        operator="the deployment's PD Secret",
    ),
    Flag(
        "--transfer-threads",
        "prefill, nixl: threads that post a big write's byte shares at once, each on its own "
        "UCX worker (default 2; writes under 256 KiB per thread stay on the engine thread; 0 "
        "or 1: the engine thread posts everything)",
        bounds=Bounds("int", 0, True, 64),
        group=PD,
    ),
    Flag(
        "--pp-size",
        "stages in the PP group",
        bounds=POSITIVE_INT,
        default=1,
        group=PP,
        operator="spec.<role>.pipelineParallel",
    ),
    Flag(
        "--pp-rank",
        "this stage's rank",
        bounds=NON_NEGATIVE_INT,
        default=0,
        group=PP,
        operator="the pod's PP rank",
    ),
    Flag(
        "--pp-addr",
        "where the group meets: rank 0 listens on PORT (on --host only), the others connect "
        "to HOST:PORT",
        metavar="HOST:PORT",
        group=PP,
        operator="the group's Service",
    ),
    Flag(
        "--pp-timeout-s",
        "a stage that does not answer within this long fails the group",
        bounds=POSITIVE_FLOAT,
        default=30.0,
        group=PP,
    ),
    Flag(
        "--instance",
        "router: a prefill or decode instance (repeat for each)",
        default=(),
        metavar="ROLE=HOST:HTTP:STATUS:KV",
        many="repeat",
        group=PD,
        reader="router",
        operator="the router config",
    ),
    Flag(
        "--router-processes",
        "router: N processes serving one port, each with its own event loop (default: one per "
        "CPU this process may use, at most 4)",
        bounds=POSITIVE_INT,
        metavar="N",
        group=PD,
        reader="router",
    ),
    Flag(
        "--router-busy-poll-us",
        "router: after each write on a completion, poll this long before the event loop may "
        "sleep, so the next event of the exchange does not wait for an idle CPU to wake up "
        "(costs up to this much CPU per burst of I/O; 0: off; default 50)",
        bounds=Bounds("int", 0, True, 10_000),
        metavar="US",
        group=PD,
        reader="router",
    ),
)


def operator_owned() -> dict[str, str]:
    """Flag name -> where to set it instead, for every flag the operator computes."""
    return {f.name: f.operator for f in SERVE_FLAGS if f.operator is not None}


def serve_flag(name: str) -> Flag:
    """The row of `dsv4 serve` flag `name`; KeyError when there is none."""
    for flag in SERVE_FLAGS:
        if flag.name == name:
            return flag
    raise KeyError(name)
