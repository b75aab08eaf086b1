"""EAGLE-3 drafter (arXiv 2503.01840): fused target features + one Llama layer, autoregressive.

Terms: a *feature* is what the drafter layer receives as its residual stream: at step 0 the fc
projection of the target's 3 aux hidden states at position t, at later steps the drafter's own
output hidden state. Pairing: feature t + embed(token t+1) -> predicts token t+2.

Training-time test (TTT), step j = 0..ttt_steps-1, query position t:
  1. input = (feature_j[t], token t+1+j) at RoPE position pos[t]+1+j (teacher-forced tokens);
  2. attention sees step-0 keys t' <= t of its segment plus the keys at t of steps 1..j
     (``eagle3_ttt_mask``) -- exactly what the chain sees at inference;
  3. label = token t+2+j, soft target = p_t at position t+1+j on the draft vocabulary; loss weight
     ttt_decay**j; supervised only where t+2+j is a response token of the same segment.

Inference: ``extend`` appends the committed (accepted) positions to the draft KV cache and
``speculate`` runs one chain step against cache + this round's draft keys, which are dropped
at the end of the round. ``draft`` composes them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from specdraft.errors import SpecdraftError
from specdraft.models.base import DrafterBatch, TrainOutput
from specdraft.models.common import checkpoint as ckpt
from specdraft.models.common.chunked import chunked_rows
from specdraft.models.common.config import shape_from_layer_config
from specdraft.models.common.distill_losses import DISTILL_LOSSES, Distributions
from specdraft.models.common.drafter import SpeculatorsDrafter, speculative_tokens_of
from specdraft.models.common.layers import DecoderLayer, RMSNorm, RotaryEmbedding
from specdraft.models.common.masks import eagle3_ttt_mask
from specdraft.models.common.metrics import position_metrics
from specdraft.models.common.sampling import Chain, DraftProposal
from specdraft.models.common.sequence import WHOLE_ROW, SequenceShard
from specdraft.models.common.vocab import check_vocab_tables, coverage_vocab_size, draft_ids, install_draft_vocab
from specdraft.models.eagle3.config import Eagle3Config
from specdraft.models.eagle3.loss import step_weights
from specdraft.targets.base import Target

KV = tuple[torch.Tensor, torch.Tensor]


class Eagle3Layer(DecoderLayer):
    """Llama layer whose attention reads concat(norm(embed), norm(feature)) (2D wide)."""

    def __init__(self, c: Eagle3Config):
        d = c.dims()
        super().__init__(
            in_dim=2 * d.hidden_size,
            hidden=d.hidden_size,
            num_heads=d.num_attention_heads,
            num_kv_heads=d.num_key_value_heads,
            head_dim=d.head_dim,
            intermediate=d.intermediate_size,
            qk_norm=False,
            eps=d.rms_norm_eps,
        )
        self.hidden_norm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.norm_before_residual = c.norm_before_residual

    def forward(
        self,
        embeds: torch.Tensor,
        feature: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        past: KV | None,
        mask: torch.Tensor,
        shard: SequenceShard = WHOLE_ROW,
    ) -> tuple[torch.Tensor, KV]:
        """embeds/feature [N, L, D]; past K/V [N, G, M, E] or None; mask [N|1, 1, L, M+L].
        Returns (out [N, L, D], this call's (k, v) [N, G, L, E]). Without ``past`` (TTT step 0) the keys are the
        whole row's: a sequence-parallel ``shard`` gathers them from every rank (its mask has the whole row's columns)."""
        normed = self.hidden_norm(feature)
        residual = normed if self.norm_before_residual else feature
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        q = self.self_attn.project_q(x, cos, sin)
        k, v = self.self_attn.project_kv(x, cos, sin)
        if past is None:
            k, v = shard.context_kv((k, v))
        keys = k if past is None else torch.cat([past[0], k], dim=2)
        values = v if past is None else torch.cat([past[1], v], dim=2)
        h = residual + self.self_attn.attend(q, keys, values, mask)
        return self.feed_forward(h), (k, v)


@dataclass
class Eagle3Cache:
    """Draft K/V of committed positions, (k, v) each [1, G, M, E] (None while empty)."""

    kv: KV | None = None

    @property
    def length(self) -> int:
        return 0 if self.kv is None else self.kv[0].shape[2]

    def append(self, kv: KV) -> None:
        self.kv = kv if self.kv is None else (torch.cat([self.kv[0], kv[0]], dim=2), torch.cat([self.kv[1], kv[1]], dim=2))


class Eagle3Drafter(SpeculatorsDrafter):
    method: ClassVar[str] = "eagle3"
    config_cls = Eagle3Config
    architecture = "Eagle3Speculator"
    layer_model_type = "llama"
    slot_side = "input"
    ignored_on_load = SpeculatorsDrafter.ignored_on_load + ("d2t", "t2d")
    config: Eagle3Config
    d2t: torch.Tensor  # buffers: the draft vocabulary (see ``common.vocab``)
    t2d: torch.Tensor

    def __init__(self, config: Eagle3Config, verifier: dict | None = None):
        super().__init__(config, verifier)
        c, d = config, self.dims
        if c.draft_vocab_size is None:
            raise SpecdraftError(
                f"eagle3 config: draft_vocab_coverage {c.draft_vocab_coverage} is turned into draft_vocab_size from token counts "
                "when the drafter is built; use MethodSpec.build(config, target, counts=...)"
            )
        self.draft_vocab: int = c.draft_vocab_size
        width = len(c.slots()) * d.hidden_size
        self.input_norm = RMSNorm(width, d.rms_norm_eps) if c.norm_before_fc else None
        self.fc_norm = nn.ModuleList([RMSNorm(d.hidden_size, d.rms_norm_eps) for _ in c.slots()]) if c.fc_norm else None
        self.fc = nn.Linear(width, d.hidden_size, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(c)])
        self.norm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.lm_head = nn.Linear(d.hidden_size, self.draft_vocab, bias=False)
        self.rotary = RotaryEmbedding(d.head_dim, d.rope_theta)
        t2d = torch.zeros(d.vocab_size, dtype=torch.bool)
        t2d[: self.draft_vocab] = True
        self.register_buffer("d2t", torch.zeros(self.draft_vocab, dtype=torch.int64))
        self.register_buffer("t2d", t2d)

    @property
    def use_draft_vocab(self) -> bool:
        return self.draft_vocab < self.dims.vocab_size

    # ----- format --------------------------------------------------------------------------
    def saved_state(self) -> dict[str, torch.Tensor]:
        state = super().saved_state()
        if not self.use_draft_vocab:
            state.pop("d2t"), state.pop("t2d")
        return state

    def draft_vocab_size(self) -> int:
        return self.draft_vocab

    def speculative_tokens(self) -> int:
        return self.config.ttt_steps

    def method_fields(self, aux_ids: list[int]) -> dict:
        return {
            "eagle_aux_hidden_state_layer_ids": aux_ids,
            "norm_before_residual": self.config.norm_before_residual,
            "norm_before_fc": self.config.norm_before_fc,
            "fc_norm": self.config.fc_norm,
            "norm_output": self.config.norm_output,
            "embed_requires_grad": False,
        }

    @classmethod
    def speculators_fields(cls, cfg: dict, *, where: str) -> dict:
        ids = cfg.get("eagle_aux_hidden_state_layer_ids")
        if not ids:
            raise SpecdraftError(f"{where}: eagle_aux_hidden_state_layer_ids is missing; cannot tell which target layers to read")
        shape = shape_from_layer_config(cfg.get("transformer_layer_config") or {}, where=where)
        layers = ",".join(str(ckpt.aux_id_to_slot(int(i), "input")) for i in ids)
        steps = speculative_tokens_of(cfg)
        if steps is None:
            raise SpecdraftError(
                f"{where}/config.json: speculators_config.proposal_methods[0].speculative_tokens missing; "
                "required for an eagle3 drafter (its TTT steps)"
            )
        return {
            **shape,
            "layers": layers,
            "draft_vocab_size": int(cfg.get("draft_vocab_size") or shape["vocab_size"]),
            "ttt_steps": int(steps),
            "norm_before_residual": bool(cfg.get("norm_before_residual", False)),
            **{flag: bool(cfg.get(flag, False)) for flag in ("norm_before_fc", "fc_norm", "norm_output")},
        }

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        if self.use_draft_vocab and "d2t" in state_dict:
            check_vocab_tables(self.d2t, self.t2d, where="eagle3 draft vocabulary")
        return result

    # ----- building ------------------------------------------------------------------------
    def set_draft_vocab(self, counts: torch.Tensor) -> None:
        """Select the draft vocabulary from token counts and start the draft head from the
        target head's rows for those tokens (the reference's initialisation)."""
        install_draft_vocab(
            counts, self.draft_vocab, d2t=self.d2t, t2d=self.t2d, head=self.lm_head, target_head=self.verifier_lm_head.weight
        )

    def draft_target_ids(self) -> torch.Tensor:
        """[Vd] target id of each draft id."""
        return draft_ids(self.d2t)

    # ----- training ------------------------------------------------------------------------
    def _layer(
        self,
        embeds: torch.Tensor,
        feature: torch.Tensor,
        positions: torch.Tensor,
        past: KV | None,
        mask: torch.Tensor,
        shard: SequenceShard = WHOLE_ROW,
    ) -> tuple[torch.Tensor, KV]:
        cos, sin = self.rotary(positions, embeds.dtype)
        return self.layers[0](embeds, feature, cos, sin, past, mask, shard)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """Target features [..., S, D] of S layers -> the step-0 feature [..., D]: fc of their concatenation, each
        layer's features normed first with ``fc_norm``, the concatenation normed with ``norm_before_fc``."""
        aux = aux.to(self.fc.weight.dtype)
        if self.fc_norm is not None:
            aux = torch.stack([norm(aux[..., i, :]) for i, norm in enumerate(self.fc_norm)], dim=-2)
        flat = aux.flatten(-2)
        return self.fc(flat if self.input_norm is None else self.input_norm(flat))

    def next_feature(self, out: torch.Tensor) -> torch.Tensor:
        """The feature the next unroll or draft step reads from this step's output: normed with ``norm_output``
        (Eagle 3.1), else the raw output. The logits are ``lm_head(norm(out))`` either way."""
        return self.norm(out) if self.config.norm_output else out

    def sequence_halo(self) -> int:
        """Rows after its own that a rank of a sequence-parallel group reads (``models/common/sequence.py``): step j at
        row t embeds token t+1+j, is scored against ``last_hidden`` at t+1+j and labelled with token t+2+j."""
        return self.config.ttt_steps + 1

    def ttt_hidden(self, batch: DrafterBatch, shard: SequenceShard = WHOLE_ROW) -> list[torch.Tensor]:
        """Teacher-forced TTT unroll: the drafter's output hidden state [N, T, D] per step (T: the ``shard``'s own rows)."""
        self.check_batch(batch)
        tokens, seg = batch.token_ids, batch.segment_ids
        t = tokens.shape[1]
        positions = shard.own(batch.position_ids)
        rows = positions.shape[1]
        idx = torch.arange(rows, device=tokens.device)
        feature = self.fuse(shard.own(batch.aux_hidden))
        past: KV | None = None
        outputs: list[torch.Tensor] = []
        for j in range(self.config.ttt_steps):
            src = (idx + 1 + j).clamp(max=t - 1)
            embeds = self.embed_tokens(tokens[:, src])
            mask = eagle3_ttt_mask(shard.segment_ids(seg), j, start=shard.start, length=rows)
            out, kv = self._layer(embeds, feature, positions + 1 + j, past, mask, shard)
            past = kv if past is None else (torch.cat([past[0], kv[0]], 2), torch.cat([past[1], kv[1]], 2))
            outputs.append(out)
            feature = self.next_feature(out)
        return outputs

    def step_valid(self, batch: DrafterBatch, step: int) -> torch.Tensor:
        """bool [N, T]: step ``step`` at position t has a label (token t+2+step, response, same segment)."""
        seg, mask = batch.segment_ids, batch.loss_mask.bool()
        t = seg.shape[1]
        shift = 2 + step
        valid = torch.zeros_like(mask)
        if shift < t:
            valid[:, : t - shift] = (seg[:, shift:] == seg[:, :-shift]) & (seg[:, :-shift] != -1) & mask[:, shift:]
        return valid

    def training_forward(self, batch: DrafterBatch, shard: SequenceShard = WHOLE_ROW) -> TrainOutput:
        """Each step's loss is the mean over the whole row's supervised positions (every rank's, with a ``shard``)."""
        norm = self.require_verifier()
        tokens = batch.token_ids
        n, t = tokens.shape[0], shard.own(tokens).shape[1]
        ids = self.draft_target_ids()
        head = self.verifier_lm_head.weight[ids]
        distill = DISTILL_LOSSES.get(self.config.distill_loss)

        def rows_loss(h: torch.Tensor, target_h: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            draft_logits = self.lm_head(self.norm(h))
            target_logits = nn.functional.linear(norm(target_h), head)
            return distill(Distributions(draft_logits, target_logits)), ids[draft_logits.argmax(-1)] == labels

        weights = step_weights(self.config.ttt_steps, self.config.ttt_decay)
        hiddens = self.ttt_hidden(batch, shard)
        # Start from a graph-connected zero: a batch without labels still backpropagates (zeros).
        loss = hiddens[-1].sum() * 0.0
        correct = torch.zeros(n, t, self.config.ttt_steps, dtype=torch.bool, device=tokens.device)
        valid_all = torch.zeros_like(correct)
        metrics: dict[str, float] = {}
        for j, hidden in enumerate(hiddens):
            valid = shard.own(self.step_valid(batch, j))
            valid_all[..., j] = valid
            supervised = shard.total(valid.sum().float())
            if not supervised:
                continue
            shift = 1 + j
            target_h = shard.own(torch.roll(batch.last_hidden, -shift, dims=1))[valid]
            labels = shard.own(torch.roll(tokens, -(shift + 1), dims=1))[valid]
            ce, ok = chunked_rows(rows_loss, hidden[valid], target_h.to(hidden.dtype), labels, chunk_rows=self.config.loss_chunk_rows)
            step_loss = shard.total(ce.sum()) / supervised  # ce.mean() of the whole row (bit for bit on one process)
            loss = loss + weights[j] * step_loss
            correct[..., j][valid] = ok
            metrics[f"loss_step{j}"] = float(step_loss.detach())
        acc, cond, count = position_metrics(correct.flatten(0, 1), valid_all.flatten(0, 1), total=shard.total)
        metrics["loss"] = float(loss.detach())
        return TrainOutput(loss=loss, metrics=metrics, position_acc=acc, position_cond_acc=cond, position_count=count)

    # ----- inference -----------------------------------------------------------------------
    def new_cache(self) -> Eagle3Cache:
        return Eagle3Cache()

    @torch.no_grad()
    def extend(self, cache: Eagle3Cache, *, features: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Commit accepted positions. features [n, S, D] (target aux states at those positions),
        next_tokens [n] (the token after each), positions [n]. Returns output hidden [n, D]."""
        m, new = cache.length, features.shape[0]
        feature = self.fuse(features)[None]
        mask = torch.cat([torch.ones(new, m, dtype=torch.bool), torch.ones(new, new, dtype=torch.bool).tril()], dim=1).to(feature.device)
        out, kv = self._layer(self.embed_tokens(next_tokens)[None], feature, positions[None] + 1, cache.kv, mask[None, None])
        cache.append(kv)
        return out[0]

    @torch.no_grad()
    def speculate(
        self, cache: Eagle3Cache, draft_kv: Eagle3Cache, *, hidden: torch.Tensor, token: torch.Tensor, step: int, base_position: int
    ) -> torch.Tensor:
        """One chain step ``step`` >= 1 from the last committed position ``base_position``:
        feature = the previous step's output ``hidden`` [D] (as ``next_feature`` gives it), input ``token`` = the
        previous draft. Sees the committed cache plus this round's ``draft_kv`` (which it extends)."""
        past = cache.kv
        if draft_kv.kv is not None:
            past = (torch.cat([past[0], draft_kv.kv[0]], 2), torch.cat([past[1], draft_kv.kv[1]], 2)) if past else draft_kv.kv
        total = (0 if past is None else past[0].shape[2]) + 1
        mask = torch.ones(1, 1, 1, total, dtype=torch.bool, device=hidden.device)
        pos = torch.tensor([[base_position + 1 + step]], device=hidden.device)
        out, kv = self._layer(self.embed_tokens(token.view(1, 1)), self.next_feature(hidden).view(1, 1, -1), pos, past, mask)
        draft_kv.append(kv)
        return out[0, 0]

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., D] -> logits over the full target vocabulary (-inf outside the draft vocab)."""
        small = self.lm_head(self.norm(hidden))
        full = small.new_full((*small.shape[:-1], self.dims.vocab_size), float("-inf"))
        full[..., self.draft_target_ids()] = small
        return full

    @torch.no_grad()
    def draft(
        self,
        cache: Eagle3Cache,
        *,
        features: torch.Tensor,
        next_tokens: torch.Tensor,
        positions: torch.Tensor,
        num_tokens: int | None = None,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> DraftProposal:
        """Commit the newly accepted positions (see ``extend``), then draft ``num_tokens``
        (default ttt_steps) tokens as a chain. The last ``next_tokens`` entry is the round's
        bonus/corrected token; draft 1 predicts the token after it."""
        k = num_tokens or self.config.ttt_steps
        hidden = self.extend(cache, features=features, next_tokens=next_tokens, positions=positions)[-1]
        base = int(positions[-1])
        draft_kv = Eagle3Cache()
        chain = Chain(temperature=temperature, generator=generator)
        for i in range(k):
            if i:
                hidden = self.speculate(cache, draft_kv, hidden=hidden, token=chain.tokens[-1], step=i, base_position=base)
            chain.draw(self.draft_logits(hidden))
        return DraftProposal(*chain.result())


def build_eagle3(config: Eagle3Config, target: Target, *, counts: torch.Tensor | None = None, **_: Any) -> Eagle3Drafter:
    """A fresh EAGLE-3 drafter for ``target``; ``counts`` int64[V] (response-token frequencies,
    the prepared dataset's token_counts) selects the reduced draft vocabulary: ``draft_vocab_size``
    if set, else the smallest N reaching ``draft_vocab_coverage`` (written into the config)."""
    config = config.resolve(target)
    if config.draft_vocab_size is None and config.draft_vocab_coverage is not None:  # resolve() leaves it unset only then
        if counts is None:
            raise SpecdraftError(
                f"eagle3 draft_vocab_coverage={config.draft_vocab_coverage} needs token counts (the prepared dataset's "
                "token_counts.safetensors) to choose the draft vocabulary"
            )
        config = dataclasses.replace(config, draft_vocab_size=coverage_vocab_size(counts, config.draft_vocab_coverage))
    model = Eagle3Drafter(config, verifier=target.describe())
    model.attach_target(target)
    if model.use_draft_vocab:
        if counts is None:
            raise SpecdraftError(
                f"eagle3 draft_vocab_size {config.draft_vocab_size} < target vocabulary {model.dims.vocab_size} needs token "
                "counts (the prepared dataset's token_counts.safetensors)"
            )
        model.set_draft_vocab(counts)
    else:
        with torch.no_grad():
            model.lm_head.weight.copy_(model.verifier_lm_head.weight)
    return model
