"""The contract between drafter models, the trainer and the decoding runtime.

Shape symbols used on every field: B batch rows, T tokens per row, S stored hidden-state slots
(``LayerSlot``s, in manifest order), D target hidden size, V target vocabulary, K draft positions.

One drafter family lives in one package, ``models/<method>/``, and its :class:`MethodSpec` is the one place
generic code learns about it: the layer slots it reads, its warm starts, which decoding proposer runs it and
what vLLM can serve of it. Dependencies point one way (targets -> data -> hidden_states -> models -> decode ->
train -> eval -> integrations -> cli, ``tests/test_layering.py``), so each entry is written in this layer's
terms and the higher layers read it:

* layer slots: a function of the target's layer count; the package also registers it as the ``extract --method``
  preset in ``hidden_states.layers.LAYER_PRESETS`` (a lower layer's registry, filled from above);
* warm starts: pure weight surgery on the drafter and the target (:class:`WarmStartData`), keyed by the
  training switch that turns each on; ``train/warm_start.py`` owns the switches and calls them;
* proposer: decoding is a higher layer, so a proposer class cannot live here; the spec names a proposer kind of
  ``decode.proposers.drafters.PROPOSER_KINDS`` (``block`` or ``chain``) and the keyword options it takes for a
  built drafter;
* serving: :class:`VllmServing`, plain facts and a function of the checkpoint's ``config.json`` that
  ``integrations/vllm/serve.py`` reads.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import torch
from torch import nn

from specdraft.hidden_states.layers import LayerSlot, parse_slots
from specdraft.registry import Registry

if TYPE_CHECKING:
    import numpy as np

    from specdraft.targets.base import Target


@dataclass
class DrafterBatch:
    """One training batch built from hidden-state payloads (rows may hold several packed samples).

    token_ids:   [B, T] int64  target token ids
    loss_mask:   [B, T] bool   True where the token is a response (assistant) token
    segment_ids: [B, T] int32  packed-sample id per token; -1 marks padding. Attention, anchors and
                               labels never cross a segment boundary.
    position_ids:[B, T] int64  position inside its own sample (restarts at 0 per segment)
    aux_hidden:  [B, T, S, D]  the method's target hidden states (slots in ``layer_slots`` order)
    last_hidden: [B, T, D]     input of the target's final norm (target logits = head(norm(.)))
    """

    token_ids: torch.Tensor
    loss_mask: torch.Tensor
    segment_ids: torch.Tensor
    position_ids: torch.Tensor
    aux_hidden: torch.Tensor
    last_hidden: torch.Tensor

    def to(self, device: torch.device | str) -> DrafterBatch:
        return DrafterBatch(**{k: v.to(device) for k, v in vars(self).items()})


@dataclass
class TrainOutput:
    """What one training forward returns: the scalar to minimise and metrics for the trainer to log.

    loss:         []  scalar, differentiable
    metrics:      name -> float (loss terms, ...), already detached
    position_acc: [K] float  accuracy at draft position k (1-based k = index + 1), over valid labels
    position_cond_acc: [K] float  accuracy at k given positions < k were all correct
    position_count: [K] float number of supervised labels at position k (for weighted averaging)
    """

    loss: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)
    position_acc: torch.Tensor | None = None
    position_cond_acc: torch.Tensor | None = None
    position_count: torch.Tensor | None = None


class DrafterModel(nn.Module, ABC):
    """A drafter network. Frozen target pieces (embedding, LM head, final norm) are buffers or
    ``requires_grad=False`` parameters that ``save_pretrained`` writes only where vLLM expects them."""

    method: ClassVar[str]

    @abstractmethod
    def training_forward(self, batch: DrafterBatch) -> TrainOutput:
        """Teacher-forced forward + loss over one batch."""

    @abstractmethod
    def save_pretrained(self, directory: str | Path) -> None:
        """Write ``config.json`` (speculators format) + ``model.safetensors`` atomically."""

    @classmethod
    @abstractmethod
    def from_pretrained(cls, directory: str | Path, **kwargs: Any) -> DrafterModel:
        """Load a checkpoint written by us or by the ``speculators`` package."""


@dataclass
class WarmStartData:
    """What a warm start may read besides the drafter it initialises."""

    target: Target
    token_rows: Callable[[], list[tuple[np.ndarray, np.ndarray]]]  # [(token ids, loss mask)] of the training split
    seed: int  # for any randomness (the same on every rank)


WarmStart = Callable[[DrafterModel, WarmStartData], list[str]]  # -> names of the tensors it set


@dataclass(frozen=True)
class VllmServing:
    """What vLLM (0.32) serves of a family."""

    cpu: bool = True  # the vLLM-CPU model runner has this family's proposer
    adaptive_verification: bool = False  # vLLM can size verification from the drafter's confidences
    # (checkpoint config.json, its trained draft tokens, the requested draft tokens or None, adaptive verification asked,
    #  the checkpoint's name for messages) -> extra ``--speculative-config`` entries; raises for what vLLM cannot serve
    options: Callable[[dict, int, int | None, bool, str], dict] | None = None


Drafter = TypeVar("Drafter", bound=DrafterModel)


@dataclass(frozen=True)
class MethodSpec(Generic[Drafter]):
    """Everything generic code needs to know about one drafter family (see the module docstring); typed by its
    drafter class, so ``proposer_options`` may read that class's own attributes."""

    name: str
    config_cls: type
    model_cls: type[Drafter]
    layer_slots: Callable[[int], list[LayerSlot]]  # num target layers -> slots the method reads
    build: Callable[..., Drafter]  # (config, target, *, counts=None) -> drafter with the target's frozen pieces
    # (counts: int64[V] response-token frequencies; EAGLE-3 picks its draft vocabulary from them)
    proposer: str | None = None  # the decoding proposer kind (``decode.proposers.drafters.PROPOSER_KINDS``); None: not decodable
    proposer_options: Callable[[Drafter], dict] = lambda drafter: {}  # keyword options of that kind for a built drafter
    warm_starts: Mapping[str, WarmStart] = field(default_factory=dict)  # training switch (e.g. "fc_init=identity") -> surgery
    serving: VllmServing = VllmServing()

    def run_slots(self, overrides: Mapping[str, Any], num_layers: int) -> list[LayerSlot]:
        """The slots a run with ``--model`` ``overrides`` reads from a target of ``num_layers`` decoder layers: the
        ``layers`` override, else the preset (of ``num_target_layers`` when overridden, as the built config resolves
        it). One answer for the trainer's plan and the slots an online source requests, so the two cannot differ."""
        num_layers = int(overrides.get("num_target_layers") or num_layers)
        layers = overrides.get("layers")
        return parse_slots(layers, num_layers) if layers else self.layer_slots(num_layers)


METHODS: Registry[MethodSpec[Any]] = Registry("drafter method")
