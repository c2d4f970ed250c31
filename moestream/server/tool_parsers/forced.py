"""Tool calls under `tool_choice` "required" or a named function, where the output is
constrained to JSON (as vLLM does) and read back without a model-specific parser:

- a named function: the output is its arguments object;
- "required": the output is an array of `{"name": ..., "parameters": {...}}` objects, one
  per call, each name one of the request's tools (`required_schema`).
"""

from __future__ import annotations

from typing import Any

from moestream.server.tool_parsers.base import ToolCallPart, ToolParse, _skip_ws, json_call


def required_schema(tools: list[dict[str, Any]], parallel: bool = True) -> dict[str, Any]:
    """The JSON schema of "required": a non-empty array of calls of the given tools
    (`tools` as the request's dicts: {"type": "function", "function": {"name", "parameters"}}),
    as vLLM's, except that a call object has no members but `name` and `parameters`.
    `parallel` False (`parallel_tool_calls: false`) allows one call only."""
    variants = [{"type": "object",
                 "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                "parameters": t["function"].get("parameters") or {"type": "object"}},
                 "required": ["name", "parameters"], "additionalProperties": False}
                for t in tools]
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": variants}}
    return schema if parallel else {**schema, "maxItems": 1}


class NamedFunctionParser:
    """The whole output is the arguments of the named function."""

    needs_special_tokens = False

    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, text: str, final: bool) -> ToolParse:
        args = text.strip()
        if final and not args:  # nothing written (e.g. the model was still thinking)
            return ToolParse("")
        return ToolParse("", (ToolCallPart(self.name, args),))


class RequiredParser:
    """The output is a JSON array of `{"name", "parameters"}` calls."""

    needs_special_tokens = False

    def parse(self, text: str, final: bool) -> ToolParse:
        i = _skip_ws(text, 0)
        if i >= len(text) or text[i] != "[":
            return ToolParse(text if final else "")
        calls = []
        i += 1
        while True:
            name, args, end = json_call(text, i, ("parameters", "arguments"))
            if name is not None and (end is not None or not final):  # a whole output keeps finished calls only
                calls.append(ToolCallPart(name, args))
            if end is None:
                break
            i = _skip_ws(text, end)
            if i < len(text) and text[i] == ",":
                i += 1
            else:
                break
        if final and not calls:
            return ToolParse(text)
        return ToolParse("", tuple(calls))
