"""Drafter models. Importing this package registers every family in ``METHODS``."""

from specdraft.models import dflash, dflash2, dspark, eagle3  # noqa: F401  (registration side effects)
from specdraft.models.base import METHODS, DrafterBatch, DrafterModel, MethodSpec, TrainOutput
from specdraft.models.common.drafter import load_drafter
from specdraft.models.common.sampling import DraftProposal

__all__ = ["METHODS", "DraftProposal", "DrafterBatch", "DrafterModel", "MethodSpec", "TrainOutput", "load_drafter"]
