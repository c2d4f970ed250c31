"""DeepSeek-V3's tool-call format (vLLM's `deepseek_v3`; DeepSeek-V3, V3-0324, R1-0528):

    text<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

The content is the text before `<｜tool▁calls▁begin｜>`; a call's arguments are the text
between its "```json" line and the closing fence, as the model wrote it.
"""

from __future__ import annotations

from moestream.reasoning.parser import partial_suffix
from moestream.server.tool_parsers.base import ToolCallPart, ToolParse, no_calls

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALL_BEGIN, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
FENCE_OPEN, FENCE_CLOSE = "\n```json\n", "\n```"


class DeepSeekV3ToolParser:
    """Parses DeepSeek-V3 tool calls (see the module docstring)."""

    needs_special_tokens = True

    def parse(self, text: str, final: bool) -> ToolParse:
        first = text.find(CALLS_BEGIN)
        if first < 0:
            return no_calls(text, CALLS_BEGIN, final)
        calls = []
        i = text.find(CALL_BEGIN, first)
        while i >= 0:
            close = text.find(CALL_END, i)
            block = text[i + len(CALL_BEGIN):close if close >= 0 else len(text)]
            sep = block.find(SEP)
            fence = block.find(FENCE_OPEN, sep + 1) if sep >= 0 else -1
            if close >= 0 or final:
                if sep < 0 or fence < 0 or not block.endswith(FENCE_CLOSE):
                    if final:
                        return ToolParse(text)
                    break
                calls.append(ToolCallPart(block[sep + len(SEP):fence], block[fence + len(FENCE_OPEN):-len(FENCE_CLOSE)]))
            else:
                if fence >= 0:
                    args = block[fence + len(FENCE_OPEN):]
                    calls.append(ToolCallPart(block[sep + len(SEP):fence],
                                              args[:len(args) - partial_suffix(args, (FENCE_CLOSE + CALL_END,))]))
                break
            i = text.find(CALL_BEGIN, close)
        return ToolParse(text[:first], tuple(calls))
