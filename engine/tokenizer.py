"""Tokenizers implementing :class:`engine.api.Tokenizer`.

* :class:`TextTokenizer`: a ``tokenizers`` tokenizer (from tokenizer.json or built
  from GGUF metadata) plus the model's Jinja chat template, rendered like
  transformers does (sandboxed, ``trim_blocks``/``lstrip_blocks``).
* :class:`ByteTokenizer`: one token per UTF-8 byte plus three specials, for the tiny
  test model.
"""

from __future__ import annotations

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

_FALLBACK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _raise(message: str) -> None:
    raise TemplateError(message)


class ChatTemplate:
    """A compiled Jinja chat template."""

    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(source or _FALLBACK_TEMPLATE)
        self._bos, self._eos = bos_token, eos_token

    def render(self, messages: list[dict[str, object]]) -> str:
        """The prompt text, generation prompt included."""
        return self._template.render(
            messages=messages, add_generation_prompt=True, bos_token=self._bos, eos_token=self._eos
        )


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` with the model's chat template and EOS ids."""

    def __init__(
        self, tok: HFTokenizer, template: ChatTemplate, eos_token_ids: tuple[int, ...]
    ) -> None:
        self._tok = tok
        self._template = template
        self.eos_token_ids = eos_token_ids

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text`` (special-token strings inside it are recognised)."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: list[int]) -> str:
        """Text of ``token_ids``, special tokens skipped."""
        return str(self._tok.decode(token_ids, skip_special_tokens=True))

    def apply_chat_template(self, messages: list[dict[str, object]]) -> list[int]:
        """Token ids of the rendered chat prompt, with the generation prompt added."""
        return self.encode(self._template.render(messages))


class ByteTokenizer:
    """UTF-8 bytes as tokens 3..258; 0 = pad, 1 = BOS, 2 = EOS (the tiny model's)."""

    NUM_SPECIAL = 3
    vocab_size = 256 + NUM_SPECIAL

    def __init__(self) -> None:
        self.eos_token_ids: tuple[int, ...] = (2,)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """One id per UTF-8 byte."""
        ids = [b + self.NUM_SPECIAL for b in text.encode("utf-8")]
        return [1, *ids] if add_special_tokens else ids

    def decode(self, token_ids: list[int]) -> str:
        """Bytes back to text; specials skipped, broken UTF-8 as U+FFFD."""
        data = bytes(t - self.NUM_SPECIAL for t in token_ids if t >= self.NUM_SPECIAL)
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, object]]) -> list[int]:
        """A minimal ChatML rendering, byte-encoded."""
        return self.encode(ChatTemplate(None).render(messages))
