"""POST /tokenize, POST /detokenize and GET /tokenizer_info (as vLLM's serving_tokenization.py):
the server's own tokenizer and chat template, for clients that count tokens or build
prompts from ids (lm-evaluation-harness's remote tokenizer reads all three)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moestream.server.async_engine import AsyncLLMEngine
from moestream.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ImageContentPart,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from moestream.server.serving import APIError, OpenAIServing, ServerConfig
from moestream.server.serving_chat import OpenAIServingChat

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


async def tokenizer_answer(serving: "OpenAIServingTokenization", kind: str, req: Any) -> dict[str, Any]:
    """The JSON body answering `kind` ("tokenize", "detokenize" or "tokenizer_info") of `req`.

    Raises:
        APIError: as the endpoint's method.
    """
    if kind == "tokenize":
        return (await serving.tokenize(req)).model_dump()
    if kind == "detokenize":
        return (await serving.detokenize(req)).model_dump()
    return serving.tokenizer_info()


class OpenAIServingTokenization(OpenAIServing):
    """The tokenizer endpoints. Encoding and decoding run on the engine's tokenizer thread
    (`AsyncLLMEngine.run_tokenizer`), never on the event loop; chat messages are rendered by
    the chat endpoint's template code (`OpenAIServingChat.render`)."""

    def __init__(self, engine: AsyncLLMEngine, config: ServerConfig, chat: OpenAIServingChat) -> None:
        super().__init__(engine, config)
        self.chat = chat

    async def tokenize(self, req: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        """The token ids of a prompt, or of chat messages after the chat template.

        Raises:
            APIError: 404 unknown model; 400 no chat template, a template error, or an image part.
        """
        self.check_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            for i, m in enumerate(req.messages):
                for j, part in enumerate(m.content if isinstance(m.content, list) else []):
                    if isinstance(part, ImageContentPart):
                        raise APIError(400, "/tokenize takes text messages only; an image's tokens depend on its "
                                            "pixels, so send it to /v1/chat/completions and read usage.prompt_tokens.",
                                       param=f"messages[{i}].content[{j}]")
            text, _ = self.chat.render(req)  # type: ignore[arg-type]  # the fields render reads are the same
        else:
            text = req.prompt

        def encode(tok: "PreTrainedTokenizerBase") -> tuple[list[int], list[str] | None]:
            ids = tok.encode(text, add_special_tokens=req.add_special_tokens)
            return ids, tok.convert_ids_to_tokens(ids) if req.return_token_strs else None

        ids, strs = await self.engine.run_tokenizer(encode)
        return TokenizeResponse(count=len(ids), max_model_len=self.engine.engine.max_model_len, tokens=ids,
                                token_strs=strs)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        """The text of token ids (special tokens kept, as vLLM).

        Raises:
            APIError: 404 unknown model; 400 a token id outside the vocabulary.
        """
        self.check_model(req.model)
        vocab = self.engine.engine.model_config.vocab_size
        bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"tokens[{bad}] = {req.tokens[bad]} is not a token id of this model; ids must be "
                                f"in [0, {vocab})", param="tokens")
        text = await self.engine.run_tokenizer(lambda tok: tok.decode(req.tokens))
        return DetokenizeResponse(prompt=text)

    def tokenizer_info(self) -> dict[str, Any]:
        """vLLM's /tokenizer_info: the tokenizer's class, special tokens, chat template (the
        server's --chat-template when set) and `model_max_length` (the server's max_model_len)."""
        tok = self.engine.tokenizer
        info: dict[str, Any] = {"tokenizer_class": type(tok).__name__}
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            value = getattr(tok, name, None)
            info[name] = None if value is None else str(value)
        info["chat_template"] = self.config.chat_template or getattr(tok, "chat_template", None)
        info["model_max_length"] = self.engine.engine.max_model_len
        info["vocab_size"] = self.engine.engine.model_config.vocab_size
        return info
