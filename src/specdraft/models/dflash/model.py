"""DFlash drafter (arXiv 2602.06036): one parallel forward drafts a whole block.

Context features = RMSNorm(fc(concat of 5 target layer outputs)). Every draft layer injects them
as extra keys/values (k_proj/v_proj only: no query, output projection or MLP for the context);
queries come from the block [anchor, MASK x (B-1)] at positions anchor..anchor+B-1, which attends
to itself non-causally and to context strictly before the anchor. The embedding is the target's,
frozen; so is the LM head, unless the drafter has a reduced draft vocabulary (``draft_vocab_size``
N < V): then it owns an ``lm_head`` [N, D] started from the target head's rows of the N most
frequent response tokens (trained, or frozen with ``train_draft_head: false``), with
``d2t``/``t2d`` mapping draft ids to target ids (vLLM layout).

Reduced-vocabulary training follows speculators: the hard label is the token's draft id, and a
label outside the draft vocabulary is unreachable (no draft logit can score it), so it gets no CE
weight and counts as a miss in the accuracy metrics. Drafting samples over the N draft ids and
hands back target ids, with the draft distribution scattered into V (zero elsewhere) so rejection
sampling is unchanged and stays lossless.

Training packs every sampled block of a row into one sequence (``anchor_block_mask``).
Block slot k (k = 1..B-1) at position anchor+k predicts the token at anchor+k; its loss weight
is exp(-(k-1)/gamma) or D-PACE's (``position_weighting``). Worked example, block 4 anchored at a=10 holding token x10:
slots [x10, M, M, M] at positions 10..13 predict x11, x12, x13 from slots 1, 2, 3.

Inference: the draft cache holds only context K/V (append the newly verified positions'
features each round); the block is run once and its K/V are never stored ("cropped").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar, cast

import torch
from torch import nn

from specdraft.errors import SpecdraftError
from specdraft.models.base import DrafterBatch, TrainOutput
from specdraft.models.common import checkpoint as ckpt
from specdraft.models.common.anchors import ANCHOR_SAMPLING, block_labels
from specdraft.models.common.chunked import chunked_rows
from specdraft.models.common.config import shape_from_layer_config
from specdraft.models.common.drafter import NOT_SAVED, SpeculatorsDrafter
from specdraft.models.common.layers import DecoderLayer, RMSNorm, RotaryEmbedding
from specdraft.models.common.masks import anchor_block_mask
from specdraft.models.common.metrics import position_metrics
from specdraft.models.common.sampling import DraftProposal, sample_tokens
from specdraft.models.common.sequence import WHOLE_ROW, SequenceShard
from specdraft.models.common.vocab import check_vocab_tables, coverage_vocab_size, draft_ids, install_draft_vocab, target_to_draft
from specdraft.models.common.weights import POSITION_WEIGHTS
from specdraft.models.dflash.config import DFlashConfig
from specdraft.models.dflash.loss import ce_rows, weighted_mean
from specdraft.targets.base import Target

KV = tuple[torch.Tensor, torch.Tensor]


class DFlashLayer(DecoderLayer):
    """Qwen3-style layer (q/k-norm) with KV injection from the context features."""

    def __init__(self, c: DFlashConfig):
        d = c.dims()
        super().__init__(
            in_dim=d.hidden_size,
            hidden=d.hidden_size,
            num_heads=d.num_attention_heads,
            num_kv_heads=d.num_key_value_heads,
            head_dim=d.head_dim,
            intermediate=d.intermediate_size,
            qk_norm=True,
            eps=d.rms_norm_eps,
        )

    def context_kv(self, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> KV:
        """Context features [N, M, D] -> injected (k, v) [N, G, M, E]."""
        return self.self_attn.project_kv(context, cos, sin)

    def forward(self, x: torch.Tensor, context_kv: KV, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [N, L, D] block tokens; mask [N|1, 1, L, M + L] over (context keys, block keys)."""
        h = self.input_layernorm(x)
        q = self.self_attn.project_q(h, cos, sin)
        k, v = self.self_attn.project_kv(h, cos, sin)
        keys = torch.cat([context_kv[0], k], dim=2)
        values = torch.cat([context_kv[1], v], dim=2)
        return self.feed_forward(x + self.self_attn.attend(q, keys, values, mask))


@dataclass
class ContextCache:
    """Per-layer injected context K/V of one sequence, each [1, G, M, E]."""

    k: list[torch.Tensor] = field(default_factory=list)
    v: list[torch.Tensor] = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.k[0].shape[2] if self.k else 0


class DFlashDrafter(SpeculatorsDrafter):
    method: ClassVar[str] = "dflash"
    config_cls = DFlashConfig
    architecture = "DFlashSpeculator"
    layer_model_type = "qwen3"
    slot_side = "output"
    not_saved = NOT_SAVED + ("embed_tokens.",)
    ignored_on_load = SpeculatorsDrafter.ignored_on_load + ("embed_tokens.weight",)
    requires_target = True
    sample_from_anchor: ClassVar[bool] = False  # DSpark: the anchor slot is a prediction too
    layer_cls: ClassVar[type[DFlashLayer]] = DFlashLayer  # DFlash2: a layer with convolutions around attention and MLP
    config: DFlashConfig
    d2t: torch.Tensor | None  # buffers, set with a reduced draft vocabulary (see ``__init__``)
    t2d: torch.Tensor | None

    def __init__(self, config: DFlashConfig, verifier: dict | None = None):
        super().__init__(config, verifier)
        c, d = config, self.dims
        self.mask_token_id = c.mask_token()
        self.fc = nn.Linear(len(c.slots()) * d.hidden_size, d.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.layers = nn.ModuleList([self.layer_cls(c) for _ in range(c.num_layers)])
        self.norm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.rotary = RotaryEmbedding(d.head_dim, d.rope_theta)
        if c.draft_vocab_coverage is not None and not c.draft_vocab_size:
            raise SpecdraftError(
                f"{self.method} config: draft_vocab_coverage {c.draft_vocab_coverage} is turned into draft_vocab_size from "
                "token counts when the drafter is built; use MethodSpec.build(config, target, counts=...)"
            )
        self.lm_head: nn.Linear | None = None
        self.register_buffer("d2t", None)
        self.register_buffer("t2d", None)
        if c.uses_draft_vocab:
            self.lm_head = nn.Linear(d.hidden_size, c.draft_vocab, bias=False)
            self.lm_head.weight.requires_grad_(c.train_draft_head)
            t2d = torch.zeros(d.vocab_size, dtype=torch.bool)
            t2d[: c.draft_vocab] = True
            self.d2t = torch.zeros(c.draft_vocab, dtype=torch.int64)
            self.t2d = t2d

    @property
    def decoder_layers(self) -> Sequence[DFlashLayer]:
        """``layers`` as what they are (``nn.ModuleList`` is not generic)."""
        return cast("Sequence[DFlashLayer]", self.layers)

    # ----- draft vocabulary ----------------------------------------------------------------
    def set_draft_vocab(self, counts: torch.Tensor) -> None:
        """Select the draft vocabulary from response-token counts int64[V] and start the draft
        head from the target head's rows for those tokens."""
        if self.lm_head is None or self.d2t is None or self.t2d is None:
            raise SpecdraftError(f"this {self.method} drafter drafts over the full vocabulary; it has no draft vocabulary to set")
        install_draft_vocab(
            counts, self.config.draft_vocab, d2t=self.d2t, t2d=self.t2d, head=self.lm_head, target_head=self.verifier_lm_head.weight
        )

    def draft_labels(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Target-id labels -> (draft-id labels, bool in-vocabulary mask); identity when not reduced."""
        if self.t2d is None:
            return labels, torch.ones_like(labels, dtype=torch.bool)
        return target_to_draft(self.t2d, labels)

    def draft_target_ids(self) -> torch.Tensor | None:
        """[N] target id of each draft id; None with the full vocabulary (the identity)."""
        return None if self.d2t is None else draft_ids(self.d2t)

    def draft_target_head(self) -> torch.Tensor:
        """The target head's rows for the draft ids, [N, D]: p_t restricted to the draft vocabulary."""
        ids = self.draft_target_ids()
        return self.verifier_lm_head.weight if ids is None else self.verifier_lm_head.weight[ids]

    def to_target_vocab(self, tokens: torch.Tensor, probs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft ids [...] and their distributions [..., N] (None: argmaxes) -> target ids and distributions over V
        (zero outside the draft vocabulary)."""
        ids = self.draft_target_ids()
        if ids is None or probs is None:
            return (tokens if ids is None else ids[tokens]), probs
        full = probs.new_zeros(*probs.shape[:-1], self.dims.vocab_size)
        full[..., ids] = probs
        return ids[tokens], full

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        if self.d2t is not None and self.t2d is not None and "d2t" in state_dict:
            check_vocab_tables(self.d2t, self.t2d, where=f"{self.method} draft vocabulary (d2t/t2d)")
        return result

    # ----- format --------------------------------------------------------------------------
    def speculative_tokens(self) -> int:
        return self.config.block_size if self.sample_from_anchor else self.config.block_size - 1

    def draft_vocab_size(self) -> int:
        return self.config.draft_vocab

    def method_fields(self, aux_ids: list[int]) -> dict:
        return {
            "block_size": self.config.block_size,
            "aux_hidden_state_layer_ids": aux_ids,
            "mask_token_id": self.config.mask_token_id,
            "sample_from_anchor": self.sample_from_anchor,
            # The block attends to itself non-causally. speculators reads this flag only for sliding-window
            # layers (ours are all full attention, always non-causal there), but vLLM's speculators translation
            # (`update_dflash`) turns it into dflash_config.causal = not flag for EVERY draft layer: False
            # would make vLLM draft causally, a model it was never trained as.
            "sliding_window_non_causal": True,
        }

    @classmethod
    def speculators_fields(cls, cfg: dict, *, where: str) -> dict:
        shape = shape_from_layer_config(cfg.get("transformer_layer_config") or {}, where=where)
        draft_vocab = int(cfg.get("draft_vocab_size") or shape["vocab_size"])
        if not 0 < draft_vocab <= shape["vocab_size"]:
            raise SpecdraftError(f"{where}: draft_vocab_size {draft_vocab} must be in 1..{shape['vocab_size']} (the target vocabulary)")
        if bool(cfg.get("sample_from_anchor", cls.sample_from_anchor)) != cls.sample_from_anchor:
            raise SpecdraftError(f"{where}: sample_from_anchor={cfg.get('sample_from_anchor')} is not supported for {cls.method}")
        missing = [k for k in ("aux_hidden_state_layer_ids", "mask_token_id", "block_size") if cfg.get(k) in (None, [])]
        if missing:
            raise SpecdraftError(f"{where}/config.json: {', '.join(missing)} missing; required for a {cls.method} drafter")
        return {
            **shape,
            "layers": ",".join(str(ckpt.aux_id_to_slot(int(i), "output")) for i in cfg["aux_hidden_state_layer_ids"]),
            "block_size": int(cfg["block_size"]),
            "mask_token_id": int(cfg["mask_token_id"]),
            "draft_vocab_size": draft_vocab if draft_vocab < shape["vocab_size"] else None,
        }

    # ----- shared forward ------------------------------------------------------------------
    def context(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """aux [..., S, D] -> context features [..., D]."""
        return self.hidden_norm(self.fc(aux_hidden.flatten(-2).to(self.fc.weight.dtype)))

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Post-norm hidden [..., D] -> draft-vocabulary logits [..., N]: the trainable draft head when
        the vocabulary is reduced, else the frozen target head (N = V)."""
        return self.verifier_lm_head(hidden) if self.lm_head is None else self.lm_head(hidden)

    def label_offsets(self) -> torch.Tensor:
        """Row offset from the anchor of the token each draft slot predicts: [K] = 1..K
        (DFlash: slot k predicts anchor+k; DSpark: slot k-1 predicts anchor+k)."""
        return torch.arange(1, self.speculative_tokens() + 1)

    def draft_slots(self) -> slice:
        """The block slots that draft tokens: the last K of B."""
        return slice(self.config.block_size - self.speculative_tokens(), self.config.block_size)

    def block_inputs(self, anchor_tokens: torch.Tensor) -> torch.Tensor:
        """anchor tokens [...] -> block token ids [..., B] = [anchor, MASK, ..., MASK]."""
        block = anchor_tokens.new_full((*anchor_tokens.shape, self.config.block_size), self.mask_token_id)
        block[..., 0] = anchor_tokens
        return block

    def sequence_halo(self) -> int:
        """Rows after its own that a rank of a sequence-parallel group reads (``models/common/sequence.py``): a block
        anchored on its last row needs the tokens, labels and ``last_hidden`` up to its furthest label."""
        return int(self.label_offsets().max())

    def forward_blocks(self, batch: DrafterBatch, anchors: torch.Tensor, shard: SequenceShard = WHOLE_ROW) -> torch.Tensor:
        """Teacher-forced packed forward. anchors int64 [N, A] (-1 = none; rows of ``batch``) -> post-norm block
        hidden states [N, A, B, D]. With a ``shard`` of a sequence-parallel group, ``batch`` holds this rank's rows
        and the blocks attend to the whole row's context K/V."""
        self.check_batch(batch)
        b = self.config.block_size
        n, a = anchors.shape
        safe = anchors.clamp(min=0)
        ctx = self.context(shard.own(batch.aux_hidden))
        cos_c, sin_c = self.rotary(shard.own(batch.position_ids), ctx.dtype)
        x = self.embed_tokens(self.block_inputs(torch.gather(batch.token_ids, 1, safe))).flatten(1, 2)
        pos = (torch.gather(batch.position_ids, 1, safe)[..., None] + torch.arange(b, device=anchors.device)).flatten(1)
        cos_b, sin_b = self.rotary(pos, ctx.dtype)
        mask = anchor_block_mask(shard.segment_ids(batch.segment_ids), shard.global_anchors(anchors), b)
        for layer in self.decoder_layers:
            x = layer(x, shard.context_kv(layer.context_kv(ctx, cos_c, sin_c)), cos_b, sin_b, mask)
        return self.norm(x).view(n, a, b, -1)

    def training_forward(self, batch: DrafterBatch, shard: SequenceShard = WHOLE_ROW) -> TrainOutput:
        # Held-out metrics must estimate decode-time acceptance, where every response position is an
        # anchor: in eval mode anchors are uniform whatever the training sampler (a "predictable" draw
        # would overstate tau by favouring easy positions). Every rank of a sequence-parallel group draws the whole
        # row's anchors with the same generator state and keeps its own: the anchors N = 1 draws.
        sampler = ANCHOR_SAMPLING.get(self.config.anchor_sampling if self.training else "uniform")
        anchors = sampler(
            shard.segment_ids(batch.segment_ids),
            shard.loss_mask(batch.loss_mask),
            max_per_segment=self.config.max_anchors,
            label_prob=shard.label_prob(lambda rows, pos: self.target_label_prob(batch, rows, pos)),
        )
        anchors = shard.anchors(anchors)
        return self.block_loss(batch, anchors, self.forward_blocks(batch, anchors, shard), shard)

    @torch.no_grad()
    def target_label_prob(self, batch: DrafterBatch, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """p_t(token at positions+1 | prefix) at (rows, positions) [M], from the frozen target head on
        last_hidden. With a reduced draft vocabulary p_t is restricted to the draft ids before the
        softmax (renormalised over them, as the DSpark L1 term's target) and a label outside them gets
        0 (no draft can hit it): [M x N] work instead of [M x V], and the full value when N = V."""
        labels, in_vocab = self.draft_labels(batch.token_ids[rows, (positions + 1).clamp(max=batch.token_ids.shape[1] - 1)])
        norm, head = self.require_verifier(), self.draft_target_head()

        def prob(h: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor]:
            return (torch.log_softmax(nn.functional.linear(norm(h), head).float(), -1).gather(-1, y[:, None])[:, 0].exp(),)

        p = chunked_rows(prob, batch.last_hidden[rows, positions], labels, chunk_rows=self.config.loss_chunk_rows)[0]
        return p * in_vocab

    def block_loss(self, batch: DrafterBatch, anchors: torch.Tensor, hidden: torch.Tensor, shard: SequenceShard = WHOLE_ROW) -> TrainOutput:
        """Hard-label CE over slots 1..B-1 weighted per position (``position_weighting``), normalised by
        the weight sum (labels outside a reduced draft vocabulary: no CE weight, counted as misses); the sum
        and the weight sum are the whole row's (``shard.total``)."""
        labels, valid, _ = block_labels(
            batch.token_ids, batch.segment_ids, batch.loss_mask, anchors, self.label_offsets().to(anchors.device)
        )
        labels, in_vocab = self.draft_labels(labels)
        h = hidden[:, :, self.draft_slots()]

        def rows(hr: torch.Tensor, lr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logits = self.lm_logits(hr)
            return ce_rows(logits=logits, labels=lr), logits.argmax(-1) == lr

        ce_valid, ok_valid = chunked_rows(rows, h[valid], labels[valid], chunk_rows=self.config.loss_chunk_rows)
        ce = torch.zeros(valid.shape, dtype=ce_valid.dtype, device=h.device).masked_scatter(valid, ce_valid)
        correct = torch.zeros_like(valid).masked_scatter(valid, ok_valid) & in_vocab
        hit = valid & in_vocab
        weigh = POSITION_WEIGHTS.get(self.config.position_weighting)
        weights = weigh(torch.exp(-ce.detach()), hit, gamma=self.config.gamma, alpha=self.config.dpace_alpha)  # q = p_d(label)
        loss = weighted_mean(ce, weights, hit, total=shard.total)
        acc, cond, count = position_metrics(correct.flatten(0, 1), valid.flatten(0, 1), total=shard.total)
        return TrainOutput(
            loss=loss,
            metrics={"loss": float(loss.detach()), "ce": float(loss.detach())},
            position_acc=acc,
            position_cond_acc=cond,
            position_count=count,
        )

    # ----- inference -----------------------------------------------------------------------
    def new_cache(self) -> ContextCache:
        return ContextCache()

    @torch.no_grad()
    def append_context(self, cache: ContextCache, *, features: torch.Tensor, positions: torch.Tensor) -> None:
        """Append verified positions: features [n, S, D] (target aux states), positions [n]."""
        ctx = self.context(features)[None]
        cos, sin = self.rotary(positions[None], ctx.dtype)
        for i, layer in enumerate(self.decoder_layers):
            k, v = layer.context_kv(ctx, cos, sin)
            if len(cache.k) <= i:
                cache.k.append(k)
                cache.v.append(v)
            else:
                cache.k[i] = torch.cat([cache.k[i], k], dim=2)
                cache.v[i] = torch.cat([cache.v[i], v], dim=2)

    @torch.no_grad()
    def block_hidden(self, cache: ContextCache, *, anchor_token: int, anchor_position: int) -> torch.Tensor:
        """Run the block once against all cached context -> post-norm hidden [B, D]."""
        b = self.config.block_size
        device = self.fc.weight.device
        x = self.embed_tokens(self.block_inputs(torch.tensor([anchor_token], device=device)))
        cos, sin = self.rotary((anchor_position + torch.arange(b, device=device))[None], x.dtype)
        mask = torch.ones(1, 1, b, cache.length + b, dtype=torch.bool, device=device)
        for i, layer in enumerate(self.decoder_layers):
            ctx_kv = (
                (cache.k[i], cache.v[i]) if cache.k else (x.new_zeros(1, layer.self_attn.num_kv_heads, 0, layer.self_attn.head_dim),) * 2
            )
            x = layer(x, ctx_kv, cos, sin, mask)
        return self.norm(x)[0]

    @torch.no_grad()
    def draft_block(
        self,
        cache: ContextCache,
        *,
        anchor_token: int,
        anchor_position: int,
        context_features: torch.Tensor | None = None,
        context_positions: torch.Tensor | None = None,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> DraftProposal:
        """Append the new context (features of the positions just verified, all < anchor_position),
        then draft K tokens after ``anchor_token`` (the bonus/corrected token at anchor_position)."""
        if context_features is not None and context_features.shape[0]:
            if context_positions is None:
                raise SpecdraftError(f"{self.method} draft_block: context_features come with their context_positions")
            self.append_context(cache, features=context_features, positions=context_positions)
        hidden = self.block_hidden(cache, anchor_token=anchor_token, anchor_position=anchor_position)
        return self.propose(hidden, anchor_token=anchor_token, temperature=temperature, generator=generator)

    def propose(self, hidden: torch.Tensor, *, anchor_token: int, temperature: float, generator: torch.Generator | None) -> DraftProposal:
        """Independent per-slot draws from slots 1..B-1."""
        tokens, probs = sample_tokens(self.lm_logits(hidden[self.draft_slots()]), temperature=temperature, generator=generator)
        return DraftProposal(*self.to_target_vocab(tokens, probs))


BlockDrafter = TypeVar("BlockDrafter", bound=DFlashDrafter)


def build_block_drafter(cls: type[BlockDrafter], config: DFlashConfig, target: Target, counts: torch.Tensor | None) -> BlockDrafter:
    """A fresh DFlash/DSpark drafter for ``target`` (frozen embedding, target head and final norm
    copied in). ``counts`` int64[V] (the prepared dataset's response-token counts) selects a reduced
    draft vocabulary: ``draft_vocab_size`` if set, else the smallest N reaching ``draft_vocab_coverage``."""
    config = config.resolve(target)
    if config.draft_vocab_size and config.draft_vocab_size >= config.dims().vocab_size:
        config = dataclasses.replace(config, draft_vocab_size=None)
    wants_counts = bool(config.draft_vocab_size) or config.draft_vocab_coverage is not None
    if wants_counts and counts is None:
        raise SpecdraftError(
            f"{config.method} draft_vocab_size={config.draft_vocab_size} / draft_vocab_coverage={config.draft_vocab_coverage} "
            "needs token counts (the prepared dataset's token_counts.safetensors) to choose the draft vocabulary"
        )
    if counts is not None and not config.draft_vocab_size and config.draft_vocab_coverage is not None:
        size = coverage_vocab_size(counts, config.draft_vocab_coverage)
        config = dataclasses.replace(config, draft_vocab_size=size if size < config.dims().vocab_size else None)
    model = cls(config, verifier=target.describe())
    model.attach_target(target)
    if counts is not None and model.lm_head is not None:
        model.set_draft_vocab(counts)
    return model


def build_dflash(config: DFlashConfig, target: Target, *, counts: torch.Tensor | None = None, **_: Any) -> DFlashDrafter:
    return build_block_drafter(DFlashDrafter, config, target, counts)
