"""Verify-length policies, including DSpark's hardware-aware prefix scheduler (DSpark paper §3).

A policy maps the drafter's per-position confidences to the number of drafts each request sends
to the target this round. Terms, for request r and 1-based draft position j:

  c_{r,j}  confidence: the drafter's estimate of P(x_j accepted | x_1..x_{j-1} accepted). It is
           computed from x_{j-1} (DSpark's confidence head reads the Markov embedding of the
           previous token), never from x_j itself.
  a_{r,j}  prefix survival prod_{i<=j} c_{r,i}: the expected contribution of x_j to tau.
  l_r      verify length: drafts x_1..x_{l_r} are verified (always a prefix).

Scheduled policy: verifying lengths l gives a target forward of B = sum_r (1 + l_r) tokens and
expected committed tokens tau = sum_r (1 + sum_{j<=l_r} a_{r,j}); maximise Theta = tau * SPS(B).

  1. Start from l_r = 0 (anchor only): B = R, tau = R.
  2. Sort every candidate (r, j) by a_{r,j} descending (ties: earlier j first). Because a is
     non-increasing in j, each request's candidates appear in prefix order.
  3. Take candidates one at a time, extending l_r by one while Theta strictly improves; **stop at
     the first candidate that does not improve it**.

Why the break matters (losslessness): whether x_j is verified must not depend on x_j. With the
break, candidate (r, j) is reached only through candidates with larger survival, and those
involve request r's tokens before x_j only (a_{r,j} reads x_{j-1}). A look-ahead rule that skips
a non-improving candidate to take a later one would include x_j *because* a_{r,j+1}, which reads
x_j, is high; verified drafts are then a biased selection and the output distribution shifts
(``tests/test_scheduler.py`` measures both).

Draft cost. The paper's objective prices only the verify forward (on a GPU the drafter is cheap
and overlapped). On a CPU a draft round costs a sizeable fraction of a target forward, so the
runtime passes ``with_draft_cost(sps, draft_s)``: the rate of the whole round, 1 / (draft_s +
1 / SPS(B)). The draft time is already spent when the lengths are chosen, yet it still belongs in
the objective: the round's throughput is tau over the *round's* time, which makes verifying more
drafts relatively cheaper than the bare SPS curve says.

Skipping the draft (``DraftGate``). Verify length 0 everywhere is a plain decoding step, but the
draft that was thrown away still cost time. The gate predicts, from the rounds already run,
whether drafting pays at all: it compares the measured committed-tokens-per-second of drafting
rounds with that of plain rounds and drafts only while drafting is faster, probing again after
1, 2, 4, ... skipped rounds (capped). The decision reads only past rounds, never the tokens of
the round it gates, so it keeps sampling lossless.

Worked example (one request, c = [0.9, 0.8, 0.2], SPS flat up to 3 tokens then halved):
  a = [0.9, 0.72, 0.144]; start B=1, tau=1, Theta=1*SPS(1).
  take a=0.9  -> B=2, tau=1.9,   Theta=1.9*SPS(2)   improves
  take a=0.72 -> B=3, tau=2.62,  Theta=2.62*SPS(3)  improves
  try a=0.144 -> B=4, tau=2.764, Theta=2.764*SPS(4) = 1.38*SPS(3) < 2.62*SPS(3): stop, l = 2.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from specdraft.errors import SpecdraftError, setting
from specdraft.registry import Registry

__all__ = [
    "VERIFY_POLICIES",
    "DraftGate",
    "PolicySettings",
    "StepRate",
    "VerifyPolicy",
    "choose_verify_lengths",
    "prefix_survival",
    "schedule_prefix",
    "with_draft_cost",
]


class StepRate(Protocol):
    def __call__(self, num_tokens: int) -> float: ...


class PolicySettings(Protocol):
    """What a verify policy reads from its settings: ``decode.config.SchedulerConfig`` is one.

    Named by its fields, not its class, so that dependencies point one way: ``config.py`` checks a policy
    name against ``VERIFY_POLICIES`` here, and this module never imports ``config.py``.
    """

    @property
    def verify_policy(self) -> str: ...

    @property
    def confidence_threshold(self) -> float: ...


def with_draft_cost(sps: StepRate, draft_s: float) -> StepRate:
    """Rounds per second when a round costs ``draft_s`` of drafting plus one B-token verify forward."""
    if draft_s < 0:
        raise ValueError(f"draft time must be >= 0, got {draft_s}")
    return lambda num_tokens: 1.0 / (draft_s + 1.0 / sps(num_tokens))


@dataclass
class DraftGate:
    """Drafts only while drafting rounds commit tokens faster than plain decoding rounds.

    Rates are committed tokens per second of whole rounds (draft + verify + bookkeeping), smoothed
    exponentially. ``plain_rate`` starts from the SPS profile and is replaced by measured plain
    rounds. After a drafting round that leaves drafting slower, the gate decodes plainly before
    probing again, for at least twice as many rounds as last time and for enough rounds that the
    probe's extra time stays under ``probe_cost`` of theirs (at most ``max_interval``); a probe that
    pays resets the interval to 1. The runtime keeps one gate per decoder, so what it learnt carries over
    from one request to the next.
    """

    plain_rate: float
    max_interval: int = 256
    probe_cost: float = (
        0.01  # probes add at most ~1% to plain decoding: with a plain step's own <1% (benchmarks/gate_floor.py), inside the 3% floor
    )
    smoothing: float = 0.5
    draft_rate: float | None = None
    interval: int = 1
    skip_left: int = 0
    plain_measured: bool = False

    def __post_init__(self) -> None:
        if not self.plain_rate > 0 or self.max_interval < 1 or not 0 < self.smoothing <= 1 or not self.probe_cost > 0:
            raise ValueError("DraftGate needs plain_rate > 0, max_interval >= 1, smoothing in (0, 1] and probe_cost > 0")

    def should_draft(self) -> bool:
        if self.skip_left > 0:
            self.skip_left -= 1
            return False
        return True

    def record(self, *, drafted: bool, tokens: int, seconds: float, rows: int = 1) -> None:
        """Account one finished round of ``rows`` requests that committed ``tokens`` in ``seconds``."""
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        if not drafted:
            self.plain_rate = rate if not self.plain_measured else self._smooth(self.plain_rate, rate)
            self.plain_measured = True
            return
        self.draft_rate = rate if self.draft_rate is None else self._smooth(self.draft_rate, rate)
        if self.draft_rate >= self.plain_rate:
            self.interval = 1
            return
        extra_s = seconds - tokens / self.plain_rate  # what this round cost beyond plain decoding of its tokens
        plain_round_s = rows / self.plain_rate
        affordable = math.ceil(extra_s / (self.probe_cost * plain_round_s))
        self.skip_left = min(max(self.interval, affordable), self.max_interval)
        self.interval = min(2 * self.skip_left, self.max_interval)

    def _smooth(self, old: float, new: float) -> float:
        return (1 - self.smoothing) * old + self.smoothing * new


@dataclass(frozen=True)
class VerifyPolicy:
    """choose(survival [R, K] | None, lengths [R], config, sps) -> verify lengths [R] (int64, <= lengths).

    survival is None only for policies that do not need confidences (and drafters without them).
    """

    choose: Callable[[torch.Tensor | None, torch.Tensor, PolicySettings, StepRate | None], torch.Tensor]
    needs_confidences: bool
    needs_sps: bool
    needs_calibration: bool = False  # treats confidences as probabilities, so they must be calibrated


VERIFY_POLICIES: Registry[VerifyPolicy] = Registry("verify policy")


def prefix_survival(confidences: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """a_{r,j} = prod_{i<=j} c_{r,i} for [R, K] confidences, zero at positions >= lengths[r]."""
    if confidences.dim() != 2 or lengths.shape != confidences.shape[:1]:
        raise ValueError(f"confidences must be [R, K] and lengths [R], got {list(confidences.shape)} and {list(lengths.shape)}")
    if bool(((confidences < 0) | (confidences > 1)).any()) or bool(torch.isnan(confidences).any()):
        raise ValueError("confidences must lie in [0, 1]")
    survival = torch.cumprod(confidences.double(), dim=1)
    cols = torch.arange(confidences.shape[1], device=confidences.device)
    return survival.masked_fill(cols >= lengths[:, None], 0.0)


def schedule_prefix(survival: torch.Tensor, lengths: torch.Tensor, sps: StepRate) -> torch.Tensor:
    """The greedy prefix scheduler with the stop-at-first-non-improvement break (see module doc)."""
    rows, _ = survival.shape
    values = survival.tolist()
    caps = lengths.tolist()
    candidates = sorted(
        ((values[r][j], j, r) for r in range(rows) for j in range(int(caps[r]))),
        key=lambda c: (-c[0], c[1], c[2]),
    )
    chosen = [0] * rows
    batch, tau = rows, float(rows)
    best = tau * sps(batch)
    for a, j, r in candidates:
        assert chosen[r] == j, "prefix order violated: confidences must be in [0, 1]"
        theta = (tau + a) * sps(batch + 1)
        if not theta > best:
            break
        chosen[r], batch, tau, best = j + 1, batch + 1, tau + a, theta
    return torch.tensor(chosen, dtype=torch.long, device=lengths.device)


def _verify_all(survival: torch.Tensor | None, lengths: torch.Tensor, config: PolicySettings, sps: StepRate | None) -> torch.Tensor:
    return lengths


def _verify_above_threshold(
    survival: torch.Tensor | None, lengths: torch.Tensor, config: PolicySettings, sps: StepRate | None
) -> torch.Tensor:
    assert survival is not None  # needs_confidences: choose_verify_lengths checked
    # survival is non-increasing along a row, so the positions above the threshold form a prefix
    return (survival >= config.confidence_threshold).sum(dim=1).minimum(lengths)


def _verify_scheduled(survival: torch.Tensor | None, lengths: torch.Tensor, config: PolicySettings, sps: StepRate | None) -> torch.Tensor:
    assert survival is not None and sps is not None  # needs_confidences, needs_sps: choose_verify_lengths checked
    return schedule_prefix(survival, lengths, sps)


VERIFY_POLICIES.register("full")(VerifyPolicy(_verify_all, needs_confidences=False, needs_sps=False))
VERIFY_POLICIES.register("threshold")(VerifyPolicy(_verify_above_threshold, needs_confidences=True, needs_sps=False))
VERIFY_POLICIES.register("scheduled")(VerifyPolicy(_verify_scheduled, needs_confidences=True, needs_sps=True, needs_calibration=True))


def choose_verify_lengths(
    *, confidences: torch.Tensor | None, lengths: torch.Tensor, config: PolicySettings, sps: StepRate | None = None
) -> torch.Tensor:
    """Verify lengths [R] for drafts of ``lengths`` [R] with ``confidences`` [R, K] (None if the drafter has none)."""
    policy = VERIFY_POLICIES.get(config.verify_policy)
    if policy.needs_confidences and confidences is None:
        raise SpecdraftError(
            f"verify policy {config.verify_policy!r} needs a drafter with a confidence head (DSpark); use {setting('verify_policy')} full"
        )
    if policy.needs_sps and sps is None:
        raise SpecdraftError(f"verify policy {config.verify_policy!r} needs a target steps/s profile (SPS table)")
    survival = prefix_survival(confidences, lengths) if confidences is not None else None
    return policy.choose(survival, lengths, config, sps)
