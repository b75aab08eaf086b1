"""Trained drafters (EAGLE-3, DFlash, DSpark) behind the ``Proposer`` interface.

Each request keeps its own draft-side cache (EAGLE-3: the drafter's KV cache; DFlash/DSpark:
the injected context K/V), extended every round with the target features of the positions
the previous round verified, exactly as the papers' inference loops do. Requests are drafted
one after another (the drafter helpers work on one sequence); verification stays batched.

Rounds run in ``DecodeConfig.draft_dtype`` on ``DecodeConfig.forward_path``; for ``auto`` the proposer hands
tuning a typical round (a few new positions after a cached context, :meth:`DrafterProposer.timed_work`), and
``tuning.resolve_choices`` times it on each path in fp32, then in fp32 and bf16 autocast on the path it kept, once per
machine and drafter configuration, and keeps the faster. Drafts stay lossless whatever the dtype or path:
the target verifies them against the distribution they were actually drawn from.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch

from specdraft.decode.config import DecodeConfig
from specdraft.decode.proposers.base import PROPOSERS, Draft, ProposalInput, Proposer
from specdraft.decode.sampling import SamplingConfig
from specdraft.errors import SpecdraftError, setting
from specdraft.models import METHODS, DrafterModel
from specdraft.registry import Registry
from specdraft.targets.base import Target
from specdraft.tuning.forward_path import PathChoice, current_path
from specdraft.tuning.measured import fastest_time
from specdraft.tuning.settings import MachineSettings, TimedWork, resolve_choices
from specdraft.utils.compute import autocast

_PROBE_ROW = -1  # request id of the synthetic rounds that time the drafter
_NO_FEATURES = "a trained drafter needs target hidden states; the runtime was not asked to capture them"


def _row_features(inputs: ProposalInput, row: int) -> tuple[torch.Tensor, int]:
    """Row ``row``'s new target features [N, S, D] and the position of the first."""
    if inputs.new_hidden is None:
        raise SpecdraftError(_NO_FEATURES)
    return inputs.new_hidden[row], inputs.new_start[row]


class DrafterProposer(Proposer):
    """Shared per-request loop: one drafter call per row, stacked into a ``Draft``."""

    def __init__(self, drafter: Any, *, provides_confidences: bool = False, confidences_calibrated: bool = False):
        self.drafter = drafter.eval()
        self.layer_slots = tuple(drafter.config.slots())
        self.provides_confidences = provides_confidences
        self.confidences_calibrated = confidences_calibrated
        self.caches: dict[int, Any] = {}
        self.compute_dtype = "fp32"
        self.dtype_facts: dict[str, Any] = {"draft_dtype": "fp32", "draft_dtype_source": "default"}  # what reports record
        self.path_facts: dict[str, Any] = PathChoice(current_path(self.drafter), "default", {}).to_json()

    @abstractmethod
    def draft_row(self, cache: Any, inputs: ProposalInput, row: int) -> Any:
        """One request's ``DraftProposal`` (tokens [K], probs [K, V], confidences [K] | None)."""

    @torch.no_grad()
    def propose(self, inputs: ProposalInput) -> Draft:
        if inputs.new_hidden is None:
            raise SpecdraftError(_NO_FEATURES)
        proposals = []
        with autocast(self.compute_dtype, inputs.max_draft.device):
            for i, rid in enumerate(inputs.row_ids):
                cache = self.caches.get(rid)
                if cache is None:
                    cache = self.caches[rid] = self.drafter.new_cache()
                proposals.append(self.draft_row(cache, inputs, i))
        rows, device = len(proposals), inputs.max_draft.device
        width = max((int(p.tokens.shape[0]) for p in proposals), default=0)
        tokens = torch.zeros((rows, width), dtype=torch.long, device=device)
        # greedy rounds draw argmaxes (probs None: point masses, which verification needs no table for)
        probs = (
            torch.zeros((rows, width, int(proposals[0].probs.shape[-1])), device=device)
            if proposals and proposals[0].probs is not None
            else None
        )
        confidences = torch.zeros((rows, width), device=device) if self.provides_confidences else None
        lengths = torch.zeros(rows, dtype=torch.long, device=device)
        for i, p in enumerate(proposals):
            k = int(p.tokens.shape[0])
            tokens[i, :k], lengths[i] = p.tokens, k
            if probs is not None:
                probs[i, :k] = p.probs
            if confidences is not None:
                confidences[i, :k] = p.confidences
        return Draft(tokens=tokens, lengths=lengths.minimum(inputs.max_draft), probs=probs, confidences=confidences)

    def release(self, row_ids: Sequence[int]) -> None:
        for rid in row_ids:
            self.caches.pop(rid, None)

    def round_seconds(self, dtype: str, *, context: int = 128, step: int = 3, repeats: int = 3) -> float:
        """Seconds of a typical round in ``dtype``: ``step`` new positions after ``context`` cached ones
        (random tokens and features: the work does not depend on the values)."""
        c = self.drafter.config
        device = next(self.drafter.parameters()).device
        g = torch.Generator().manual_seed(0)
        n = context + step * (repeats + 1) + 1
        tokens = torch.randint(0, c.vocab_size, (n,), generator=g).to(device)
        features = torch.randn(n, len(self.layer_slots), c.hidden_size, generator=g).to(device)
        max_draft = torch.tensor([self.block_length or getattr(self, "num_draft_tokens", 4)], device=device)
        end = [0]

        def one_round() -> None:  # the first (untimed warm-up) call fills the context
            start = end[0]
            end[0] = start + (step if start else context)
            self.propose(
                ProposalInput(
                    row_ids=[_PROBE_ROW],
                    tokens=[tokens[: end[0] + 1]],
                    new_hidden=[features[start : end[0]]],
                    new_start=[start],
                    max_draft=max_draft,
                    sampling=SamplingConfig(),
                    generator=g,
                )
            )

        saved, self.compute_dtype = self.compute_dtype, dtype
        try:
            return fastest_time(
                one_round, repeats=repeats, sync=(lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
            )
        finally:
            self.compute_dtype = saved
            self.release([_PROBE_ROW])

    def _probe_context(self) -> dict[str, Any]:
        return {
            "method": self.drafter.method,
            "config": self.drafter.config.to_json(),
            "block": self.block_length,
            "draft_tokens": getattr(self, "num_draft_tokens", None),
        }

    def timed_work(self) -> TimedWork:
        """A typical round (:meth:`round_seconds`), which ``tuning.resolve_choices`` times to choose the drafter's forward
        path (in fp32) and then its draft dtype on that path."""
        return TimedWork(
            "draft", self._probe_context(), seconds_in=self.round_seconds, model=self.drafter, device=next(self.drafter.parameters()).device
        )

    def use_choices(self, settings: MachineSettings) -> None:
        """Draft in the dtype ``settings`` resolved (``tuning.resolve_choices`` left the drafter on its path); ``path_facts``
        and ``dtype_facts`` record both and why (flag, measured or cached, with the figures)."""
        path, dtype = settings.forward_path, settings.compute_dtype
        if path is not None:
            self.path_facts = PathChoice(path.value, path.source, dict(path.seconds)).to_json()
        if dtype is not None:
            self.compute_dtype = dtype.value
            self.dtype_facts = dtype.facts("draft_dtype")


class BlockDrafterProposer(DrafterProposer):
    """DFlash / DSpark: append the new context features, then draft one block after the anchor."""

    def __init__(self, drafter: Any, **kwargs: Any):
        super().__init__(drafter, **kwargs)
        self.block_length = drafter.speculative_tokens()  # the whole block can be verified, not just k

    def draft_row(self, cache: Any, inputs: ProposalInput, row: int) -> Any:
        features, start = _row_features(inputs, row)
        tokens = inputs.tokens[row]
        return self.drafter.draft_block(
            cache,
            anchor_token=int(tokens[-1]),
            anchor_position=int(tokens.shape[0]) - 1,
            context_features=features,
            context_positions=torch.arange(start, start + features.shape[0], device=features.device),
            temperature=inputs.sampling.temperature,
            generator=inputs.generator,
        )


class Eagle3Proposer(DrafterProposer):
    """EAGLE-3: commit the new positions (feature at t paired with token t+1), then a chain of k drafts."""

    def __init__(self, drafter: Any, *, num_draft_tokens: int):
        super().__init__(drafter)
        self.num_draft_tokens = num_draft_tokens

    def draft_row(self, cache: Any, inputs: ProposalInput, row: int) -> Any:
        features, start = _row_features(inputs, row)
        count = features.shape[0]
        return self.drafter.draft(
            cache,
            features=features,
            next_tokens=inputs.tokens[row][start + 1 : start + count + 1],  # ends with the anchor
            positions=torch.arange(start, start + count, device=features.device),
            num_tokens=max(min(self.num_draft_tokens, int(inputs.max_draft[row])), 1),
            temperature=inputs.sampling.temperature,
            generator=inputs.generator,
        )


def load_checkpoint(config: DecodeConfig, target: Target | None) -> DrafterModel:
    """The drafter at ``config.drafter_path``, checked to be of the ``config.drafter`` family."""
    if not config.drafter_path:
        raise SpecdraftError(
            f"{setting('drafter')} {config.drafter} needs {setting('drafter_path')}: the directory of a trained {config.drafter} checkpoint"
        )
    if target is None:
        raise SpecdraftError(f"the {config.drafter} drafter needs the loaded target (its embedding, LM head and layer count)")
    device = next(target.model.parameters()).device
    return METHODS.get(config.drafter).model_cls.from_pretrained(config.drafter_path, target=target).to(device)


#: proposer kind (a family's ``MethodSpec.proposer``) -> fn(drafter, config, **the spec's proposer_options) -> proposer.
#: The families name a kind rather than register a proposer: decoding is a layer above the models.
PROPOSER_KINDS: Registry[Callable[..., DrafterProposer]] = Registry("proposer kind")
PROPOSER_KINDS.register("block")(lambda drafter, config, **options: BlockDrafterProposer(drafter, **options))
PROPOSER_KINDS.register("chain")(
    lambda drafter, config, **options: Eagle3Proposer(drafter, num_draft_tokens=config.num_draft_tokens, **options)
)


def decodable_methods() -> list[str]:
    """The families whose spec names a proposer kind."""
    return [m for m in METHODS.names() if METHODS.get(m).proposer is not None]


def drafter_proposer(drafter: DrafterModel, config: DecodeConfig) -> DrafterProposer:
    """The proposer around an already built drafter (a loaded checkpoint, or the model being trained)."""
    spec = METHODS.get(drafter.method)
    if spec.proposer is None:
        raise SpecdraftError(f"{drafter.method} drafters cannot decode (no proposer kind); decodable: {', '.join(decodable_methods())}")
    return PROPOSER_KINDS.get(spec.proposer)(drafter, config, **spec.proposer_options(drafter))


def _from_checkpoint(config: DecodeConfig, target: Target | None) -> Proposer:
    """A checkpoint's proposer on ``config.forward_path``, drafting in ``config.draft_dtype`` (``auto``: what tuning
    measured fastest here, once)."""
    proposer = drafter_proposer(load_checkpoint(config, target), config)
    proposer.use_choices(resolve_choices("draft", proposer.timed_work(), forward_path=config.forward_path, dtype=config.draft_dtype))
    return proposer


for _method in decodable_methods():
    PROPOSERS.register(_method)(_from_checkpoint)
