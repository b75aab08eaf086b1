"""DFlash2 drafter: the DFlash parallel block with grouped convolutions in its layers and a candidate selector.

The backbone is DFlash's (anchor slot 0 is the bonus token, slots 1..B-1 draft; ``sample_from_anchor`` is
false, the only setting vLLM's DFlash-family runtime accepts). Slot k's unary logits U_k come from the
frozen target head on the full vocabulary; its drafted token is chosen among the unary top-k by the
selector's scores U_k[c] + T(x_{k-1}, h_k, c), x_0 the anchor, left to right. The draft distribution at
slot k is softmax(scores/T) over its top-k candidates (zero elsewhere; one-hot argmax at T=0): that is what
the verifier's rejection sampling divides by, so sampling stays exact.

No confidences: DFlash2 has no trained acceptance estimate, and the selector's softmax is normalised over
the k candidates only (blind to the target mass outside them), so it would overstate acceptance exactly
where the unary top-k misses; decoding therefore runs on the draft gate alone (the scheduled policy refuses it).

Training: the unary term is the config's ``distill_loss`` D(p_d, p_t) over the vocabulary (default KL(p_t || p_d),
speculators' default; p_t from the target head on the final-norm input before the predicted token) or DFlash's
hard-label CE (``unary_loss``); beside
it the selector's K-way cross-entropy on teacher-forced predecessors (the data tokens), both with DFlash's
position weights and, like DFlash, normalised by the weight sum (speculators divides by the supervised
count and labels its selector with the target's argmax: equal for greedy-regenerated data).
The position accuracy is the selector's: the teacher-forced reranked argmax equals the label and the
label was among the unary top-k (speculators' ``eal`` gate).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from specdraft.errors import SpecdraftError
from specdraft.models.base import DrafterBatch, TrainOutput
from specdraft.models.common.anchors import block_labels
from specdraft.models.common.chunked import chunked_rows
from specdraft.models.common.distill_losses import DISTILL_LOSSES, Distributions
from specdraft.models.common.metrics import position_metrics
from specdraft.models.common.sampling import Chain, DraftProposal
from specdraft.models.common.sequence import WHOLE_ROW, SequenceShard
from specdraft.models.common.weights import POSITION_WEIGHTS
from specdraft.models.dflash.loss import ce_rows, weighted_mean
from specdraft.models.dflash.model import DFlashDrafter, build_block_drafter
from specdraft.models.dflash2.config import DFlash2Config
from specdraft.models.dflash2.layers import CandidateSelector, DFlash2Layer
from specdraft.models.dflash2.loss import selector_ce, training_candidates
from specdraft.targets.base import Target

# The speculators fields DFlash2 adds to DFlash's; speculators 0.9.0 always writes them, so a checkpoint without them is refused.
SELECTOR_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


class DFlash2Drafter(DFlashDrafter):
    method: ClassVar[str] = "dflash2"
    config_cls = DFlash2Config
    architecture = "DFlash2DraftModel"
    layer_cls = DFlash2Layer
    config: DFlash2Config

    def __init__(self, config: DFlash2Config, verifier: dict | None = None):
        super().__init__(config, verifier)
        c, d = config, self.dims
        self.candidate_selector = CandidateSelector(
            vocab_size=d.vocab_size, hidden=d.hidden_size, rank=c.selector_rank, top_k=c.selector_top_k
        )

    # ----- format --------------------------------------------------------------------------
    def method_fields(self, aux_ids: list[int]) -> dict:
        return {**super().method_fields(aux_ids), **{name: getattr(self.config, name) for name in SELECTOR_FIELDS}}

    @classmethod
    def speculators_fields(cls, cfg: dict, *, where: str) -> dict:
        fields = super().speculators_fields(cfg, where=where)
        if fields["draft_vocab_size"] is not None:
            raise SpecdraftError(
                f"{where}: dflash2 draft_vocab_size {fields['draft_vocab_size']} is below the verifier vocabulary "
                f"{fields['vocab_size']}; DFlash2 needs the full vocabulary"
            )
        missing = [name for name in SELECTOR_FIELDS if not isinstance(cfg.get(name), int)]
        if missing:
            raise SpecdraftError(f"{where}/config.json: {', '.join(missing)} missing (or not an integer); required for a dflash2 drafter")
        return {**fields, **{name: int(cfg[name]) for name in SELECTOR_FIELDS}}

    # ----- training ------------------------------------------------------------------------
    def block_loss(self, batch: DrafterBatch, anchors: torch.Tensor, hidden: torch.Tensor, shard: SequenceShard = WHOLE_ROW) -> TrainOutput:
        """Unary term (KL or CE) + selector_weight * selector CE over slots 1..B-1, each weighted per position
        (``position_weighting``) and normalised by the weight sum; the CE is reported either way."""
        c = self.config
        labels, valid, pos = block_labels(
            batch.token_ids, batch.segment_ids, batch.loss_mask, anchors, self.label_offsets().to(anchors.device)
        )
        src = (pos - 1).clamp(min=0)  # the token before the label: x_{k-1} (the anchor for slot 1), and p_t's context
        prev = torch.gather(batch.token_ids, 1, src.flatten(1)).view_as(pos)
        h = hidden[:, :, self.draft_slots()]
        kl = c.unary_loss == "kl"
        norm = self.require_verifier() if kl else None
        distill = DISTILL_LOSSES.get(c.distill_loss)

        def rows(
            hr: torch.Tensor, lr: torch.Tensor, pr: torch.Tensor, tr: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
            unary = self.lm_logits(hr)
            candidates, index, found = training_candidates(unary, lr, c.selector_top_k)
            scores = self.candidate_selector.scores(unary, hr, pr, candidates)
            picked = candidates.gather(-1, scores.detach().argmax(-1, keepdim=True))[:, 0]
            ce = ce_rows(logits=unary, labels=lr)
            div = distill(Distributions(unary, self.verifier_lm_head(norm(tr.to(hr.dtype))))) if norm is not None else ce
            return ce, div, selector_ce(scores, index), (picked == lr) & found

        last = (
            batch.last_hidden[torch.arange(src.shape[0], device=src.device)[:, None, None].expand_as(src)[valid], src[valid]]
            if kl
            else hidden.new_zeros(int(valid.sum()), 0)
        )
        ce_v, unary_v, sel_v, ok_v = chunked_rows(rows, h[valid], labels[valid], prev[valid], last, chunk_rows=c.loss_chunk_rows)

        def spread(values: torch.Tensor) -> torch.Tensor:
            return torch.zeros(valid.shape, dtype=values.dtype, device=h.device).masked_scatter(valid, values)

        correct = torch.zeros_like(valid).masked_scatter(valid, ok_v)
        weights = POSITION_WEIGHTS.get(c.position_weighting)(torch.exp(-spread(ce_v).detach()), valid, gamma=c.gamma, alpha=c.dpace_alpha)
        terms = {
            "ce": weighted_mean(spread(ce_v), weights, valid, total=shard.total),
            "selector": weighted_mean(spread(sel_v), weights, valid, total=shard.total),
        }
        unary = c.distill_loss if kl else "ce"
        terms[unary] = weighted_mean(spread(unary_v), weights, valid, total=shard.total) if kl else terms["ce"]
        loss = terms[unary] + c.selector_weight * terms["selector"]
        acc, cond, count = position_metrics(correct.flatten(0, 1), valid.flatten(0, 1), total=shard.total)
        metrics = {"loss": float(loss.detach()), **{k: float(t.detach()) for k, t in terms.items()}}
        return TrainOutput(loss=loss, metrics=metrics, position_acc=acc, position_cond_acc=cond, position_count=count)

    # ----- inference -----------------------------------------------------------------------
    def propose(self, hidden: torch.Tensor, *, anchor_token: int, temperature: float, generator: torch.Generator | None) -> DraftProposal:
        """Left to right over slots 1..B-1: x_k ~ softmax(scores_k(x_{k-1})/T) over the unary top-k."""
        h = hidden[self.draft_slots()]
        unary = self.lm_logits(h)
        candidates = unary.topk(self.config.selector_top_k, dim=-1).indices
        prev = torch.tensor(anchor_token, device=h.device)
        chain, tokens = Chain(temperature=temperature, generator=generator), []
        for k in range(h.shape[0]):
            scores = self.candidate_selector.scores(unary[k], h[k], prev, candidates[k])

            def probs_of(p: torch.Tensor, k: int = k) -> torch.Tensor:
                return p.new_zeros(self.dims.vocab_size).index_copy_(0, candidates[k], p)

            choice = chain.draw(scores, probs_of=probs_of)
            prev = candidates[k, choice]
            tokens.append(prev)
        return DraftProposal(tokens=torch.stack(tokens), probs=chain.result()[1])


def build_dflash2(config: DFlash2Config, target: Target, *, counts: torch.Tensor | None = None, **_: Any) -> DFlash2Drafter:
    """A fresh DFlash2 drafter (full vocabulary: ``counts`` is not needed)."""
    return build_block_drafter(DFlash2Drafter, config, target, counts)
