"""Rotary position embeddings as plain tensors: compressors that re-score or re-position keys
(KVzip's probes, Quest's pages, ExpectedAttention's future queries) rotate and unrotate with them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Rope:
    """A Llama-style rotary embedding as plain tensors (cheap to copy with a compressed KV)."""

    inv_freq: torch.Tensor  # [head_dim / 2], float32
    scaling: float = 1.0

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` shaped ``[*positions.shape, head_dim]`` (float32)."""
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq.to(positions.device)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos() * self.scaling, emb.sin() * self.scaling

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE ``x`` ``[..., n, d]`` at ``positions`` ``[..., n]`` to post-RoPE (float32 math)."""
        cos, sin = self.cos_sin(positions)
        return apply_rope(x.float(), cos, sin).to(x.dtype)

    def unrotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos_sin(positions)
        return unapply_rope(x.float(), cos, sin).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[..., n, d]`` to the positions of ``cos, sin`` ``[..., n, d]`` (Llama RoPE)."""
    return x * cos + rotate_half(x) * sin


def unapply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The inverse rotation: post-RoPE back to pre-RoPE."""
    return x * cos - rotate_half(x) * sin
