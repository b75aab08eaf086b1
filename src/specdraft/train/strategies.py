"""The parallel strategies (single process, DDP, FSDP2): what a run resumes from, and how each strategy wraps and saves it.

``TrainState`` is the one resumable state of a run (the wrapped step module, optimizer, schedule,
step); ``train/checkpoint_files.py`` is its file format. A ``Checkpointer`` writes it: full (unsharded)
states, the weight check that keeps NaN/inf out of every checkpoint, pruning, the final drafter.
``Checkpointer`` serves replicated parameters (one process, DDP); ``ShardedCheckpointer`` serves FSDP2,
whose sharded parameters cannot go through ``save_pretrained``: rank 0 keeps an unsharded CPU replica
of the drafter and loads the gathered full state into it before each save. ``STRATEGIES`` pairs each
strategy's wrapping with its checkpointer.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specdraft.errors import SpecdraftError, setting
from specdraft.models.base import DrafterModel
from specdraft.models.common.checkpoint import DRAFTER_DIR
from specdraft.registry import Registry
from specdraft.train import checkpoint_files as ckpt
from specdraft.train.distributed import Dist


@dataclass
class TrainState:
    """Everything a checkpoint holds and a resume restores; the data position is a function of ``step``."""

    module: nn.Module  # the step module, wrapped for the strategy
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    frozen: frozenset[str]  # state-dict names of the frozen target pieces: never stored, never restored
    step: int = 0

    def restore(self, saved: dict, optim_state: dict) -> None:
        """Load the optimizer and schedule of checkpoint state ``saved`` (the model state went in before wrapping)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        if optim_state["state"]:
            set_optimizer_state_dict(self.module, self.optimizer, optim_state, options=StateDictOptions(full_state_dict=True))
        self.scheduler.load_state_dict(saved["scheduler"])
        self.step = int(saved["step"])

    def full_states(self) -> tuple[dict, dict]:
        """Unsharded, CPU copies of the trainable model state and the optimizer state (a collective)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state = {k: v for k, v in get_model_state_dict(self.module, options=options).items() if k not in self.frozen}
        if not self.optimizer.state:
            # Before the first step: get_optimizer_state_dict would materialise the state with a dummy
            # step (step=1), which a resume would then wrongly count as a real update.
            return model_state, {"state": {}, "param_groups": []}
        return model_state, get_optimizer_state_dict(self.module, self.optimizer, options=options)


class Checkpointer:
    """Saves a run whose every rank holds the whole drafter (one process, DDP): rank 0 writes it."""

    def __init__(
        self, drafter: DrafterModel, *, out: Path, keep: int, dist: Dist, device: torch.device, last_saved: int, meta: Callable[[int], dict]
    ):
        """Made before the step module is wrapped; ``last_saved`` is the resumed checkpoint's step (-1: none),
        ``meta(step)`` the run facts stored beside the tensors (called after the states are gathered)."""
        self.drafter, self.out, self.keep, self.dist, self.device = drafter, out, keep, dist, device
        self.last_saved, self.meta = last_saved, meta

    def current_drafter(self, state: TrainState) -> DrafterModel:
        """The drafter with the current weights, to save or decode with on rank 0 (every rank calls it)."""
        return self.drafter

    def failure(self, what: str, at_step: int) -> SpecdraftError:
        """The error that stops a run whose step went non-finite, naming the checkpoint a rerun resumes from."""
        kept = (
            f"the last good checkpoint, {self.out / ckpt.CHECKPOINTS / f'step-{self.last_saved}'}, is kept (a rerun resumes from it)"
            if self.last_saved >= 0
            else "no checkpoint had been written yet"
        )
        return SpecdraftError(
            f"training stopped at step {at_step}: {what}; nothing from this step on was saved and {kept}. "
            f"Lower {setting('lr')}, check {setting('grad_clip')} and {setting('weight_decay')}, or look for broken samples in the data"
        )

    def check_weights(self, state: TrainState) -> None:
        """Never write a checkpoint or final drafter with NaN/inf weights (a step can blow them up with a finite loss)."""
        bad = _non_finite_parameter(state.module)
        if self.dist.any(bad is not None, self.device):
            raise self.failure(f"parameter {bad or '(on another rank)'} is not finite", state.step)

    def save(self, state: TrainState) -> Path:
        """Write ``checkpoints/step-N`` for the state's step and prune old ones (a collective)."""
        self.check_weights(state)
        self.last_saved = state.step
        path = self.out / ckpt.CHECKPOINTS / f"step-{state.step}"
        model_state, optim_state = state.full_states()
        meta = self.meta(state.step)
        if self.dist.main:
            ckpt.save_checkpoint(
                path,
                drafter=self._savable(model_state),
                model_state=model_state,
                optim_state=optim_state,
                scheduler_state=state.scheduler.state_dict(),
                meta=meta,
            )
            ckpt.prune_checkpoints(self.out, self.keep)
        self.dist.barrier()
        return path

    def save_final(self, state: TrainState, extra: Callable[[Path], object]) -> Path:
        """Write ``OUT/final``: the drafter, and what ``extra(directory)`` adds (the model card)."""
        final = self.out / ckpt.FINAL
        self.check_weights(state)
        module = self.current_drafter(state)
        if self.dist.main:
            with ckpt.atomic_dir(final, DRAFTER_DIR) as tmp:
                module.save_pretrained(tmp)
                extra(tmp)
        self.dist.barrier()
        return final

    def _savable(self, model_state: dict[str, torch.Tensor]) -> DrafterModel:
        return self.drafter


class ShardedCheckpointer(Checkpointer):
    """Saves an FSDP2 run through an unsharded CPU replica on rank 0, loaded with the gathered full state."""

    def __init__(self, drafter: DrafterModel, **kwargs: Any) -> None:
        super().__init__(drafter, **kwargs)
        self.replica = copy.deepcopy(drafter).cpu() if self.dist.main else None

    def current_drafter(self, state: TrainState) -> DrafterModel:
        return self._savable(state.full_states()[0])  # a collective: every rank calls it

    def _savable(self, model_state: dict[str, torch.Tensor]) -> DrafterModel:
        if self.replica is None:
            return self.drafter
        prefix = "drafter."
        self.replica.load_state_dict({k[len(prefix) :]: v for k, v in model_state.items() if k.startswith(prefix)}, strict=False)
        return self.replica


def _non_finite_parameter(module: nn.Module) -> str | None:
    """The name of the first trainable parameter holding NaN/inf on this rank (its local shard under FSDP), or None."""
    for name, p in module.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if p.requires_grad and not bool(torch.isfinite(local.detach()).all()):
            return name
    return None


# ---------------------------------------------------------------------------------------------
# Parallel strategies: how the step module is wrapped, and which checkpointer saves it.


@dataclass(frozen=True)
class Strategy:
    wrap: Callable[[nn.Module, torch.device], nn.Module]
    checkpointer: type[Checkpointer] = Checkpointer


def _ddp_wrap(module: nn.Module, device: torch.device) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None)


def _fsdp_wrap(module: nn.Module, device: torch.device) -> nn.Module:
    """Shard the step module over every process, as one FSDP2 unit (drafters are small; per-layer units would need
    method knowledge). With ``--sequence-parallel N`` the processes are the data x sequence mesh (``Dist``) and the
    shards span all of it, data x N (TorchTitan's ``dp_shard_cp``), not only the data dimension: the N ranks of a
    sequence group need the same whole parameters in every forward anyway, so sharding over them too divides the
    parameter, gradient and optimizer memory by data x N instead of data, for the same one all-gather and one
    reduce-scatter per step (HSDP, replicating over the sequence dimension, would add an all-reduce and keep N
    copies). The reduce-scatter averages over every process, as DDP's all-reduce does: per group, the mean of its N
    ranks' gradients is the one-process gradient of its batch (``sequence_parallel.py``)."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(module)  # the default mesh: every process, the data x sequence mesh flattened
    return module


STRATEGIES: Registry[Strategy] = Registry("parallel strategy")
STRATEGIES.register("single")(Strategy(wrap=lambda m, d: m))
STRATEGIES.register("ddp")(Strategy(wrap=_ddp_wrap))
STRATEGIES.register("fsdp")(Strategy(wrap=_fsdp_wrap, checkpointer=ShardedCheckpointer))


def strategy_name(parallel: str, world: int) -> str:
    """The strategy of ``--parallel`` with ``world`` processes: FSDP when asked, else DDP across several, else single."""
    return "fsdp" if parallel == "fsdp" else ("ddp" if world > 1 else "single")
