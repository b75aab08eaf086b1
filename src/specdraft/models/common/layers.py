"""Transformer building blocks shared by every drafter family.

Parameter names (``q_proj``, ``input_layernorm``, ``mlp.gate_proj`` ...) are the HF Llama/Qwen3
names on purpose: they become the tensor names vLLM and ``speculators`` read from
``model.safetensors``. Attention always goes through ``scaled_dot_product_attention`` with an
explicit boolean mask (True = may attend), so packed rows, anchor blocks and training-time-test
diagonals are all just masks.

Shape symbols: N batch rows, L query tokens, M key tokens, H query heads, G key/value heads,
E head dim, D hidden size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``, computed in float32 like HF Llama/Qwen3."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class RotaryEmbedding(nn.Module):
    """Default (unscaled) RoPE: ``cos/sin`` tables for arbitrary position ids."""

    inv_freq: torch.Tensor  # buffer [E/2]

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [N, L] -> (cos, sin) each [N, 1, L, E], ready to broadcast over heads."""
        freqs = position_ids.to(torch.float32)[..., None] * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, L, E] rotated by the (cos, sin) of its own positions."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """GQA attention split into projection and attention steps.

    The split is what KV injection needs: DFlash projects the target's context features with
    ``project_kv`` only (no query, no output projection) and concatenates them in front of the
    block's own keys. ``in_dim`` may differ from ``hidden`` (EAGLE-3's q/k/v take 2D).
    """

    def __init__(self, *, in_dim: int, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, qk_norm: bool, eps: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(in_dim, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(in_dim, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(in_dim, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(*x.shape[:-1], n, self.head_dim)

    def project_q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [N, L, in_dim] -> q [N, H, L, E] (q-norm, then RoPE)."""
        q = self._heads(self.q_proj(x), self.num_heads)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rope(q.transpose(1, 2), cos, sin)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, M, in_dim] -> (k, v) each [N, G, M, E] (k-norm, then RoPE on k)."""
        k = self._heads(self.k_proj(x), self.num_kv_heads)
        if self.k_norm is not None:
            k = self.k_norm(k)
        v = self._heads(self.v_proj(x), self.num_kv_heads)
        return apply_rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [N, H, L, E], k/v [N, G, M, E], mask bool [N or 1, 1, L, M] -> [N, L, D]."""
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer; subclasses decide what the attention's input and residual are."""

    def __init__(
        self, *, in_dim: int, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int, qk_norm: bool, eps: float
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = Attention(
            in_dim=in_dim, hidden=hidden, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, qk_norm=qk_norm, eps=eps
        )
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = SwiGLU(hidden, intermediate)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.post_attention_layernorm(x))
