"""Kimi-K2's tool-call format (vLLM's `kimi_k2`):

    text<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

The call id is the model's own (`functions.get_weather:0`) and the name is the part between
the last "." and the ":"; the arguments are the text between the markers, stripped.
"""

from __future__ import annotations

import re

from moestream.reasoning.parser import partial_suffix
from moestream.server.tool_parsers.base import ToolCallPart, ToolParse, no_calls

SECTION_BEGIN = "<|tool_calls_section_begin|>"
CALL_BEGIN, ARG_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
_ID = re.compile(r"\s*([^<\s]+:\d+)\s*$")


class KimiK2ToolParser:
    """Parses Kimi-K2 tool calls (see the module docstring)."""

    needs_special_tokens = True

    def parse(self, text: str, final: bool) -> ToolParse:
        first = text.find(SECTION_BEGIN)
        if first < 0:
            return no_calls(text, SECTION_BEGIN, final)
        calls = []
        i = text.find(CALL_BEGIN, first)
        while i >= 0:
            close = text.find(CALL_END, i)
            block = text[i + len(CALL_BEGIN):close if close >= 0 else len(text)]
            head, found, args = block.partition(ARG_BEGIN)
            m = _ID.match(head) if found else None
            if close >= 0 or final:
                if m is None:
                    if final:
                        return ToolParse(text)
                    break
                calls.append(self._call(m.group(1), args.strip()))
            else:
                if m is not None:  # hold back what may be the end marker or trailing spaces
                    args = args.lstrip()
                    args = args[:len(args) - partial_suffix(args, (CALL_END,))].rstrip()
                    calls.append(self._call(m.group(1), args))
                break
            i = text.find(CALL_BEGIN, close)
        return ToolParse(text[:first], tuple(calls))

    @staticmethod
    def _call(call_id: str, args: str) -> ToolCallPart:
        return ToolCallPart(call_id.split(":")[0].split(".")[-1], args, id=call_id)
