"""`InputProcessor`: a prompt (text, token ids, or a dict of either) -> validated token ids,
rejecting over-long inputs before they are tokenized (as vLLM's InputPreprocessor /
v1 Processor). It reads only the tokenizer and fixed limits, so the server runs it off the
engine thread (on its own copy of the tokenizer): a huge prompt never stalls a step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from moestream.validation import is_int

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from moestream.engine.cartridge_cache import CartridgeCache, CartridgePrefix, CartridgeRoute
    from moestream.multimodal.inputs import MultiModalInputs
    from moestream.multimodal.processor import MultiModalProcessor

logger = logging.getLogger(__name__)

PromptType = str | Sequence[int] | dict


def max_token_chars(tokenizer: "PreTrainedTokenizerBase") -> int:
    """The most characters of text any one token of `tokenizer` stands for (an upper bound).

    A vocabulary entry is at least as long as the text it decodes to: byte-level BPE spells
    each byte as one character, SentencePiece spells text as is (and byte-fallback entries
    like `<0x41>` are longer than their byte). So a text of C characters is at least
    ceil(C / max_token_chars) tokens, which proves a prompt too long without tokenizing it.
    """
    return max((len(t) for t in tokenizer.get_vocab()), default=1) or 1


class InputProcessor:
    """Validates prompts and tokenizes text prompts.

    Args:
        tokenizer: encodes text prompts (its `encode`).
        vocab_size: token ids must be in [0, vocab_size).
        max_model_len: a prompt must leave room for one output token (tokens); prompt and
            output together stop there (`check_max_tokens`).
        mm_processor: a multimodal checkpoint's image processor (None: prompts with
            `multi_modal_data` are refused).
        cartridges: the engine's cartridge cache (None: prompts with `cartridges` are refused).
    """

    def __init__(self, tokenizer: "PreTrainedTokenizerBase", vocab_size: int, max_model_len: int,
                 mm_processor: "MultiModalProcessor | None" = None, cartridges: "CartridgeCache | None" = None) -> None:
        self.tokenizer = tokenizer
        self.cartridges = cartridges
        self.mm_processor = mm_processor
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_token_chars = max_token_chars(tokenizer)
        self._warned_max_tokens = False  # check_max_tokens(strict=False) warns once per processor

    def _check_length(self, num_tokens: int, what: str) -> None:
        if num_tokens >= self.max_model_len:
            raise ValueError(  # vLLM's wording, then what is allowed here
                f"The decoder prompt ({what}) is longer than the maximum model length of {self.max_model_len} less "
                f"one token for output: max_model_len is {self.max_model_len}, so the prompt may be at most "
                f"{self.max_model_len - 1} tokens. Shorten the prompt or raise max_model_len."
            )

    def check_max_tokens(self, num_prompt_tokens: int, max_tokens: int | None, *, strict: bool) -> int:
        """The most output tokens a request of `num_prompt_tokens` prompt tokens produces when it
        asks for `max_tokens` (None: unset): max_tokens, or `max_model_len - num_prompt_tokens`
        when that is fewer (the output stops at max_model_len, finish_reason "length").

        Asking for more than fits is, with `strict` (the server, as vLLM's), an error in
        vLLM's wording; without (the offline `LLM`, as vLLM's), the output is cut at
        max_model_len and the first such request of this processor logs a warning. An unset
        max_tokens is never an error: the output runs until max_model_len.

        Raises:
            ValueError: `strict` and `max_tokens` is more than max_model_len leaves after the prompt.
        """
        room = self.max_model_len - num_prompt_tokens
        if max_tokens is None or max_tokens <= room:
            return room if max_tokens is None else max_tokens
        if strict:
            raise ValueError(
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum context "
                f"length is {self.max_model_len} tokens and your request has {num_prompt_tokens} input tokens "
                f"({max_tokens} > {self.max_model_len} - {num_prompt_tokens}). Ask for at most {room} output tokens "
                "or shorten the prompt."
            )
        if not self._warned_max_tokens:
            self._warned_max_tokens = True
            logger.warning(
                "max_tokens=%d is more than max_model_len=%d leaves after a prompt of %d tokens: the output is cut at "
                "%d tokens (finish_reason 'length'). Requests like it are cut the same way without another warning; "
                "raise max_model_len or lower max_tokens", max_tokens, self.max_model_len, num_prompt_tokens, room)
        return room

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; a text too long to fit is refused before it is tokenized.

        Raises:
            ValueError: `text` has so many characters that it must be at least max_model_len
                tokens (see `max_token_chars`).
        """
        at_least = math.ceil(len(text) / self.max_token_chars)
        if at_least >= self.max_model_len:
            self._check_length(at_least, f"{len(text)} characters, so at least {at_least} tokens (no token of this "
                                         f"tokenizer is longer than {self.max_token_chars} characters),")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def process(self, prompt: PromptType, add_special_tokens: bool = True
                ) -> tuple[str | None, list[int], "MultiModalInputs | None", "CartridgePrefix | None",
                           "CartridgeRoute | None"]:
        """(prompt text or None, token ids, multimodal inputs or None, cartridges attached or None,
        the cartridges' routing decision or None) of a prompt: a str is
        tokenized (with special tokens unless `add_special_tokens=False`, as for chat
        prompts whose template writes them); {"prompt_token_ids": [...]} or a list of ints
        is taken as is; {"prompt": str} is tokenized. A dict may carry vLLM's
        `multi_modal_data` ({"image": PIL image or list, "video": frames or list}): each
        placeholder is expanded to the item's tokens (`MultiModalProcessor.process`). Length is checked
        before anything else, so an over-long input costs no tokenization and no scan of
        its ids; a multimodal prompt is checked again once expanded. A dict's `cartridges`
        (a list of cartridge ids, paths or {"id", "source", "path"}) are composed
        (`CartridgeCache.compose`), and their positions count toward max_model_len; its
        `cartridge_routing` ("always" or "auto", default the engine's) says whether the
        router decides to attach them (`CartridgeCache.route`).

        Raises:
            ValueError: an empty prompt, a token id outside the vocabulary, a prompt that
                leaves no room for output under max_model_len, an unknown prompt type, or
                images that are refused (see `MultiModalProcessor.process`; also when the
                model takes no images), or cartridges that are refused (`CartridgeError`).
        """
        encode = False
        if isinstance(prompt, str):
            text, ids, encode = prompt, None, True
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
        elif isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            text, ids, encode = prompt["prompt"], None, True
        elif isinstance(prompt, (list, tuple)):
            text, ids = None, prompt
        else:
            raise ValueError(
                "a prompt must be a str, a list of token ids, or a dict with 'prompt' (str) or "
                f"'prompt_token_ids' (list of ints); got {type(prompt).__name__}"
            )
        if text is not None and not isinstance(text, str):
            raise ValueError(f"'prompt' must be a str, got {type(text).__name__}")
        if encode:
            ids = self.encode(text, add_special_tokens)
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"prompt_token_ids must be a list of ints, got {type(ids).__name__}")
        if not ids:
            raise ValueError("the prompt is empty; give at least one token")
        self._check_length(len(ids), f"{len(ids)} tokens")
        vocab = self.vocab_size
        bad = [t for t in ids if not is_int(t) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be ints in [0, {vocab}); got {bad[:5]}")
        ids = [int(t) for t in ids]
        mm = None
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            if self.mm_processor is None:
                raise ValueError("this model takes no images (its checkpoint has no vision tower); send text only")
            ids, mm = self.mm_processor.process(ids, prompt["multi_modal_data"], self.tokenizer)
            if mm is not None:
                self._check_length(len(ids), f"{len(ids)} tokens with its images")
        cartridge, route = None, None
        if isinstance(prompt, dict) and prompt.get("cartridges") is not None:
            if mm is not None:
                raise ValueError("cartridges with images are not supported yet; send text with cartridges")
            if self.cartridges is None:
                raise ValueError("this engine serves no cartridges")
            cartridge = self.cartridges.compose(prompt["cartridges"])
            route = self.cartridges.route(cartridge, ids, prompt.get("cartridge_routing"))
            cartridge = cartridge if route.attached else None
            if cartridge is not None:
                self._check_length(cartridge.num_tokens + len(ids),
                                   f"{len(ids)} tokens after {cartridge.num_tokens} cartridge positions")
        return text, ids, mm, cartridge, route
