"""How this server answers what a request leaves open (`ApiOptions`, from `dsv4 serve` flags),
and the header that names the top-level fields it ignored. Pure.

    option               flag                   default
    max_tokens_default   --max-tokens-default   None: a chat request without max_tokens may
                                                use what the context leaves (vLLM's rule)
    strict_fields        --strict-fields        False: unknown top-level fields are ignored,
                                                named in a log line and `X-DSV4-Ignored-Fields`
    thinking_default     --thinking             False: chat requests that do not choose get
                                                DeepSeek-V4's non-thinking mode
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

IGNORED_FIELDS_HEADER: Final = "X-DSV4-Ignored-Fields"
MAX_SHOWN_FIELDS: Final = 16
MAX_SHOWN_CHARS: Final = 64


@dataclass(frozen=True, slots=True)
class ApiOptions:
    max_tokens_default: int | None = None
    strict_fields: bool = False
    thinking_default: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens_default is not None and self.max_tokens_default < 1:
            raise ValueError(f"max_tokens_default: must be >= 1, got {self.max_tokens_default}")


def shown_fields(names: Sequence[str]) -> str:
    """Field names as one header value: ASCII only (others escaped as JSON escapes them),
    each cut to MAX_SHOWN_CHARS, at most MAX_SHOWN_FIELDS (then "+N more")."""
    shown = [json.dumps(n[:MAX_SHOWN_CHARS])[1:-1] for n in names[:MAX_SHOWN_FIELDS]]
    rest = len(names) - len(shown)
    return ", ".join(shown) + (f", +{rest} more" if rest > 0 else "")
