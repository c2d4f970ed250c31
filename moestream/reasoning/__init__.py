"""Reasoning parsers by vLLM name (`--reasoning-parser`): qwen3, deepseek_r1, glm45 and
openai_gptoss (also accepted as gpt_oss / gpt-oss)."""

from __future__ import annotations

from moestream.reasoning.harmony import HarmonyReasoningParser
from moestream.reasoning.parser import ReasoningSplit, ThinkReasoningParser

ReasoningParser = ThinkReasoningParser | HarmonyReasoningParser

REASONING_PARSERS: dict[str, ReasoningParser] = {
    "qwen3": ThinkReasoningParser("qwen3", implicit_start=True),
    "deepseek_r1": ThinkReasoningParser("deepseek_r1", implicit_start=True),
    "glm45": ThinkReasoningParser("glm45", implicit_start=False),
    "openai_gptoss": HarmonyReasoningParser(),
}
ALIASES = {"gpt_oss": "openai_gptoss", "gpt-oss": "openai_gptoss"}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser named `name` (a vLLM name or an alias).

    Raises:
        ValueError: an unknown name, listing the known ones.
    """
    parser = REASONING_PARSERS.get(ALIASES.get(name, name))
    if parser is None:
        raise ValueError(f"reasoning_parser '{name}' is unknown; choose one of {', '.join(REASONING_PARSERS)}")
    return parser


__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningSplit", "get_reasoning_parser"]
