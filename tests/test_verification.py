"""Verification maths as pure functions: greedy exact match and lossless rejection sampling."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from specdraft.decode.sampling import SamplingConfig, sample, sampling_probs
from specdraft.decode.verification import PAD, verify_greedy, verify_rejection
from specdraft.errors import SpecdraftError


def one_hot_logits(tokens: list[list[int]], vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).double()


def test_greedy_worked_example():
    # The docstring example: l = 3, x1 == g0, x2 == g1, x3 != g2 -> commit [x1, x2, g2].
    target = one_hot_logits([[4, 5, 7, 8, 9]], vocab=10)  # g = [4, 5, 7, 8, 9]
    out = verify_greedy(draft_tokens=torch.tensor([[4, 5, 6, 0]]), draft_lengths=torch.tensor([3]), target_logits=target)
    assert out.num_accepted.tolist() == [2]
    assert out.tokens.tolist() == [[4, 5, 7, PAD, PAD]]
    assert out.bonus.tolist() == [False]
    # All three accepted: bonus token g3; the pad draft at index 3 is never looked at.
    out = verify_greedy(draft_tokens=torch.tensor([[4, 5, 7, 1]]), draft_lengths=torch.tensor([3]), target_logits=target)
    assert out.committed(0) == [4, 5, 7, 8] and out.bonus.tolist() == [True]


def test_greedy_batched_per_request_lengths():
    target = one_hot_logits([[1, 2, 3], [1, 2, 3], [1, 2, 3]], vocab=4)
    drafts = torch.tensor([[1, 2], [0, 2], [1, 2]])
    out = verify_greedy(draft_tokens=drafts, draft_lengths=torch.tensor([2, 2, 0]), target_logits=target)
    assert out.num_accepted.tolist() == [2, 0, 0]
    assert [out.committed(i) for i in range(3)] == [[1, 2, 3], [1], [1]]
    assert out.bonus.tolist() == [True, False, True]
    assert out.num_committed.tolist() == [3, 1, 1]


def test_shape_errors_are_clear():
    with pytest.raises(ValueError, match="K\\+1"):
        verify_greedy(
            draft_tokens=torch.zeros((1, 2), dtype=torch.long), draft_lengths=torch.tensor([1]), target_logits=torch.zeros(1, 2, 4)
        )
    with pytest.raises(ValueError, match="draft_lengths"):
        verify_greedy(
            draft_tokens=torch.zeros((1, 2), dtype=torch.long), draft_lengths=torch.tensor([3]), target_logits=torch.zeros(1, 3, 4)
        )


def _chi_square_p(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    observed = np.bincount(tokens.numpy(), minlength=probs.numel()).astype(float)
    expected = (probs.double() / probs.double().sum()).numpy() * len(tokens)
    keep = expected > 0
    assert observed[~keep].sum() == 0, "sampled a token the target gives probability 0"
    return stats.chisquare(observed[keep], expected[keep]).pvalue


@pytest.mark.parametrize("deterministic_draft", [False, True])
def test_rejection_sampling_is_lossless(deterministic_draft):
    """Random p_t, p_d on a 6-token vocabulary: every committed position follows p_t."""
    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(0)  # Dirichlet draws from the global generator: fix it so the test does not depend on test order
    vocab, k, n = 6, 3, 40_000
    p_t = torch.distributions.Dirichlet(torch.ones(vocab)).sample((k + 1,)).double()
    p_t[1, 2] = 0.0  # a token the target never emits, drafted often below
    p_t = p_t / p_t.sum(-1, keepdim=True)
    p_d = torch.distributions.Dirichlet(torch.full((vocab,), 0.5)).sample((k,)).double()
    p_d[1] = 0.5 * p_d[1] + 0.5 * torch.nn.functional.one_hot(torch.tensor(2), vocab)
    if deterministic_draft:
        drafts = p_t[:k].argmax(-1).expand(n, k)  # likely tokens, so later positions are reached often
        draft_probs = None
    else:
        drafts = sample(p_d.expand(n, k, vocab), gen)
        draft_probs = p_d.expand(n, k, vocab)
    out = verify_rejection(
        draft_tokens=drafts,
        draft_lengths=torch.full((n,), k),
        draft_probs=draft_probs,
        target_probs=p_t.expand(n, k + 1, vocab),
        generator=gen,
    )
    committed = out.num_committed
    for position in range(k + 1):
        # Reaching a position only depends on earlier positions, so conditionally it must still follow p_t.
        rows = committed > position
        assert rows.sum() > 1000
        assert _chi_square_p(out.tokens[rows, position], p_t[position]) > 1e-3
    # The acceptance rate of position 1 is sum_x min(p_t, p_d) = 1 - TV distance.
    expected_accept = (p_t[0].max() if deterministic_draft else torch.minimum(p_t[0], p_d[0]).sum()).item()
    assert abs((out.num_accepted >= 1).double().mean().item() - expected_accept) < 0.015


def test_rejection_with_zero_drafts_samples_bonus_from_target():
    gen = torch.Generator().manual_seed(2)
    p_t = torch.tensor([0.1, 0.6, 0.3]).double()
    out = verify_rejection(
        draft_tokens=torch.zeros((20_000, 0), dtype=torch.long),
        draft_lengths=torch.zeros(20_000, dtype=torch.long),
        draft_probs=None,
        target_probs=p_t.expand(20_000, 1, 3),
        generator=gen,
    )
    assert out.bonus.all()
    assert _chi_square_p(out.tokens[:, 0], p_t) > 1e-3


def test_sampling_transform():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    assert sampling_probs(logits, SamplingConfig()).tolist() == [[1.0, 0.0, 0.0, 0.0]]
    full = torch.softmax(logits / 0.5, -1)
    assert torch.allclose(sampling_probs(logits, SamplingConfig(temperature=0.5)), full)
    top2 = sampling_probs(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert torch.allclose(top2, torch.tensor([[0.7311, 0.2689, 0.0, 0.0]]), atol=1e-4)
    # softmax = [0.644, 0.237, 0.087, 0.032]: top_p 0.8 keeps the first two (0.644 < 0.8 <= 0.881).
    nucleus = sampling_probs(logits, SamplingConfig(temperature=1.0, top_p=0.8))
    assert (nucleus[0, 2:] == 0).all() and torch.allclose(nucleus.sum(-1), torch.ones(1))
    assert (sampling_probs(logits, SamplingConfig(temperature=1.0, top_p=0.1))[0] == torch.tensor([1.0, 0, 0, 0])).all()


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"temperature": float("nan")}, "temperature"),
    ],
)
def test_bad_sampling_config(kwargs, field):
    with pytest.raises(SpecdraftError, match=field):
        SamplingConfig(**kwargs)
