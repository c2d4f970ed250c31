"""Incremental detokenization and stop-string matching.

Follows vLLM's prefix_offset/read_offset method (vllm/transformers_utils/detokenizer_utils.py,
detokenize_incrementally) and stop-string check (vllm/v1/engine/detokenizer.py, check_stop_strings).
"""

from typing import Any

# Prompt tokens kept as decoding context, as vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns output token ids, fed one at a time, into text deltas.

    Keeps the token strings of the output and two offsets into them: text of
    tokens[prefix_offset:read_offset] has already been emitted, and the delta of a step is what
    decoding tokens[prefix_offset:] adds beyond it. Decoding a short window with some context
    rather than single tokens keeps SentencePiece leading spaces ("▁") and byte-level BPE
    merges right; while the window's text ends with "\\ufffd" (an incomplete UTF-8 character)
    nothing is emitted and the window grows. The last few prompt tokens seed the context, so
    the output text is the continuation of the prompt: with an empty prompt it equals
    `tokenizer.decode(output_ids, skip_special_tokens=...)`. Bytes of a character left
    incomplete at the end of the output are never emitted.

    tokenizer: a Hugging Face tokenizer (convert_ids_to_tokens / convert_tokens_to_string).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Two extra ids, as vLLM, in case the last prompt tokens are special and get skipped.
        context = prompt_token_ids[-(PROMPT_CONTEXT_TOKENS + 2):]
        self.tokens: list[str] = self._to_tokens(context)
        self.read_offset = len(self.tokens)
        self.prefix_offset = max(self.read_offset - PROMPT_CONTEXT_TOKENS, 0)
        # Unlike vLLM, drop context tokens until the context decodes cleanly: a window that starts
        # inside a multi-byte character (e.g. SentencePiece <0x..> byte tokens) decodes to "\ufffd"s
        # that would otherwise leak into, or forever stall, the output.
        while (self.prefix_offset < self.read_offset and "\ufffd" in tokenizer.convert_tokens_to_string(
                self.tokens[self.prefix_offset:self.read_offset])):
            self.prefix_offset += 1
        self.output_token_ids: list[int] = []
        self._deltas: list[str] = []

    def _to_tokens(self, ids: list[int]) -> list[str]:
        tokens = self.tokenizer.convert_ids_to_tokens(ids, skip_special_tokens=self.skip_special_tokens)
        return [tokens] if isinstance(tokens, str) else list(tokens)

    def add_token(self, token_id: int) -> str:
        """Append one output token and return the text it completes ("" while a character is pending)."""
        self.output_token_ids.append(token_id)
        self.tokens += self._to_tokens([token_id])
        prefix_text = self.tokenizer.convert_tokens_to_string(self.tokens[self.prefix_offset:self.read_offset])
        new_text = self.tokenizer.convert_tokens_to_string(self.tokens[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        self._deltas.append(delta)
        return delta

    @property
    def output_text(self) -> str:
        """All output text emitted so far (the concatenation of the deltas)."""
        return "".join(self._deltas)


def find_stop_string(text: str, new_text_len: int, stops: list[str],
                     include_stop_str_in_output: bool) -> tuple[str, int] | None:
    """Find a stop string completed by the last `new_text_len` characters of `text`.

    Only a match ending inside the new text counts (earlier ones were checked on earlier
    deltas), so each stop `s` is searched in the last new_text_len + len(s) - 1 characters.
    Returns (stop string, index) where text[:index] is the text to keep: up to the start of
    the stop string, or its end if include_stop_str_in_output; None if no stop matched.
    When several match, the one starting earliest in `text` wins, then the first in `stops`
    (vLLM returns the first in `stops` order). Follows vLLM check_stop_strings.
    """
    if new_text_len <= 0:
        return None
    best: tuple[int, str] | None = None
    for stop in stops:
        start = max(len(text) - new_text_len - len(stop) + 1, 0)
        idx = text.find(stop, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    if best is None:
        return None
    idx, stop = best
    return stop, idx + len(stop) if include_stop_str_in_output else idx
