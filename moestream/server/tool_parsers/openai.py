"""gpt-oss tool calls in harmony form (vLLM's `openai`): a commentary message addressed to
`functions.NAME` is a call of NAME whose body is the arguments; the content is the final
channel (see `moestream.reasoning.harmony`). Analysis messages are never content."""

from __future__ import annotations

from moestream.reasoning.harmony import final_text, parse_harmony
from moestream.server.tool_parsers.base import ToolCallPart, ToolParse

PREFIX = "functions."


class OpenAIToolParser:
    """Parses gpt-oss (harmony) tool calls."""

    needs_special_tokens = True

    def parse(self, text: str, final: bool) -> ToolParse:
        messages = parse_harmony(text, final)
        calls = tuple(ToolCallPart(m.recipient[len(PREFIX):], m.body.strip())
                      for m in messages if m.recipient is not None and m.recipient.startswith(PREFIX))
        return ToolParse(final_text(messages), calls)
