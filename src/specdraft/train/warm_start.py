"""Warm starts for a fresh drafter: cheap-compute initialisations switched on in ``TrainConfig``.

The trainer calls ``apply_warm_start`` once, on a freshly built drafter of a fresh run (never on
resume: the checkpoint already holds trained weights), so a ``--dry-run`` checkpoint holds them.
This module owns the switches; the weight surgery belongs to each family, listed in its
``MethodSpec.warm_starts`` under the switch's name (``models/common/warm_start.py`` for the shared
pieces, ``models/<method>/warm_start.py`` for its own). A family that lacks a piece does not list it,
and asking for it is an error naming the switch to turn off.

* ``init_from_target``: draft layers start as the target's last layers where those compute the same;
* ``fc_init=identity``: the fc fusing the captured slots starts as the identity on one slot;
* ``markov_init=bigram`` (DSpark): the Markov head starts from the training split's bigram log-odds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from specdraft.errors import SpecdraftError
from specdraft.models import METHODS
from specdraft.models.base import DrafterModel, WarmStartData
from specdraft.targets.base import Target

log = logging.getLogger(__name__)

FC_INITS = ("random", "identity")
MARKOV_INITS = ("random", "bigram")


@dataclass
class WarmStartInputs:
    """What a piece may read: the target, the training split's token rows, the config."""

    target: Target
    cfg: Any  # TrainConfig
    token_rows: Callable[[], list[tuple[np.ndarray, np.ndarray]]]  # [(token ids, loss mask)] of the training split


@dataclass(frozen=True)
class Piece:
    """One switch of ``TrainConfig``: on when ``cfg.<switch> == on``; families list it under ``name``."""

    switch: str
    on: Any
    off: Any

    @property
    def name(self) -> str:
        return self.switch if self.on is True else f"{self.switch}={self.on}"

    def enabled(self, cfg: Any) -> bool:
        return getattr(cfg, self.switch) == self.on

    def methods(self) -> list[str]:
        """The families that take this piece."""
        return [m for m in METHODS.names() if self.name in METHODS.get(m).warm_starts]

    def off_flag(self) -> str:
        flag = "--" + self.switch.replace("_", "-")
        return flag.replace("--", "--no-", 1) if self.off is False else f"{flag} {self.off}"


PIECES = (
    Piece("init_from_target", True, False),
    Piece("fc_init", "identity", "random"),
    Piece("markov_init", "bigram", "random"),
)


def check_warm_start(cfg: Any, method: str) -> None:
    """Refuse a switched-on piece that does not apply to ``method`` (before anything is built)."""
    for piece in PIECES:
        if piece.enabled(cfg) and piece.name not in METHODS.get(method).warm_starts:
            raise SpecdraftError(
                f"{piece.name} does not apply to method {method!r} (it applies to: {', '.join(piece.methods())}); "
                f"set `{piece.switch}: {str(piece.off).lower()}` in the recipe or pass {piece.off_flag()}"
            )


@torch.no_grad()
def apply_warm_start(drafter: DrafterModel, method: str, inputs: WarmStartInputs) -> dict[str, list[str]]:
    """Apply every switched-on piece in order; returns {piece: tensors set} (also logged)."""
    check_warm_start(inputs.cfg, method)
    data = WarmStartData(target=inputs.target, token_rows=inputs.token_rows, seed=int(inputs.cfg.seed))
    surgery = METHODS.get(method).warm_starts
    done: dict[str, list[str]] = {}
    for piece in PIECES:
        if piece.enabled(inputs.cfg):
            done[piece.name] = tensors = surgery[piece.name](drafter, data)
            log.info("warm start %s: initialised %d tensor(s): %s", piece.name, len(tensors), ", ".join(tensors))
    return done
