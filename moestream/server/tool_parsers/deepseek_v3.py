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
from moestream.server.tool_parsers.base import ToolCallPart, ToolParse, parse_blocks

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALL_BEGIN, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
FENCE_OPEN, FENCE_CLOSE = "\n```json\n", "\n```"


class DeepSeekV3ToolParser:
    """Parses DeepSeek-V3 tool calls (see the module docstring)."""

    needs_special_tokens = True

    def parse(self, text: str, final: bool) -> ToolParse:
        return parse_blocks(text, CALLS_BEGIN, CALL_BEGIN, CALL_END, final, self._read)

    @staticmethod
    def _read(block: str, done: bool) -> ToolCallPart | None:
        sep = block.find(SEP)
        fence = block.find(FENCE_OPEN, sep + 1) if sep >= 0 else -1
        if fence < 0 or (done and not block.endswith(FENCE_CLOSE)):
            return None
        name, args = block[sep + len(SEP):fence], block[fence + len(FENCE_OPEN):]
        if done:
            return ToolCallPart(name, args[:-len(FENCE_CLOSE)])
        return ToolCallPart(name, args[:len(args) - partial_suffix(args, (FENCE_CLOSE + CALL_END,))])
