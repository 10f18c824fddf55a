"""Request schemas of the OpenAI-compatible API, and the one rule: honoured or refused by name.

Every field a request model declares is honoured. `REFUSED` lists the OpenAI parameters this
server cannot honour, each with the reason given in its 400; `ROUTER_DEFAULTS` the fields routers add
to every request, dropped when they ask for nothing different. Any other key is unknown and is
refused the way OpenAI refuses it ("Unrecognized request argument supplied: X"), or ignored with
a logged warning when the server runs with `--lenient`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails

# OpenAI parameters this server does not implement, with the reason their 400 gives.
REFUSED = {
    "audio": "audio output is not supported: this server serves a text-only model",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "functions": "the deprecated 'functions' parameter is not supported; use 'tools'",
    "function_call": "the deprecated 'function_call' parameter is not supported; use 'tool_choice'",
    "reasoning_effort": "this model does not reason; 'reasoning_effort' cannot be honoured",
    "verbosity": "'verbosity' cannot be honoured by this model",
    "suffix": "'suffix' (insertion) is not supported",
    "store": "stored completions are not supported",
    "metadata": "'metadata' is only stored with stored completions, which are not supported",
    "service_tier": "service tiers are not supported",
}
# Accepted values that change nothing here, so refusing them would only break clients.
ACCEPTED_DEFAULTS = {
    "modalities": [["text"]],
    "store": [False, None],
    "service_tier": ["auto", "default", None],
}

# Fields sglang-router and vllm-router add to every request they forward, whatever the client sent,
# with the values that ask for what kvblocks does anyway: dropped when they carry one of these values,
# refused by name otherwise. kvblocks does not split reasoning from content, which changes nothing for
# a model that does not reason (SmolLM2); it always skips special tokens in the text it returns.
ROUTER_DEFAULTS = {
    "skip_special_tokens": [True, None],
    "no_stop_trim": [False, None],
    "continue_final_message": [False, None],
    "return_hidden_states": [False, None],
    "separate_reasoning": [True, None],
    "stream_reasoning": [True, None],
    "include_reasoning": [True, None],
}

# Fields of an echoed assistant message (`message.model_dump()` of the openai SDK, vLLM's extras)
# that carry nothing when null or empty: such a value is dropped wherever a message may be.
ECHOED_EMPTY = {"annotations", "audio", "function_call", "reasoning_content", "reasoning", "refusal"}

MAX_STOPS = 16
MAX_TOP_LOGPROBS = 20
MAX_N = 16
# Structural ceilings: pydantic checks a list's length before validating any item, so a body of
# more messages or input items than this costs only its JSON decoding. `kvblocks serve`'s
# --max-messages and --max-input-items (kvblocks.server.cost) set the caps below them.
MESSAGES_CEILING = 16384
INPUT_ITEMS_CEILING = 16384


# One bound for every route that names a cache inside the tenant (chat, completions, /v1/blocks, explain).
CacheSalt = Annotated[str, Field(max_length=256)]


class _Model(BaseModel):
    """Strict: a value of the wrong JSON type is a 400, never coerced ("1" is not an integer, 1 is
    not a boolean), so the published schema is the whole truth about what is accepted."""

    model_config = ConfigDict(extra="forbid", strict=True)


class CacheControl(_Model):
    """Anthropic-style prompt-caching hint (litellm forwards it): keep the prefix that ends with
    this part in the cache for `ttl` (default 5 minutes). kvblocks pins it for the caller's tenant."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None

    @property
    def seconds(self) -> float:
        return 3600.0 if self.ttl == "1h" else 300.0


class TextPart(_Model):
    """`kvblocks_block`: this part is a KV block (a document, a tool output): its KV is computed on its
    own and reused wherever it appears again, under the request's `kv_mode` (kvblocks extension)."""

    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    kvblocks_block: bool | None = None


class FunctionCall(_Model):
    name: str
    arguments: str


class ToolCallIn(_Model):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None

    @model_validator(mode="after")
    def _shape(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a 'tool' message needs 'tool_call_id'")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only 'assistant' messages carry 'tool_calls'")
        if self.content is None and not self.tool_calls:
            raise ValueError("a message needs 'content' (or 'tool_calls' for an assistant message)")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def parts(self) -> list[TextPart]:
        return self.content if isinstance(self.content, list) else []


class StreamOptions(_Model):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class FunctionDef(_Model):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Model):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")]
    description: str | None = None
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("'json_schema' is required when type is 'json_schema'")
        return self


Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class _Sampling(_Model):
    """Parameters shared by chat and completions (OpenAI's, then vLLM's extras)."""

    model: str | None = None  # None: the served model (vLLM's rule; routers forward requests without it)
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = 1.0
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = 1
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=-(1 << 63), lt=1 << 64)] | None = None  # what torch accepts
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = 0.0
    frequency_penalty: Penalty | None = 0.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    user: str | None = None
    # vLLM extras
    top_k: Annotated[int, Field(ge=-1)] | None = 0
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = 1.0
    min_tokens: Annotated[int, Field(ge=0)] | None = 0
    ignore_eos: bool | None = False
    cache_salt: CacheSalt | None = None
    # kvblocks extension: how KV blocks (`kvblocks_block` parts, `prompt_blocks`) are reused; None:
    # the server's --kv-mode / --blend-recompute
    kv_mode: Literal["exact", "blend", "concat"] | None = None
    blend_recompute: Annotated[float, Field(ge=0.0, le=1.0)] | None = None

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, v):
        if isinstance(v, list) and len(v) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, v):
        for key in v or {}:
            if not key.lstrip("-").isdigit() or int(key) < 0:
                raise ValueError(f"keys must be token ids, got '{key}'")
        return v


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MESSAGES_CEILING)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    response_format: ResponseFormat | None = None
    # accepted, no effect on output: routing keys and end-user identifiers
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    modalities: list[str] | None = None
    store: bool | None = None
    service_tier: str | None = None


class PromptSegment(_Model):
    """One part of a completions `prompt_blocks` prompt: text or token ids; `block` marks a KV block."""

    text: str | None = None
    token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] | None = None
    block: bool = False

    @model_validator(mode="after")
    def _one_content(self) -> PromptSegment:
        if (self.text is None) == (self.token_ids is None):
            raise ValueError("a prompt segment needs exactly one of 'text' and 'token_ids'")
        return self


class CompletionRequest(_Sampling):
    # `prompt_blocks` (kvblocks extension) replaces `prompt` (then omitted or ""): one prompt of segments
    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    prompt_blocks: Annotated[list[PromptSegment], Field(min_length=1)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool | None = False
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    # kvblocks extension, encoder-decoder models only: the decoder's prefix (`prompt` is the source)
    decoder_prompt: str | list[int] | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        if self.prompt_blocks is not None and self.prompt not in (None, ""):
            raise ValueError("give 'prompt' or 'prompt_blocks', not both")
        if self.prompt_blocks is None and self.prompt is None:
            # said as pydantic says a missing field, so the 400 names `prompt`
            missing = InitErrorDetails(type="missing", loc=("prompt",), input=None)
            raise ValidationError.from_exception_data(type(self).__name__, [missing])
        return self


class StoreBlockRequest(_Model):
    """`POST /v1/blocks` (kvblocks extension): a KV block (a document) to compute and store in the
    caller tenant's block store, as text (tokenised on its own) or token ids, under `cache_salt`."""

    model: str | None = None
    text: str | None = None
    token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] | None = None
    cache_salt: CacheSalt | None = None

    @model_validator(mode="after")
    def _one_content(self) -> StoreBlockRequest:
        if (self.text is None) == (self.token_ids is None):
            raise ValueError("a block needs exactly one of 'text' and 'token_ids'")
        return self


# Here, not beside their routes: the body-parsing workers unpickle request models by module, and a
# route module would import torch into every worker.
class TokenizeRequest(_Model):
    """vLLM's `/tokenize`: a completion `prompt` or chat `messages` (with `tools`), never both."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MESSAGES_CEILING)] | None = None
    tools: list[Tool] | None = None
    add_special_tokens: bool | None = None  # None: vLLM's default, True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        return self


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class ExplainRequest(_Model):
    prompt: str | list[int] | None = None
    messages: Annotated[list[ChatMessage], Field(max_length=MESSAGES_CEILING)] | None = None
    # kvblocks extension: a prompt with KV blocks (`kvblocks_block` parts in `messages`, or this),
    # explained per block under `kv_mode` / `blend_recompute` (None: the server's defaults)
    prompt_blocks: Annotated[list[PromptSegment], Field(min_length=1)] | None = None
    kv_mode: Literal["exact", "blend", "concat"] | None = None
    blend_recompute: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    cache_salt: CacheSalt | None = None
    # what the request would ask for that changes how the cache is used
    echo_logprobs: bool = False
    # encoder-decoder models: the decoder's prefix (`prompt` is the source)
    decoder_prompt: str | list[int] | None = None


# ---- the Responses API (/v1/responses) ---------------------------------------------------------

# Responses parameters this server cannot honour, refused by name unless they ask for nothing.
RESPONSES_REFUSED = {
    "reasoning": "this model does not reason; 'reasoning' cannot be honoured",
    "background": "background responses are not supported",
    "conversation": "conversations are not supported; use 'previous_response_id'",
    "prompt": "stored prompt templates are not supported",
    "top_logprobs": "log-probabilities are not returned by /v1/responses here; use /v1/chat/completions",
    "service_tier": "service tiers are not supported",
    "max_tool_calls": "'max_tool_calls' is not supported",
}
RESPONSES_ACCEPTED_DEFAULTS = {
    "reasoning": [None, {}],
    "background": [False, None],
    "conversation": [None],
    "prompt": [None],
    "top_logprobs": [None, 0],
    "service_tier": ["auto", "default", None],
    "max_tool_calls": [None],
}


class InputText(_Model):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None  # echoed output text carries them; nothing to honour
    logprobs: list[Any] | None = None


class MessageItem(_Model):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Model):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Model):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


def _item_kind(value: Any) -> str | None:
    return value.get("type", "message") if isinstance(value, dict) else None


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_kind),
]


class FunctionTool(_Model):
    """A Responses function tool: the chat tool's `function` fields, flattened."""

    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(_Model):
    type: Literal["function"]
    name: str


class TextFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")] | None = None
    description: str | None = None
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @model_validator(mode="after")
    def _named(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("a 'json_schema' format needs 'name' and 'schema'")
        return self


# `metadata` as OpenAI bounds it: the bytes a stored response keeps for it stay small.
MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
Metadata = Annotated[
    dict[
        Annotated[str, Field(max_length=MAX_METADATA_KEY_CHARS)],
        Annotated[str, Field(max_length=MAX_METADATA_VALUE_CHARS)],
    ],
    Field(max_length=MAX_METADATA_KEYS),
]


class TextOptions(_Model):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the only verbosity a plain model has


class ResponsesRequest(_Model):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = True
    text: TextOptions | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = 1.0
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    user: str | None = None
    metadata: Metadata | None = None  # kept with a stored response, returned as given
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # RESPONSES_REFUSED keys, declared so their default values pass
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    conversation: None = None
    prompt: None = None
    top_logprobs: int | None = None
    service_tier: str | None = None
    max_tool_calls: None = None

    @field_validator("metadata", mode="before")
    @classmethod
    def _metadata_within_limits(cls, v):
        """OpenAI's limits, said in one message naming `metadata` (the schema states them too)."""
        if not isinstance(v, dict):
            return v
        if len(v) > MAX_METADATA_KEYS:
            raise ValueError(f"at most {MAX_METADATA_KEYS} keys, got {len(v)}")
        for key, value in v.items():
            if len(key) > MAX_METADATA_KEY_CHARS:
                raise ValueError(f"keys have at most {MAX_METADATA_KEY_CHARS} characters, got {len(key)}")
            if isinstance(value, str) and len(value) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(
                    f"values have at most {MAX_METADATA_VALUE_CHARS} characters, got {len(value)}"
                )
        return v

    @field_validator("input", mode="before")
    @classmethod
    def _below_the_ceiling(cls, v):
        """Counted before any item is validated, so an oversized list costs only its decoding."""
        if isinstance(v, list) and len(v) > INPUT_ITEMS_CEILING:
            raise ValueError(f"input holds {len(v)} items; at most {INPUT_ITEMS_CEILING} are accepted")
        return v

    @field_validator("include")
    @classmethod
    def _nothing_extra(cls, v):
        if v:
            raise ValueError(f"extra output ({', '.join(map(str, v))}) is not available here; send []")
        return v
