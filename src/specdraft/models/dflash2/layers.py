"""DFlash2's two additions to the DFlash block, as speculators 0.9.0 defines them and vLLM 0.32 serves them.

Grouped convolution: around each draft layer's attention and MLP, ``prepare`` mixes every block slot with
the slots before it in the same block (``kernel_size`` causal taps, never across blocks) using
per-token kernels = ``base_kernel`` (per channel) + a projection of the slot's own input (per group of
``group_size`` channels); ``finish`` applies the output-side kernel from that same projection to the
sublayer's output. Identity-initialised (base tap 0 = 1, the rest and the projection 0), so a fresh
DFlash2 computes what a DFlash with the same weights does.

Candidate selector: after the unary head, the top-k candidates at each slot are rescored with
unary logit + <P[x_{k-1}] * W h_k, S[candidate]>, a bilinear transition from the previous token.
"""

from __future__ import annotations

import torch
from torch import nn

from specdraft.models.dflash.model import KV, DFlashLayer
from specdraft.models.dflash2.config import DFlash2Config


def block_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, *, block_size: int) -> torch.Tensor:
    """Token-conditioned grouped causal convolution inside each block.

    x [N, L, D] (L a multiple of block_size, blocks laid end to end), delta [N, L, K, G], base [K, D] -> [N, L, D]:
    out[t] = sum_tap (base[tap] + delta[t, tap]) * x[t - tap], the term dropped where t - tap leaves t's block.
    """
    n, length, d = x.shape
    taps, groups = delta.shape[-2:]
    blocks = x.view(n, length // block_size, block_size, groups, d // groups)
    coef = base.to(x.dtype).view(taps, groups, d // groups) + delta.reshape(n, length // block_size, block_size, taps, groups)[..., None]
    out = blocks * coef[..., 0, :, :]
    for tap in range(1, taps):
        shifted = torch.cat([blocks.new_zeros(n, blocks.shape[1], tap, groups, d // groups), blocks[:, :, :-tap]], dim=2)
        out = out + shifted * coef[..., tap, :, :]
    return out.view(n, length, d)


class GroupedConv(nn.Module):
    """The input-side and output-side convolutions of one sublayer (``base_kernel[0]`` / ``[1]``)."""

    def __init__(self, hidden: int, *, block_size: int, taps: int, group_size: int):
        super().__init__()
        self.block_size, self.taps, self.groups = block_size, taps, hidden // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, taps, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * taps * self.groups, bias=False)
        self.reset_identity()

    def reset_identity(self) -> None:
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [N, L, D] -> (convolved h, the output-side delta kernels [N, L, K, G])."""
        kernels = self.kernel_projection(h).view(*h.shape[:-1], 2, self.taps, self.groups)
        return block_conv(h, kernels[..., 0, :, :], self.base_kernel[0], block_size=self.block_size), kernels[..., 1, :, :]

    def finish(self, out: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return block_conv(out, delta, self.base_kernel[1], block_size=self.block_size)


class DFlash2Layer(DFlashLayer):
    """A DFlash layer (KV injection unchanged: the context features bypass the convolutions) with a
    grouped convolution around its attention and around its MLP."""

    def __init__(self, c: DFlash2Config):
        super().__init__(c)
        width = c.dims().hidden_size
        self.attention_conv = GroupedConv(width, block_size=c.block_size, taps=c.conv_kernel_size, group_size=c.conv_group_size)
        self.mlp_conv = GroupedConv(width, block_size=c.block_size, taps=c.conv_kernel_size, group_size=c.conv_group_size)

    def forward(self, x: torch.Tensor, context_kv: KV, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h, delta = self.attention_conv.prepare(self.input_layernorm(x))
        q = self.self_attn.project_q(h, cos, sin)
        k, v = self.self_attn.project_kv(h, cos, sin)
        attn = self.self_attn.attend(q, torch.cat([context_kv[0], k], dim=2), torch.cat([context_kv[1], v], dim=2), mask)
        x = x + self.attention_conv.finish(attn, delta)
        h, delta = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), delta)


class CandidateSelector(nn.Module):
    """Bilinear reranker of the unary top-k (names and shapes are the checkpoint's)."""

    def __init__(self, *, vocab_size: int, hidden: int, rank: int, top_k: int, std: float = 0.02):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)
        for weight in (self.predecessor_codebook, self.successor_codebook, self.hidden_projection.weight):
            nn.init.normal_(weight, std=std)

    def scores(self, unary: torch.Tensor, hidden: torch.Tensor, prev_ids: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """unary logits [..., V], hidden [..., D], previous token ids [...], candidate ids [..., C] -> scores [..., C]."""
        context = self.predecessor_codebook[prev_ids] * self.hidden_projection(hidden).to(self.predecessor_codebook.dtype)
        transition = (context.unsqueeze(-2) * self.successor_codebook[candidates]).sum(-1)
        return unary.gather(-1, candidates) + transition.to(unary.dtype)
