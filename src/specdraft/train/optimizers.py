"""Optimizers of the trainer, registered by name in ``OPTIMIZERS`` (``TrainConfig.optimizer``).

* ``adamw``: AdamW over every trainable tensor; weight decay on matrices only (norm gains and biases
  are not shrunk towards 0).
* ``muon``: Muon (momentum, then the update orthogonalised by a Newton-Schulz iteration) on the hidden
  weight matrices, AdamW on everything else: norms, biases, vectors and the vocabulary-sized matrices
  (embeddings, LM heads, Markov factors), whose rows are per-token and must not be mixed. Muon moves
  every direction of a matrix at the same rate, where AdamW's first steps follow the few largest
  gradient directions; speculators 0.9.0 trains with it. On the head-to-head store (2 epochs, 93 steps)
  it did not help our DFlash drafter (decoded tau 1.086 vs 1.090 with AdamW, docs/results/peer_compare.md),
  so the recipes keep AdamW. Its step size is
  scaled to AdamW's update RMS (0.2 * sqrt(max(rows, cols))), so one ``lr`` serves both groups and the
  learning-rate schedule applies to both. Its matrix step is ``torch.optim.Muon`` with
  ``adjust_lr_fn="match_rms_adamw"``, speculators' setting, up to torch's bf16 Newton-Schulz (ours iterates in fp32;
  tests/test_optimizers.py); it is written out here so that both halves are one optimizer on any torch.

Both are one ``torch.optim.Optimizer`` with tensor state, so checkpoints, resume and the distributed
state-dict helpers treat them alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import nn

from specdraft.errors import SpecdraftError
from specdraft.registry import Registry

__all__ = ["OPTIMIZERS", "MuonAdamW", "muon_eligible", "orthogonalise"]

#: name -> build(module, lr, betas, weight_decay, fused_loops) -> optimizer
OPTIMIZERS: Registry[Callable[..., torch.optim.Optimizer]] = Registry("optimizer")
#: 2-D parameters whose name contains one of these are vocabulary-sized (one row per token): AdamW.
VOCABULARY_MATRICES = ("embed", "lm_head", "markov")
#: Quintic Newton-Schulz coefficients: five steps take every singular value of a unit-norm matrix to ~[0.7, 1.2].
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def muon_eligible(name: str, param: torch.Tensor) -> bool:
    """A hidden weight matrix: 2-D, both sides > 1, not one of the vocabulary-sized matrices."""
    return param.ndim == 2 and min(param.shape) > 1 and not any(hint in name for hint in VOCABULARY_MATRICES)


def orthogonalise(update: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The nearest semi-orthogonal matrix to ``update`` (approximately: U V^T of its SVD), in fp32."""
    x = update.float()
    tall = x.shape[0] > x.shape[1]
    if tall:  # iterate on the short side: X X^T is the smaller Gram matrix
        x = x.T
    x = x / (x.norm() + 1e-7)
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the parameter groups marked ``muon: True``, AdamW on the others (see module doc)."""

    def __init__(
        self,
        groups: list[dict],
        *,
        lr: float,
        betas: tuple[float, float],
        weight_decay: float,
        momentum: float = 0.95,
        ns_steps: int = 5,
        eps: float = 1e-8,
    ):
        defaults = {
            "lr": lr,
            "betas": betas,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "ns_steps": ns_steps,
            "eps": eps,
            "muon": False,
        }
        super().__init__(groups, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                (self._muon if group["muon"] else self._adamw)(p, group)
        return loss

    def _muon(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p)
        buf = state["momentum_buffer"]
        grad = p.grad
        assert grad is not None  # step() skips parameters without a gradient
        buf.mul_(group["momentum"]).add_(grad)
        update = orthogonalise(grad.add(buf, alpha=group["momentum"]), group["ns_steps"])  # Nesterov
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(update.to(p.dtype), alpha=-group["lr"] * 0.2 * math.sqrt(max(p.shape)))

    def _adamw(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] += 1
        step = float(state["step"])
        b1, b2 = group["betas"]
        state["exp_avg"].lerp_(p.grad, 1 - b1)
        state["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
        denom = (state["exp_avg_sq"] / (1 - b2**step)).sqrt_().add_(group["eps"])
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - b1**step))


def _trainable(module: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if not named:
        raise SpecdraftError("the drafter has no trainable parameters")
    return named


@OPTIMIZERS.register("adamw")
def build_adamw(
    module: nn.Module, *, lr: float, betas: tuple[float, float], weight_decay: float, fused_loops: bool
) -> torch.optim.Optimizer:
    named = _trainable(module)
    groups = [
        {"params": [p for _, p in named if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas, foreach=fused_loops)


@OPTIMIZERS.register("muon")
def build_muon(
    module: nn.Module, *, lr: float, betas: tuple[float, float], weight_decay: float, fused_loops: bool
) -> torch.optim.Optimizer:
    named = _trainable(module)
    groups = [
        {"params": [p for n, p in named if muon_eligible(n, p)], "muon": True, "weight_decay": weight_decay},
        {"params": [p for n, p in named if not muon_eligible(n, p) and p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for n, p in named if p.ndim < 2], "weight_decay": 0.0},
    ]
    return MuonAdamW([g for g in groups if g["params"]], lr=lr, betas=betas, weight_decay=weight_decay)
