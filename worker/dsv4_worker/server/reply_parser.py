"""The incremental parser of a DeepSeek-V4 reply: text in (pieces of any size, split anywhere),
reasoning, content and finished tool calls out. Pure.

    mode        what its text is               leaves it at
    reasoning   reasoning_content              </think> (-> content), a DSML tag (-> block)
    content     content                        <think> (-> reasoning), a DSML tag (-> block)
    block       whitespace between invokes     </｜DSML｜tool_calls> or other text (-> content)
    invoke      parameters of one call         </｜DSML｜invoke> (the call is done)
    param       one parameter's value          </｜DSML｜parameter>

NOTE: the output never depends on how the text was split: `push(a); push(b)` gives what
`push(a + b)` gives, and `finish` whatever is left. To get there the parser holds back every
tail that could still begin a tag (and the whitespace before it: whitespace just before a
tool-call block is dropped, as the release writes "\\n\\n" there), and decides a tag only
once it is whole. No part of a think or DSML tag is ever emitted as reasoning or content:
tags are consumed, a malformed DSML tag is dropped through its ">", and an unfinished tag
(two characters or more of one) at the very end is dropped too.

Tags are recognized wherever they appear in reasoning or content (as the release's own parser
does); inside a parameter only its closing tag counts, and for a JSON value (string="false")
only outside the value's JSON strings. An invoke still open at the end of the reply (cut by
max_tokens) gives no call. Tool calls inside the reasoning end it: they are calls, never
reasoning. An invoke whose body is a JSON object instead of parameters (SGLang's second
form) takes that object as its arguments.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Final

from dsv4_worker.server.dsml import (
    BLOCK_NAME,
    MARK,
    PARAM_CLOSE,
    THINK_END,
    THINK_START,
    arguments_json,
    to_json,
)

MAX_TAG_CHARS: Final = 1024  # a DSML tag longer than this is malformed
_TAG_STARTS: Final = (THINK_START, THINK_END, f"<{MARK}", f"</{MARK}", MARK)
_DSML_STARTS: Final = (f"<{MARK}", f"</{MARK}", MARK)


class Mode(Enum):
    REASONING = "reasoning"
    CONTENT = "content"
    BLOCK = "block"
    INVOKE = "invoke"
    PARAM = "param"


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object


@dataclass(slots=True)
class Parsed:
    """What one push (or the finish) released."""

    reasoning: str = ""
    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _Tag:
    closing: bool
    name: str  # tool_calls, invoke, parameter (or whatever the model wrote)
    attrs: dict[str, str]
    end: int  # index just past its ">"


class _Need:
    """The tag is not whole yet: wait for more text."""


_NEED: Final = _Need()


class ReplyParser:
    def __init__(self, *, reasoning: bool) -> None:
        """`reasoning`: the prompt opened the reasoning (it ends with <think>)."""
        self.mode = Mode.REASONING if reasoning else Mode.CONTENT
        self._buf = ""
        self._pos = 0  # text before it is consumed
        self._name = ""  # the open invoke's
        self._params: list[tuple[str, str, bool | None]] = []
        self._body: list[str] = []  # the open invoke's text outside parameters
        self._key = ""  # the open parameter's
        self._is_string: bool | None = None
        self._value_start = 0
        self._scan = 0  # a JSON value: where its scan for the closing tag resumes
        self._in_string = False
        self._escaped = False

    def push(self, text: str) -> Parsed:
        self._buf += text
        out = Parsed()
        self._run(out, final=False)
        self._compact()
        return out

    def finish(self) -> Parsed:
        out = Parsed()
        self._run(out, final=True)
        self._buf, self._pos = "", 0
        return out

    # ---- the modes -----------------------------------------------------------------------------

    def _run(self, out: Parsed, *, final: bool) -> None:
        while True:
            mode = self.mode
            if mode in (Mode.REASONING, Mode.CONTENT):
                progressed = self._text(out, final)
            elif mode is Mode.BLOCK:
                progressed = self._block(final)
            elif mode is Mode.INVOKE:
                progressed = self._invoke(out, final)
            else:
                progressed = self._param(final)
            if not progressed:
                return

    def _emit(self, out: Parsed, text: str) -> None:
        if self.mode is Mode.REASONING:
            out.reasoning += text
        else:
            out.content += text

    def _text(self, out: Parsed, final: bool) -> bool:
        buf, pos = self._buf, self._pos
        start, tag = _first_tag(buf, pos)
        if tag is None:
            held = _held(buf, pos)
            end = len(buf) - held
            if final:
                tail = buf[end:]
                cut = len(tail) - len(tail.lstrip())  # the whitespace before a tag prefix
                end += cut if len(tail) - cut >= 2 else len(tail)
            self._emit(out, buf[pos:end])
            self._pos = len(buf) if final else end
            return False
        text = buf[pos:start]
        if tag in (THINK_START, THINK_END):
            self._emit(out, text)
            self._pos = start + len(tag)
            self.mode = Mode.REASONING if tag == THINK_START else Mode.CONTENT
        else:  # a DSML tag: the block starts here, the whitespace before it goes
            self._emit(out, text.rstrip())
            self._pos = start
            self.mode = Mode.BLOCK
        return True

    def _block(self, final: bool) -> bool:
        buf = self._buf
        pos = _skip_space(buf, self._pos)
        self._pos = pos
        if pos == len(buf):
            return False
        if not buf.startswith(_DSML_STARTS, pos):
            if not final and any(s.startswith(buf[pos:]) for s in _DSML_STARTS):
                return False  # a tag may begin here
            self.mode = Mode.CONTENT  # text after the calls (or a block left unclosed)
            return True
        tag = self._tag(pos, final)
        if tag is _NEED:
            return False
        if isinstance(tag, _Tag):
            if tag.name == BLOCK_NAME and tag.closing:
                self.mode = Mode.CONTENT
            elif tag.name == "invoke" and not tag.closing:
                self._open_invoke(tag)
        return True

    def _invoke(self, out: Parsed, final: bool) -> bool:
        buf, pos = self._buf, self._pos
        start = _find_dsml(buf, pos)
        if start is None:
            end = len(buf) if final else len(buf) - _held_dsml(buf, pos)
            self._body.append(buf[pos:end])
            self._pos = end
            return False
        self._body.append(buf[pos:start])
        tag = self._tag(start, final)
        if tag is _NEED:
            self._pos = start
            return False
        if not isinstance(tag, _Tag):
            return True  # malformed: dropped
        if tag.name == "parameter" and not tag.closing:
            self._key = tag.attrs.get("name", "")
            flag = tag.attrs.get("string")
            self._is_string = True if flag == "true" else False if flag == "false" else None
            self._value_start = self._scan = tag.end
            self._in_string = self._escaped = False
            self.mode = Mode.PARAM
        elif tag.name == "invoke":
            if tag.closing:
                self._close_invoke(out)
                self.mode = Mode.BLOCK
            else:  # a new invoke before this one closed: this one ends here
                self._close_invoke(out)
                self._open_invoke(tag)
        elif tag.name == BLOCK_NAME and tag.closing:
            self._close_invoke(out)
            self.mode = Mode.CONTENT
        return True

    def _param(self, final: bool) -> bool:
        end = self._find_param_close()
        if end is None:
            return False  # at the end of the reply: the invoke is unfinished, no call
        value = self._buf[self._value_start : end]
        self._params.append((self._key, value, self._is_string))
        self._pos = end + len(PARAM_CLOSE)
        self.mode = Mode.INVOKE
        return True

    # ---- pieces --------------------------------------------------------------------------------

    def _open_invoke(self, tag: _Tag) -> None:
        self._name = tag.attrs.get("name", "")
        self._params, self._body = [], []
        self.mode = Mode.INVOKE

    def _close_invoke(self, out: Parsed) -> None:
        name, params, body = self._name, self._params, "".join(self._body).strip()
        self._name, self._params, self._body = "", [], []
        if not name:
            return  # an invoke without a name calls nothing
        if not params and body.startswith("{"):
            try:
                obj = json.loads(body)
            except ValueError:
                obj = None
            if isinstance(obj, dict):
                out.calls.append(ParsedCall(name, to_json(obj)))
                return
        out.calls.append(ParsedCall(name, arguments_json(params)))

    def _find_param_close(self) -> int | None:
        """Where the open parameter's closing tag starts (None: not yet seen)."""
        buf = self._buf
        if self._is_string is not False:
            at = buf.find(PARAM_CLOSE, self._scan)
            if at < 0:
                self._scan = max(self._value_start, len(buf) - len(PARAM_CLOSE) + 1)
                return None
            return at
        i, n = self._scan, len(buf)
        while i < n:
            c = buf[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c == "<":
                if buf.startswith(PARAM_CLOSE, i):
                    return i
                if PARAM_CLOSE.startswith(buf[i:]):
                    break  # may be the closing tag: look again with more text
            i += 1
        self._scan = i
        return None

    def _tag(self, pos: int, final: bool) -> _Tag | _Need | None:
        """The DSML tag at `pos`, consumed (`_pos` moves past it); None when it is malformed
        (dropped through its ">"); _NEED when more text may complete it."""
        buf = self._buf
        scanned = _scan_tag(buf, pos)
        if isinstance(scanned, _Tag):
            self._pos = scanned.end
            return scanned
        if scanned is None and not final:
            return _NEED
        bad = len(buf) if scanned is None else scanned
        close = buf.find(">", bad, pos + MAX_TAG_CHARS)
        if close < 0 and not final and len(buf) < pos + MAX_TAG_CHARS:
            return _NEED  # the ">" that ends the malformed tag may still come
        self._pos = close + 1 if close >= 0 else max(bad, pos + 1)
        return None

    def _compact(self) -> None:
        keep = min(self._pos, self._value_start if self.mode is Mode.PARAM else self._pos)
        if keep > 4096:
            self._buf = self._buf[keep:]
            self._pos -= keep
            self._value_start -= keep
            self._scan -= keep


def _first_tag(buf: str, pos: int) -> tuple[int, str | None]:
    """The earliest whole tag start in buf[pos:]: (where, which); a DSML tag is found by its
    marker and starts at the "<" or "</" before it."""
    best, which = len(buf), None
    for tag in (THINK_START, THINK_END):
        at = buf.find(tag, pos)
        if 0 <= at < best:
            best, which = at, tag
    dsml = _find_dsml(buf, pos)
    if dsml is not None and dsml < best:
        best, which = dsml, MARK
    return best, which


def _find_dsml(buf: str, pos: int) -> int | None:
    at = buf.find(MARK, pos)
    if at < 0:
        return None
    if at - 2 >= pos and buf[at - 2 : at] == "</":
        return at - 2
    if at - 1 >= pos and buf[at - 1] == "<":
        return at - 1
    return at


def _held(buf: str, pos: int) -> int:
    """How many trailing chars of buf[pos:] to hold: a tail that may begin a tag, and the
    whitespace before it (or a whitespace tail: a block may follow it)."""
    n = _prefix_tail(buf, pos, _TAG_STARTS)
    end = len(buf) - n
    while end > pos and buf[end - 1].isspace():
        end -= 1
    return len(buf) - end


def _held_dsml(buf: str, pos: int) -> int:
    return _prefix_tail(buf, pos, _DSML_STARTS)


def _prefix_tail(buf: str, pos: int, tags: tuple[str, ...]) -> int:
    """The longest tail of buf[pos:] that is a proper prefix of one of `tags`."""
    longest = max(len(t) for t in tags) - 1
    for n in range(min(longest, len(buf) - pos), 0, -1):
        tail = buf[len(buf) - n :]
        if any(t.startswith(tail) for t in tags):
            return n
    return 0


def _skip_space(buf: str, pos: int) -> int:
    while pos < len(buf) and buf[pos].isspace():
        pos += 1
    return pos


def _scan_tag(buf: str, pos: int) -> _Tag | int | None:
    """Read the DSML tag at `pos`: the tag, the index where it went wrong, or None when the
    text ends before it does."""
    n = len(buf)
    limit = pos + MAX_TAG_CHARS
    i = pos
    closing = False
    if buf.startswith("</", i):
        closing, i = True, i + 2
    elif buf.startswith("<", i):
        i += 1
    if not buf.startswith(MARK, i):
        return None if MARK.startswith(buf[i:]) else i
    i += len(MARK)
    start = i
    while i < n and (buf[i].isalnum() or buf[i] == "_"):
        i += 1
    name = buf[start:i]
    attrs: dict[str, str] = {}
    while True:
        if i >= limit:
            return i
        i = _skip_space(buf, i)
        if i >= n:
            return None
        c = buf[i]
        if c == ">":
            return _Tag(closing, name, attrs, i + 1)
        if c == "/":
            if i + 1 >= n:
                return None
            return _Tag(closing, name, attrs, i + 2) if buf[i + 1] == ">" else i + 1
        key_start = i
        while i < n and (buf[i].isalnum() or buf[i] in "_-"):
            i += 1
        if i >= n:
            return None
        if i == key_start or buf[i] != "=":
            return i
        i += 1
        if i >= n:
            return None
        if buf[i] != '"':
            return i
        close = buf.find('"', i + 1, limit)
        if close < 0:
            return None if n < limit else limit
        attrs[buf[key_start : i - 1]] = buf[i + 1 : close]
        i = close + 1
