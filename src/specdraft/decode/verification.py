"""Verification of drafted tokens against one target forward: greedy exact match and lossless
rejection sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023, "Accelerating LLM decoding with speculative sampling").

Terms (per request, per round):
  drafted tokens   x_1..x_l  proposed by the drafter; l is the request's *verify length* (it may
                   differ per request: the scheduler or a short n-gram match shortens it).
  accepted tokens  the longest prefix x_1..x_n that passes verification (0 <= n <= l).
  recovered token  when x_{n+1} is rejected (n < l), the token that replaces it, drawn from the
                   target (argmax at T=0, else from norm(max(0, p_t - p_d))).
  bonus token      when every draft is accepted (n = l), one more token drawn from the target at
                   the position after x_l; it costs nothing because the target already scored it.
  committed        n accepted + 1 recovered-or-bonus token. The acceptance length tau is the
                   number committed per round, bonus included, so tau is in [1, l + 1].

The target forward scores the block [anchor, x_1, ..., x_K]; its row ``j`` is the target's
distribution for the token *after* block position ``j``, i.e. the one x_{j+1} must match.

Worked index example (K = 4 padded drafts, this request has l = 3, greedy):
  block positions  0       1    2    3    4
  block tokens     anchor  x1   x2   x3   (pad)
  target argmax    g0      g1   g2   g3   g4       g_j predicts the token after position j
  x1 == g0, x2 == g1, x3 != g2  ->  n = 2 accepted; recovered token = g2;
  committed = [x1, x2, g2]  (tau contribution 3); g3, g4 and the pad are ignored.
  Had x3 == g2 as well: n = 3, bonus = g3, committed = [x1, x2, x3, g3] (tau 4).

Greedy output is token-for-token the target's greedy output. Rejection sampling makes every
committed token distributed exactly as the target's (transformed) distribution, *provided* the
verify length l is chosen without looking at the drafted token it would verify (see
``scheduler.py``) and ``p_d`` is the distribution each draft was really sampled from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdraft.decode.sampling import sample

PAD = -1


@dataclass
class VerifyOutput:
    """Result of verifying one round for R requests.

    Shape symbols: R requests, K drafted positions (block width minus the anchor).

    num_accepted: [R] int64   n_r, accepted drafts (0 <= n_r <= l_r)
    tokens:       [R, K+1] int64  committed tokens: accepted drafts in [:n_r], the recovered or
                              bonus token at [n_r], ``PAD`` (-1) after it
    bonus:        [R] bool    True where every verified draft was accepted (tokens[n_r] is a bonus token)
    """

    num_accepted: torch.Tensor
    tokens: torch.Tensor
    bonus: torch.Tensor

    @property
    def num_committed(self) -> torch.Tensor:
        """[R] int64: tokens committed this round (n_r + 1)."""
        return self.num_accepted + 1

    def committed(self, row: int) -> list[int]:
        return self.tokens[row, : int(self.num_accepted[row]) + 1].tolist()


def _check_shapes(draft_tokens: torch.Tensor, draft_lengths: torch.Tensor, target: torch.Tensor) -> tuple[int, int]:
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [R, K], got shape {list(draft_tokens.shape)}")
    r, k = draft_tokens.shape
    if target.dim() != 3 or target.shape[0] != r or target.shape[1] != k + 1:
        raise ValueError(f"target scores must be [R, K+1, V] = [{r}, {k + 1}, V], got {list(target.shape)}")
    if draft_lengths.shape != (r,):
        raise ValueError(f"draft_lengths must be [R] = [{r}], got {list(draft_lengths.shape)}")
    if bool((draft_lengths < 0).any()) or bool((draft_lengths > k).any()):
        raise ValueError(f"draft_lengths must lie in [0, K={k}], got {draft_lengths.tolist()}")
    return r, k


def _leading_true(flags: torch.Tensor) -> torch.Tensor:
    """[R, K] bool -> [R] int64: length of the all-True prefix of each row."""
    return flags.long().cumprod(dim=1).sum(dim=1)


def _assemble(draft_tokens: torch.Tensor, num_accepted: torch.Tensor, last: torch.Tensor, draft_lengths: torch.Tensor) -> VerifyOutput:
    r, k = draft_tokens.shape
    cols = torch.arange(k + 1, device=draft_tokens.device)
    padded = torch.cat([draft_tokens, torch.full((r, 1), PAD, dtype=torch.long, device=draft_tokens.device)], dim=1)
    tokens = torch.where(cols < num_accepted[:, None], padded, torch.full_like(padded, PAD))
    tokens.scatter_(1, num_accepted[:, None], last[:, None])
    return VerifyOutput(num_accepted=num_accepted, tokens=tokens, bonus=num_accepted == draft_lengths)


def verify_greedy(*, draft_tokens: torch.Tensor, draft_lengths: torch.Tensor, target_logits: torch.Tensor) -> VerifyOutput:
    """Exact-match verification (temperature 0).

    draft_tokens:  [R, K] int64 (entries at or past draft_lengths[r] are ignored)
    draft_lengths: [R] int64    l_r, drafts to verify per request
    target_logits: [R, K+1, V]  target scores of the block [anchor, x_1..x_K]

    1. g = argmax of every target row.
    2. n_r = length of the prefix where x_{j+1} == g_j, capped at l_r.
    3. Commit x_1..x_{n_r} and g_{n_r} (recovered if n_r < l_r, else bonus).
    """
    _, k = _check_shapes(draft_tokens, draft_lengths, target_logits)
    argmax = target_logits.argmax(-1)  # [R, K+1]
    cols = torch.arange(k, device=draft_tokens.device)
    match = (draft_tokens == argmax[:, :k]) & (cols < draft_lengths[:, None])
    num_accepted = _leading_true(match)
    last = argmax.gather(1, num_accepted[:, None]).squeeze(1)
    return _assemble(draft_tokens, num_accepted, last, draft_lengths)


def verify_rejection(
    *,
    draft_tokens: torch.Tensor,
    draft_lengths: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> VerifyOutput:
    """Lossless rejection sampling (temperature > 0).

    draft_tokens:  [R, K] int64
    draft_lengths: [R] int64
    draft_probs:   [R, K, V] the distribution each draft was sampled from, or None for
                   deterministic proposers (n-gram lookup), whose distribution is a point mass
    target_probs:  [R, K+1, V] the target's *transformed* sampling distribution on the block

    1. Draw u_j ~ U[0, 1); accept x_j iff u_j * p_d(x_j) < p_t(x_j), i.e. with probability
       min(1, p_t(x_j) / p_d(x_j)); n_r = length of the accepted prefix, capped at l_r.
    2. If n_r < l_r: recovered token ~ norm(max(0, p_t - p_d)) at row n_r.
       Else: bonus token ~ p_t at row n_r.
    """
    r, k = _check_shapes(draft_tokens, draft_lengths, target_probs)
    if draft_probs is None:
        draft_probs = torch.nn.functional.one_hot(draft_tokens.clamp(min=0), target_probs.shape[-1]).to(target_probs.dtype)
    elif draft_probs.shape != (r, k, target_probs.shape[-1]):
        raise ValueError(f"draft_probs must be [R, K, V] = {[r, k, target_probs.shape[-1]]}, got {list(draft_probs.shape)}")
    draft_probs = draft_probs.to(target_probs.dtype)
    device = draft_tokens.device
    safe_tokens = draft_tokens.clamp(min=0)[..., None]
    p_t = target_probs[:, :k].gather(2, safe_tokens).squeeze(2)  # [R, K]
    p_d = draft_probs.gather(2, safe_tokens).squeeze(2)
    u = torch.rand((r, k), generator=generator, device=device, dtype=target_probs.dtype)
    cols = torch.arange(k, device=device)
    accept = (u * p_d < p_t) & (cols < draft_lengths[:, None])
    num_accepted = _leading_true(accept)

    row_t = target_probs.gather(1, num_accepted[:, None, None].expand(-1, 1, target_probs.shape[-1])).squeeze(1)  # [R, V]
    rejected = num_accepted < draft_lengths
    at = num_accepted.clamp(max=max(k - 1, 0))
    if k > 0:
        row_d = draft_probs.gather(1, at[:, None, None].expand(-1, 1, draft_probs.shape[-1])).squeeze(1)
        residual = (row_t - row_d).clamp(min=0)
        # A rejection with an all-zero residual only happens through rounding when p_t == p_d;
        # the target distribution itself is then the correct fallback.
        usable = rejected & (residual.sum(-1) > 0)
        dist = torch.where(usable[:, None], residual, row_t)
    else:
        dist = row_t
    last = sample(dist / dist.sum(-1, keepdim=True), generator)
    return _assemble(draft_tokens, num_accepted, last, draft_lengths)
