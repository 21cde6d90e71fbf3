"""The answer to one completion request in OpenAI's shapes: one `Choice` per (prompt, sample)
that turns the engine's token events into text, token ids and logprobs, and the bodies and
stream chunks built from them. Pure (no I/O): the HTTP side feeds events in and writes out
what comes back.

    choice index        prompt index x n + sample index (completions may batch prompts)
    id                  cmpl-<request id> / chatcmpl-<request id>: the client's X-Request-Id
                        (through the router: its attempt's), else a new random id
    text                stop strings cut it (at the match, or after it with
                        include_stop_str_in_output); a match must end after the text of the
                        first `min_tokens` tokens; echo puts the prompt first
    logprobs            completions: {tokens, token_logprobs, top_logprobs, text_offset}, the
                        sampled token always in its top_logprobs (OpenAI: up to k + 1);
                        chat: {content: [{token, logprob, bytes, top_logprobs}]}
    usage               every body; streaming: with stream_options.include_usage a last
                        chunk with no choices (and continuous_usage_stats: on every chunk)
    chat message        content, reasoning_content and tool_calls, split by the reply parser
                        (`chat_reply.py`) after stop strings cut the text; streamed as deltas
                        of each (a tool call whole, once its invoke closes); content is null
                        when the reply is only calls; finish_reason "tool_calls" when it has any

A token whose text is not whole UTF-8 on its own (a byte of a character) shows as
"bytes:\\xe2" with the byte tokenizer, as OpenAI shows such tokens; its `bytes` are exact.
"""

from __future__ import annotations

import time
from typing import Any, Final

from dsv4_common.api.http_rules import error_document
from dsv4_common.api.request_id import new_request_id
from dsv4_worker.engine.logprobs import TokenLogprob
from dsv4_worker.server.chat_reply import ChatReply
from dsv4_worker.server.protocol import CompletionRequest, Prompt
from dsv4_worker.server.runner import Token
from dsv4_worker.server.tokenizer import ByteTokenizer, StreamDecoder, Tokenizer, stop_holdback

MIN_LOGPROB = -9999.0  # what -inf is sent as (JSON has no infinity)
# `error.code` of a stream chunk that ends a failed request with no code of its own.
STREAM_ERROR_CODE: Final = "generation_failed"
_REPLACEMENT = "\ufffd"

# A token, its logprobs (None: the first prompt token) and its text_offset.
Entry = tuple[int, TokenLogprob | None, int]


def token_piece(tok: Tokenizer, token_id: int) -> tuple[str, list[int]]:
    """A token's text and UTF-8 bytes, as logprobs show it."""
    if isinstance(tok, ByteTokenizer):
        raw = bytes([token_id]) if 0 <= token_id < 256 else b""
        try:
            return raw.decode("utf-8"), list(raw)
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)
    piece = tok.decode([token_id])
    return piece, list(piece.encode("utf-8"))


def text_offsets(tok: Tokenizer, ids: tuple[int, ...]) -> list[int]:
    """Where each token's text starts in the text of `ids` (a token inside a character
    starts where that character does)."""
    decoder, offsets, length = StreamDecoder(tok), [], 0
    for token in ids:
        offsets.append(length)
        length += len(decoder.push(token))
    return offsets


def find_stop_after(text: str, stops: tuple[str, ...], min_end: int) -> tuple[int, int] | None:
    """The earliest stop string match that ends after `min_end`: (start, end)."""
    best: tuple[int, int] | None = None
    for s in stops:
        i = text.find(s, max(0, min_end - len(s) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, i + len(s))
    return best


class Choice:
    """One choice: its tokens, released text and logprob entries not yet sent."""

    def __init__(self, tok: Tokenizer, req: CompletionRequest, index: int, prompt: Prompt):
        self.tok = tok
        self.req = req
        self.index = index
        self.prompt = prompt
        self.decoder = StreamDecoder(tok)
        self.full = ""  # the generated text decoded so far
        self.text = ""  # the part of it released to the client (or to be, at the end)
        self.token_ids: list[int] = []
        self.stopped = False  # a stop string ended it
        self.finish_reason: str | None = None
        self.entries: list[Entry] = []  # logprob entries not taken yet
        self.echo_pending = req.gen.echo  # the prompt's text still leads the next piece
        self.role_sent = False  # chat streaming: the first delta carries the role
        self._min_end = 0  # stop strings must end past this (the first min_tokens' text)
        self.reply = ChatReply(req.reply) if req.reply is not None else None  # chat

    @property
    def shown_finish_reason(self) -> str | None:
        """The finish reason the answer shows ("tool_calls" for a chat reply with calls)."""
        if self.reply is None:
            return self.finish_reason
        return self.reply.finish_reason(self.finish_reason)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def push(self, event: Token) -> str:
        """The new generated text this token releases."""
        gen = self.req.gen
        if event.prompt_logprobs is not None and gen.echo and gen.logprobs is not None:
            offsets = text_offsets(self.tok, self.prompt.ids)
            self.entries.append((self.prompt.ids[0], None, 0))
            self.entries.extend(
                (e.token_id, e, at)
                for e, at in zip(event.prompt_logprobs, offsets[1:], strict=True)
            )
        if not gen.generate:
            return ""  # echo alone: the one token computed is not part of the answer
        self.token_ids.append(event.token_id)
        if gen.logprobs is not None and event.logprob is not None:
            start = len(self.prompt.text) if gen.echo else 0
            self.entries.append((event.token_id, event.logprob, start + len(self.full)))
        self.full += self.decoder.push(event.token_id)
        if len(self.token_ids) <= gen.params.min_tokens:
            self._min_end = len(self.full)
        piece = self._release(final=False)
        if self.reply is not None:
            self.reply.push(piece)
            if self.stopped:  # a stop string ended the text: nothing more comes
                self.reply.finish()
        return piece

    def finish(self) -> str:
        """The rest of the text at the end of the request."""
        self.full += self.decoder.flush()
        stopped = self.stopped
        piece = self._release(final=True)
        if self.reply is not None and not stopped:
            self.reply.push(piece)
            self.reply.finish()
        return piece

    def _release(self, *, final: bool) -> str:
        if self.stopped:
            return ""
        stops = self.req.stop_strings
        match = find_stop_after(self.full, stops, self._min_end) if stops else None
        if match is not None:
            self.stopped = True
            end = match[1] if self.req.gen.include_stop_str else match[0]
        elif final:
            end = len(self.full)
        else:
            end = len(self.full) - stop_holdback(self.full, stops)
        piece = self.full[len(self.text) : max(end, len(self.text))]
        self.text += piece
        return piece

    def take_echo(self) -> str:
        """The prompt's text, the first time (echo), else ""."""
        if not self.echo_pending:
            return ""
        self.echo_pending = False
        return self.prompt.text

    def take_logprobs(self, chat: bool) -> dict[str, Any] | None:
        """The logprobs of the entries not sent yet, in the endpoint's shape."""
        if self.req.gen.logprobs is None:
            return None
        entries, self.entries = self.entries, []
        if chat:
            return {"content": [self._chat_entry(t, e) for t, e, _ in entries], "refusal": None}
        return self._completion_logprobs(entries)

    def _completion_logprobs(self, entries: list[Entry]) -> dict[str, Any]:
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for token, entry, offset in entries:
            piece, _ = token_piece(self.tok, token)
            tokens.append(piece)
            offsets.append(offset)
            if entry is None:
                values.append(None)
                tops.append(None)
                continue
            values.append(max(entry.logprob, MIN_LOGPROB))
            top = {token_piece(self.tok, t)[0]: max(v, MIN_LOGPROB) for t, v in entry.top}
            top.setdefault(piece, max(entry.logprob, MIN_LOGPROB))
            tops.append(top)
        return {
            "tokens": tokens,
            "token_logprobs": values,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _chat_entry(self, token: int, entry: TokenLogprob | None) -> dict[str, Any]:
        assert entry is not None, "chat has no prompt logprobs"
        piece, raw = token_piece(self.tok, token)
        top = []
        for t, v in entry.top:
            p, b = token_piece(self.tok, t)
            top.append({"token": p, "logprob": max(v, MIN_LOGPROB), "bytes": b})
        return {
            "token": piece,
            "logprob": max(entry.logprob, MIN_LOGPROB),
            "bytes": raw,
            "top_logprobs": top,
        }


class Answer:
    """Every choice of one request, and the response bodies built from them."""

    def __init__(
        self,
        tok: Tokenizer,
        req: CompletionRequest,
        model: str,
        chat: bool,
        request_id: str | None = None,
    ) -> None:
        """`request_id`: the request's one id (`dsv4_common.api.request_id`; None: a new one)."""
        self.req = req
        self.chat = chat
        self.model = req.model or model
        self.request_id = request_id or new_request_id()
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{self.request_id}"
        self.created = int(time.time())
        n = req.gen.n
        self.choices = [
            Choice(tok, req, p * n + i, prompt)
            for p, prompt in enumerate(req.prompts)
            for i in range(n)
        ]

    def usage(self) -> dict[str, int]:
        prompt = sum(len(p.ids) for p in self.req.prompts)  # once per prompt, whatever n
        completion = sum(len(c.token_ids) for c in self.choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def body(self) -> dict[str, Any]:
        """The whole answer (not streaming), every choice finished."""
        choices = []
        for c in self.choices:
            text = c.take_echo() + c.text
            choice: dict[str, Any] = {"index": c.index}
            if c.reply is not None:
                choice["message"] = _message(c.reply)
            elif self.chat:
                choice["message"] = {"role": "assistant", "content": text, "refusal": None}
            else:
                choice["text"] = text
            choice["logprobs"] = c.take_logprobs(self.chat)
            choice["finish_reason"] = c.shown_finish_reason
            if self.req.gen.return_token_ids:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        return {**self._envelope(stream=False), "choices": choices, "usage": self.usage()}

    def chunk(
        self, c: Choice, piece: str, error: str | None = None, code: str | None = None
    ) -> dict[str, Any]:
        """A stream chunk for choice `c`: its new text, the logprobs of its new tokens, and
        its finish reason once it has one; with `error`, OpenAI's error object (`code`, else
        STREAM_ERROR_CODE)."""
        text = c.take_echo() + piece
        choice: dict[str, Any] = {"index": c.index}
        if self.chat:
            delta: dict[str, Any] = {"content": text} if c.reply is None else _delta(c.reply)
            if not c.role_sent:
                c.role_sent = True
                delta = {"role": "assistant", **delta}
            choice["delta"] = delta
        else:
            choice["text"] = text
        choice["logprobs"] = c.take_logprobs(self.chat)
        choice["finish_reason"] = c.shown_finish_reason
        if self.req.gen.return_token_ids and c.done:
            choice["token_ids"] = c.token_ids
        out = {**self._envelope(stream=True), "choices": [choice]}
        if self.req.gen.continuous_usage:
            out["usage"] = self.usage()
        elif self.req.gen.include_usage:
            out["usage"] = None
        if error:
            out |= error_document(error, "server_error", None, code or STREAM_ERROR_CODE)
        return out

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk with stream_options.include_usage: no choices, the usage."""
        return {**self._envelope(stream=True), "choices": [], "usage": self.usage()}

    def _envelope(self, *, stream: bool) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        return {
            "id": self.id,
            "object": f"{kind}.chunk" if stream and self.chat else kind,
            "created": self.created,
            "model": self.model,
        }


def _message(reply: ChatReply) -> dict[str, Any]:
    """A finished chat choice's message."""
    message: dict[str, Any] = {
        "role": "assistant",
        "content": reply.content if reply.content or not reply.calls else None,
        "reasoning_content": reply.reasoning or None,
        "refusal": None,
    }
    if reply.calls:
        message["tool_calls"] = [c.as_openai(with_index=False) for c in reply.calls]
    return message


def _delta(reply: ChatReply) -> dict[str, Any]:
    """A chat stream chunk's delta: what the reply released since the last chunk."""
    d = reply.take_delta()
    delta: dict[str, Any] = {}
    if d.reasoning:
        delta["reasoning_content"] = d.reasoning
    if d.content or not (d.reasoning or d.calls):
        delta["content"] = d.content
    if d.calls:
        delta["tool_calls"] = [c.as_openai(with_index=True) for c in d.calls]
    return delta
