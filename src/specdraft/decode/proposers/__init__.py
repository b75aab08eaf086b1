"""Draft proposers, registered by name in ``PROPOSERS`` (importing this package registers them)."""

from specdraft.decode.proposers import drafters, hybrid, ngram, none  # noqa: F401  (importing them registers them)
from specdraft.decode.proposers.base import PROPOSERS, Draft, ProposalInput, Proposer

__all__ = ["PROPOSERS", "Draft", "ProposalInput", "Proposer"]
