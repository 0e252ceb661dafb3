"""engine.detokenize: the incremental text equals decoding every id, token by token,
while each step decodes only a short window."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models

from engine.api import Tokenizer as TokenizerProtocol
from engine.detokenize import DetokWindow, output_text
from engine.factory import LoadedModel
from engine.tokenizer import ByteTokenizer, ChatTemplate, TextTokenizer


class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call got."""

    def __init__(self, inner: TokenizerProtocol) -> None:
        self.inner = inner
        self.eos_token_ids = inner.eos_token_ids
        self.lengths: list[int] = []

    def decode(self, token_ids: list[int]) -> str:
        self.lengths.append(len(token_ids))
        return self.inner.decode(token_ids)


def _stream(tokenizer: TokenizerProtocol, ids: list[int]) -> list[str]:
    window = DetokWindow()
    return [output_text(tokenizer, window, ids[:n]) for n in range(1, len(ids) + 1)]  # type: ignore[arg-type]


# Byte tokens 3..258 (specials 0..2): multi-byte characters split across tokens, stray
# continuation bytes and truncated sequences, all mixed.
byte_ids = st.lists(
    st.one_of(
        st.integers(0, 2),
        st.integers(3, 3 + 127),
        st.sampled_from([3 + b for b in "é€😀".encode()]),
        st.integers(3 + 128, 258),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(byte_ids)
def test_byte_tokenizer_stream_equals_full_decode(ids: list[int]) -> None:
    tok = ByteTokenizer()
    assert _stream(tok, ids) == [tok.decode(ids[:n]) for n in range(1, len(ids) + 1)]


def test_long_output_decodes_only_a_short_window() -> None:
    tok = CountingTokenizer(ByteTokenizer())
    ids = ByteTokenizer().encode("naïve café, 😀 and plain words " * 40)
    window = DetokWindow()
    for n in range(1, len(ids) + 1):
        text = output_text(tok, window, ids[:n])  # type: ignore[arg-type]
    assert text == ByteTokenizer().decode(ids)
    assert len(ids) > 1000 and max(tok.lengths) <= 8  # an emoji is 4 byte tokens


def test_dropping_uncommitted_ids_gives_their_text() -> None:
    """A stop token is not text: the processor asks again without it."""
    tok = ByteTokenizer()
    ids = tok.encode("ab€")  # € is 3 byte tokens
    window = DetokWindow()
    assert output_text(tok, window, ids[:3]) == "ab\ufffd"  # an incomplete character
    assert output_text(tok, window, ids[:2]) == "ab"
    assert output_text(tok, window, ids) == "ab€"
    with pytest.raises(ValueError, match="already committed"):
        output_text(tok, window, ids[:1])


def test_a_decoder_that_strips_the_first_space_keeps_inner_spaces() -> None:
    """SentencePiece-style: decode() drops the leading space of its first token, so
    decoding a window from the middle would lose a space; the window's two decodes
    both start at one token, and the difference keeps it."""
    vocab = {"▁Hello": 0, "▁world": 1, "!": 2, "▁again": 3, "<unk>": 4}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    hf.decoder = decoders.Metaspace()
    tok = TextTokenizer(hf, ChatTemplate(None), eos_token_ids=())
    ids = [0, 1, 2, 3, 1]
    assert _stream(tok, ids)[-1] == tok.decode(ids) == "Hello world! again world"


def test_a_decoder_that_rewrites_earlier_text_falls_back_to_full_decodes() -> None:
    class Reversing:
        eos_token_ids = ()

        def decode(self, token_ids: list[int]) -> str:
            return ByteTokenizer().decode(token_ids)[::-1]

    ids = ByteTokenizer().encode("abc")
    assert _stream(Reversing(), ids) == ["a", "ba", "cba"]  # type: ignore[arg-type]


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_smollm2_tokenizer_stream_equals_full_decode(
    real_model: LoadedModel, data: st.DataObject
) -> None:
    tok = real_model.tokenizer
    text = data.draw(st.text(alphabet="ab é€中文😀\n.,'", max_size=30))
    noise = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=10))
    ids = tok.encode(text) + noise + tok.encode(text[::-1])
    assert _stream(tok, ids) == [tok.decode(ids[:n]) for n in range(1, len(ids) + 1)]
