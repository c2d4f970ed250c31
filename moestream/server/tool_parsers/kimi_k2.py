"""Kimi-K2's tool-call format (vLLM's `kimi_k2`):

    text<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

The call id is the model's own (`functions.get_weather:0`) and the name is the part between
the last "." and the ":"; the arguments are the text between the markers, stripped.
"""

from __future__ import annotations

import re

from moestream.reasoning.parser import partial_suffix
from moestream.server.tool_parsers.base import ToolCallPart, ToolParse, parse_blocks

SECTION_BEGIN = "<|tool_calls_section_begin|>"
CALL_BEGIN, ARG_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
_ID = re.compile(r"\s*([^<\s]+:\d+)\s*$")


class KimiK2ToolParser:
    """Parses Kimi-K2 tool calls (see the module docstring)."""

    needs_special_tokens = True

    def parse(self, text: str, final: bool) -> ToolParse:
        return parse_blocks(text, SECTION_BEGIN, CALL_BEGIN, CALL_END, final, self._read)

    @staticmethod
    def _read(block: str, done: bool) -> ToolCallPart | None:
        head, found, args = block.partition(ARG_BEGIN)
        m = _ID.match(head) if found else None
        if m is None:
            return None
        args = args.strip() if done else args.lstrip()
        if not done:  # hold back what may be the end marker, and trailing spaces (stripped at the end)
            args = args[:len(args) - partial_suffix(args, (CALL_END,))].rstrip()
        call_id = m.group(1)
        return ToolCallPart(call_id.split(":")[0].split(".")[-1], args, id=call_id)
