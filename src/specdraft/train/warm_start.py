"""Warm starts for a fresh drafter: cheap-compute initialisations switched on in ``TrainConfig``.

The trainer checks the switches against the method once, before anything is built (``check_warm_start``),
and applies the pieces it chose (``apply_warm_start``) to the freshly built drafter of a fresh run (never on
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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from specdraft.errors import SpecdraftError, setting
from specdraft.models import METHODS
from specdraft.models.base import DrafterModel, WarmStart, WarmStartData
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
        """How the running command switches it off, or "" where it has no flag for it (the recipe does)."""
        flag = setting(self.switch)
        if not flag.startswith("--"):
            return ""
        return flag.replace("--", "--no-", 1) if self.off is False else f"{flag} {self.off}"


PIECES = (
    Piece("init_from_target", True, False),
    Piece("fc_init", "identity", "random"),
    Piece("markov_init", "bigram", "random"),
)


def check_warm_start(cfg: Any, method: str) -> dict[str, WarmStart]:
    """The switched-on pieces, in order, each with ``method``'s surgery; refused when one does not apply.
    The trainer calls it before anything is built or written and hands the result to ``apply_warm_start``."""
    surgery = METHODS.get(method).warm_starts
    chosen: dict[str, WarmStart] = {}
    for piece in PIECES:
        if not piece.enabled(cfg):
            continue
        if piece.name not in surgery:
            raise SpecdraftError(
                f"{piece.name} does not apply to method {method!r} (it applies to: {', '.join(piece.methods())}); "
                f"set `{piece.switch}: {str(piece.off).lower()}` in the recipe"
                + (f" or pass {piece.off_flag()}" if piece.off_flag() else "")
            )
        chosen[piece.name] = surgery[piece.name]
    return chosen


@torch.no_grad()
def apply_warm_start(drafter: DrafterModel, pieces: Mapping[str, WarmStart], inputs: WarmStartInputs) -> dict[str, list[str]]:
    """Apply ``pieces`` (``check_warm_start``'s) in order; returns {piece: tensors set} (also logged)."""
    data = WarmStartData(target=inputs.target, token_rows=inputs.token_rows, seed=int(inputs.cfg.seed))
    done: dict[str, list[str]] = {}
    for name, surgery in pieces.items():
        done[name] = tensors = surgery(drafter, data)
        log.info("warm start %s: initialised %d tensor(s): %s", name, len(tensors), ", ".join(tensors))
    return done
