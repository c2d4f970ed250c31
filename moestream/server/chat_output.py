"""One chat choice's output text -> the assistant message: reasoning (`reasoning_content`),
content and tool calls, whole or as stream deltas (as vLLM's serving_chat.py with a
reasoning parser and a tool parser).

The reasoning parser runs first; the tool parser reads what follows the reasoning. While
streaming, each step parses the whole text so far and sends what grew since the last step:
the reasoning, the content, a new call (its id, type and name), a call's arguments. Parsers
only ever extend what they returned before, so the deltas add up to the whole message,
with one exception: a whole output whose tool-call syntax turns out malformed (or is cut by
max_tokens) is content in a whole response, while a stream has sent part of it as a call
already; that call is not taken back, and its text is not sent again as content.
"""

from __future__ import annotations

from dataclasses import dataclass

from moestream.reasoning import ReasoningParser
from moestream.server.protocol import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall, random_id
from moestream.server.tool_parsers import ToolCallPart, ToolParser


def tool_call_id() -> str:
    """A new tool call id, as vLLM's: `chatcmpl-tool-` + 32 hex digits."""
    return random_id("chatcmpl-tool")


@dataclass(frozen=True)
class ParsedMessage:
    """An assistant message parsed from the output text (None: absent)."""

    reasoning: str | None
    content: str | None
    tool_calls: tuple[ToolCallPart, ...]


@dataclass
class StreamDelta:
    """What one step adds: reasoning text, content text, tool-call deltas."""

    reasoning: str
    content: str
    tool_calls: list[DeltaToolCall]


class ChatOutputParser:
    """Parses one choice's output.

    Args:
        reasoning: the server's reasoning parser, or None.
        tools: the request's tool-call parser (None: no tools, or tool_choice none).
        max_calls: keep only the first `max_calls` calls (1 for `parallel_tool_calls: false`,
            as vLLM); None: all.

    Attributes:
        num_calls: the calls of the last parse (after a final one: of the whole output).
    """

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None, max_calls: int | None = None) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.max_calls = max_calls
        self.num_calls = 0
        self._sent_reasoning = 0
        self._sent_content = 0
        self._sent_args: list[int] = []  # per call sent so far: characters of its arguments

    def parse(self, text: str, final: bool = True) -> ParsedMessage:
        """The message of `text`; `final`: the output is whole."""
        reasoning, rest = None, text
        if self.reasoning is not None:
            split = self.reasoning.split(text, final)
            reasoning, rest = split.reasoning, split.rest
        if self.tools is not None:
            parsed = self.tools.parse(rest, final)
            content, calls = parsed.content, parsed.tool_calls[:self.max_calls]
        else:
            content = self.reasoning.content(rest) if self.reasoning is not None else rest
            calls = ()
        return ParsedMessage(reasoning, content or None, calls)

    def whole(self, text: str) -> tuple[ParsedMessage, list[ToolCall]]:
        """The message of a finished output, with its calls as OpenAI tool calls."""
        m = self.parse(text, True)
        calls = [ToolCall(id=c.id or tool_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
                 for c in m.tool_calls]
        return m, calls

    def delta(self, text: str, final: bool) -> StreamDelta:
        """What `text` (the output so far) adds to what was sent before."""
        m = self.parse(text, final)
        self.num_calls = len(m.tool_calls)
        if final and self._sent_args and not m.tool_calls:
            # the whole output's calls do not parse (malformed, or cut by max_tokens): what was
            # streamed as a call stays one; its text is not sent again as content
            return StreamDelta((m.reasoning or "")[self._sent_reasoning:], "", [])
        reasoning = (m.reasoning or "")[self._sent_reasoning:]
        content = (m.content or "")[self._sent_content:]
        self._sent_reasoning += len(reasoning)
        self._sent_content += len(content)
        deltas = []
        for i, call in enumerate(m.tool_calls):
            if i == len(self._sent_args):
                self._sent_args.append(0)
                deltas.append(DeltaToolCall(index=i, id=call.id or tool_call_id(), type="function",
                                            function=DeltaFunctionCall(name=call.name, arguments="")))
            args = call.arguments[self._sent_args[i]:]
            if args:
                self._sent_args[i] += len(args)
                deltas.append(DeltaToolCall(index=i, function=DeltaFunctionCall(arguments=args)))
        return StreamDelta(reasoning, content, _merge(deltas))


def _merge(deltas: list[DeltaToolCall]) -> list[DeltaToolCall]:
    """Join consecutive deltas of one call (a new call's header and its first arguments)."""
    out: list[DeltaToolCall] = []
    for d in deltas:
        if out and out[-1].index == d.index and d.id is None:
            prev = out[-1]
            out[-1] = prev.model_copy(update={"function": DeltaFunctionCall(
                name=prev.function.name, arguments=(prev.function.arguments or "") + (d.function.arguments or ""))})
        else:
            out.append(d)
    return out
