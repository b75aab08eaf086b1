"""Hybrid proposer: per row and round, a lookup or a trained drafter, whichever is expected to
commit more tokens per second.

Spelled ``--drafter METHOD+ngram`` (prompt lookup) or ``METHOD+suffix`` (prompt lookup, else the
target's own answers, ``--lookup-corpus``), e.g. ``dspark+suffix`` with ``--drafter-path``; in
``specdraft eval`` a drafter spec ``DIR+ngram`` or ``reference+suffix``. Each round, for every row:

  1. look the context's suffix up earlier in the context (``ngram.Lookup``; with a corpus, in the
     target's answers where the context has no match): a continuation of up to the round's draft
     width and its *bucket* (the prompt match's length, or the corpus match's context length and share);
  2. estimate both branches' expected committed tokens for every verify length l from measured
     acceptance (``AcceptanceStats``): the lookup's per bucket, the drafter's per
     draft position; committed = 1 + sum_{j<=l} a_j with a_j the prefix survival;
  3. price them: a row's round costs its drafting (the drafter's measured seconds per row; the
     lookup is already paid in 1.) plus its share of the verify forward, 1 / SPS(R (1 + l)) / R
     (the target's measured profile, ``decode/sps.py``, as if every row verified l);
  4. ``choose_branch`` keeps the branch and length with the most tokens per second; only rows that
     chose the drafter are drafted, and every row is verified up to its chosen length.

Lossless: the choice reads committed tokens and past rounds only, never this round's sampled
drafts (the lookup's continuation is itself a function of committed tokens), so each row's draft
distribution is fixed before anything is sampled. Lookup rows carry a one-hot ``probs`` (the point
mass they were drawn from) beside the drafter rows' real ``probs`` in one ``Draft``, so rejection
sampling treats each row as its own proposer would (``tests/test_hybrid.py`` measures it).

Drafters that read target features must see every committed position: a row's features are
queued while it takes the lookup and handed to the drafter, joined, the next time it drafts (as
the runtime does for rounds the draft gate skips), so a lookup round costs the drafter nothing.

Learning: at its next round, the committed tokens show how far each row's last proposal matched
(the longest common prefix). For the lookup (a point mass) a match at j happens exactly with its
acceptance probability whether or not j was verified, so the lookup is scored on every row every
round, chosen or not; drafter drafts are scored where greedy decoding makes the committed text the
target's own continuation, else only up to the verified length.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specdraft.decode.config import DecodeConfig
from specdraft.decode.proposers.base import PROPOSERS, Draft, ProposalInput, Proposer
from specdraft.decode.proposers.drafters import decodable_methods
from specdraft.decode.proposers.lookup_scores import AcceptanceStats, LookupScores, Proposed, score
from specdraft.decode.proposers.ngram import Lookup, answer_corpus
from specdraft.decode.scheduler import StepRate
from specdraft.decode.verification import PAD
from specdraft.errors import SpecdraftError
from specdraft.targets.base import Target

#: ``--drafter`` names ``METHOD + kind`` for every decodable method and lookup kind: prompt lookup, or suffix drafting
#: (prompt lookup, else the target's answers in ``--lookup-corpus``).
HYBRID_KINDS = ("+ngram", "+suffix")
LOOKUP, DRAFTER = "lookup", "drafter"


@dataclass(frozen=True)
class Branch:
    """What a row does this round: ``name`` (lookup / drafter), ``length`` drafts to verify, and the
    expected committed ``tokens`` per second of row time (``rate``)."""

    name: str
    length: int
    tokens: float
    rate: float


def best_prefix(
    name: str, survival: Sequence[float], *, draft_s: float, step_s: Callable[[int], float], rows: int, min_length: int = 0
) -> Branch:
    """The verify length l in [min_length, len(survival)] with the most expected committed tokens per
    second: (1 + sum_{j<=l} a_j) / (draft_s + step_s(rows (1 + l)) / rows)."""
    best: Branch | None = None
    tokens = 1.0 + sum(survival[:min_length])
    for l in range(min_length, len(survival) + 1):
        if l > min_length:
            tokens += survival[l - 1]
        rate = tokens / (draft_s + step_s(rows * (1 + l)) / rows)
        if best is None or rate > best.rate:
            best = Branch(name, l, tokens, rate)
    if best is None:
        raise SpecdraftError(f"best_prefix: min_length {min_length} exceeds the {len(survival)} survival values of {name}")
    return best


def choose_branch(
    *, lookup_survival: Sequence[float], drafter_survival: Sequence[float], draft_s: float, step_s: Callable[[int], float], rows: int = 1
) -> Branch:
    """The better of the lookup (its continuation's survival, no drafting cost: a length of 0 is a
    plain step) and the drafter (its block's survival, ``draft_s`` per row, at least one draft).
    Ties go to the lookup, which costs nothing to draft. Inputs are estimates from earlier rounds
    and committed tokens only; nothing here may read this round's sampled drafts."""
    by_lookup = best_prefix(LOOKUP, lookup_survival, draft_s=0.0, step_s=step_s, rows=rows)
    if not drafter_survival:
        return by_lookup
    by_drafter = best_prefix(DRAFTER, drafter_survival, draft_s=draft_s, step_s=step_s, rows=rows, min_length=1)
    return by_drafter if by_drafter.rate > by_lookup.rate else by_lookup


@dataclass
class _RowState:
    pending: list[torch.Tensor] = field(default_factory=list)  # features the drafter has not seen yet
    pending_start: int = 0
    drafted: bool = False  # the drafter has run for this row (its first round also absorbs the prompt)
    drafter: Proposed | None = None


class HybridProposer(Proposer):
    """Prompt lookup and a trained drafter behind one ``Proposer``; see the module docstring.

    ``step_rate`` is the target's SPS profile; ``lookup_prior`` / ``drafter_prior`` the acceptance assumed
    per draft before any is measured; ``clock`` times the drafter's rounds (tests inject one).
    """

    def __init__(
        self,
        drafter: Proposer,
        *,
        step_rate: StepRate,
        lookup: Lookup,
        lookup_prior: float = 0.5,
        drafter_prior: float = 0.5,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.drafter = drafter
        self.step_rate = step_rate
        self.lookup = lookup
        self.clock = clock
        self.layer_slots = drafter.layer_slots
        self.provides_confidences = drafter.provides_confidences
        self.confidences_calibrated = drafter.confidences_calibrated
        self.block_length = drafter.block_length
        self.lookup_scores = LookupScores(prior=lookup_prior)  # by bucket
        self.drafter_stats = AcceptanceStats(prior=drafter_prior)
        self.draft_s: float | None = None  # measured seconds of drafting one row (smoothed)
        self.rows: dict[int, _RowState] = {}
        self.branches = {LOOKUP: 0, DRAFTER: 0}  # rows that took each branch, for reports and tests

    @property
    def dtype_facts(self) -> dict[str, Any] | None:
        return getattr(self.drafter, "dtype_facts", None)

    @property
    def path_facts(self) -> dict[str, Any] | None:
        return getattr(self.drafter, "path_facts", None)

    def propose(self, inputs: ProposalInput) -> Draft:
        if inputs.new_hidden is None and self.layer_slots:
            raise SpecdraftError("the hybrid's drafter needs target hidden states; the runtime was not asked to capture them")
        rows = len(inputs.row_ids)
        choices: list[Branch] = []
        found: list[torch.Tensor] = []
        buckets: list[Hashable] = []
        for i, rid in enumerate(inputs.row_ids):
            state = self.rows.setdefault(rid, _RowState())
            context = inputs.tokens[i].cpu()
            self._learn(rid, state, context, inputs.sampling.greedy)
            if inputs.new_hidden is not None:
                if not state.pending:
                    state.pending_start = inputs.new_start[i]
                state.pending.append(inputs.new_hidden[i])
            cap = int(inputs.max_draft[i])
            continuation, bucket = self.lookup(context, cap)
            stats = self.lookup_scores.stats(bucket)
            width = min(self.block_length or cap, cap)
            choices.append(
                choose_branch(
                    lookup_survival=stats.survival(int(continuation.numel())),
                    drafter_survival=self.drafter_stats.survival(width),
                    draft_s=self.draft_s or 0.0,
                    step_s=lambda b: 1.0 / self.step_rate(b),
                    rows=rows,
                )
            )
            found.append(continuation)
            buckets.append(bucket)
            self.lookup_scores.remember(
                rid, Proposed(continuation.tolist(), choices[-1].length if choices[-1].name == LOOKUP else 0, int(context.shape[0]), bucket)
            )
        drafted = self._draft(inputs, [i for i, c in enumerate(choices) if c.name == DRAFTER])
        return self._assemble(inputs, choices, found, buckets, drafted)

    def _draft(self, inputs: ProposalInput, picked: list[int]) -> Draft | None:
        """The drafter's proposal for the ``picked`` rows, fed every feature queued since they last drafted."""
        if not picked:
            return None
        states = [self.rows[inputs.row_ids[i]] for i in picked]
        sub = ProposalInput(
            row_ids=[inputs.row_ids[i] for i in picked],
            tokens=[inputs.tokens[i] for i in picked],
            new_hidden=[torch.cat(s.pending) if len(s.pending) > 1 else s.pending[0] for s in states]
            if inputs.new_hidden is not None
            else None,
            new_start=[s.pending_start if s.pending else inputs.new_start[i] for s, i in zip(states, picked)],
            max_draft=inputs.max_draft[picked],
            sampling=inputs.sampling,
            generator=inputs.generator,
        )
        start = self.clock()
        draft = self.drafter.propose(sub)
        seconds = (self.clock() - start) / len(picked)
        if all(s.drafted for s in states):  # a first round also appends the whole prompt: not a typical round
            self.draft_s = seconds if self.draft_s is None else 0.5 * (self.draft_s + seconds)
        for s in states:
            s.pending, s.drafted = [], True
        return draft

    def _assemble(
        self, inputs: ProposalInput, choices: list[Branch], found: list[torch.Tensor], buckets: list[Hashable], drafted: Draft | None
    ) -> Draft:
        """One ``Draft`` for all rows: lookup rows with a one-hot ``probs`` and their estimated
        conditional acceptance as confidences, drafter rows as the drafter drew them."""
        rows, device = len(choices), inputs.max_draft.device
        width = max([int(t.numel()) for t in found] + ([int(drafted.tokens.shape[1])] if drafted is not None else []) + [0])
        tokens = torch.full((rows, width), PAD, dtype=torch.long, device=device)
        lengths = torch.zeros(rows, dtype=torch.long, device=device)
        # a round of lookup rows alone is all point masses (probs None); confidences are always there
        # when the drafter gives them, since a confidence-reading verify policy needs them for every row
        probs = None
        if drafted is not None and drafted.probs is not None:
            probs = torch.zeros((rows, width, int(drafted.probs.shape[-1])), device=device)
        confidences = torch.zeros((rows, width), device=device) if self.provides_confidences else None
        d = 0
        for i, choice in enumerate(choices):
            rid = inputs.row_ids[i]
            if choice.name == DRAFTER:
                assert drafted is not None  # a row chooses the drafter only when it drafted
                k = int(drafted.tokens.shape[1])
                tokens[i, :k] = drafted.tokens[d]
                lengths[i] = min(int(drafted.lengths[d]), choice.length)
                if probs is not None and drafted.probs is not None:  # probs exists only when drafted.probs does
                    probs[i, :k] = drafted.probs[d]
                if confidences is not None and drafted.confidences is not None:
                    confidences[i, :k] = drafted.confidences[d]
                self.rows[rid].drafter = Proposed(
                    drafted.tokens[d, : int(drafted.lengths[d])].tolist(), int(lengths[i]), int(inputs.tokens[i].shape[0]), 0
                )
                d += 1
            else:
                k = int(found[i].numel())
                tokens[i, :k] = found[i].to(device)
                lengths[i] = choice.length
                if probs is not None and k:
                    probs[i, :k] = torch.nn.functional.one_hot(found[i], probs.shape[-1]).to(device, probs.dtype)
                if confidences is not None:
                    confidences[i, :k] = torch.tensor(self.lookup_scores.stats(buckets[i]).rates(k), device=device)
            self.branches[choice.name] += 1
        return Draft(tokens=tokens, lengths=lengths, probs=probs, confidences=confidences)

    def _learn(self, rid: int, state: _RowState, context: torch.Tensor, greedy: bool) -> None:
        """Score the row's last proposals against the tokens committed since: the lookup's anywhere (a point mass),
        the drafter's where greedy decoding makes the committed text the target's own, else up to its verified length."""
        self.lookup_scores.learn(rid, context)
        if state.drafter is not None:
            score(state.drafter, context, self.drafter_stats, anywhere=greedy)
            state.drafter = None

    def release(self, row_ids: Sequence[int]) -> None:
        self.drafter.release(row_ids)
        self.lookup_scores.release(row_ids)
        for rid in row_ids:
            self.rows.pop(rid, None)


def build_hybrid(config: DecodeConfig, target: Target | None) -> Proposer:
    """The checkpoint's drafter (``config.drafter`` less the kind) with its lookup (with the answer corpus for
    ``+suffix``), priced by the target's SPS profile (measured once per target and device, then cached)."""
    from specdraft.decode.sps import load_or_measure_sps

    method, _, kind = config.drafter.rpartition("+")
    corpus = answer_corpus(config, target) if kind == "suffix" else None
    drafter = PROPOSERS.get(method)(dataclasses.replace(config, drafter=method), target)
    assert target is not None  # the drafter's checkpoint loader refused None
    sps = load_or_measure_sps(target.model, fingerprint=target.fingerprint)
    return HybridProposer(drafter, step_rate=sps, lookup=Lookup(config.ngram_max, config.ngram_min, corpus))


for _method in decodable_methods():
    for _kind in HYBRID_KINDS:
        PROPOSERS.register(f"{_method}{_kind}")(build_hybrid)
