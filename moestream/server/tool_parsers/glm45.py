"""GLM-4.5's tool-call format (vLLM's `glm45`; GLM-4.5, GLM-4.5-Air, GLM-4.6):

    text<tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

Each value is kept as a string when the function's schema says the parameter is a string,
else read as JSON (falling back to the string), and the arguments are those pairs as a JSON
object. A call's arguments are sent whole once its block closes, as vLLM streams them.
"""

from __future__ import annotations

import json
import re
from typing import Any

from moestream.server.tool_parsers.base import ToolCallPart, ToolParse, parse_blocks

START, END = "<tool_call>", "</tool_call>"
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


class Glm45ToolParser:
    """Parses GLM-4.5 tool calls (see the module docstring).

    Args:
        tools: the request's `tools` as dicts ({"type": "function", "function": {...}}),
            whose parameter schemas say which values are strings.
    """

    needs_special_tokens = True

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self._string_params = {
            t["function"]["name"]: {k for k, v in ((t["function"].get("parameters") or {}).get("properties") or {}).items()
                                    if isinstance(v, dict) and v.get("type") == "string"}
            for t in tools or () if isinstance(t.get("function"), dict) and "name" in t["function"]}

    def parse(self, text: str, final: bool) -> ToolParse:
        return parse_blocks(text, START, START, END, final, self._read)

    def _read(self, block: str, done: bool) -> ToolCallPart | None:
        name, newline, rest = block.partition("\n")
        name = name.strip()
        if not name or "<" in name or not (newline or done):
            return None
        return ToolCallPart(name, self._arguments(name, rest) if done else "")

    def _arguments(self, name: str, body: str) -> str:
        strings = self._string_params.get(name, set())
        args: dict[str, Any] = {}
        for key, value in _PAIR.findall(body):
            key, value = key.strip(), value.strip()
            if key in strings:
                args[key] = value
                continue
            try:
                args[key] = json.loads(value)
            except json.JSONDecodeError:
                args[key] = value
        return json.dumps(args, ensure_ascii=False)
