"""The empty proposer: plain autoregressive decoding through the speculative runtime."""

from __future__ import annotations

from specdraft.decode.config import DecodeConfig
from specdraft.decode.proposers.base import PROPOSERS, Draft, ProposalInput, Proposer
from specdraft.targets.base import Target


class NoDraftProposer(Proposer):
    """Proposes nothing: every round verifies zero drafts, i.e. plain autoregressive decoding
    through exactly the same runtime (the baseline speedups are measured against)."""

    def propose(self, inputs: ProposalInput) -> Draft:
        return Draft.empty(len(inputs.tokens), inputs.max_draft.device)


@PROPOSERS.register("none")
def build_no_draft(config: DecodeConfig, target: Target | None = None) -> Proposer:
    return NoDraftProposer()
