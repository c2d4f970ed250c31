"""What every tool-call parser returns, and the JSON scanning two of them share.

A parser turns a model's output text into the message content and its tool calls, as
vLLM's tool parsers do (vllm/entrypoints/openai/tool_parsers/). Parsers here hold no
per-request state: a streamed output is parsed again at each longer prefix with
`final=False`, and each parse only extends the one before it (the content, each call's
arguments), so that the server streams the differences (`server/chat_output.py`). While
streaming, a parser leaves out a call whose name is not complete yet and holds back text that
may still become a marker.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from collections.abc import Callable
from typing import Protocol

from moestream.reasoning.parser import partial_suffix

_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ToolCallPart:
    """One tool call as parsed so far.

    Attributes:
        name: the function's name.
        arguments: its arguments, a JSON object as text (so far, while streaming).
        id: the call id the model wrote (Kimi-K2), else None (the server makes one).
    """

    name: str
    arguments: str
    id: str | None = None


@dataclass(frozen=True)
class ToolParse:
    """An output text parsed: `content` (text outside the tool calls; "" for none) and
    the `tool_calls` in order."""

    content: str
    tool_calls: tuple[ToolCallPart, ...] = ()


class ToolParser(Protocol):
    """A tool-call parser (one per request: some read the request's tool schemas)."""

    #: decode the output with special tokens kept (the parser's markers are special tokens)
    needs_special_tokens: bool

    def parse(self, text: str, final: bool) -> ToolParse:
        """Parse `text`; `final`: the output is whole. A whole output whose tool-call syntax
        does not parse is all content, as in vLLM."""


def no_calls(text: str, marker: str, final: bool) -> ToolParse:
    """The parse of a text without tool calls: all content, less (while streaming) a suffix
    that may still become `marker`, the start of the calls."""
    return ToolParse(text if final else text[:len(text) - partial_suffix(text, (marker,))])


def parse_blocks(text: str, section: str, begin: str, end: str, final: bool,
                 read: Callable[[str, bool], ToolCallPart | None]) -> ToolParse:
    """The calls of the `begin`...`end` blocks after the first `section` marker (the start of
    the calls), the content being the text before it; without one, all content
    (`no_calls`). `read(block, done)` reads one block's inside (`done`: it is closed or the
    output is whole) and returns None when it is malformed (done) or names no function yet.
    A malformed block makes a whole output all content; while streaming, parsing stops there.
    """
    first = text.find(section)
    if first < 0:
        return no_calls(text, section, final)
    calls: list[ToolCallPart] = []
    i = text.find(begin, first)
    while i >= 0:
        close = text.find(end, i + len(begin))
        done = close >= 0 or final
        call = read(text[i + len(begin):close if close >= 0 else len(text)], done)
        if call is None and done and final:
            return ToolParse(text)  # not a well-formed call: all content, as vLLM
        if call is not None:
            calls.append(call)
        if call is None or close < 0:
            break
        i = text.find(begin, close + len(end))
    return ToolParse(text[:first], tuple(calls))


def scan_object(s: str, start: int = 0) -> tuple[dict[str, tuple[int, int, bool]], int | None]:
    """The top-level members of the JSON object at `s[start]` (after whitespace), read as
    far as `s` goes: key -> (value start, value end, value complete), and the index after
    the closing brace (None while the object is not closed, or when `s` is not JSON there).
    A value that does not parse yet runs to the end of `s`."""
    members: dict[str, tuple[int, int, bool]] = {}
    i = _skip_ws(s, start)
    if i >= len(s) or s[i] != "{":
        return members, None
    i = _skip_ws(s, i + 1)
    if i < len(s) and s[i] == "}":
        return members, i + 1
    while i < len(s):
        try:
            key, i = _DECODER.raw_decode(s, i)
        except json.JSONDecodeError:
            return members, None
        i = _skip_ws(s, i)
        if i >= len(s) or s[i] != ":" or not isinstance(key, str):
            return members, None
        i = _skip_ws(s, i + 1)
        if i >= len(s):
            return members, None
        try:
            _, end = _DECODER.raw_decode(s, i)
        except json.JSONDecodeError:
            members[key] = (i, len(s), False)
            return members, None
        members[key] = (i, end, True)
        i = _skip_ws(s, end)
        if i < len(s) and s[i] == "}":
            return members, i + 1
        if i >= len(s) or s[i] != ",":
            return members, None
        i = _skip_ws(s, i + 1)
    return members, None


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in " \t\r\n":
        i += 1
    return i


def json_call(s: str, start: int, args_keys: tuple[str, ...]) -> tuple[str | None, str, int | None]:
    """A `{"name": ..., "arguments": {...}}` call at `s[start]`: (its name once the name
    string is complete, else None; the raw text of its arguments so far, "{}" when a closed
    object has none; the index after the object, None while it is open). The arguments
    keep the model's own spacing, so a streamed prefix is always a prefix of the whole."""
    members, end = scan_object(s, start)
    name = None
    if "name" in members and members["name"][2]:
        value = json.loads(s[members["name"][0]:members["name"][1]])
        name = value if isinstance(value, str) else None
    key = next((k for k in args_keys if k in members), None)
    args = s[members[key][0]:members[key][1]] if key is not None else ("{}" if end is not None else "")
    return name, args, end
