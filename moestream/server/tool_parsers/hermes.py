"""The hermes tool-call format (vLLM's `hermes`; Qwen2.5, Qwen3, Qwen3-MoE, Hermes models):

    Some text<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The content is the text before the first `<tool_call>`. A call's arguments are the raw JSON
text of its `arguments` value (vLLM re-serializes it with json.dumps; the two differ only in
spacing).
"""

from __future__ import annotations

from moestream.server.tool_parsers.base import ToolCallPart, ToolParse, no_calls, json_call

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser:
    """Parses `<tool_call>{json}</tool_call>` blocks (see the module docstring)."""

    needs_special_tokens = True

    def parse(self, text: str, final: bool) -> ToolParse:
        first = text.find(START)
        if first < 0:
            return no_calls(text, START, final)
        calls = []
        i = first
        while i >= 0:
            body_start = i + len(START)
            close = text.find(END, body_start)
            name, args, end = json_call(text, body_start, ("arguments", "parameters"))
            if close >= 0 or final:
                if name is None or end is None or text[end:close if close >= 0 else len(text)].strip():
                    if final:
                        return ToolParse(text)  # not a well-formed call: all content, as vLLM
                    break
                calls.append(ToolCallPart(name, args))
            elif name is not None:
                calls.append(ToolCallPart(name, args))
                break
            else:
                break
            i = text.find(START, close + len(END)) if close >= 0 else -1
        return ToolParse(text[:first], tuple(calls))
