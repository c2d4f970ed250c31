"""Reasoning parsers: split a model's output text into its reasoning (thinking) and the rest,
as vLLM's `--reasoning-parser` does (vllm/reasoning/). One parser object serves every
request; it holds no per-request state, so a streamed output is parsed by splitting each
longer prefix again (`split(text, final=False)`), and what it returns only ever grows.
"""

from __future__ import annotations

from dataclasses import dataclass


def partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`:
    text a streamed output must hold back, as it may become a marker (0 when none)."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


@dataclass(frozen=True)
class ReasoningSplit:
    """One split of an output text.

    Attributes:
        reasoning: the thinking text (markers removed); None when there is none.
        rest: the text after the reasoning, for the tool-call parser or the content.
    """

    reasoning: str | None
    rest: str


@dataclass(frozen=True)
class ThinkReasoningParser:
    """`<think>...</think>` reasoning (Qwen3, DeepSeek-R1, GLM-4.5).

    Attributes:
        name: the parser's vLLM name.
        implicit_start: True when the chat template opens the think block in the prompt
            (DeepSeek-R1, Qwen3 thinking templates), so the output is reasoning from its first
            token until `</think>` even without a `<think>`; False (GLM-4.5) when reasoning
            is only what follows a `<think>` the model writes.
        start, end: the markers.
    """

    name: str
    implicit_start: bool
    start: str = "<think>"
    end: str = "</think>"

    @property
    def gate_markers(self) -> tuple[str, str]:
        """(start, end): constraints apply once `end` follows the last `start` (see
        `structured_output.reasoning_gate`)."""
        return self.start, self.end

    def ended_in(self, prompt: str) -> bool:
        """Whether `prompt` (the rendered chat prompt) closed the reasoning already, as a
        template with thinking turned off does (`<think></think>`): then the whole output
        is content (vLLM's prompt_is_reasoning_end)."""
        return prompt.rfind(self.end) >= 0 and prompt.rfind(self.end) > prompt.rfind(self.start)

    def split(self, text: str, final: bool) -> ReasoningSplit:
        """Split `text`. While streaming (`final` False) a suffix that may still become a
        marker is held back. A think block cut short (no `</think>`, e.g. by max_tokens) is
        all reasoning.

        Unlike vLLM's GLM-4.5 parser, which returns an unclosed `<think>` block as content when
        the output is whole and as reasoning when it is streamed, both give reasoning here.
        """
        head = text.lstrip() if not self.implicit_start else text
        opened = head.startswith(self.start)
        if not opened and not final and self.start.startswith(head):
            return ReasoningSplit(None, "")  # may still become <think>
        if not opened and not self.implicit_start:
            return ReasoningSplit(None, text)
        body = head[len(self.start):] if opened else text
        reasoning, found, rest = body.partition(self.end)
        if not found and not final:
            reasoning = reasoning[:len(reasoning) - partial_suffix(reasoning, (self.end,))]
        return ReasoningSplit(reasoning or None, rest)

    def content(self, rest: str) -> str:
        """The message content of `rest` when no tool-call parser reads it: `rest` itself."""
        return rest
