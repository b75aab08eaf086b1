"""Draft proposers, registered by name in ``PROPOSERS`` (importing this package registers them)."""

from specdraft.decode.proposers.base import PROPOSERS, Draft, ProposalInput, Proposer
from specdraft.decode.proposers import drafters as _drafters, hybrid as _hybrid, ngram as _ngram, none as _none  # noqa: F401  (register themselves)

__all__ = ["PROPOSERS", "Draft", "ProposalInput", "Proposer"]
