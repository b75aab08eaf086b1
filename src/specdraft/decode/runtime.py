"""The speculative decoding loop over an HF causal LM: draft, verify with ONE target forward, commit.

Batching without re-padding: every request is a row of one target KV cache (``kv_cache.GrowingCache``).
Rows accept different numbers of drafts per round, so instead of shifting caches the runtime
keeps a boolean *validity mask* over cache columns and passes it as the attention mask: rejected
drafts stay in the cache as masked-out "holes", position ids are tracked per row, and trailing
columns that no row kept are cropped away. A row's attention therefore sees exactly its own
committed tokens at their true positions, as in an unbatched run. Linear-attention layers (hybrid
targets) hold a recurrent state instead, which a rejected draft would corrupt: the verify forward
records the state after each column and every row resumes from the one at its last accepted token.

Round for the R active rows (each has an *anchor*: its last committed token, not yet in the cache):
  1. the proposer drafts up to k tokens per row from the committed tokens and the target hidden
     states of newly verified positions;
  2. the verify policy (``scheduler.py``) may shorten each row's verify length l_r;
  3. one target forward over [anchor, x_1..x_K] per row (K = max l_r, padding masked out);
  4. verification (``verification.py``) commits n_r accepted drafts + 1 recovered/bonus token;
  5. the cache keeps the anchor and accepted drafts of each row (the new last token becomes the
     next anchor); requests stop at EOS, at ``max_new_tokens`` or at the target's context length.
Plain autoregressive decoding is the same loop with the ``none`` proposer (zero drafts). With the
scheduled policy a ``DraftGate`` may skip step 1 for a round (verify length 0 for every row): the
features of skipped rounds accumulate and reach the proposer at the next drafting round.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch

from specdraft.decode.config import DecodeConfig, SchedulerConfig
from specdraft.decode.proposers import PROPOSERS, Draft, ProposalInput, Proposer
from specdraft.decode.sampling import SamplingConfig, sample_from_logits, sampling_probs
from specdraft.decode.scheduler import VERIFY_POLICIES, DraftGate, StepRate, VerifyPolicy, choose_verify_lengths, with_draft_cost
from specdraft.decode.verification import VerifyOutput, verify_greedy, verify_rejection
from specdraft.errors import SpecdraftError, setting
from specdraft.hidden_states.capture import record_slots
from specdraft.hidden_states.layers import LayerSlot
from specdraft.targets.attention import SLIDING, WindowTrim
from specdraft.targets.base import Target
from specdraft.targets.families import family_of
from specdraft.tuning.forward_path import PathChoice, current_path, path_version
from specdraft.tuning.settings import Choice, MachineSettings, TimedWork, resolve_choices

if TYPE_CHECKING:  # generate() imports it when decoding starts: it loads transformers
    from specdraft.decode.kv_cache import GrowingCache

log = logging.getLogger(__name__)


#: prompt columns per prefill forward: bounds a long prompt's masks at R x PREFILL_CHUNK x C
PREFILL_CHUNK = 1024


@dataclass
class RequestOutput:
    """One request's result: generated token ids (prompt excluded) and why generation stopped."""

    tokens: list[int]
    finish_reason: str  # "eos" | "length" (max_new_tokens) | "context" (target context full)


@dataclass
class DecodeMetrics:
    """Counters of one ``generate`` call; derived rates are properties (and in ``to_json``).

    A *round* is one verification of one request after a draft (a target forward serves all rows
    at once, counted in ``target_forwards``). ``committed`` counts n + 1 per round before truncation
    at EOS/limits, so ``tau`` is the acceptance length as the papers report it (bonus included).
    position_drafted[j] / position_accepted[j]: rounds that verified / accepted draft j+1.
    request_rounds[i] / request_committed[i]: the same counters of request i alone (the i-th prompt of the
    call; ``merge`` concatenates them), whose ratio is that request's tau (``request_tau``).
    ``plain_steps`` counts request steps the draft gate decoded without drafting (not rounds).
    """

    batches: int = 1
    requests: int = 0
    output_tokens: int = 0
    rounds: int = 0
    committed: int = 0
    drafted: int = 0
    accepted: int = 0
    target_forwards: int = 0
    plain_steps: int = 0
    position_drafted: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)
    request_rounds: list[int] = field(default_factory=list, metadata={"per_request": True})
    request_committed: list[int] = field(default_factory=list, metadata={"per_request": True})
    wall_s: float = 0.0
    ttft_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("request_rounds", "request_committed"):
            getattr(self, name).extend([0] * (self.requests - len(getattr(self, name))))

    @property
    def tau(self) -> float:
        return self.committed / self.rounds if self.rounds else 0.0

    @property
    def request_tau(self) -> list[float | None]:
        """Each request's tau (None for one that finished before any drafting round)."""
        return [c / r if r else None for r, c in zip(self.request_rounds, self.request_committed)]

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.position_accepted, self.position_drafted)]

    @property
    def drafting_fraction(self) -> float:
        """Share of request steps that drafted (1.0 unless the draft gate skipped some)."""
        total = self.rounds + self.plain_steps
        return self.rounds / total if total else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def mean_ttft_s(self) -> float:
        """Time to first token of a batch (prefill + first sample), averaged over batches."""
        return self.ttft_s / self.batches if self.batches else 0.0

    @property
    def time_per_output_token_s(self) -> float:
        """Decode time after the first token per later token of one request (streams run in parallel)."""
        later_per_stream = (self.output_tokens - self.requests) * self.batches / max(self.requests, 1)
        return (self.wall_s - self.ttft_s) / later_per_stream if later_per_stream > 0 else 0.0

    def merge(self, other: DecodeMetrics) -> DecodeMetrics:
        """Counters and times of two ``generate`` calls added together (e.g. consecutive batches)."""
        merged = DecodeMetrics()
        for spec in fields(self):
            name = spec.name
            value, theirs = getattr(self, name), getattr(other, name)
            if spec.metadata.get("per_request"):
                value = value + theirs
            elif isinstance(value, list):
                width = max(len(value), len(theirs))
                value = [(value[j] if j < len(value) else 0) + (theirs[j] if j < len(theirs) else 0) for j in range(width)]
            else:
                value = value + theirs
            setattr(merged, name, value)
        return merged

    def record_round(self, lengths: list[int], accepted: list[int], requests: list[int]) -> None:
        """One round's verify lengths and accepted drafts of the rows serving ``requests`` (indices into the call's prompts)."""
        for l, n, request in zip(lengths, accepted, requests):
            self.request_rounds[request] += 1
            self.request_committed[request] += n + 1
            self.rounds += 1
            self.committed += n + 1
            self.drafted += l
            self.accepted += n
            for counts, upto in ((self.position_drafted, l), (self.position_accepted, n)):
                counts.extend([0] * (upto - len(counts)))
                for j in range(upto):
                    counts[j] += 1

    def to_json(self) -> dict[str, Any]:
        derived = (
            "tau",
            "request_tau",
            "acceptance_rate",
            "drafting_fraction",
            "position_acceptance",
            "tokens_per_s",
            "mean_ttft_s",
            "time_per_output_token_s",
        )
        return {**asdict(self), **{name: getattr(self, name) for name in derived}}


@dataclass
class DecodeResult:
    outputs: list[RequestOutput]
    metrics: DecodeMetrics


def build_proposer(config: DecodeConfig, target: Target | None = None) -> Proposer:
    """The registered proposer named by ``config.drafter`` (trained drafters need the ``Target``)."""
    return PROPOSERS.get(config.drafter)(config, target)


def check_policy_fits(scheduler: SchedulerConfig, proposer: Proposer, config: DecodeConfig) -> VerifyPolicy:
    """The verify policy, refused when the drafter cannot feed it: checked before the SPS profile is measured, so a
    policy that cannot run costs no profiling."""
    policy = VERIFY_POLICIES.get(scheduler.verify_policy)
    if policy.needs_confidences and not proposer.provides_confidences:
        raise SpecdraftError(
            f"verify policy {scheduler.verify_policy!r} needs draft confidences, which the {config.drafter!r} drafter "
            f"does not produce; use {setting('verify_policy')} full (or a DSpark drafter)"
        )
    if policy.needs_calibration and not proposer.confidences_calibrated:
        raise SpecdraftError(
            f"verify policy {scheduler.verify_policy!r} reads the drafter's confidences as acceptance probabilities, "
            f"but this {config.drafter} checkpoint is not calibrated; run `specdraft calibrate --drafter "
            f"{config.drafter_path or 'DIR'} --data HIDDEN_STATES` first"
        )
    return policy


def decoder_for_target(
    target: Target,
    *,
    config: DecodeConfig,
    sampling: SamplingConfig,
    scheduler: SchedulerConfig = SchedulerConfig(),
    forward_path: PathChoice | None = None,
) -> SpeculativeDecoder:
    """A decoder for a loaded ``Target``: on ``forward_path`` where the stage resolved it already (else on
    ``config.forward_path``, resolved by tuning now: :func:`resolve_target_path`), with the proposer and, when the verify
    policy needs it, the target's SPS profile on that path (measured once per target, device and path, then cached)."""
    if forward_path is None:  # first: proposers that price verify widths read SPS on it
        forward_path = resolve_target_path(target, config.forward_path)
    proposer = build_proposer(config, target)
    sps = None
    if check_policy_fits(scheduler, proposer, config).needs_sps:
        from specdraft.decode.sps import load_or_measure_sps

        sps = load_or_measure_sps(target.model, fingerprint=target.fingerprint, forward_path=forward_path.name)
    eos = sorted(target.end_of_turn_ids) if target.tokenizer is not None else None  # decoding stops at the template's turn end
    return SpeculativeDecoder(
        target.model, proposer, config=config, sampling=sampling, scheduler=scheduler, sps=sps, eos_token_ids=eos, forward_path=forward_path
    )


#: Verify width the target-path probe times beside the 1-token step: an anchor plus a DSpark/DFlash block of 8.
PROBE_VERIFY_TOKENS = 9
#: Cached tokens the target-path probe times its steps after: a chat turn, and a long prompt (where a path that
#: does not copy the cache per grouped head, ``gqa``, shows; at 128 it ties).
PROBE_CONTEXTS = (128, 2048)


def resolve_target_path(target: Target, requested: str) -> PathChoice:
    """Put the target on ``requested`` (``--forward-path``), or for ``auto`` on the path whose plain step plus
    verify step (1 and ``PROBE_VERIFY_TOKENS`` tokens, the two forwards decoding pays) after each of
    ``PROBE_CONTEXTS`` cached tokens (capped at the target's context) ran fastest here: ``tuning.resolve_choices``
    times that work once per machine and target, then caches it (``tuning/forward_path.py``)."""
    from specdraft.decode.sps import measure_sps

    param = next(target.model.parameters())
    limit = int(getattr(target.model.config.get_text_config(), "max_position_embeddings", 0) or 0) - PROBE_VERIFY_TOKENS
    contexts = sorted({min(c, limit) for c in PROBE_CONTEXTS if limit > 0}) or [PROBE_CONTEXTS[0]]

    def work_seconds() -> float:
        total = 0.0
        for context_tokens in contexts:
            table = measure_sps(target.model, token_counts=[1, PROBE_VERIFY_TOKENS], context_tokens=context_tokens, repeats=2)
            total += 1.0 / table(1) + 1.0 / table(PROBE_VERIFY_TOKENS)
        return total

    context = {
        "work": "plain+verify-step",
        "target": target.fingerprint,
        "dtype": str(param.dtype),
        "verify_tokens": PROBE_VERIFY_TOKENS,
        "contexts": contexts,
    }
    work = TimedWork("target", context, seconds_in=lambda _dtype: work_seconds(), model=target.model, device=param.device)
    path = resolve_choices("decode", work, forward_path=requested).chosen("forward_path")  # a measurement logs its figures
    return PathChoice(path.value, path.source, dict(path.seconds))


def resolve_decode_threads(target: Target, requested: int, *, rows: int = 1, tokens: int = 8) -> Choice:
    """Set the CPU thread count of decoding: ``requested`` when > 0, else the count at which plain
    decoding of ``rows`` x ``tokens`` (the target step every speculative round also pays) ran fastest
    here, measured once per machine and target by ``tuning.resolve_choices`` (``tuning/threads.py``)."""
    param = next(target.model.parameters())
    config = DecodeConfig(drafter="none", max_new_tokens=tokens)
    decoder = SpeculativeDecoder(target.model, build_proposer(config, target), config=config, sampling=SamplingConfig())
    prompt = [int(t) % int(target.vocab_size) for t in range(100, 132)]
    context = {
        "work": "plain-decode",
        "target": target.fingerprint,
        "dtype": str(param.dtype),
        "rows": rows,
        "tokens": tokens,
        "forward_path": path_version(current_path(target.model)),
    }
    work = TimedWork("decode", context, run=lambda _dtype: decoder.generate([prompt] * rows), device=param.device)
    return resolve_choices("decode", work, threads=requested).chosen("threads")


def decoding_settings(stage: str, decoder: SpeculativeDecoder, threads: Choice) -> MachineSettings:
    """What a decoding stage runs with (``tuning/settings.py``): the target's path, the thread count
    (:func:`resolve_decode_threads`) and the drafter's own path and dtype where it has them; the stage logs it in one block."""
    path = decoder.forward_path
    return dataclasses.replace(
        drafter_settings(stage, decoder.proposer), forward_path=Choice(path.name, path.source, path.seconds), threads=threads
    )


def drafter_settings(label: str, proposer: Proposer) -> MachineSettings:
    """A drafter's own forward path and draft dtype, where it has them (a trained drafter: ``DrafterProposer.use_choices``)."""
    return MachineSettings(
        label,
        draft_forward_path=Choice.from_facts(getattr(proposer, "path_facts", None), "forward_path"),
        draft_dtype=Choice.from_facts(getattr(proposer, "dtype_facts", None), "draft_dtype"),
    )


class SpeculativeDecoder:
    """Generates with a target ``model`` (HF causal LM) and a ``proposer``; reusable across calls.

    ``clock`` (seconds) times the rounds, for the metrics and the draft gate's decisions; tests inject one.
    """

    def __init__(
        self,
        model: Any,
        proposer: Proposer,
        *,
        config: DecodeConfig,
        sampling: SamplingConfig,
        scheduler: SchedulerConfig = SchedulerConfig(),
        sps: StepRate | None = None,
        eos_token_ids: Sequence[int] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        forward_path: PathChoice | None = None,
    ):
        self.model = model
        self.forward_path = forward_path or PathChoice(current_path(model), "as given", {})  # what reports record
        self.clock = clock
        self.proposer = proposer
        self.config = config
        self.sampling = sampling
        self.scheduler = scheduler
        self.sps = sps
        self.draft_gates: dict[int, DraftGate] = {}
        policy = check_policy_fits(scheduler, proposer, config)
        if policy.needs_sps and sps is None:
            raise SpecdraftError(f"verify policy {scheduler.verify_policy!r} needs the target's steps/s profile (sps)")
        self.text_config = text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        family = family_of(model)
        # Rejected drafts stay in the cache as masked holes: the masks count positions, not cache columns,
        # so every layer (sliding-window ones included) sees exactly its unbatched window.
        self.attention = family.attention(model)
        self.context_length = int(getattr(text_config, "max_position_embeddings", 0) or 0) or None
        self.num_layers = int(text_config.num_hidden_layers)
        if eos_token_ids is None:
            eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
            eos = eos if eos is not None else getattr(text_config, "eos_token_id", None)
            eos_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.eos_token_ids = frozenset(int(e) for e in eos_token_ids)
        self.slots: tuple[LayerSlot, ...] = tuple(proposer.layer_slots)
        self.layers = family.decoder_parts(model).layers if self.slots else ()  # hooked to hand features to the proposer
        for slot in self.slots:
            slot.check(self.num_layers)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int] | torch.Tensor]) -> DecodeResult:
        """Decode every prompt (token ids) to completion as one batch."""
        from specdraft.decode.kv_cache import GrowingCache

        prompt_ids: list[list[int]] = [p.tolist() if isinstance(p, torch.Tensor) else list(p) for p in prompts]
        self._check_prompts(prompt_ids)
        device = self.device
        generator = torch.Generator(device=device).manual_seed(self.config.seed)
        metrics = DecodeMetrics(requests=len(prompt_ids))
        start = self.clock()

        # Prefill, left-padded so that every row's last prompt token is the last column.
        rows = len(prompt_ids)
        width = max(len(p) for p in prompt_ids)
        ids = torch.zeros((rows, width), dtype=torch.long)
        valid = torch.zeros((rows, width), dtype=torch.bool)
        for i, p in enumerate(prompt_ids):
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            valid[i, width - len(p) :] = True
        ids, valid = ids.to(device), valid.to(device)
        positions = (valid.long().cumsum(1) - 1).clamp(min=0)
        # HF's sliding-window caches drop columns by count, which holes would make wrong: here attention layers grow and
        # sliding-window ones forget leading columns by position (``_trim``); recurrent layers where attention is linear
        cache = GrowingCache(self.text_config)
        trim = WindowTrim(0, torch.zeros(rows, dtype=torch.long, device=device)) if self.attention.sliding_layers else None
        logits, captured = self._prefill(ids, valid, positions, cache, trim)
        metrics.target_forwards += 1
        first, _ = sample_from_logits(logits, self.sampling, generator)
        metrics.ttft_s = self.clock() - start

        limits = [
            min(self.config.max_new_tokens, self.context_length - len(p)) if self.context_length else self.config.max_new_tokens
            for p in prompt_ids
        ]
        active = _Rows(
            row_ids=list(range(rows)),
            tokens=[list(p) for p in prompt_ids],
            generated=[0] * rows,
            next_pos=torch.tensor([len(p) for p in prompt_ids], device=device),
            new_hidden=[[captured[i, width - len(p) :]] for i, p in enumerate(prompt_ids)] if captured is not None else None,
            new_start=[0] * rows,
        )
        batch = _Batch(
            active=active, valid=valid, cache=cache, trim=trim, limits=limits, outputs=[None] * rows, generator=generator, metrics=metrics
        )
        self._drop(batch, self._commit(batch, [[int(t)] for t in first.tolist()]))

        batch.gate = self._gate(len(active.row_ids))
        while active.row_ids:
            self._trim(trim, batch.valid, active.next_pos, cache)
            self._drop(batch, self._round(batch))

        metrics.wall_s = self.clock() - start
        final = [o for o in batch.outputs if o is not None]
        metrics.output_tokens = sum(len(o.tokens) for o in final)
        return DecodeResult(outputs=final, metrics=metrics)

    # -- one round ---------------------------------------------------------------------------

    def _gate(self, rows: int) -> DraftGate | None:
        """The decoder's draft gate for batches of ``rows`` (kept across ``generate`` calls, so what it
        measured carries over to later requests), when the scheduled policy asks for one."""
        if self.sps is None or not self.scheduler.adaptive_drafting or not VERIFY_POLICIES.get(self.scheduler.verify_policy).needs_sps:
            return None
        if rows not in self.draft_gates:  # rates are per batch: one gate per batch size
            self.draft_gates[rows] = DraftGate(plain_rate=rows * self.sps(rows))
        return self.draft_gates[rows]

    def _round(self, batch: _Batch) -> list[int]:
        """One round for every active row: draft, one target forward, verify, keep what was accepted, commit.
        Returns the rows that finished."""
        rows, metrics, gate = len(batch.active.row_ids), batch.metrics, batch.gate
        drafting = gate is None or gate.should_draft()

        t0 = self.clock()
        draft = self._draft(batch, started=t0) if drafting else Draft.empty(rows, self.device)
        t1 = self.clock()
        logits, captured = self._target_forward(batch, draft)
        result = self._verify(draft, logits, batch.generator)
        metrics.draft_s += t1 - t0
        metrics.verify_s += self.clock() - t1

        accepted = result.num_accepted
        self._keep_accepted(batch, draft, accepted, captured, drafted=drafting)
        if drafting:
            metrics.record_round(draft.lengths.tolist(), accepted.tolist(), batch.active.row_ids)
        else:
            metrics.plain_steps += rows
        finished = self._commit(batch, [result.committed(i) for i in range(rows)])
        if gate is not None and metrics.target_forwards > 2:  # the first round also absorbs the prompt's features
            gate.record(drafted=drafting, tokens=int(accepted.sum()) + rows, seconds=self.clock() - t0, rows=rows)
        return finished

    def _draft(self, batch: _Batch, *, started: float) -> Draft:
        """The proposer's drafts, cut to the verify lengths the policy chooses. ``started`` is when the round began:
        the scheduled policy prices the drafting time already spent into the round."""
        active, device = batch.active, self.device
        remaining = torch.tensor([batch.limits[rid] - active.generated[i] for i, rid in enumerate(active.row_ids)], device=device)
        max_draft = (remaining - 1).clamp(min=0, max=self.proposer.block_length or self.config.num_draft_tokens)
        unseen = active.new_hidden  # per row, the feature chunks the proposer has not seen yet
        draft = self.proposer.propose(
            ProposalInput(
                row_ids=list(active.row_ids),
                tokens=[torch.tensor(t, dtype=torch.long, device=device) for t in active.tokens],
                new_hidden=None if unseen is None else [torch.cat(chunks) if len(chunks) > 1 else chunks[0] for chunks in unseen],
                new_start=list(active.new_start),
                max_draft=max_draft,
                sampling=self.sampling,
                generator=batch.generator,
            )
        )
        lengths = self._draft_lengths(draft, max_draft)
        sps = with_draft_cost(self.sps, self.clock() - started) if self.sps is not None else None
        lengths = choose_verify_lengths(confidences=draft.confidences, lengths=lengths, config=self.scheduler, sps=sps)
        width = int(lengths.max()) if lengths.numel() else 0
        return Draft(tokens=draft.tokens[:, :width], lengths=lengths, probs=draft.probs)

    def _target_forward(self, batch: _Batch, draft: Draft) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One target forward over [anchor, x_1..x_K] per row (past a row's verify length, masked padding): the logits
        that verify the drafts and, if the proposer reads features, the captured slots."""
        active, device, width = batch.active, self.device, draft.tokens.shape[1]
        anchors = torch.tensor([t[-1] for t in active.tokens], dtype=torch.long, device=device)
        block = torch.cat([anchors[:, None], draft.tokens.clamp(min=0)], dim=1)
        cols = torch.arange(width + 1, device=device)
        block_valid = cols[None] <= draft.lengths[:, None]
        positions = active.next_pos[:, None] + cols[None]
        batch.cache.record(width + 1)
        logits, captured = self._forward(block, torch.cat([batch.valid, block_valid], dim=1), positions, batch.cache, batch.trim)
        batch.metrics.target_forwards += 1
        return logits, captured

    def _keep_accepted(self, batch: _Batch, draft: Draft, accepted: torch.Tensor, captured: torch.Tensor | None, *, drafted: bool) -> None:
        """Each row keeps its anchor and ``accepted`` drafts: in the cache (rejected columns become holes, trailing ones
        no row kept are cropped), in the features the proposer has yet to see, and in its next position."""
        active, width = batch.active, draft.tokens.shape[1]
        cols = torch.arange(width + 1, device=self.device)
        kept = int(accepted.max()) + 1
        batch.cache.rollback(accepted + 1, width + 1)
        batch.valid = torch.cat([batch.valid, (cols[None] <= accepted[:, None])[:, :kept]], dim=1)
        if captured is not None:
            fresh = [captured[i, : int(n) + 1] for i, n in enumerate(accepted.tolist())]
            if drafted:
                active.new_hidden, active.new_start = [[f] for f in fresh], active.next_pos.tolist()
            else:  # the proposer has not seen the earlier chunks yet: keep them, joined only when it drafts
                assert active.new_hidden is not None  # set at prefill whenever the target's features are captured
                for chunks, f in zip(active.new_hidden, fresh):
                    chunks.append(f)
        elif drafted:
            active.new_start = active.next_pos.tolist()
        active.next_pos = active.next_pos + accepted + 1

    def _draft_lengths(self, draft: Draft, max_draft: torch.Tensor) -> torch.Tensor:
        """The drafter's lengths, checked and capped at what the runtime can verify this round."""
        rows = max_draft.shape[0]
        if draft.tokens.dim() != 2 or draft.tokens.shape[0] != rows or draft.lengths.shape != (rows,):
            raise SpecdraftError(
                f"drafter {self.config.drafter!r} returned tokens {list(draft.tokens.shape)} / lengths {list(draft.lengths.shape)} "
                f"for {rows} rows"
            )
        return draft.lengths.to(max_draft.device).clamp(min=0, max=draft.tokens.shape[1]).minimum(max_draft)

    def _verify(self, draft: Draft, logits: torch.Tensor, generator: torch.Generator) -> VerifyOutput:
        drafts, lengths, draft_probs = draft.tokens, draft.lengths, draft.probs
        if self.sampling.greedy:
            return verify_greedy(draft_tokens=drafts, draft_lengths=lengths, target_logits=logits)
        target_probs = sampling_probs(logits, self.sampling)
        if draft_probs is not None:
            draft_probs = draft_probs[:, : drafts.shape[1]]
        return verify_rejection(
            draft_tokens=drafts, draft_lengths=lengths, draft_probs=draft_probs, target_probs=target_probs, generator=generator
        )

    # -- bookkeeping -----------------------------------------------------------------------------

    def _commit(self, batch: _Batch, committed: list[list[int]]) -> list[int]:
        """Append each row's committed tokens, stopping at EOS or its limit; returns finished rows."""
        active, limits, outputs = batch.active, batch.limits, batch.outputs
        finished = []
        for i, tokens in enumerate(committed):
            rid = active.row_ids[i]
            for token in tokens:
                active.tokens[i].append(token)
                active.generated[i] += 1
                reason = None
                if token in self.eos_token_ids:
                    reason = "eos"
                elif active.generated[i] >= limits[rid]:
                    reason = "length" if active.generated[i] >= self.config.max_new_tokens else "context"
                if reason:
                    generated = active.tokens[i][len(active.tokens[i]) - active.generated[i] :]
                    outputs[rid] = RequestOutput(tokens=generated, finish_reason=reason)
                    finished.append(i)
                    break
        return finished

    def _drop(self, batch: _Batch, finished: list[int]) -> None:
        """Remove finished rows from the batch (row state, target cache, validity mask, window trim, proposer state)."""
        if not finished:
            return
        active = batch.active
        self.proposer.release([active.row_ids[i] for i in finished])
        done = set(finished)
        keep = [i for i in range(len(active.row_ids)) if i not in done]
        active.select(keep)
        if keep:
            index = torch.tensor(keep, device=batch.valid.device)
            batch.cache.batch_select_indices(index)
            batch.valid = batch.valid[index]
            if batch.trim is not None:
                batch.trim.select(index)

    def _trim(self, trim: WindowTrim | None, valid: torch.Tensor, next_positions: torch.Tensor, cache: GrowingCache) -> None:
        """Sliding-window layers forget the leading columns that no query from ``next_positions`` on can attend: their
        cache stays about a window long however long the context grows (full-attention layers keep every column)."""
        window = self.attention.windows.get(SLIDING)
        if trim is not None and window is not None:  # a trim exists only with sliding-window layers, which have a window
            cache.drop_front(self.attention.sliding_layers, trim.advance(valid, next_positions, window))

    def _prefill(
        self, ids: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor, cache: GrowingCache, trim: WindowTrim | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The prompts' forward in chunks of at most ``PREFILL_CHUNK`` columns, each attending to the cache of the
        chunks before it (as a round attends to the prompt): the masks (and SDPA's scores) stay R x chunk x C, not
        R x W x W. Returns the last column's logits [R, V] and, if the proposer reads features, [R, W, S, D]."""
        chunks: list[torch.Tensor] = []  # stays empty when the proposer reads no features
        logits: torch.Tensor | None = None
        for start in range(0, ids.shape[1], PREFILL_CHUNK):
            end = start + PREFILL_CHUNK
            logits, captured = self._forward(ids[:, start:end], valid[:, :end], positions[:, start:end], cache, trim, logits_to_keep=1)
            if captured is not None:
                chunks.append(captured)
            if end < ids.shape[1]:
                self._trim(trim, valid[:, :end], positions[:, end], cache)
        assert logits is not None  # prompts are never empty (_check_prompts)
        features = None if not chunks else chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=1)
        return logits[:, -1], features

    def _forward(
        self,
        ids: torch.Tensor,
        valid: torch.Tensor,
        positions: torch.Tensor,
        cache: GrowingCache,
        trim: WindowTrim | None,
        logits_to_keep: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Target logits [R, T', V] and, if the proposer reads features, its slots [R, T, S, D].
        ``valid`` [R, C] covers the cache and the new columns; ``positions`` [R, T] are the new tokens'."""
        seen: dict[LayerSlot, torch.Tensor] = {}
        masks = self.attention.masks(valid, positions, self.model.dtype, trim)
        with record_slots(self.layers, self.slots, seen):
            out = self.model(
                input_ids=ids, attention_mask=masks, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=logits_to_keep
            )
        hidden = torch.stack([seen[s] for s in self.slots], dim=2) if self.slots else None
        return out.logits, hidden

    def _check_prompts(self, prompts: list[list[int]]) -> None:
        if not prompts:
            raise SpecdraftError("no prompts to decode")
        vocab = int(self.model.get_input_embeddings().num_embeddings)
        for i, p in enumerate(prompts):
            if not p:
                raise SpecdraftError(f"prompt {i} is empty; every request needs at least one token")
            if self.context_length and len(p) >= self.context_length:
                raise SpecdraftError(
                    f"prompt {i} has {len(p)} tokens but the target's context is {self.context_length} tokens "
                    "(max_position_embeddings); shorten the prompt so at least one token can be generated"
                )
            if min(p) < 0 or max(p) >= vocab:
                raise SpecdraftError(f"prompt {i} has token ids outside the target vocabulary [0, {vocab})")


@dataclass
class _Rows:
    """Per-row state of the active requests, in batch order (rows leave when they finish)."""

    row_ids: list[int]
    tokens: list[list[int]]  # prompt + committed output; the last token is the anchor
    generated: list[int]
    next_pos: torch.Tensor  # [R] position of the anchor
    new_hidden: list[list[torch.Tensor]] | None  # per row, chunks of features the proposer has not seen yet
    new_start: list[int]

    def select(self, keep: list[int]) -> None:
        self.row_ids = [self.row_ids[i] for i in keep]
        self.tokens = [self.tokens[i] for i in keep]
        self.generated = [self.generated[i] for i in keep]
        self.next_pos = self.next_pos[torch.tensor(keep, dtype=torch.long, device=self.next_pos.device)]
        if self.new_hidden is not None:
            self.new_hidden = [self.new_hidden[i] for i in keep]
        self.new_start = [self.new_start[i] for i in keep]


@dataclass
class _Batch:
    """What the rounds of one ``generate`` call share and update: the active rows, the target's cache and the mask
    over its columns, and where finished requests land. It exists so that each phase of a round (draft, target
    forward, verify, keep, commit, drop) takes one typed state instead of the same loose arguments each."""

    active: _Rows
    valid: torch.Tensor  # [R, C] bool: the cache columns each row attends to (rejected drafts and padding are holes)
    cache: GrowingCache
    trim: WindowTrim | None  # the columns sliding-window layers have forgotten; None without sliding-window layers
    limits: list[int]  # per request: tokens it may generate (max_new_tokens, or fewer where the target's context ends)
    outputs: list[RequestOutput | None]  # per request, set when it finishes
    generator: torch.Generator  # every sample of the call (drafts and verification) draws from it, in round order
    metrics: DecodeMetrics
    gate: DraftGate | None = None  # set once the first token is committed, for the batch size the rounds start with
