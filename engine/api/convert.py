"""OpenAI request -> what a kvtoll engine runs: prompt token ids and SamplingParams.

Checks what this engine can honour, each failure an :class:`OpenAIError` (400):

* the prompt is empty after tokenization, or fills the context
  (``context_length_exceeded``);
* ``prompt + max_tokens`` exceeds ``max_model_len``;
* token ids outside the vocabulary (when the tokenizer tells its size);
* features the engine does not implement: penalties other than 0, a non-empty
  ``logit_bias``, ``response_format`` other than text, ``tools`` unless
  ``tool_choice`` is ``"none"``, ``suffix``, ``echo``, ``best_of`` other than ``n``.

``n`` above the engine's own cap is refused by the engine (``EngineRejected``).
Default ``max_tokens``: the rest of the context for chat (as OpenAI), 16 for
completions (as OpenAI), never more than what fits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from jinja2 import TemplateError

from engine.api import EngineRejected, KVShare, SamplingParams, Tokenizer
from engine.kv.hashing import TenantSalt
from kvtoll.openai.errors import OpenAIError
from kvtoll.openai.protocol import ChatCompletionRequest, CompletionRequest, OpenAIRequest

DEFAULT_COMPLETION_MAX_TOKENS = 16
_TEMPLATE_ROLES = {"developer": "system"}


@dataclass(frozen=True)
class PreparedRequest:
    """An OpenAI request ready for the engine: one token-id prompt per input prompt."""

    kind: Literal["chat", "completion"]
    prompts: tuple[tuple[int, ...], ...]
    sampling: SamplingParams
    salt: TenantSalt | None
    kv_share: KVShare | None = None  # the salt's tenant share of the prefix cache

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.sampling.n


def rejection_param(exc: EngineRejected) -> str | None:
    """The parameter an engine rejection names: its ``param`` attribute, else the
    ``"param: message"`` prefix of its message."""
    param = getattr(exc, "param", None)
    if isinstance(param, str):
        return param
    head, sep, _ = str(exc).partition(":")
    return head if sep and head.isidentifier() else None


def rejection_error(exc: EngineRejected) -> OpenAIError:
    """An engine rejection as a 400 naming the parameter."""
    return OpenAIError(str(exc), param=rejection_param(exc), code="invalid_value")


def chat_messages(request: ChatCompletionRequest) -> list[dict[str, object]]:
    """Messages as the chat template expects them: role and text content."""
    return [
        {"role": _TEMPLATE_ROLES.get(m.role, m.role), "content": m.text()} for m in request.messages
    ]


def text_prompt_ids(tokenizer: Tokenizer, text: str) -> tuple[int, ...]:
    """Token ids of one text prompt exactly as the engine receives them (special
    tokens such as BOS added): the proxy tokenizes with this too, so its prefix
    hashes match the worker's."""
    return tuple(tokenizer.encode(text, add_special_tokens=True))


def _reject_unsupported(request: OpenAIRequest) -> None:
    def unsupported(param: str, what: str) -> OpenAIError:
        return OpenAIError(
            f"{what} is not supported by this server", param=param, code="unsupported_parameter"
        )

    if request.presence_penalty:
        raise unsupported("presence_penalty", "A non-zero presence_penalty")
    if request.frequency_penalty:
        raise unsupported("frequency_penalty", "A non-zero frequency_penalty")
    if request.logit_bias:
        raise unsupported("logit_bias", "logit_bias")
    if isinstance(request, ChatCompletionRequest):
        fmt = (request.response_format or {}).get("type", "text")
        if fmt != "text":
            raise unsupported("response_format", f"response_format {fmt!r}")
        if request.tools and request.tool_choice != "none":
            raise unsupported("tools", "Tool calling")
    else:
        if request.suffix:
            raise unsupported("suffix", "suffix")
        if request.echo:
            raise unsupported("echo", "echo")
        if request.best_of is not None and request.best_of != request.n:
            raise unsupported("best_of", "best_of other than n")


def _check_token_ids(token_ids: list[int], tokenizer: Tokenizer) -> None:
    vocab_size = getattr(tokenizer, "vocab_size", None)
    if isinstance(vocab_size, int) and any(t >= vocab_size for t in token_ids):
        raise OpenAIError(
            f"Token ids must be smaller than the vocabulary size {vocab_size}",
            param="prompt",
            code="invalid_value",
        )


def _max_tokens(requested: int | None, default: int | None, prompt_len: int, limit: int) -> int:
    room = limit - prompt_len
    if prompt_len == 0:
        raise OpenAIError("The prompt is empty", param="prompt", code="invalid_value")
    if room <= 0:
        raise OpenAIError(
            f"This model's maximum context length is {limit} tokens. However, your prompt "
            f"has {prompt_len} tokens, leaving no room for a completion.",
            param="messages",
            code="context_length_exceeded",
        )
    if requested is None:
        return room if default is None else min(default, room)
    if prompt_len + requested > limit:
        raise OpenAIError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the "
            "completion). Please reduce the prompt or max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested


def _sampling(request: OpenAIRequest, max_tokens: int, logprobs: int | None) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=max(request.top_k or 0, 0),
        seed=request.seed,
        n=request.n,
        stop=request.stop_strings(),
        stop_token_ids=tuple(request.stop_token_ids or ()),
        ignore_eos=request.ignore_eos,
        logprobs=logprobs,
    )


def prepare_chat(
    request: ChatCompletionRequest,
    tokenizer: Tokenizer,
    max_model_len: int,
    salt: TenantSalt | None,
    prompt_token_ids: tuple[int, ...] | None = None,
) -> PreparedRequest:
    """Render the chat template (unless ``prompt_token_ids`` are given) and size the
    completion."""
    _reject_unsupported(request)
    prompt = prompt_token_ids
    if prompt is None:
        try:
            prompt = tuple(tokenizer.apply_chat_template(chat_messages(request)))
        except (TemplateError, ValueError) as exc:
            raise OpenAIError(
                f"The messages do not fit the model's chat template: {exc}", param="messages"
            ) from None
    max_tokens = _max_tokens(request.requested_max_tokens(), None, len(prompt), max_model_len)
    sampling = _sampling(request, max_tokens, request.num_logprobs())
    return PreparedRequest("chat", (prompt,), sampling, salt)


def prepare_completion(
    request: CompletionRequest,
    tokenizer: Tokenizer,
    max_model_len: int,
    salt: TenantSalt | None,
    prompt_token_ids: tuple[int, ...] | None = None,
) -> PreparedRequest:
    """Tokenize each prompt (or take its token ids) and size the completion;
    ``prompt_token_ids`` replaces a single prompt already tokenized by the caller."""
    _reject_unsupported(request)
    items = request.prompts()
    if prompt_token_ids is not None:
        if len(items) != 1:
            raise OpenAIError("Pre-tokenized input allows one prompt only", param="prompt")
        items = [list(prompt_token_ids)]
    prompts: list[tuple[int, ...]] = []
    for item in items:
        if isinstance(item, str):
            prompts.append(text_prompt_ids(tokenizer, item))
        else:
            _check_token_ids(item, tokenizer)
            prompts.append(tuple(item))
    limits = [
        _max_tokens(request.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS, len(p), max_model_len)
        for p in prompts
    ]
    sampling = _sampling(request, min(limits), request.logprobs)
    return PreparedRequest("completion", tuple(prompts), sampling, salt)


def prepare(
    request: OpenAIRequest,
    tokenizer: Tokenizer,
    max_model_len: int,
    salt: TenantSalt | None,
    prompt_token_ids: tuple[int, ...] | None = None,
) -> PreparedRequest:
    """:func:`prepare_chat` or :func:`prepare_completion` by request type."""
    if isinstance(request, ChatCompletionRequest):
        return prepare_chat(request, tokenizer, max_model_len, salt, prompt_token_ids)
    return prepare_completion(request, tokenizer, max_model_len, salt, prompt_token_ids)
