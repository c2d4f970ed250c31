"""Pydantic models of the OpenAI-compatible API (as vLLM's entrypoints/openai/protocol.py).

Requests are validated strictly (no string-to-number coercion) and ignore unknown fields,
as vLLM does. Besides OpenAI's fields they take vLLM's extra sampling fields: `top_k`,
`min_p`, `repetition_penalty`, `ignore_eos`, `stop_token_ids`,
`include_stop_str_in_output`, `skip_special_tokens`, `prompt_logprobs`; moestream's
`expert_mode` (docs/expert_modes.md); and vLLM's `/tokenize` and `/detokenize` bodies.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from moestream.structured_output.params import StructuredOutputsParams

MAX_N = 128  # the most choices one request may ask for
MAX_TOP_LOGPROBS = 20  # OpenAI's limit, and the engine's default max_logprobs


def random_id(prefix: str) -> str:
    """An id like OpenAI's: prefix + 32 hex digits."""
    return f"{prefix}-{uuid.uuid4().hex}"


class ParamError(ValueError):
    """A cross-field check failed; `param` names the field to blame in the error body."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class _Request(BaseModel):
    """Base of request bodies: strict types, unknown fields ignored, no inf/nan."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Request):
    """`stream_options`: `include_usage` adds a last chunk with the usage (empty choices)."""

    include_usage: bool = False


class JsonSchemaFormat(_Request):
    """`response_format.json_schema` (OpenAI): the schema under `schema`, a `name`, `strict`."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, populate_by_name=True)

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI's `response_format`: text (no constraint), any JSON object, or a JSON schema;
    or vLLM's `structural_tag` (`structures` of {begin, schema, end} and their `triggers`)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None


class StructuredOutputsField(_Request):
    """vLLM's `structured_outputs` extra field: exactly one of `json` (a schema), `regex`,
    `choice`, `grammar` (Lark or GBNF), `json_object`, `structural_tag`;
    `disable_any_whitespace`, `whitespace_pattern`."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, populate_by_name=True)

    json_schema: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None


class CartridgeRef(BaseModel):
    """One cartridge of a request's `cartridges` (Tokasaurus's shape): `id` (a file in the
    server's --cartridge-dir), `source` ("local" only), or moestream's `path` (a file inside
    --cartridge-dir); `force_redownload` re-reads the file."""

    model_config = ConfigDict(extra="forbid")

    id: str | None = Field(None, max_length=255)
    source: Literal["local"] = "local"
    path: str | None = Field(None, max_length=4096)
    force_redownload: bool = False


class SamplingRequest(_Request):
    """Fields common to completions and chat completions. A constraint comes from one of
    `response_format` (json_object, json_schema), vLLM's `structured_outputs`, or its older
    `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` (accepted as aliases,
    with `guided_whitespace_pattern`)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(None, max_length=1024)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = Field(None, ge=0)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    # moestream's: "exact" opts out of the server's approximate expert mode (docs/expert_modes.md)
    expert_mode: str | None = None
    # KV cartridges the prompt starts after (Tokasaurus's field; docs/cartridges.md), and whether to route them
    cartridges: list[CartridgeRef | str] | None = Field(None, min_length=1, max_length=16)
    cartridge_routing: Literal["always", "auto"] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or ():
            if not key.strip().lstrip("-").isdigit():
                raise ValueError(f"logit_bias keys must be token ids written as integers, got {key!r}")
        return v

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The request's constraint as `StructuredOutputsParams`, or None.

        Raises:
            ParamError: constraints from several fields, a json_schema format without a
                schema, or a `structured_outputs` with none or several constraints.
        """
        found: list[tuple[str, StructuredOutputsParams]] = []
        rf = self.response_format
        try:
            if rf is not None and rf.type == "json_object":
                found.append(("response_format", StructuredOutputsParams(json_object=True)))
            elif rf is not None and rf.type == "json_schema":
                if rf.json_schema is None or rf.json_schema.json_schema is None:
                    raise ParamError("response_format.json_schema",
                                     "response_format of type json_schema needs json_schema.schema")
                found.append(("response_format", StructuredOutputsParams(
                    json=rf.json_schema.json_schema, whitespace_pattern=self.guided_whitespace_pattern)))
            elif rf is not None and rf.type == "structural_tag":
                found.append(("response_format", StructuredOutputsParams(
                    structural_tag={"structures": rf.structures, "triggers": rf.triggers})))
            so = self.structured_outputs
            if so is not None:
                found.append(("structured_outputs", StructuredOutputsParams(
                    json=so.json_schema, regex=so.regex, choice=so.choice, grammar=so.grammar,
                    json_object=so.json_object, structural_tag=so.structural_tag,
                    disable_any_whitespace=so.disable_any_whitespace, whitespace_pattern=so.whitespace_pattern)))
            for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                               ("guided_grammar", "grammar")):
                if getattr(self, name) is not None:
                    found.append((name, StructuredOutputsParams(
                        **{kind: getattr(self, name)},
                        whitespace_pattern=self.guided_whitespace_pattern if kind == "json" else None)))
        except ParamError:
            raise
        except ValueError as e:
            raise ParamError("structured_outputs", str(e)) from None
        if len(found) > 1:
            raise ParamError(found[1][0], f"give one constraint; got {', '.join(name for name, _ in found)}")
        return found[0][1] if found else None

    def logit_bias_ids(self) -> dict[int, float] | None:
        """`logit_bias` with integer token ids and each bias clamped to [-100, 100] (OpenAI's
        range; vLLM clamps the same way)."""
        if not self.logit_bias:
            return None
        return {int(k): min(100.0, max(-100.0, b)) for k, b in self.logit_bias.items()}

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 16:
            raise ValueError("stop takes at most 16 strings")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return v

    @model_validator(mode="after")
    def _check_common(self) -> "SamplingRequest":
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "stream_options is only allowed with stream: true")
        if self.stream and self.prompt_logprobs is not None:  # vLLM's check and wording
            raise ParamError("prompt_logprobs", "`prompt_logprobs` are not available when `stream=True`.")
        self.structured_outputs_params()  # a constraint that cannot be built is a 400 now
        return self


class CompletionRequest(SamplingRequest):
    """POST /v1/completions. `prompt`: a string, a list of strings, a list of token ids, or
    a list of lists of token ids (a batch)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, p: str | list) -> str | list:
        if p == "" or p == [] or (isinstance(p, list) and any(x == "" or x == [] for x in p)):
            raise ValueError("prompt must not be empty")
        return p

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v is not None:
            raise ValueError("suffix is not supported")
        return v

    @model_validator(mode="after")
    def _check(self) -> "CompletionRequest":
        if self.best_of is not None and self.best_of != self.n:
            raise ParamError("best_of", "best_of is not supported (only best_of equal to n)")
        if self.max_tokens == 0 and not self.echo:
            raise ParamError("max_tokens", "max_tokens must be at least 1, got 0 (0 is allowed only with echo: true, "
                                           "which then returns the prompt and its logprobs)")
        return self

    @property
    def echo_without_generation(self) -> bool:
        """`echo` with `max_tokens` 0: the answer is the prompt alone (one token is sampled
        and dropped, as vLLM)."""
        return self.echo and self.max_tokens == 0


class TextContentPart(_Request):
    """A text part of a chat message's content."""

    type: Literal["text"]
    text: str


class ImageURL(_Request):
    """OpenAI's `image_url` object: a data: URL (or, where the server allows, http(s) or file)."""

    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImageContentPart(_Request):
    """An image part of a chat message's content (multimodal models only)."""

    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextContentPart | ImageContentPart, Field(discriminator="type")]


class MessageFunctionCall(_Request):
    """A function call in an assistant message: its name and arguments (a JSON string)."""

    name: str
    arguments: str


class MessageToolCall(_Request):
    """A tool call in an assistant message of the conversation (sent back by the client)."""

    id: str
    type: Literal["function"] = "function"
    function: MessageFunctionCall


class ChatMessage(_Request):
    """One chat message; `content` is a string or a list of text and image parts. An
    assistant message may carry the `tool_calls` it made, a tool message the
    `tool_call_id` it answers."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(_Request):
    """A function the model may call: `name`, `description`, `parameters` (a JSON schema)."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolsParam(_Request):
    """One entry of `tools`."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    """The function of a named `tool_choice`."""

    name: str


class NamedToolChoice(_Request):
    """`tool_choice` naming the function to call: {"type": "function", "function": {"name"}}."""

    type: Literal["function"] = "function"
    function: NamedFunction


class ChatTemplateFields(_Request):
    """What the chat template reads: `messages`, `tools`, `chat_template_kwargs` (extra
    template variables, e.g. {"enable_thinking": false}), and where the prompt ends."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatCompletionToolsParam] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @field_validator("chat_template_kwargs")
    @classmethod
    def _check_template_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        reserved = {"messages", "tools", "chat_template", "tokenize", "add_generation_prompt",
                    "continue_final_message", "return_dict", "documents", "conversation"}
        if v and reserved & set(v):
            raise ValueError(f"chat_template_kwargs may not set {', '.join(sorted(reserved & set(v)))}; use the "
                             "request's own fields")
        return v

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """`tools` as plain dicts (what chat templates and parsers read), or None."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


class ChatCompletionRequest(SamplingRequest, ChatTemplateFields):
    """POST /v1/chat/completions; the prompt is the tokenizer's chat template over `messages`."""

    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """`tool_choice`, or when unset OpenAI's default: "auto" with tools, else "none"."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @model_validator(mode="after")
    def _check(self) -> "ChatCompletionRequest":
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            raise ParamError("tool_choice", "When using `tool_choice`, `tools` must be set.")  # vLLM's wording
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in self.tools}:
            raise ParamError("tool_choice", f"The tool '{choice.function.name}' named in `tool_choice` is not one of "
                                            "the `tools`.")
        if self.tools and len({t.function.name for t in self.tools}) != len(self.tools):
            raise ParamError("tools", "The `tools` have two functions of the same name.")
        if (choice == "required" or isinstance(choice, NamedToolChoice)) and self.structured_outputs_params():
            raise ParamError("tool_choice", "tool_choice 'required' or a named function constrains the output to "
                                            "the tool call; it cannot be combined with another constraint.")
        if self.top_logprobs is not None and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs needs logprobs: true")
        if self.add_generation_prompt and self.continue_final_message:
            raise ParamError("continue_final_message",
                             "continue_final_message needs add_generation_prompt: false")
        return self


class TokenizeCompletionRequest(_Request):
    """POST /tokenize with a `prompt` (vLLM's shape)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatTemplateFields):
    """POST /tokenize with chat `messages` (and `tools`), rendered by the chat template first
    (vLLM's shape; special tokens come from the template, so `add_special_tokens` defaults to
    false)."""

    model: str | None = None
    add_special_tokens: bool = False
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _check(self) -> "TokenizeChatRequest":
        if self.add_generation_prompt and self.continue_final_message:
            raise ParamError("continue_final_message",
                             "continue_final_message needs add_generation_prompt: false")
        return self


class DetokenizeRequest(_Request):
    """POST /detokenize (vLLM's shape)."""

    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


# ---- responses ------------------------------------------------------------------------


class CartridgeUsage(BaseModel):
    """moestream's `usage.cartridges`: the cartridges a request named, how they were routed
    ("always" or "auto"), whether they were attached, the router's relevance and threshold
    (nats per token; auto only), and their positions."""

    ids: list[str]
    routing: str
    attached: bool
    relevance: float | None = None
    threshold: float | None = None
    positions: int = 0


class PromptTokensDetails(BaseModel):
    """OpenAI's `usage.prompt_tokens_details`: `cached_tokens` = prompt tokens found in the
    prefix cache (not computed)."""

    cached_tokens: int = 0


class UsageInfo(BaseModel):
    """Token counts: each prompt once, every choice's completion tokens."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    cartridges: list[CartridgeUsage | None] | None = None  # moestream's: per prompt, with cartridges only


class CompletionLogProbs(BaseModel):
    """Completion logprobs, one entry per token (natural logs; offsets in characters). With
    `echo` the prompt's tokens come first, the very first with a null logprob (OpenAI, vLLM)."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's serialized `Logprob` of `prompt_logprobs`: natural log, 1-based rank, text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's `prompt_logprobs` in a response: per prompt token, None for the first, then
# token id -> its PromptLogprob (the prompt token and the top-N).
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    """One choice of a completion (or its delta, in a streamed chunk)."""

    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    """A completion, or one streamed chunk of it."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    """A token, its natural-log probability and its UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    """A sampled token's logprob and the most likely alternatives at its position."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """Chat logprobs: one entry per output token."""

    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    """A function call the model made: name and arguments (a JSON object as a string)."""

    name: str
    arguments: str


class ToolCall(BaseModel):
    """A tool call of the assistant message."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    """A streamed piece of a function call: the name (once), then pieces of the arguments."""

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A streamed piece of tool call `index`: its first piece has the id, type and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatResponseMessage(BaseModel):
    """The assistant message of a chat choice: content, the reasoning (with a reasoning
    parser) and tool calls."""

    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    """One choice of a chat completion."""

    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    """A chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(BaseModel):
    """What a streamed chat chunk adds to a choice's message."""

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    """One choice's delta in a streamed chat chunk."""

    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    """One streamed chat chunk."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class TokenizeResponse(BaseModel):
    """The answer of /tokenize: the ids, their count, the server's max_model_len, and with
    `return_token_strs` each id's token string."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    """The answer of /detokenize: the decoded text."""

    prompt: str


class ModelCard(BaseModel):
    """A served model name, as /v1/models lists it (`root`: the server's first served model
    name; the checkpoint's local path is never shown)."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "moestream"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    """The answer of /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    """The inside of OpenAI's error body; `param` names the offending field, if any."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorInfo
