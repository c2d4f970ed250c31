"""Tool-call parsers by vLLM name (`--tool-call-parser`): hermes (Qwen2.5/Qwen3 and their
MoE models), deepseek_v3, glm45, kimi_k2 and openai (gpt-oss, harmony)."""

from __future__ import annotations

from typing import Any

from moestream.server.tool_parsers.base import ToolCallPart, ToolParse, ToolParser
from moestream.server.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from moestream.server.tool_parsers.forced import NamedFunctionParser, RequiredParser, required_schema
from moestream.server.tool_parsers.glm45 import Glm45ToolParser
from moestream.server.tool_parsers.hermes import HermesToolParser
from moestream.server.tool_parsers.kimi_k2 import KimiK2ToolParser
from moestream.server.tool_parsers.openai import OpenAIToolParser

TOOL_PARSERS = {
    "hermes": lambda tools: HermesToolParser(),
    "deepseek_v3": lambda tools: DeepSeekV3ToolParser(),
    "glm45": Glm45ToolParser,
    "kimi_k2": lambda tools: KimiK2ToolParser(),
    "openai": lambda tools: OpenAIToolParser(),
}


def check_tool_parser(name: str) -> str:
    """`name` when it is a known parser.

    Raises:
        ValueError: an unknown name, listing the known ones.
    """
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool call parser '{name}' is unknown; choose one of {', '.join(TOOL_PARSERS)}")
    return name


def make_tool_parser(name: str, tools: list[dict[str, Any]] | None) -> ToolParser:
    """A parser for one request's output (`tools`: the request's tools as dicts)."""
    return TOOL_PARSERS[check_tool_parser(name)](tools)


__all__ = ["TOOL_PARSERS", "NamedFunctionParser", "RequiredParser", "ToolCallPart", "ToolParse", "ToolParser",
           "check_tool_parser", "make_tool_parser", "required_schema"]
