"""DSpark drafter: the DFlash backbone plus a Markov head and a confidence head.

Differences from DFlash (the only ones): the anchor slot is a prediction too, so slot k
(k = 0..B-1) at position anchor+k predicts the token at anchor+k+1 (B drafts from B inputs);
logits_k = U_k + MarkovBias(x_{k-1}, ...) with x_0 = the anchor; c_k = sigmoid(w.[h_k; W1[x_{k-1}]] + b)
estimates P(x_k accepted | earlier accepted). Drafting runs the backbone once, then samples the
block left to right through the Markov head (argmax at T=0, else softmax(logits/T)); that
corrected distribution is what rejection sampling must divide by.

With a reduced draft vocabulary (see ``dflash.model``), U_k and B_k are over the N draft ids
while W1 still embeds target ids: each drawn draft id is mapped through d2t before it becomes
x_{k-1} and before it is returned. As in speculators, the L1 term and the confidence soft label
use p_t restricted to the draft ids and renormalised over them.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from specdraft.errors import SpecdraftError
from specdraft.models.base import DrafterBatch, TrainOutput
from specdraft.models.common.anchors import block_labels, sample_anchors
from specdraft.models.common.chunked import chunked_rows
from specdraft.models.common.distill_losses import DISTILL_LOSSES
from specdraft.models.common.metrics import position_metrics
from specdraft.models.common.sampling import Chain, DraftProposal
from specdraft.models.common.sequence import WHOLE_ROW, SequenceShard
from specdraft.models.common.weights import POSITION_WEIGHTS
from specdraft.models.dflash.loss import weighted_mean
from specdraft.models.dflash.model import DFlashDrafter, build_block_drafter
from specdraft.models.dspark.config import DSparkConfig
from specdraft.models.dspark.heads import MARKOV_HEADS, ConfidenceHead
from specdraft.models.dspark.loss import block_terms, soft_acceptance
from specdraft.targets.base import Target


class DSparkDrafter(DFlashDrafter):
    method: ClassVar[str] = "dspark"
    config_cls = DSparkConfig
    architecture = "DSparkSpeculator"
    sample_from_anchor: ClassVar[bool] = True
    config: DSparkConfig

    def __init__(self, config: DSparkConfig, verifier: dict | None = None):
        super().__init__(config, verifier)
        c, d = config, self.dims
        compact = c.uses_draft_vocab and c.draft_vocab + 1 < d.vocab_size
        self.markov_head = MARKOV_HEADS.get(c.markov_head)(
            vocab_size=d.vocab_size,
            draft_vocab_size=c.draft_vocab,
            rank=c.markov_rank,
            hidden_size=d.hidden_size,
            w1_rows=c.draft_vocab + 1 if compact else None,
        )
        self.confidence_head = (
            ConfidenceHead(d.hidden_size + (c.markov_rank if c.confidence_with_markov else 0)) if c.confidence_head else None
        )
        self._sync_markov_rows()
        # Hooks, not a load_state_dict override: they also run when a wrapper (the trainer's step
        # module, a resume) loads this drafter as a submodule.
        self.register_load_state_dict_pre_hook(DSparkDrafter._w1_into_layout)
        self.register_load_state_dict_post_hook(lambda module, incompatible: module._sync_markov_rows())

    # ----- Markov W1 layout (see ``heads``) ---------------------------------------------------
    def _sync_markov_rows(self) -> None:
        """Point the compact W1's ``row_of`` at the current draft vocabulary: draft id i -> row i,
        any other target id -> the shared row N."""
        head = self.markov_head
        if head.markov_w1.num_embeddings == self.dims.vocab_size or self.t2d is None:  # a full W1 (no draft vocabulary)
            head.row_of = None
            return
        rank = torch.cumsum(self.t2d.to(torch.int64), 0) - 1
        head.row_of = torch.where(self.t2d, rank, torch.full_like(rank, self.config.draft_vocab))

    def set_draft_vocab(self, counts: torch.Tensor) -> None:
        super().set_draft_vocab(counts)
        self._sync_markov_rows()

    def saved_state(self) -> dict[str, torch.Tensor]:
        return {**super().saved_state(), "markov_head.markov_w1.weight": self.markov_head.full_w1()}

    def _w1_into_layout(self, state: dict, prefix: str, *_: Any) -> None:
        """Load pre-hook: a [V, r] W1 (the format's) for a compact head is compacted in ``state`` when
        every id outside the draft vocabulary has the same row (what ``full_w1`` writes); otherwise
        the head switches to a full [V, r] table (a checkpoint trained elsewhere keeps every row)."""
        key = prefix + "markov_head.markov_w1.weight"
        w1, head = state.get(key), self.markov_head
        if w1 is None or head.row_of is None or self.t2d is None or w1.shape[0] != self.dims.vocab_size:
            return  # already in this layout, or a shape load_state_dict reports
        t2d = state.get(prefix + "t2d", self.t2d).to(device=w1.device, dtype=torch.bool)
        others = w1[~t2d]
        if bool((others == others[:1]).all()):
            state[key] = torch.cat([w1[t2d], others[:1]])
        else:
            weight = head.markov_w1.weight
            head.markov_w1 = torch.nn.Embedding(w1.shape[0], w1.shape[1], device=weight.device, dtype=weight.dtype)

    # ----- format --------------------------------------------------------------------------
    def method_fields(self, aux_ids: list[int]) -> dict:
        c = self.config
        return {
            **super().method_fields(aux_ids),
            "markov_rank": c.markov_rank,
            "markov_head_type": c.markov_head,
            "enable_confidence_head": c.confidence_head,
            "confidence_head_with_markov": c.confidence_with_markov if c.confidence_head else False,
        }

    @classmethod
    def speculators_fields(cls, cfg: dict, *, where: str) -> dict:
        rank = int(cfg.get("markov_rank", 256))
        if rank <= 0:
            raise SpecdraftError(f"{where}: dspark with markov_rank {rank} (no Markov head) is not supported by specdraft")
        return {
            **super().speculators_fields(cfg, where=where),
            "markov_rank": rank,
            "markov_head": str(cfg.get("markov_head_type", "vanilla")),
            "confidence_head": bool(cfg.get("enable_confidence_head", True)),
            "confidence_with_markov": bool(cfg.get("confidence_head_with_markov", True)),
        }

    # ----- heads ---------------------------------------------------------------------------
    def confidence_logits(self, hidden: torch.Tensor, prev_emb: torch.Tensor) -> torch.Tensor | None:
        if self.confidence_head is None:
            return None
        feats = torch.cat([hidden, prev_emb.to(hidden.dtype)], -1) if self.config.confidence_with_markov else hidden
        return self.confidence_head(feats)

    def corrected_block(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Teacher-forced: hidden [R, B, D], previous target ids [R, B] -> (Markov-corrected
        draft-vocabulary logits [R, B, N], confidence logits [R, B] or None)."""
        prev_emb = self.markov_head.prev_embeddings(prev_ids)
        logits = self.lm_logits(hidden) + self.markov_head.block_bias(prev_emb, hidden)
        return logits, self.confidence_logits(hidden, prev_emb)

    # ----- training ------------------------------------------------------------------------
    def teacher_forced_blocks(self, batch: DrafterBatch, anchors: torch.Tensor, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
        """Gather, for every valid block, what its positions are scored against.

        Returns (N valid blocks, B slots): ``hidden`` [N,B,D], ``prev_ids`` [N,B] (x_{k-1}, teacher-forced),
        ``target_hidden`` [N,B,D] (final-norm input at the predicted position's context), ``labels`` [N,B],
        ``valid`` [N,B] (supervision stops at the first invalid label) and ``blocks`` [R,A] (which anchors
        were valid, to scatter results back).
        """
        labels, valid, pos = block_labels(
            batch.token_ids, batch.segment_ids, batch.loss_mask, anchors, self.label_offsets().to(anchors.device)
        )
        src = (pos - 1).clamp(min=0)  # slot k sits at anchor+k: its p_t and its previous token x_{k-1}
        prev_ids = torch.gather(batch.token_ids, 1, src.flatten(1)).view_as(src)
        target_h = torch.gather(batch.last_hidden, 1, src.flatten(1)[..., None].expand(-1, -1, batch.last_hidden.shape[-1]))
        target_h = target_h.view(*src.shape, -1).to(hidden.dtype)
        blocks = valid[..., 0]
        return {
            "hidden": hidden[blocks],
            "prev_ids": prev_ids[blocks],
            "target_hidden": target_h[blocks],
            "labels": labels[blocks],
            "valid": valid[blocks],
            "blocks": blocks,
            "all_valid": valid,
        }

    def block_loss(self, batch: DrafterBatch, anchors: torch.Tensor, hidden: torch.Tensor, shard: SequenceShard = WHOLE_ROW) -> TrainOutput:
        c = self.config
        norm = self.require_verifier()
        tf = self.teacher_forced_blocks(batch, anchors, hidden)
        labels, in_vocab = self.draft_labels(tf["labels"])
        head = self.draft_target_head()
        distill = DISTILL_LOSSES.get(c.distill_loss)

        def rows(
            h: torch.Tensor, prev: torch.Tensor, th: torch.Tensor, lab: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
            logits, conf = self.corrected_block(h, prev)
            ce, l1, div, bce = block_terms(
                draft_logits=logits, target_logits=F.linear(norm(th), head), labels=lab, confidence_logits=conf, distill=distill
            )
            return ce, l1, div, bce, logits.argmax(-1) == lab

        ce, l1, div, bce, ok = chunked_rows(
            rows, tf["hidden"], tf["prev_ids"], tf["target_hidden"], labels, chunk_rows=max(1, c.loss_chunk_rows // c.block_size)
        )
        v = tf["valid"]
        w = POSITION_WEIGHTS.get(c.position_weighting)(soft_acceptance(l1), v, gamma=c.gamma, alpha=c.dpace_alpha)
        # Labels outside a reduced draft vocabulary are unreachable: no CE weight, a miss in the metrics.
        terms = {
            "ce": weighted_mean(ce, w, v & in_vocab, total=shard.total),
            c.distill_loss: weighted_mean(div, w, v, total=shard.total),
            "bce": weighted_mean(bce, w, v, total=shard.total),
        }
        loss = c.ce_weight * terms["ce"] + c.l1_weight * terms[c.distill_loss] + c.bce_weight * terms["bce"]
        valid = tf["all_valid"]
        correct = torch.zeros_like(valid)
        correct[tf["blocks"]] = ok & v & in_vocab
        acc, cond, count = position_metrics(correct.flatten(0, 1), valid.flatten(0, 1), total=shard.total)
        metrics = {"loss": float(loss.detach()), **{k: float(t.detach()) for k, t in terms.items()}}
        return TrainOutput(loss=loss, metrics=metrics, position_acc=acc, position_cond_acc=cond, position_count=count)

    @torch.no_grad()
    def confidence_records(self, batch: DrafterBatch, *, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """Raw confidence logits and what actually happened, per block position, for calibration.

        Returns [N, B] tensors: ``logits`` (uncalibrated confidence logits), ``greedy_accept`` (1 where the
        draft argmax equals the target argmax: acceptance under greedy verification), ``soft_accept``
        (sum_v min(p_d, p_t): acceptance probability under rejection sampling at T=1), ``valid``. Both
        compare against the full target distribution, as the runtime does (a reduced draft vocabulary
        puts zero draft mass outside the draft ids).
        """
        if self.confidence_head is None:
            raise SpecdraftError("this dspark drafter has no confidence head (enable_confidence_head is false); nothing to calibrate")
        norm = self.require_verifier()
        anchors = sample_anchors(batch.segment_ids, batch.loss_mask, max_per_segment=self.config.max_anchors, generator=generator)
        tf = self.teacher_forced_blocks(batch, anchors, self.forward_blocks(batch, anchors))

        ids = self.draft_target_ids()

        def rows(h: torch.Tensor, prev: torch.Tensor, th: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            logits, conf = self.corrected_block(h, prev)
            target_logits = self.verifier_lm_head(norm(th))
            p_t = torch.softmax(target_logits.float(), -1)
            p_d = torch.softmax(logits.float(), -1)
            drafted = logits.argmax(-1)
            if ids is not None:
                p_t, drafted = p_t[..., ids], ids[drafted]
            overlap = torch.minimum(p_d, p_t).sum(-1)
            # conf is set: corrected_block gives confidence logits whenever there is a confidence head (checked above).
            return conf.float(), (drafted == target_logits.argmax(-1)).float(), overlap.clamp(0, 1)  # type: ignore[union-attr]

        conf, greedy, soft = chunked_rows(
            rows,
            tf["hidden"],
            tf["prev_ids"],
            tf["target_hidden"],
            chunk_rows=max(1, self.config.loss_chunk_rows // self.config.block_size),
        )
        return {"logits": conf, "greedy_accept": greedy, "soft_accept": soft, "valid": tf["valid"]}

    # ----- inference -----------------------------------------------------------------------
    def propose(self, hidden: torch.Tensor, *, anchor_token: int, temperature: float, generator: torch.Generator | None) -> DraftProposal:
        """Left-to-right over the block: x_k ~ softmax((U_k + B_k(x_{k-1}))/T); the confidences c_k, which nothing in
        the chain reads, afterwards in one call over the block."""
        block = self.config.block_size
        base = self.lm_logits(hidden[:block])
        ids = self.draft_target_ids()
        prev = torch.tensor([anchor_token], device=hidden.device)
        state = self.markov_head.init_state(1, hidden[:1])
        chain, prev_embs = Chain(temperature=temperature, generator=generator), []
        for k in range(block):
            prev_emb = self.markov_head.prev_embeddings(prev)
            bias, state = self.markov_head.step(state, prev_emb, hidden[k : k + 1])
            token = chain.draw(base[k] + bias[0])
            prev_embs.append(prev_emb)
            prev = (token if ids is None else ids[token]).view(1)
        conf = self.confidence_logits(hidden[:block], torch.cat(prev_embs))
        if conf is not None:
            if self.config.confidence_temperatures:
                conf = conf / conf.new_tensor(self.config.confidence_temperatures[:block])
            conf = torch.sigmoid(conf)
        drafted, full = self.to_target_vocab(*chain.result())
        return DraftProposal(tokens=drafted, probs=full, confidences=conf)


def build_dspark(config: DSparkConfig, target: Target, *, counts: torch.Tensor | None = None, **_: Any) -> DSparkDrafter:
    """A fresh DSpark drafter (see ``build_block_drafter`` for the draft vocabulary)."""
    return build_block_drafter(DSparkDrafter, config, target, counts)
