"""The attention math every execution path shares: the rotary position table (`RotaryEmbedding`)
and its rotation (`apply_rotary`), the per-layer attention rules (`AttentionSpec`: scale, soft-cap,
sliding window) and the attention over whole sequences (`causal_attention`, `spec_attention`).

The reference modules (reference.py) run them; the serving runtime's paged attention, the
evaluation's scoring and the native kernels' tests compare against them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lmfoundry.model.config import ModelConfig


def building_on_meta() -> bool:
    """Whether modules are being built under `torch.device("meta")` (the loaders' skeletons)."""
    return torch.empty(0).is_meta


class RotaryEmbedding(nn.Module):
    """Rotary position embedding: cos/sin tables from positions (any rope type of the config).

    A model with several rotary tables (Gemma 3: `config.rope_kinds`) gets them side by side,
    [..., T, head_dim * kinds]; `Attention` reads the head_dim columns of its layer's kind."""

    inv_freq: torch.Tensor  # the registered buffer [kinds, head_dim / 2]

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        tables = [config.rope_inv_freq(kind) for kind in config.rope_kinds]
        inv_freq = torch.stack([f for f, _ in tables])  # CPU tensors (`rope_inv_freq`)
        if building_on_meta():  # the loader rebuilds this module on CPU
            inv_freq = inv_freq.to("meta")
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = [scale for _, scale in tables]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = [], []
        for inv_freq, scale in zip(self.inv_freq, self.attention_scaling, strict=True):
            freqs = positions.float()[..., None] * inv_freq.float()
            emb = torch.cat((freqs, freqs), dim=-1)
            cos.append((emb.cos() * scale).to(dtype))
            sin.append((emb.sin() * scale).to(dtype))
        if len(cos) == 1:
            return cos[0], sin[0]
        return torch.cat(cos, dim=-1), torch.cat(sin, dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., T, heads, head_dim]; cos/sin: [..., T, head_dim] (cat(freqs, freqs) layout).

    The rotate-half rotation x·cos + cat(-x₂, x₁)·sin, written as one product and two in-place
    fused multiply-adds on the halves instead of materializing cat(-x₂, x₁): no tensor of x's
    size is allocated and written twice (it runs for every q and k of calibration and serving)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    h = x.shape[-1] // 2
    out = x * cos
    out[..., :h].addcmul_(x[..., h:], sin[..., :h], value=-1.0)
    out[..., h:].addcmul_(x[..., :h], sin[..., h:])
    return out


@dataclass(frozen=True)
class AttentionSpec:
    """How one layer's attention differs from causal softmax(q·kᵀ / sqrt(head_dim)) · v (Gemma):
    scores are q·kᵀ · `scale`, then `softcap` · tanh(scores / `softcap`) when set, then masked
    causally and, with `window`, to the keys at positions > query position - window."""

    scale: float
    softcap: float | None = None
    window: int | None = None

    def allowed(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Boolean mask [..., Tq, Tk]: key positions a query position may attend to."""
        ok = k_pos[..., None, :] <= q_pos[..., :, None]
        if self.window is not None:
            ok &= k_pos[..., None, :] > q_pos[..., :, None] - self.window
        return ok


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Full causal attention over whole sequences. q: [B, T, Hq, D], k/v: [B, T, Hkv, D]."""
    out = F.scaled_dot_product_attention(
        q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2), is_causal=True, enable_gqa=True
    )
    return out.transpose(-3, -2)


def spec_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec,
                   q_pos: torch.Tensor | None = None, k_pos: torch.Tensor | None = None,
                   allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Attention under `spec`. q: [..., Tq, Hq, D], k/v: [..., Tk, Hkv, D]; returns [..., Tq, Hq, D].

    Positions default to 0..T-1 (whole sequences); `allowed` ([..., Tq, Tk], True where a key is
    real) further restricts what the serving runtime's padded caches hold. Without a soft-cap this
    is one SDPA call with the scale and a window mask; with one (Gemma 2) the scores are formed
    explicitly in float32, capped, masked and softmaxed (transformers' eager order), since SDPA
    has no soft-cap. Query heads are grouped by KV head, so GQA needs no K/V repeat."""
    tq, hq, d = q.shape[-3:]
    tk, hkv = k.shape[-3], k.shape[-2]
    if q_pos is None:
        q_pos = torch.arange(tk - tq, tk, device=q.device)
    if k_pos is None:
        k_pos = torch.arange(tk, device=q.device)
    mask = spec.allowed(q_pos, k_pos)  # [..., Tq, Tk]
    if allowed is not None:
        mask = mask & allowed
    mask = mask.unsqueeze(-3)  # broadcast over heads
    if spec.softcap is None:
        out = F.scaled_dot_product_attention(q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2),
                                             attn_mask=mask, scale=spec.scale, enable_gqa=True)
        return out.transpose(-3, -2)
    g = hq // hkv
    lead = q.shape[:-3]
    qg = q.float().reshape(*lead, tq, hkv, g, d).movedim(-4, -2)  # [..., Hkv, G, Tq, D]
    kt = k.float().movedim(-3, -1).unsqueeze(-3)  # [..., Hkv, 1, D, Tk]
    scores = torch.matmul(qg, kt) * spec.scale  # [..., Hkv, G, Tq, Tk]
    scores = torch.tanh(scores / spec.softcap) * spec.softcap
    scores = scores.masked_fill(~mask.unsqueeze(-3), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v.float().movedim(-3, -2).unsqueeze(-3))  # [..., Hkv, G, Tq, D]
    return out.movedim(-2, -4).reshape(*lead, tq, hq, d).to(q.dtype)
