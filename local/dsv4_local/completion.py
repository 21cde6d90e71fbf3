"""`dsv4 up --request`: one greedy completion through the router (side effects: network).

`parse_completion` is pure (a response body -> `Completion`); `request_completion` sends the
request over loopback HTTP without any proxy and raises `CompletionError` with a one-line
reason on every failure.
"""

from __future__ import annotations

import http.client
import json
from dataclasses import dataclass
from typing import Final
from urllib.parse import urlsplit

__all__ = ["Completion", "CompletionError", "parse_completion", "request_completion"]

COMPLETIONS_PATH: Final = "/v1/completions"
_BODY_EXCERPT_CHARS: Final = 200


class CompletionError(Exception):
    """The request failed; the message says how."""


@dataclass(frozen=True, slots=True)
class Completion:
    text: str
    completion_tokens: int | None  # None when the response has no usage


def request_completion(
    router_url: str, prompt: str, max_tokens: int, timeout_s: float, api_key: bytes | None = None
) -> Completion:
    """`api_key`: sent as `Authorization: Bearer` (the router wants it)."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    parts = urlsplit(router_url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout_s)
    headers = {"Content-Type": "application/json"}
    if api_key is not None:
        headers["Authorization"] = f"Bearer {api_key.decode('ascii')}"
    try:
        conn.request("POST", COMPLETIONS_PATH, body=body, headers=headers)
        response = conn.getresponse()
        raw = response.read()
    except TimeoutError as exc:
        raise CompletionError(f"no answer from {router_url} within {timeout_s:g} s") from exc
    except (OSError, http.client.HTTPException) as exc:
        raise CompletionError(f"{router_url}{COMPLETIONS_PATH}: {exc}") from exc
    finally:
        conn.close()
    text = raw.decode("utf-8", errors="replace")
    if response.status != 200:
        raise CompletionError(f"HTTP {response.status}: {text[:_BODY_EXCERPT_CHARS]}")
    return parse_completion(text)


def parse_completion(text: str) -> Completion:
    """An OpenAI-style text_completion body -> its first choice's text and token count."""
    try:
        body = json.loads(text)
        choice_text = body["choices"][0]["text"]
    except (ValueError, LookupError, TypeError) as exc:
        raise CompletionError(
            f"unexpected response (no choices[0].text): {text[:_BODY_EXCERPT_CHARS]}"
        ) from exc
    if not isinstance(choice_text, str):
        raise CompletionError(f"choices[0].text: expected a string, got {choice_text!r}")
    usage = body.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return Completion(choice_text, tokens if isinstance(tokens, int) else None)
