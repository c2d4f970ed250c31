"""The hermes tool-call format (vLLM's `hermes`; Qwen2.5, Qwen3, Qwen3-MoE, Hermes models):

    Some text<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The content is the text before the first `<tool_call>`. A call's arguments are the raw JSON
text of its `arguments` value (vLLM re-serializes it with json.dumps; the two differ only in
spacing).
"""

from __future__ import annotations

from moestream.reasoning.parser import partial_suffix
from moestream.server.tool_parsers.base import ToolCallPart, ToolParse, json_call, parse_blocks

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser:
    """Parses `<tool_call>{json}</tool_call>` blocks (see the module docstring)."""

    needs_special_tokens = True

    def parse(self, text: str, final: bool) -> ToolParse:
        return parse_blocks(text, START, START, END, final, self._read)

    @staticmethod
    def _read(block: str, done: bool) -> ToolCallPart | None:
        name, args, end = json_call(block, 0, ("arguments", "parameters"))
        if done and (end is None or block[end:].strip()):
            return None
        if end is None:  # unfinished: text that may be the start of </tool_call> is held back
            args = args[:len(args) - partial_suffix(args, (END,))]
        return ToolCallPart(name, args) if name is not None else None
