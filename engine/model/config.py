"""Llama-family architecture hyper-parameters (HF ``config.json`` names)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, object] | None = field(default=None, hash=False)
    tie_word_embeddings: bool = True
    head_dim: int | None = None

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )

    @classmethod
    def from_hf_dict(cls, d: dict[str, object]) -> LlamaConfig:
        """Build from a Hugging Face ``config.json`` dict (unknown keys ignored)."""
        names = set(cls.__dataclass_fields__)
        kwargs = {k: v for k, v in d.items() if k in names}
        kwargs.setdefault("num_key_value_heads", d["num_attention_heads"])
        return cls(**kwargs)  # type: ignore[arg-type]

    def to_hf_dict(self) -> dict[str, object]:
        """The ``config.json`` fields of a transformers ``LlamaConfig``."""
        return {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "head_dim": self.head_size,
        }
