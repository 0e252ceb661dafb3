"""OpenAI chat-completions and completions request schema (pydantic v2).

Shared by the worker server and the proxy. The models check the *shape* of a
request as OpenAI documents it (types are strict: ``"0.5"`` is not a number, ``1``
is not ``true``); what a particular engine supports (context length, ``n`` cap,
penalties...) is checked later, by :mod:`engine.api.convert` on a worker.

Policy on fields:

* Unknown fields are refused with a 400 ("Unrecognized request argument"), as
  OpenAI does; the official SDK only sends known ones.
* Fields that try to choose where a request goes (:data:`UPSTREAM_PICKING_FIELDS`)
  get a dedicated 400: a client can never pick an upstream URL.
* ``cache_salt`` (vLLM's name) is how the kvtoll proxy hands the *server-derived*
  tenant salt (hex) to a worker. The proxy must drop any client-sent value
  (:func:`strip_client_salt`) before setting its own; workers are internal
  services that only the proxy may reach. ``kvtoll_kv_share`` travels beside it
  the same way: the tenant's share of the worker's prefix cache
  (``{"tenant", "reserved_blocks", "max_blocks"}``), set by the proxy only.
* Accepted and ignored (harmless): ``user``, ``metadata``, ``store``,
  ``service_tier``, ``parallel_tool_calls``. Accepted as JSON and left to the
  upstream: ``tools``, ``tool_choice``, ``response_format``, ``logit_bias``,
  penalties (a kvtoll worker refuses the ones it cannot honour).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    field_validator,
    model_validator,
)

from kvtoll.openai.errors import OpenAIError, validation_error

MAX_N = 128
MAX_STOP_SEQUENCES = 16
MAX_TOP_LOGPROBS = 20
MAX_PROMPTS = 64
MAX_SALT_HEX_CHARS = 128

UPSTREAM_PICKING_FIELDS = frozenset(
    {
        "api_base",
        "base_url",
        "upstream",
        "upstream_url",
        "worker",
        "worker_url",
        "endpoint",
        "server_url",
        "url",
    }
)
SALT_FIELDS = frozenset({"cache_salt", "kvtoll_kv_share"})
MAX_KV_BLOCKS = 2**31 - 1

StrictStr = Annotated[str, Strict()]
StrictBool = Annotated[bool, Strict()]
FiniteFloat = Annotated[float, Strict(), Field(allow_inf_nan=False)]
Temperature = Annotated[float, Strict(), Field(ge=0.0, le=2.0, allow_inf_nan=False)]
TopP = Annotated[float, Strict(), Field(gt=0.0, le=1.0, allow_inf_nan=False)]
Penalty = Annotated[float, Strict(), Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
PositiveInt = Annotated[int, Strict(), Field(ge=1)]
Seed = Annotated[int, Strict(), Field(ge=-(2**63), le=2**64 - 1)]
TokenId = Annotated[int, Strict(), Field(ge=0, le=2**31 - 1)]
NonEmptyStr = Annotated[str, Strict(), Field(min_length=1)]
Stop = NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP_SEQUENCES)]
SaltHex = Annotated[
    str,
    Strict(),
    Field(min_length=2, max_length=MAX_SALT_HEX_CHARS, pattern=r"^([0-9a-fA-F]{2})+$"),
]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StreamOptions(_Model):
    include_usage: StrictBool = False


KVBlocks = Annotated[int, Strict(), Field(ge=0, le=MAX_KV_BLOCKS)]


class KVShareField(_Model):
    """``kvtoll_kv_share``: the tenant's share of a worker's prefix cache (proxy only)."""

    tenant: Annotated[str, Strict(), Field(max_length=64)]
    reserved_blocks: KVBlocks = 0
    max_blocks: KVBlocks | None = None


class TextContentPart(_Model):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Model):
    """One message. ``content`` is a string or a list of text parts."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextContentPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: StrictStr | None = None
    refusal: StrictStr | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(f"only 'text' content parts are supported, got {kind!r}")
        return value

    @model_validator(mode="after")
    def _content_present(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a '{self.role}' message needs 'content'")
        return self

    def text(self) -> str:
        """The content as one string (text parts joined by newlines)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class _SamplingFields(_Model):
    """Fields common to chat and completions requests."""

    model: NonEmptyStr
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Strict(), Field(ge=-1)] | None = None  # extension; -1 or 0 = off
    n: Annotated[int, Strict(), Field(ge=1, le=MAX_N)] = 1
    stop: Stop | None = None
    seed: Seed | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, FiniteFloat] | None = None
    user: StrictStr | None = None
    ignore_eos: StrictBool = False  # extension (vLLM)
    stop_token_ids: list[TokenId] | None = None  # extension (vLLM)
    cache_salt: SaltHex | None = None  # server-derived tenant salt, set by the proxy only
    kvtoll_kv_share: KVShareField | None = None  # the salt's tenant share, proxy only

    def stop_strings(self) -> tuple[str, ...]:
        """``stop`` as a tuple of strings."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def salt_bytes(self) -> bytes | None:
        """``cache_salt`` decoded from hex."""
        return bytes.fromhex(self.cache_salt) if self.cache_salt else None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[int, Strict(), Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    response_format: dict[str, Any] | None = None
    metadata: dict[str, StrictStr] | None = None
    store: StrictBool | None = None
    service_tier: StrictStr | None = None

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError("'top_logprobs' requires 'logprobs' to be true", param="top_logprobs")
        return self

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` if given, else ``max_tokens``."""
        return self.max_completion_tokens or self.max_tokens

    def num_logprobs(self) -> int | None:
        """Top-k logprobs per token requested (0 = only the sampled token), or None."""
        return (self.top_logprobs or 0) if self.logprobs else None


PromptInput = StrictStr | list[StrictStr] | list[TokenId] | list[list[TokenId]]
_PROMPT_SHAPE = "a string, a list of strings, a list of token ids or a list of token-id lists"


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31


def _check_prompt_shape(value: Any) -> None:
    if isinstance(value, str):
        if not value:
            raise ValueError("the prompt must not be empty")
        return
    if not isinstance(value, list) or not value:
        raise ValueError(f"the prompt must be {_PROMPT_SHAPE}, and not empty")
    if all(_is_token_id(x) for x in value):
        return
    if len(value) > MAX_PROMPTS:
        raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
    if all(isinstance(x, str) for x in value):
        if not all(value):
            raise ValueError("the prompt must not contain empty strings")
        return
    if all(isinstance(x, list) and x and all(_is_token_id(t) for t in x) for x in value):
        return
    raise ValueError(f"the prompt must be {_PROMPT_SHAPE} (non-empty, token ids >= 0)")


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt``: text, texts, token ids or lists of them."""

    prompt: PromptInput
    logprobs: Annotated[int, Strict(), Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: Annotated[int, Strict(), Field(ge=1, le=MAX_N)] | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        _check_prompt_shape(value)
        return value

    @model_validator(mode="after")
    def _check_best_of(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of < self.n:
            raise OpenAIError("'best_of' must be greater than or equal to 'n'", param="best_of")
        return self

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompt(s) as a list: texts or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [[int(x) for x in p if isinstance(x, int)]]
        if all(isinstance(x, str) for x in p):
            return [str(x) for x in p]
        return [[int(t) for t in x] for x in p if isinstance(x, list)]


OpenAIRequest = ChatCompletionRequest | CompletionRequest


def reject_upstream_picking(data: dict[str, Any]) -> None:
    """400 if the body carries a field that tries to choose the upstream."""
    for key in data:
        if key.lower() in UPSTREAM_PICKING_FIELDS:
            raise OpenAIError(
                f"'{key}' is not allowed: clients cannot choose the upstream server",
                param=key,
                code="forbidden_parameter",
            )


def strip_client_salt(data: dict[str, Any]) -> dict[str, Any]:
    """A copy of a *client* body without any salt field: tenants never set salts."""
    return {k: v for k, v in data.items() if k not in SALT_FIELDS}


def parse_chat_request(data: dict[str, Any]) -> ChatCompletionRequest:
    """Validate a chat body; every problem is an :class:`OpenAIError` (400)."""
    reject_upstream_picking(data)
    try:
        return ChatCompletionRequest.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


def parse_completion_request(data: dict[str, Any]) -> CompletionRequest:
    """Validate a completions body; every problem is an :class:`OpenAIError` (400)."""
    reject_upstream_picking(data)
    try:
        return CompletionRequest.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


def parse_request(kind: Literal["chat", "completion"], data: dict[str, Any]) -> OpenAIRequest:
    """:func:`parse_chat_request` or :func:`parse_completion_request` by ``kind``."""
    if kind == "chat":
        return parse_chat_request(data)
    return parse_completion_request(data)
