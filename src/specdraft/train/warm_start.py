"""Warm starts for a fresh drafter: cheap-compute initialisations chosen in ``TrainConfig``.

The trainer calls ``apply_warm_start`` once, on a freshly built drafter of a fresh run (never on
resume: the checkpoint already holds trained weights), so a ``--dry-run`` checkpoint holds them.
Each piece is a registry keyed by method; a method that lacks the piece does not register it and
asking for it is an error naming the switch to turn off.

* ``init_from_target``: draft decoder layer i starts as target decoder layer L - N + i (the last
  N layers, in order), only where that layer computes what the draft layer computes
  (``layer_mismatches``); otherwise nothing is copied and the reasons are logged. The drafter's
  output is decoded by the target's final norm + LM head (DFlash/DSpark share them; EAGLE-3's
  head starts from the target's rows), which were trained on the output of the target's last
  layer, so the last layers are the ones whose output space the head already reads. Tensors are copied where the shapes match (attention q/k/v/o, MLP, norm
  gains, Qwen3 q/k norms); norms the target lacks stay at 1. EAGLE-3's q/k/v read [embed; feature]
  (2D wide): the target's weights go into the feature half and the embedding half is zeroed, so
  at step 0 the layer computes exactly the target layer on the fused feature; the zeroed half
  still gets gradients (its inputs are not zero). Its ``hidden_norm`` (the feature's norm) takes
  the target layer's input-norm gain.
* ``fc_init=identity``: the fc fusing the S captured slots (S*D -> D) starts as the identity on
  one slot and zero on the others: the slot nearest (in depth) to the input of the first copied
  target layer (L - N), i.e. the hidden state that layer was trained to read. With the DFlash
  preset on a 30-layer target and N = 2 it is exactly that layer's input (output of layer 27).
* ``markov_init=bigram`` (DSpark): W1 (Embedding(V, r), or its compact [N + 1, r] form) and W2
  (Linear(r, N)) start from a rank-r truncated SVD of the smoothed bigram log-odds
  log P(next | prev) - log P(next) of the training split's response tokens, restricted to the most
  frequent tokens that have a W1 row / a draft id; see ``bigram_log_odds``. Memory: the table is at
  most ``BIGRAM_MAX_TOKENS`` squared and everything else is per pair or per target id, never [V, V].
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

from specdraft.errors import SpecdraftError
from specdraft.hidden_states.layers import LayerSlot
from specdraft.models.base import DrafterModel
from specdraft.registry import Registry

log = logging.getLogger(__name__)

FC_INITS = ("random", "identity")
MARKOV_INITS = ("random", "bigram")

# Norm gains are read by running the target's norm on 1024 * ones: mean square 2^20 swamps eps and
# rsqrt(2^20) = 2^-10 is exact, so the output is the gain bit for bit whatever the convention
# (Llama ``w``, Gemma ``1 + w``).
_PROBE = 1024.0
# Bigram statistics: at most this many prev / next tokens (the most frequent) get a factorised
# bias; rarer ones get 0. 4096^2 float32 = 64 MB.
BIGRAM_MAX_TOKENS = 4096
# Additive smoothing towards the unigram: P(n|p) = (c(p,n) + ALPHA * P(n)) / (c(p) + ALPHA), so a
# previous token seen a few times moves the bias only a little.
BIGRAM_ALPHA = 4.0
# The log-odds are the full correction for a backbone that predicts only the unigram; the backbone
# already sees the context, so the bias starts at half of it (a few logits for strong bigrams,
# next to LM-head logits spread over ~10).
BIGRAM_SCALE = 0.5


@dataclass
class WarmStartInputs:
    """What a piece may read: the target, the training split's token rows, the config."""

    target: Any
    cfg: Any  # TrainConfig
    token_rows: Callable[[], list[tuple[np.ndarray, np.ndarray]]]  # [(token ids, loss mask)] of the training split


InitFn = Callable[[DrafterModel, WarmStartInputs], list[str]]  # -> names of the tensors it set

INIT_FROM_TARGET: Registry[InitFn] = Registry("init_from_target method")
FC_IDENTITY: Registry[InitFn] = Registry("fc_init=identity method")
MARKOV_BIGRAM: Registry[InitFn] = Registry("markov_init=bigram method")



@dataclass(frozen=True)
class Piece:
    """One switch of ``TrainConfig``: on when ``cfg.<switch> == on``; ``methods`` hold its initialisers."""

    switch: str
    on: Any
    off: Any
    methods: Registry[InitFn]

    @property
    def name(self) -> str:
        return self.switch if self.on is True else f"{self.switch}={self.on}"

    def enabled(self, cfg: Any) -> bool:
        return getattr(cfg, self.switch) == self.on

    def off_flag(self) -> str:
        flag = "--" + self.switch.replace("_", "-")
        return flag.replace("--", "--no-", 1) if self.off is False else f"{flag} {self.off}"


PIECES = (
    Piece("init_from_target", True, False, INIT_FROM_TARGET),
    Piece("fc_init", "identity", "random", FC_IDENTITY),
    Piece("markov_init", "bigram", "random", MARKOV_BIGRAM),
)


def check_warm_start(cfg: Any, method: str) -> None:
    """Refuse a switched-on piece that does not apply to ``method`` (before anything is built)."""
    for piece in PIECES:
        if piece.enabled(cfg) and method not in piece.methods:
            raise SpecdraftError(
                f"{piece.name} does not apply to method {method!r} (it applies to: {', '.join(piece.methods.names())}); "
                f"set `{piece.switch}: {str(piece.off).lower()}` in the recipe or pass {piece.off_flag()}"
            )


@torch.no_grad()
def apply_warm_start(drafter: DrafterModel, method: str, inputs: WarmStartInputs) -> dict[str, list[str]]:
    """Apply every switched-on piece in order; returns {piece: tensors set} (also logged)."""
    check_warm_start(inputs.cfg, method)
    done: dict[str, list[str]] = {}
    for piece in PIECES:
        if piece.enabled(inputs.cfg):
            done[piece.name] = tensors = piece.methods.get(method)(drafter, inputs)
            log.info("warm start %s: initialised %d tensor(s): %s", piece.name, len(tensors), ", ".join(tensors))
    return done


# ----- which target layers ------------------------------------------------------------------


def copied_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target layer each draft layer starts from: the last ``num_draft_layers``, in order."""
    if num_draft_layers > num_target_layers:
        raise SpecdraftError(
            f"init_from_target: the drafter has {num_draft_layers} layers but the target only {num_target_layers}; "
            "lower --model num_layers or set init_from_target: false"
        )
    return list(range(num_target_layers - num_draft_layers, num_target_layers))


def target_layers(target: Any) -> nn.ModuleList:
    model = target.model
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise SpecdraftError(f"target {target.name}: cannot find its decoder layers (expected model.get_decoder().layers)")
    return layers


def norm_gain(norm: nn.Module, dim: int) -> torch.Tensor:
    """The per-channel gain an RMSNorm-like module applies, float32 (exact, see ``_PROBE``)."""
    import copy

    probe = torch.full((dim,), _PROBE, dtype=torch.float32, device=next(norm.parameters()).device)
    return copy.deepcopy(norm).to(torch.float32)(probe).to(torch.float32)


# Where each of our DecoderLayer's tensors lives in an HF decoder layer, in order of preference
# (Gemma's pre-MLP norm is ``pre_feedforward_layernorm``; its ``post_attention_layernorm`` normalises
# the attention output, a different role).
_TARGET_NAMES = {"post_attention_layernorm.weight": ("pre_feedforward_layernorm.weight", "post_attention_layernorm.weight")}
_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight")


def _target_tensor(layer: nn.Module, name: str) -> torch.Tensor | None:
    """Our tensor ``name``'s counterpart in the HF ``layer``: a weight, or a norm's gain."""
    params = dict(layer.named_parameters())
    for candidate in _TARGET_NAMES.get(name, (name,)):
        if candidate in params:
            if name in _NORMS:
                return norm_gain(layer.get_submodule(candidate.rsplit(".", 1)[0]), params[candidate].shape[-1])
            return params[candidate].detach()
    return None


def copy_layer(draft: nn.Module, source: nn.Module, *, prefix: str, source_name: str,
               special: dict[str, Callable[[torch.Tensor, torch.Tensor], bool]] | None = None,
               skip: tuple[str, ...] = ()) -> tuple[list[str], list[str]]:
    """Copy ``source``'s tensors into ``draft`` where names and shapes match (``special`` copies a
    tensor whose shape differs: (ours, theirs) -> copied?; ``skip`` keeps ours). Returns (copied, kept) names."""
    copied, kept = [], []
    special = special or {}
    for name, param in draft.named_parameters():
        theirs = None if name in skip else _target_tensor(source, name)
        if theirs is not None and theirs.shape == param.shape:
            param.copy_(theirs.to(param.dtype))
            done = True
        else:
            done = theirs is not None and name in special and special[name](param, theirs)
        if done:
            copied.append(f"{prefix}.{name}<-{source_name}.{name}")
        else:
            kept.append(f"{prefix}.{name}")
    return copied, kept


def layer_mismatches(target: Any, index: int, draft_layer: nn.Module, rope_theta: float) -> list[str]:
    """Why target layer ``index`` computes something other than ``draft_layer`` with its weights
    copied in ([] when it computes the same): our draft layers are pre-norm SwiGLU(silu) layers with
    plain RoPE at the drafter's ``rope_theta``, 1/sqrt(head_dim) attention and no biases, fed
    unscaled embeddings. Copying into a layer that differs in any of these (Gemma 3: gelu, post-
    attention/post-FFN norms, per-layer-type RoPE bases, a sqrt(D) embedding scale) matched the
    target layer no better than the identity map (issue 18: relative error 0.249 vs 0.2495). One
    difference is let through: q/k norms a Llama-style target lacks start at gain 1 in a q/k-norm
    (DFlash/DSpark) draft layer, per-head RMS normalisation of q and k that the recipes'
    init_from_target measurements on the embedded Llama target already include."""
    tc = target.text_config
    layer = target_layers(target)[index]
    params = dict(layer.named_parameters())
    reasons = []
    act = getattr(tc, "hidden_act", None) or getattr(tc, "hidden_activation", None)
    if act not in ("silu", "swish"):
        reasons.append(f"its MLP activation is {act}, the draft layer's is silu")
    extra = sorted(n.rsplit(".", 1)[0] for n in params if n.startswith(("pre_feedforward_layernorm.", "post_feedforward_layernorm.")))
    if extra:
        reasons.append(f"it has post-attention/post-FFN norms ({', '.join(extra)}) the draft layer lacks")
    if any(n.endswith(".bias") for n in params):
        reasons.append("it has biases the draft layer lacks")
    if "self_attn.q_norm.weight" in params and getattr(draft_layer.self_attn, "q_norm", None) is None:
        reasons.append("it normalises q/k per head, the draft layer does not")
    rope = getattr(tc, "rope_parameters", None) or {}
    layer_types = getattr(tc, "layer_types", None)
    if layer_types and isinstance(rope.get(layer_types[index]), dict):
        rope = rope[layer_types[index]]  # per-layer-type RoPE (Gemma 3: sliding vs full attention)
    theta = rope.get("rope_theta", getattr(tc, "rope_theta", None))
    if rope.get("rope_type", "default") != "default":
        reasons.append(f"its RoPE is {rope['rope_type']!r}, the draft layer's plain")
    partial = float(rope.get("partial_rotary_factor", getattr(tc, "partial_rotary_factor", None)) or 1.0)
    if partial != 1.0:  # GLM-4.5, Qwen3-Next, Gemma 4's full layers: a copied layer would see positions it was never trained on
        reasons.append(f"it rotates {partial:g} of each head (partial_rotary_factor), the draft layer all of it")
    if theta is not None and float(theta) != float(rope_theta):
        reasons.append(f"its RoPE base is {float(theta):g}, the drafter's {float(rope_theta):g}")
    scalar = getattr(tc, "query_pre_attn_scalar", None)
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    if scalar is not None and float(scalar) != float(head_dim):
        reasons.append(f"it scales attention by 1/sqrt({scalar:g}), the draft layer by 1/sqrt({head_dim})")
    scale = getattr(target.model.get_input_embeddings(), "embed_scale", None)
    if scale is not None and float(scale) != 1.0:
        reasons.append(f"the target scales its embeddings by {float(scale):g}, the drafter feeds them unscaled")
    return reasons


def _family_mismatch(drafter: Any, inputs: WarmStartInputs, indices: list[int]) -> bool:
    """Log why init_from_target is off for this target, if it is (then nothing is copied)."""
    reasons = dict.fromkeys(r for i, t in enumerate(indices) for r in layer_mismatches(inputs.target, t, drafter.layers[i], drafter.config.rope_theta))
    if reasons:
        log.warning("init_from_target: off for target %s (the draft layers keep their fresh initialisation): target layer %s: %s",
                    inputs.target.name, ", ".join(map(str, indices)), "; ".join(reasons))
    return bool(reasons)


def _report_kept(kept: list[str]) -> None:
    if kept:
        log.info("init_from_target: kept the fresh initialisation of %s (no same-shaped target tensor)", ", ".join(kept))


def _init_block_layers(drafter: Any, inputs: WarmStartInputs) -> list[str]:
    """DFlash/DSpark: Qwen3-style layers, same shapes as the target's unless overridden."""
    layers = target_layers(inputs.target)
    indices = copied_layers(len(layers), len(drafter.layers))
    if _family_mismatch(drafter, inputs, indices):
        return []
    copied, kept = [], []
    for i, t in enumerate(indices):
        c, k = copy_layer(drafter.layers[i], layers[t], prefix=f"layers.{i}", source_name=f"target.layers.{t}")
        copied += c
        kept += k
    _report_kept(kept)
    return copied


def _feature_half(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    """EAGLE-3 q/k/v [out, 2D] <- target [out, D]: zero on the embedding half, target on the feature half."""
    d = theirs.shape[-1]
    if ours.shape != (theirs.shape[0], 2 * d):
        return False
    ours.zero_()
    ours[:, d:].copy_(theirs.to(ours.dtype))
    return True


def _init_eagle3_layer(drafter: Any, inputs: WarmStartInputs) -> list[str]:
    layers = target_layers(inputs.target)
    (t,) = copied_layers(len(layers), len(drafter.layers))
    if _family_mismatch(drafter, inputs, [t]):
        return []
    layer = drafter.layers[0]
    special = {f"self_attn.{p}_proj.weight": _feature_half for p in "qkv"}
    # The embedding norm feeds the zeroed half: it keeps its fresh gain of 1.
    copied, kept = copy_layer(layer, layers[t], prefix="layers.0", source_name=f"target.layers.{t}", special=special,
                              skip=("input_layernorm.weight", "hidden_norm.weight"))
    gain = _target_tensor(layers[t], "input_layernorm.weight")
    layer.hidden_norm.weight.copy_(gain.to(layer.hidden_norm.weight.dtype))
    copied.append(f"layers.0.hidden_norm.weight<-target.layers.{t}.input_layernorm.weight")
    kept.remove("layers.0.hidden_norm.weight")
    _report_kept(kept)
    return copied


INIT_FROM_TARGET.register("dflash")(_init_block_layers)
INIT_FROM_TARGET.register("dspark")(_init_block_layers)
INIT_FROM_TARGET.register("eagle3")(_init_eagle3_layer)


# ----- fc identity --------------------------------------------------------------------------


def hidden_index(slot: LayerSlot) -> int:
    """Depth of a captured hidden state: HF ``hidden_states`` index (input of layer i = i, output = i + 1)."""
    return slot.layer if slot.side == "input" else slot.layer + 1


def identity_slot(slots: Sequence[LayerSlot], num_target_layers: int, num_draft_layers: int) -> int:
    """Index of the slot nearest the input of the first copied target layer (ties: the deeper one)."""
    want = copied_layers(num_target_layers, num_draft_layers)[0]
    return min(range(len(slots)), key=lambda i: (abs(hidden_index(slots[i]) - want), -hidden_index(slots[i])))


def _init_fc_identity(drafter: Any, inputs: WarmStartInputs) -> list[str]:
    c = drafter.config
    slots = c.slots()
    j = identity_slot(slots, inputs.target.num_layers, len(drafter.layers))
    d = c.hidden_size
    weight = drafter.fc.weight  # [D, S*D]; the input is the slots flattened slot-major
    weight.zero_()
    weight[:, j * d : (j + 1) * d].copy_(torch.eye(d, dtype=weight.dtype))
    log.info("fc_init=identity: fc starts as the identity on slot %d (%s) of %s", j, slots[j], ", ".join(map(str, slots)))
    return [f"fc.weight=identity on slot {slots[j]}"]


for _method in ("dflash", "dspark", "eagle3"):
    FC_IDENTITY.register(_method)(_init_fc_identity)


# ----- Markov head from bigram statistics ---------------------------------------------------


def bigram_counts(rows: Sequence[tuple[np.ndarray, np.ndarray]], vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(prev ids int64[P], next ids int64[P], counts int64[P]) of the pairs (x_t, x_{t+1}) with
    x_{t+1} a response token: what the Markov head sees (x_{k-1}, the anchor included, -> x_k)."""
    keys = []
    for ids, mask in rows:
        ids = np.asarray(ids, dtype=np.int64)
        mask = np.asarray(mask, dtype=bool)
        if ids.size < 2:
            continue
        keep = mask[1:]
        keys.append(ids[:-1][keep] * vocab_size + ids[1:][keep])
    if not keys:
        raise SpecdraftError("markov_init=bigram: the training split holds no response-token pairs; set markov_init: random")
    uniq, counts = np.unique(np.concatenate(keys), return_counts=True)
    return uniq // vocab_size, uniq % vocab_size, counts


def bigram_log_odds(prev: np.ndarray, nxt: np.ndarray, counts: np.ndarray, *, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Smoothed, row-centred log P(next | prev) - log P(next) over the ``rows`` x ``cols`` token ids
    (float32 [R, C]); pairs outside them are ignored. Row centring drops what a softmax ignores."""
    ri, ci = _positions(prev, rows), _positions(nxt, cols)
    keep = (ri >= 0) & (ci >= 0)
    table = torch.zeros(len(rows), len(cols), dtype=torch.float32)
    table.index_put_((torch.from_numpy(ri[keep]), torch.from_numpy(ci[keep])), torch.from_numpy(counts[keep]).float(), accumulate=True)
    unigram = (table.sum(0) + 1.0) / (table.sum() + len(cols))  # P(next) over the columns, add-one
    cond = (table + BIGRAM_ALPHA * unigram) / (table.sum(1, keepdim=True) + BIGRAM_ALPHA)
    odds = cond.log() - unigram.log()
    return odds - odds.mean(1, keepdim=True)


def _positions(ids: np.ndarray, members: torch.Tensor) -> np.ndarray:
    """Index of each id in the sorted ``members``, -1 where absent."""
    lookup = np.full(max(int(ids.max()), int(members.max())) + 1, -1, dtype=np.int64)
    lookup[members.numpy()] = np.arange(members.numel())
    return lookup[ids]


def _frequent(ids: np.ndarray, counts: np.ndarray, among: torch.Tensor, limit: int) -> torch.Tensor:
    """The ``limit`` most frequent ids of ``among`` (frequency = ``counts`` summed per id) that occur, sorted."""
    total = np.bincount(ids, weights=counts, minlength=int(among.max()) + 1)
    freq = torch.from_numpy(total[among.numpy()])
    seen = among[freq > 0]
    top = torch.argsort(freq[freq > 0], descending=True, stable=True)[:limit]
    return torch.sort(seen[top]).values


def _init_markov_bigram(drafter: Any, inputs: WarmStartInputs) -> list[str]:
    from specdraft.models.common.vocab import draft_ids

    head = drafter.markov_head
    w1, w2 = head.markov_w1.weight, head.markov_w2.weight  # [V or N + 1, r], [N, r]
    vocab, rank = drafter.config.vocab_size, w1.shape[1]
    d2t = getattr(drafter, "d2t", None)
    out_ids = draft_ids(d2t).cpu() if d2t is not None else torch.arange(w2.shape[0])  # target id of each W2 row
    if out_ids.numel() != w2.shape[0]:
        raise SpecdraftError(f"markov_init=bigram: the drafter's d2t has {out_ids.numel()} entries but W2 has {w2.shape[0]} rows")
    # Previous tokens with a W1 row of their own: the draft ids when W1 is compact (the shared row
    # of all other ids stays 0), else every target id.
    own = out_ids if head.row_of is not None else torch.arange(vocab)
    prev, nxt, counts = bigram_counts(inputs.token_rows(), vocab)
    rows = _frequent(prev, counts, own, BIGRAM_MAX_TOKENS)
    cols = _frequent(nxt, counts, out_ids, BIGRAM_MAX_TOKENS)
    if rows.numel() == 0 or cols.numel() == 0:
        raise SpecdraftError("markov_init=bigram: no bigram of the training split falls in the drafter's vocabulary; set markov_init: random")
    odds = bigram_log_odds(prev, nxt, counts, rows=rows, cols=cols)
    k = min(rank, *odds.shape)
    with torch.random.fork_rng(devices=[]):  # svd_lowrank draws a random basis: the same on every rank
        torch.manual_seed(int(inputs.cfg.seed))
        u, s, v = torch.svd_lowrank(odds, q=k, niter=4)
    root = (s * BIGRAM_SCALE).sqrt()
    w1.zero_()
    w2.zero_()
    w1[rows if head.row_of is None else head.row_of[rows].cpu(), :k] = (u * root).to(w1.dtype)
    row_of = torch.full((int(out_ids.max()) + 1,), -1, dtype=torch.int64)
    row_of[out_ids] = torch.arange(out_ids.numel())
    w2[row_of[cols], :k] = (v * root).to(w2.dtype)
    log.info("markov_init=bigram: rank-%d factorisation of the bigram log-odds over %d prev x %d next tokens (%d pairs)",
             k, rows.numel(), cols.numel(), int(counts.sum()))
    return ["markov_head.markov_w1.weight", "markov_head.markov_w2.weight"]


MARKOV_BIGRAM.register("dspark")(_init_markov_bigram)
