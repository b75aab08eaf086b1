"""What every speculators-format drafter shares: frozen target pieces and checkpoint I/O.

Frozen pieces copied from the target (never trained, ``requires_grad=False``):
  ``embed_tokens``   the target's input embedding [V, D]
  ``verifier_norm``  a copy of the target's final norm module (so Gemma-style ``1 + w`` norms stay right)
  ``verifier_lm_head`` the target's LM head [V, D]; target logits p_t = head(norm(last_hidden))

Like speculators, checkpoints never contain ``verifier_*``; whether ``embed_tokens`` is written is
per method (EAGLE-3 writes it, DFlash/DSpark do not). Loading a checkpoint that omits what a
method needs therefore takes ``target=``. EAGLE-3 keeps the frozen embedding (most of its file on
a large vocabulary) because speculators 0.9.0 needs it: loading an EAGLE-3 checkpoint without it
there leaves a randomly initialised embedding (transformers re-initialises the missing tensor, so
the NaN sentinel that would trigger reloading it from the verifier is gone). vLLM 0.32 would share
the target's.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from specdraft.errors import SpecdraftError
from specdraft.models.base import METHODS, DrafterModel
from specdraft.models.common import checkpoint as ckpt
from specdraft.models.common.config import DraftConfig, DraftDims
from specdraft.targets.base import Target

NOT_SAVED = ("verifier_norm.", "verifier_lm_head.")


def _frozen_linear(in_dim: int, out_dim: int) -> nn.Linear:
    layer = nn.Linear(in_dim, out_dim, bias=False)
    layer.weight.requires_grad_(False)
    return layer


def target_pieces(target: Target) -> tuple[torch.Tensor, nn.Module, torch.Tensor]:
    """(embedding weight [V, D], final-norm module, LM-head weight [V, D]) of an HF causal LM."""
    from specdraft.targets.families import family_of

    parts = family_of(target.model).decoder_parts(target.model)
    return parts.embed.get_parameter("weight").detach(), parts.norm, parts.lm_head.get_parameter("weight").detach()


def portable_identity(verifier: dict) -> dict:
    """How a checkpoint's ``config.json`` names its target: for an embedded target, by name, Hugging Face repo id
    (``hub_id``, what speculators' ``verifier.name_or_path`` then holds) and fingerprint, without the local directory it
    was converted into (the building machine's cache, which a shipped drafter must not carry; ``name`` finds it again
    on any machine); any other target by its local path, where the drafter's own user keeps it."""
    from specdraft.targets import EMBEDDED_TARGETS

    name = verifier.get("name")
    if not isinstance(name, str) or name not in EMBEDDED_TARGETS:
        return dict(verifier)
    return {**{k: v for k, v in verifier.items() if k != "path"}, "hub_id": EMBEDDED_TARGETS.get(name).hub_id}


class SpeculatorsDrafter(DrafterModel):
    """Base for our three families. Subclasses set the class constants and build their modules."""

    config_cls: ClassVar[type[DraftConfig]]
    architecture: ClassVar[str]  # speculators ``architectures`` entry
    layer_model_type: ClassVar[str]  # HF model_type of ``transformer_layer_config``
    slot_side: ClassVar[str]  # "input" (EAGLE-3) or "output" (DFlash/DSpark): aux-id convention
    not_saved: ClassVar[tuple[str, ...]] = NOT_SAVED  # state-dict prefixes never written
    ignored_on_load: ClassVar[tuple[str, ...]] = ("verifier_lm_head.weight", "verifier_norm.weight")
    requires_target: ClassVar[bool] = False  # True when checkpoints lack pieces only the target has

    def __init__(self, config: DraftConfig, verifier: dict | None = None):
        super().__init__()
        self.dims: DraftDims = config.dims()  # raises unless the config is resolved
        self.config = config
        self.verifier = dict(verifier or {})
        self.embed_tokens = nn.Embedding(self.dims.vocab_size, self.dims.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.verifier_lm_head = _frozen_linear(self.dims.hidden_size, self.dims.vocab_size)
        self.verifier_norm: nn.Module | None = None

    # ----- target pieces -------------------------------------------------------------------
    def attach_target(self, target: Target) -> None:
        """Copy the frozen target pieces in (shapes must match the config)."""
        embed, norm, head = target_pieces(target)
        expected = (self.dims.vocab_size, self.dims.hidden_size)
        if tuple(embed.shape) != expected or tuple(head.shape) != expected:
            raise SpecdraftError(
                f"target {target.name}: embedding {tuple(embed.shape)} / LM head {tuple(head.shape)} do not match "
                f"the drafter config (vocab_size, hidden_size) = {expected}"
            )
        dtype = self.embed_tokens.weight.dtype
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embed.to(dtype))
            self.verifier_lm_head.weight.copy_(head.to(dtype))
        self.verifier_norm = copy.deepcopy(norm).to(dtype)
        for p in self.verifier_norm.parameters():
            p.requires_grad_(False)
        self._after_attach()
        self.verifier = {**self.verifier, **target.describe()}

    def _after_attach(self) -> None:
        """Hook: derive method pieces from the freshly copied target weights."""

    def require_verifier(self) -> nn.Module:
        if self.verifier_norm is None:
            raise SpecdraftError(
                f"this {self.method} drafter has no target attached; training needs the target's final norm "
                "(load it with from_pretrained(..., target=...) or build it with MethodSpec.build)"
            )
        return self.verifier_norm

    def check_batch(self, batch: Any) -> None:
        """The payload must carry this drafter's hidden-state slots: aux_hidden [N, T, S, D]."""
        want = (len(self.config.slots()), self.dims.hidden_size)
        got = tuple(batch.aux_hidden.shape[2:])
        if batch.aux_hidden.dim() != 4 or got != want:
            raise SpecdraftError(
                f"{self.method} drafter reads {want[0]} hidden-state slots ({self.config.layers}) of width {want[1]}, "
                f"but the batch's aux_hidden has shape {tuple(batch.aux_hidden.shape)}; extract the method's layers"
            )

    def target_logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """p_t logits over the full target vocabulary: head(norm(last_hidden))."""
        return self.verifier_lm_head(self.require_verifier()(last_hidden))

    # ----- speculators config --------------------------------------------------------------
    def transformer_layer_config(self) -> dict:
        import transformers

        c = self.dims
        hf = transformers.AutoConfig.for_model(
            self.layer_model_type,
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_hidden_layers=self.config.num_layers,
            num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            rms_norm_eps=c.rms_norm_eps,
            max_position_embeddings=c.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
            tie_word_embeddings=False,
        )
        return hf.to_dict()

    def speculative_tokens(self) -> int:
        raise NotImplementedError

    def method_fields(self, aux_ids: list[int]) -> dict:
        """The method's top-level speculators fields (``aux_ids``: see ``checkpoint.slot_to_aux_id``)."""
        raise NotImplementedError

    def draft_vocab_size(self) -> int:
        return self.dims.vocab_size

    def config_json(self) -> dict:
        slots = self.config.slots()
        verifier = portable_identity(self.verifier)
        return {
            "speculators_model_type": self.method,
            "speculators_version": ckpt.SPECULATORS_VERSION,
            "architectures": [self.architecture],
            "transformer_layer_config": self.transformer_layer_config(),
            "draft_vocab_size": self.draft_vocab_size(),
            "target_hidden_size": None,
            "speculators_config": {
                "algorithm": self.method,
                "proposal_methods": [
                    {
                        "proposal_type": "greedy",
                        "speculative_tokens": self.speculative_tokens(),
                        "verifier_accept_k": 1,
                        "accept_tolerance": 0.0,
                    }
                ],
                "default_proposal_method": "greedy",
                "verifier": {
                    "name_or_path": verifier.get("hub_id") or verifier.get("path"),
                    "architectures": list(verifier.get("architectures", [])),
                },
            },
            **self.method_fields([ckpt.slot_to_aux_id(s) for s in slots]),
            "specdraft": {
                "method": self.method,
                "config": self.config.to_json(),
                "layer_slots": [s.to_json() for s in slots],
                "target": verifier,
            },
        }

    @classmethod
    def speculators_fields(cls, cfg: dict, *, where: str) -> dict:
        """Our config fields as read from the top-level speculators fields of ``config.json``."""
        raise NotImplementedError

    @classmethod
    def config_from_speculators(cls, cfg: dict, *, where: str) -> DraftConfig:
        """Build our config from a checkpoint that speculators (not specdraft) wrote."""
        return cls.config_cls(**cls.speculators_fields(cfg, where=where))

    @classmethod
    def read_config(cls, cfg: dict, *, where: str, target: Target | None = None) -> tuple[DraftConfig, dict]:
        """(config, verifier) from ``config.json``, strictly: missing or contradictory fields are errors.

        With a ``specdraft`` block (our checkpoints) every config field must be recorded (except those marked
        ``added_later``: checkpoints from before they existed were trained with their default) and agree with
        the top-level speculators fields vLLM reads, and the block must name the target fingerprint,
        checked against ``target``. Without it (a speculators-made checkpoint) the speculators fields
        are all there is: those that shape the network are required, and the target is checked by what
        speculators records (the verifier architectures) and by shape (width, vocabulary, layer count).
        """
        ours = cfg.get("specdraft")
        if ours is None:
            config = cls.config_from_speculators(cfg, where=where)
            recorded = (cfg.get("speculators_config") or {}).get("verifier") or {}
            archs = list(recorded.get("architectures") or [])
            if target is not None and archs:
                have = list(target.describe().get("architectures") or [])
                if have and archs != have:
                    raise SpecdraftError(f"{where}: drafter was trained for a {archs} verifier, but target {target.name} is {have}")
            return config, {"path": recorded.get("name_or_path")}
        if not isinstance(ours, dict) or ours.get("method") != cls.method or not isinstance(ours.get("config"), dict):
            raise SpecdraftError(
                f"{where}/config.json: specdraft.method must be {cls.method!r} (the speculators_model_type) "
                f"beside a specdraft.config mapping, got {str(ours)[:80]!r}"
            )
        fields = {f.name for f in dataclasses.fields(cls.config_cls) if f.init and not f.metadata.get("added_later")}
        missing = sorted(fields - set(ours["config"]))
        if missing:
            raise SpecdraftError(
                f"{where}/config.json: specdraft.config lacks {', '.join(missing)}; the checkpoint is incomplete "
                "(re-save it with specdraft, or delete the specdraft block to load it as a speculators checkpoint)"
            )
        config = cls.config_cls.from_json(ours["config"], where=where)
        theirs = cls.config_from_speculators(cfg, where=where)
        for name in cls.speculators_fields(cfg, where=where):
            a, b = config.compared_value(name), theirs.compared_value(name)
            if a != b and not (isinstance(a, float) and isinstance(b, float) and math.isclose(a, b, rel_tol=1e-6)):
                raise SpecdraftError(
                    f"{where}/config.json: specdraft.config.{name} is {a!r} but the speculators fields "
                    f"(what vLLM reads) say {b!r}; the checkpoint contradicts itself"
                )
        verifier = dict(ours.get("target") or {})
        fingerprint = verifier.get("fingerprint")
        if not fingerprint:
            raise SpecdraftError(
                f"{where}/config.json: specdraft.target.fingerprint missing; cannot check which target this drafter was trained for"
            )
        if target is not None and target.fingerprint != fingerprint:
            raise SpecdraftError(
                f"{where}: drafter was trained for target fingerprint {fingerprint} ({verifier.get('name')}), "
                f"but the given target {target.name} has fingerprint {target.fingerprint}"
            )
        return config, verifier

    # ----- save / load ---------------------------------------------------------------------
    def saved_state(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if not k.startswith(self.not_saved)}

    def save_pretrained(self, directory: str | Path) -> None:
        ckpt.write_checkpoint(directory, self.config_json(), self.saved_state())

    @classmethod
    def from_pretrained(cls, directory: str | Path, *, target: Target | None = None, **kwargs: Any) -> SpeculatorsDrafter:
        """Load our own or a speculators-written checkpoint; ``target`` supplies the frozen pieces."""
        cfg, tensors = ckpt.read_checkpoint(directory)
        where = str(directory)
        kind = cfg.get("speculators_model_type")
        if kind != cls.method:
            raise SpecdraftError(f"{where}: speculators_model_type is {kind!r}, expected {cls.method!r}")
        config, verifier = cls.read_config(cfg, where=where, target=target)
        broken = next((k for k, v in tensors.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())), None)
        if broken is not None:
            raise SpecdraftError(
                f"{where}/{ckpt.WEIGHTS_FILE}: tensor {broken!r} holds NaN/inf values, so this drafter cannot "
                "draft; its training diverged or the file is damaged: use an earlier checkpoint or retrain"
            )
        if target is not None and config.num_target_layers is None:
            config = dataclasses.replace(config, num_target_layers=target.num_layers)
        if target is None and cls.requires_target:
            raise SpecdraftError(
                f"{where}: {cls.method} checkpoints omit the target's embedding and LM head (speculators layout); "
                "pass target=... to load it"
            )
        model = cls(config, verifier=verifier)
        recorded = speculative_tokens_of(cfg)
        if recorded is not None and recorded != model.speculative_tokens():
            raise SpecdraftError(
                f"{where}/config.json: speculators_config.proposal_methods[0].speculative_tokens is {recorded} "
                f"but the config gives {model.speculative_tokens()} (block_size {getattr(config, 'block_size', '-')})"
            )
        expected = model.saved_state()
        ckpt.check_tensors(tensors, expected, where=where, ignore=cls.ignored_on_load)
        model.load_state_dict({k: v for k, v in tensors.items() if k in expected}, strict=False)
        if target is not None:
            model.attach_target(target)
        return model


def speculative_tokens_of(cfg: dict) -> int | None:
    """``speculators_config.proposal_methods[0].speculative_tokens`` (what vLLM drafts per round), if recorded."""
    proposals = (cfg.get("speculators_config") or {}).get("proposal_methods") or [{}]
    tokens = proposals[0].get("speculative_tokens") if isinstance(proposals[0], dict) else None
    return tokens if isinstance(tokens, int) else None


def load_drafter(directory: str | Path, *, target: Target | None = None) -> SpeculatorsDrafter:
    """Load any drafter checkpoint, dispatching on its ``speculators_model_type`` (the family's loader reads and verifies the weights)."""
    cfg = ckpt.read_checkpoint_config(directory)
    kind = cfg.get("speculators_model_type")
    if not isinstance(kind, str):
        raise SpecdraftError(f"{directory}/config.json has no speculators_model_type; is this a drafter checkpoint?")
    return METHODS.get(kind).model_cls.from_pretrained(directory, target=target)
