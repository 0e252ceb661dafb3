"""Rotary position embeddings (HF ``rotate_half`` convention), with rope scaling.

Supported ``rope_scaling`` types: none/"default", "linear" (positions / factor) and
"llama3" (frequency-dependent wavelength scaling with ``factor``,
``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``).
"""

from __future__ import annotations

import math

import torch

from engine.model.config import LlamaConfig


def inv_frequencies(cfg: LlamaConfig) -> torch.Tensor:
    """Per-pair inverse frequencies [head_size / 2], float32, scaling applied."""
    d = cfg.head_size
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = cfg.rope_scaling or {}
    kind = str(scaling.get("rope_type", scaling.get("type", "default")))
    if kind in ("default", "None"):
        return inv
    factor = float(scaling["factor"])  # type: ignore[arg-type]
    if kind == "linear":
        return inv / factor
    if kind == "llama3":
        return _llama3(inv, factor, scaling)
    raise ValueError(f"unsupported rope_scaling type {kind!r}")


def _llama3(inv: torch.Tensor, factor: float, s: dict[str, object]) -> torch.Tensor:
    low = float(s.get("low_freq_factor", 1.0))  # type: ignore[arg-type]
    high = float(s.get("high_freq_factor", 4.0))  # type: ignore[arg-type]
    old_len = float(s.get("original_max_position_embeddings", 8192))  # type: ignore[arg-type]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding:
    """Precomputed cos/sin tables; :meth:`apply` rotates q and k in place-free style."""

    def __init__(
        self, cfg: LlamaConfig, max_positions: int, dtype: torch.dtype, device: str
    ) -> None:
        inv = inv_frequencies(cfg)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = pos[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(dtype=dtype, device=device)
        self.sin = emb.sin().to(dtype=dtype, device=device)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, D] at ``positions`` [T]: looked up once per step, used by
        every layer (:func:`rotate`)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [T, heads, D] at ``positions`` [T]."""
        cos, sin = self.tables(positions)
        return rotate(x, cos, sin)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` [T, heads, D] rotated by the tables of :meth:`RotaryEmbedding.tables`."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
