"""OpenAI's harmony response format (gpt-oss): the output is a sequence of messages,

    <|channel|>analysis<|message|>thinking...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}
    <|start|>assistant<|channel|>final<|message|>The answer.

each a header (`<|start|>` role, `<|channel|>` name, an optional `to=` recipient and
`<|constrain|>` type) and a body ended by `<|end|>`, `<|call|>` or `<|return|>` (the last two
stop generation, so their text is not in the output). Source: the harmony format guide
(openai/harmony, docs/format.md) and vLLM's gpt-oss reasoning and tool parsers.

`parse_harmony` reads the messages of an output text, or of a prefix of it while streaming;
`HarmonyReasoningParser` (vLLM's `openai_gptoss`) puts the analysis channel into reasoning.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from moestream.reasoning.parser import ReasoningSplit, partial_suffix

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN) + ENDS
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")


@dataclass(frozen=True)
class HarmonyMessage:
    """One message of a harmony output.

    Attributes:
        channel: analysis, commentary or final (None if the header names none).
        recipient: the `to=` target, e.g. "functions.get_weather", or None.
        body: the message text (while streaming, its text so far less a possible marker).
        complete: the body's end marker was read (or the output is final).
        raw: the message's text as it appears in the output, header included.
    """

    channel: str | None
    recipient: str | None
    body: str
    complete: bool
    raw: str


def parse_harmony(text: str, final: bool) -> list[HarmonyMessage]:
    """The messages of `text`, in order. A message whose header is not complete yet is
    left out while streaming. Text that does not start like a harmony message (a model that
    writes plain text) is one final-channel message.

    Args:
        text: the output text, decoded with special tokens kept.
        final: the output is whole (nothing is held back; an unfinished body is complete).
    """
    if not text.startswith("<|"):
        if not final and "<|".startswith(text):
            return []
        body = text if final else text[:len(text) - partial_suffix(text, MARKERS)]
        return [HarmonyMessage("final", None, body, final, text)]
    out: list[HarmonyMessage] = []
    i = 0
    while i < len(text):
        m = text.find(MESSAGE, i)
        if m < 0:
            if final and text[i:].strip():  # a header and no body: an empty message
                out.append(_message(text[i:], "", True, text[i:]))
            break
        header = text[i:m]
        j = m + len(MESSAGE)
        ends = [(k, e) for e in ENDS + (START,) if (k := text.find(e, j)) >= 0]
        if ends:
            k, e = min(ends)
            stop = k if e == START else k + len(e)
            out.append(_message(header, text[j:k], True, text[i:stop]))
            i = stop
        else:
            body = text[j:] if final else text[j:len(text) - partial_suffix(text[j:], MARKERS)]
            out.append(_message(header, body, final, text[i:]))
            break
    return out


def _message(header: str, body: str, complete: bool, raw: str) -> HarmonyMessage:
    channel = _CHANNEL.search(header)
    recipient = _RECIPIENT.search(header)
    return HarmonyMessage(channel.group(1) if channel else None, recipient.group(1) if recipient else None, body,
                          complete, raw)


@dataclass(frozen=True)
class HarmonyReasoningParser:
    """gpt-oss reasoning (vLLM's `openai_gptoss`): the analysis channel's bodies are the
    reasoning; the other messages stay, in harmony form, for the tool-call parser, and the
    final channel is the content."""

    name: str = "openai_gptoss"

    @property
    def gate_markers(self) -> tuple[str, str]:
        """(start, end): constraints apply once a final-channel body has begun after the
        prompt's last `<|start|>assistant`."""
        return "<|start|>assistant", "<|channel|>final<|message|>"

    def ended_in(self, prompt: str) -> bool:
        """Whether `prompt` opened a final-channel message for the output to continue."""
        start, end = self.gate_markers
        return prompt.rfind(end) >= 0 and prompt.rfind(end) > prompt.rfind(start)

    def split(self, text: str, final: bool) -> ReasoningSplit:
        """Split `text` (see `ThinkReasoningParser.split`)."""
        messages = parse_harmony(text, final)
        analysis = [m.body for m in messages if m.channel == "analysis"]
        rest = "".join(m.raw for m in messages if m.channel != "analysis" and (m.complete or final))
        # a streamed, unfinished non-analysis message is passed on as far as it is safe
        last = messages[-1] if messages else None
        if last is not None and last.channel != "analysis" and not (last.complete or final):
            rest += last.raw[:len(last.raw) - partial_suffix(last.raw, MARKERS)]
        return ReasoningSplit("".join(analysis) or None, rest)

    def content(self, rest: str) -> str:
        """The content of `rest` when no tool-call parser reads it: the final channel's
        bodies (commentary to a tool is dropped)."""
        return final_text(parse_harmony(rest, True))


def final_text(messages: list[HarmonyMessage]) -> str:
    """The content of harmony messages: the bodies of the final channel, and of commentary
    that is addressed to no tool (a preamble), in order."""
    return "".join(m.body for m in messages
                   if m.channel == "final" or (m.channel == "commentary" and m.recipient is None))
