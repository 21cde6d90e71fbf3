"""Planner inputs (frozen) and the planner's error type. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dsv4_common.core.layout import RequestState
from dsv4_common.core.model import DSV4Config, ModelConfig

Role = Literal["colocated", "prefill", "decode"]
ROLES: tuple[Role, ...] = ("colocated", "prefill", "decode")

DEFAULT_MEM_FRACTION = 0.9
# Auto max_running_requests: enough request slots that the full pool is used when the average
# request holds this many tokens, capped per role.
DEFAULT_TOKENS_PER_REQUEST = 4096
AUTO_MAX_RUNNING_CAP: dict[Role, int] = {"colocated": 1024, "decode": 1024, "prefill": 128}


class PlanError(ValueError):
    """A deployment that cannot work; the message names the limit and the setting to change.

    `input_name` is the PlanInputs field at fault when there is one (the CLI and the CR
    parser translate it to their flag or spec field)."""

    def __init__(self, message: str, input_name: str | None = None) -> None:
        super().__init__(message)
        self.input_name = input_name


@dataclass(frozen=True, slots=True)
class PlanInputs:
    model: ModelConfig
    role: Role
    gpu_memory_bytes: int  # per device
    pp_size: int = 1
    layer_split: tuple[int, ...] | None = None  # target layers per PP rank; None = even
    tp_size: int = 1
    page_size: int | None = None  # None = the model's default
    chunked_prefill_tokens: int | None = None  # None = 32 pages
    max_running_requests: int | None = None  # None = auto
    swa_ratio: float | None = None  # None = auto (sized from what the role needs)
    mem_fraction: float = DEFAULT_MEM_FRACTION
    speculative_draft_tokens: int = 0
    context_len: int | None = None  # None = the model's max_position_embeddings
    weight_bytes_per_rank: tuple[int, ...] | None = None  # measured/overridden; None = estimate
    request_state: RequestState = "ring"  # HCA compressor state: a ring, or 3 online rows

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise PlanError(f"role={self.role!r} must be one of {list(ROLES)}", "role")
        checks: list[tuple[bool, str, str]] = [
            (self.gpu_memory_bytes > 0, "gpu_memory_bytes", "must be > 0"),
            (self.pp_size >= 1, "pp_size", "must be >= 1"),
            (self.tp_size >= 1, "tp_size", "must be >= 1"),
            (0 < self.mem_fraction <= 1, "mem_fraction", "must be in (0, 1]"),
            (self.speculative_draft_tokens >= 0, "speculative_draft_tokens", "must be >= 0"),
            (self.page_size is None or self.page_size >= 1, "page_size", "must be >= 1"),
            (
                self.chunked_prefill_tokens is None or self.chunked_prefill_tokens >= 1,
                "chunked_prefill_tokens",
                "must be >= 1",
            ),
            (
                self.max_running_requests is None or self.max_running_requests >= 1,
                "max_running_requests",
                "must be >= 1",
            ),
            (self.swa_ratio is None or 0 < self.swa_ratio <= 1, "swa_ratio", "must be in (0, 1]"),
            (self.context_len is None or self.context_len >= 1, "context_len", "must be >= 1"),
        ]
        for ok, name, message in checks:
            if not ok:
                raise PlanError(f"{name}={getattr(self, name)} {message}", name)
        model_context = self.model.max_position_embeddings
        if self.context_len is not None and self.context_len > model_context:
            raise PlanError(
                f"context_len={self.context_len} exceeds the model's context of {model_context} "
                "tokens (max_position_embeddings)",
                "context_len",
            )
        heads = self.model.weights.num_attention_heads
        if heads % self.tp_size:
            raise PlanError(
                f"tp_size={self.tp_size} must divide the model's {heads} attention heads "
                f"(each tensor-parallel rank holds the same number of heads)",
                "tp_size",
            )

    @property
    def resolved_page_size(self) -> int:
        return self.page_size if self.page_size is not None else default_page_size(self.model)

    @property
    def resolved_chunk_tokens(self) -> int:
        if self.chunked_prefill_tokens is not None:
            return self.chunked_prefill_tokens
        return 32 * self.resolved_page_size

    @property
    def resolved_context_len(self) -> int:
        return self.context_len or self.model.max_position_embeddings


def default_page_size(model: ModelConfig) -> int:
    """256 for production DSV4 shapes (the fp8 kernels' page); the smallest legal page for tiny."""
    if isinstance(model, DSV4Config):
        return 256 if model.window_tokens >= 128 else max((*model.nonzero_ratios, 16))
    return 256 if model.window_tokens >= 128 else 16
