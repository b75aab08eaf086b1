"""The hybrid proposer (prompt lookup + a trained drafter, chosen per row and round): the branch
decision on injected estimates, greedy exactness with rows on different branches in one round,
lossless sampling with mixed point-mass and sampled rows, and the drafter's feature hand-over."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from specdraft.decode.config import DecodeConfig, SamplingConfig, SchedulerConfig
from specdraft.decode.proposers import hybrid
from specdraft.decode.proposers.base import Draft, ProposalInput
from specdraft.decode.proposers.hybrid import DRAFTER, LOOKUP, AcceptanceStats, HybridProposer, choose_branch
from specdraft.decode.proposers.ngram import Lookup, lookup
from specdraft.decode.runtime import SpeculativeDecoder, build_proposer
from specdraft.decode.sps import SpsTable
from specdraft.errors import SpecdraftError
from test_decode import (
    PROMPTS,
    DistributionProposer,
    FeatureRecorder,
    assert_features_of_every_position,
    assert_target_distribution,
    reference_greedy,
    tiny_model,
)
from test_decode_drafters import checkpoints  # noqa: F401  (a fixture: random drafters of every method, saved)

FLAT = lambda tokens: 0.01  # noqa: E731  a memory-bound target: every width up to 16 costs the same step
STEEP = lambda tokens: 0.01 * tokens  # noqa: E731  a compute-bound one: each token costs a full step


# -- the decision, on injected estimates ------------------------------------------------------


def test_a_long_match_wins_over_a_costly_drafter():
    choice = choose_branch(lookup_survival=[0.9, 0.85, 0.8, 0.75], drafter_survival=[0.7, 0.5, 0.3, 0.2], draft_s=0.004, step_s=FLAT)
    assert (choice.name, choice.length) == (LOOKUP, 4)
    assert choice.tokens == pytest.approx(1 + 0.9 + 0.85 + 0.8 + 0.75)


def test_without_a_match_the_drafter_runs_if_it_beats_a_plain_step():
    assert choose_branch(lookup_survival=[], drafter_survival=[0.7, 0.5], draft_s=0.002, step_s=FLAT).name == DRAFTER
    # a drafter whose round costs as much as the tokens it adds: a plain step (lookup of length 0) is better
    plain = choose_branch(lookup_survival=[], drafter_survival=[0.3, 0.1], draft_s=0.01, step_s=FLAT)
    assert (plain.name, plain.length) == (LOOKUP, 0)


def test_a_weak_match_loses_to_a_good_drafter_and_cost_sets_the_length():
    assert choose_branch(lookup_survival=[0.2, 0.05], drafter_survival=[0.8, 0.7, 0.6, 0.5], draft_s=0.001, step_s=FLAT).name == DRAFTER
    # the same drafter on a compute-bound target: each verified draft costs a step, so a likely first draft alone pays
    choice = choose_branch(lookup_survival=[0.2, 0.05], drafter_survival=[0.8, 0.7, 0.6, 0.5], draft_s=0.001, step_s=STEEP)
    assert choice.length <= 1
    # lookup length follows the SPS curve: all of a flat profile, none of a steep one with an unlikely match
    assert choose_branch(lookup_survival=[0.6, 0.4, 0.3], drafter_survival=[], draft_s=0.0, step_s=FLAT).length == 3
    assert choose_branch(lookup_survival=[0.3, 0.1, 0.05], drafter_survival=[], draft_s=0.0, step_s=STEEP).length == 0


def test_acceptance_stats_shrink_to_the_prior_and_learn():
    stats = AcceptanceStats(prior=0.5, strength=2.0)
    assert stats.survival(2) == [0.5, 0.25]
    for _ in range(98):
        stats.record(tried=2, accepted=1)  # the first always passes, the second never
    assert stats.rates(3) == pytest.approx([99 / 100, 1 / 100, 0.5])


def test_lookup_reports_its_match_length():
    ctx = torch.tensor([9, 5, 6, 7, 1, 9, 5, 6])  # suffix [5 6] matches at 1, and [9] before it too
    match = lookup(ctx, max_ngram=2, min_ngram=2, max_tokens=3)
    assert match.tokens.tolist() == [7, 1, 9] and match.match_length == 3
    assert lookup(torch.tensor([1, 2, 3]), max_ngram=2, min_ngram=1, max_tokens=3).match_length == 0


# -- in the runtime ------------------------------------------------------------------------------


class Rounds:
    """Records, per round, which branch each row took and when the drafter ran (by wrapping the
    module's ``choose_branch`` and the drafter's ``propose``)."""

    def __init__(self, monkeypatch, proposer: HybridProposer):
        self.events: list[tuple[str, str]] = []
        self.rounds: list[list[str]] = []
        choose, propose, outer = hybrid.choose_branch, proposer.drafter.propose, proposer.propose

        def chosen(**kwargs):
            branch = choose(**kwargs)
            self.events.append(("choose", branch.name))
            self.rounds[-1].append(branch.name)
            return branch

        def drafted(inputs):
            self.events.append(("draft", ""))
            return propose(inputs)

        def round_(inputs):
            self.rounds.append([])
            self.events.append(("round", ""))
            return outer(inputs)

        monkeypatch.setattr(hybrid, "choose_branch", chosen)
        monkeypatch.setattr(proposer.drafter, "propose", drafted)
        monkeypatch.setattr(proposer, "propose", round_)

    @property
    def mixed(self) -> int:
        return sum(len(set(r)) == 2 for r in self.rounds)


def first_round_prompts(model) -> tuple[list[int], list[int]]:
    """Two prompts of distinct tokens for ``model``: the first's greedy first token appears early in it
    (its first round has a 1-gram lookup match with a long continuation), the second's does not (no match)."""
    g = torch.Generator().manual_seed(0)
    found: dict[bool, list[int]] = {}
    while len(found) < 2:
        prompt = torch.randperm(int(model.config.vocab_size), generator=g)[:10].tolist()
        first = reference_greedy(model, prompt, 1)[0]
        if first not in prompt[-4:]:
            found.setdefault(first in prompt, prompt)
    return found[True], found[False]


def hybrid_for(config: DecodeConfig, target, *, lookup_prior: float = 0.95, step_rate=lambda tokens: 100.0) -> HybridProposer:
    """The hybrid around the checkpoint's drafter on a flat SPS profile, with a lookup prior that makes
    matched rows take the lookup and unmatched ones the drafter (whose drafting the frozen clock makes free)."""
    drafter = build_proposer(DecodeConfig(**{**vars(config), "drafter": config.drafter.removesuffix("+ngram")}), target)
    return HybridProposer(
        drafter, step_rate=step_rate, lookup=Lookup(config.ngram_max, config.ngram_min), lookup_prior=lookup_prior, clock=lambda: 0.0
    )


@pytest.mark.parametrize("method, policy", [("dspark", "scheduled"), ("dspark", "full"), ("dflash", "full"), ("eagle3", "full")])
def test_greedy_output_is_the_targets_with_rows_on_both_branches(target, checkpoints, monkeypatch, method, policy):
    """Alone (batch 1) and together (batch 2, the first round taking one branch per row)."""
    config = DecodeConfig(
        drafter=f"{method}+ngram",
        drafter_path=str(checkpoints[method]),
        max_new_tokens=16,
        num_draft_tokens=3,
        ngram_min=1,
        draft_dtype="fp32",
    )
    scheduler, sps = (
        (SchedulerConfig("scheduled", adaptive_drafting=False), SpsTable((1, 4, 16), (100.0, 90.0, 40.0)))
        if policy == "scheduled"
        else (SchedulerConfig(), None)
    )
    prompts = first_round_prompts(target.model)
    expected = [reference_greedy(target.model, p, 16) for p in prompts]
    for batch, first_round in (([prompts[0]], [LOOKUP]), ([prompts[1]], [DRAFTER]), (list(prompts), [LOOKUP, DRAFTER])):
        proposer = hybrid_for(config, target)
        rounds = Rounds(monkeypatch, proposer)
        dec = SpeculativeDecoder(
            target.model, proposer, config=config, sampling=SamplingConfig(), scheduler=scheduler, sps=sps, eos_token_ids=[]
        )
        result = dec.generate(batch)
        assert [o.tokens for o in result.outputs] == [expected[prompts.index(p)] for p in batch]
        assert rounds.rounds[0] == first_round
        assert not proposer.rows and not proposer.drafter.caches, "per-request state is released"
        monkeypatch.undo()


def test_the_decision_is_made_before_anything_is_drafted(target, checkpoints, monkeypatch):
    """Every row's branch is chosen before the drafter samples this round's tokens: a choice made after
    would be free to read them (and bias the sampled output)."""
    config = DecodeConfig(
        drafter="dspark+ngram", drafter_path=str(checkpoints["dspark"]), max_new_tokens=16, ngram_min=1, draft_dtype="fp32"
    )
    proposer = hybrid_for(config, target)
    rounds = Rounds(monkeypatch, proposer)
    sampling = SamplingConfig(temperature=1.0)
    SpeculativeDecoder(target.model, proposer, config=config, sampling=sampling, eos_token_ids=[]).generate(
        list(first_round_prompts(target.model))
    )
    assert rounds.mixed > 0
    per_round = [list(g) for is_round, g in itertools.groupby(rounds.events, key=lambda e: e[0] == "round") if not is_round]
    for events in per_round:
        kinds = [k for k, _ in events]
        assert kinds == sorted(kinds, key=lambda k: k == "draft"), f"a branch was chosen after drafting: {kinds}"


def test_the_drafter_sees_the_features_of_every_committed_position():
    """Rows that took the lookup queue their features; the drafter gets them, contiguous from position 0,
    the next time it drafts that row."""
    model = tiny_model()
    refs = [reference_greedy(model, p, 16) for p in PROMPTS]
    recorder = FeatureRecorder([r + [0] * 8 for r in refs])
    proposer = HybridProposer(recorder, step_rate=lambda tokens: 100.0, lookup=Lookup(2, 1), lookup_prior=0.9, clock=lambda: 0.0)
    config = DecodeConfig(max_new_tokens=16, num_draft_tokens=4)
    result = SpeculativeDecoder(model, proposer, config=config, sampling=SamplingConfig(), eos_token_ids=[]).generate(PROMPTS)
    assert [o.tokens for o in result.outputs] == refs
    assert proposer.branches[LOOKUP] > 0 and proposer.branches[DRAFTER] > 0
    assert_features_of_every_position(model, recorder, refs)


# -- lossless sampling ------------------------------------------------------------------------------


class PeekingHybrid(HybridProposer):
    """A broken hybrid that drafts every row first and takes the lookup where the drafter's first token
    is its favourite (0): the choice reads the sampled drafts."""

    def propose(self, inputs: ProposalInput) -> Draft:
        drafted = self.drafter.propose(inputs)
        tokens, lengths, probs = drafted.tokens.clone(), drafted.lengths.clone(), drafted.probs.clone()
        for i, context in enumerate(inputs.tokens):
            if tokens.shape[1] and int(tokens[i, 0]) == 0:
                found, _ = self.lookup(context, int(lengths[i]))
                k = int(found.numel())
                tokens[i, :k], lengths[i], probs[i] = found, k, 0.0
                probs[i, :k] = torch.nn.functional.one_hot(found, probs.shape[-1]).to(probs.dtype)
                self.branches[LOOKUP] += 1
            else:
                self.branches[DRAFTER] += 1
        return Draft(tokens=tokens, lengths=lengths, probs=probs)


def sampled_outputs(cls, rows: int = 6000, lookup: Lookup = Lookup(2, 2)):
    vocab, length = 4, 4
    model = tiny_model(vocab=vocab, layers=2, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
    sampling = SamplingConfig(temperature=0.8, top_k=3)
    prompt = [0, 1, 2, 3, 2, 1, 0, 1]
    drafter = DistributionProposer(torch.tensor([2.0, 0.0, 1.0, -1.0], dtype=torch.float64))
    proposer = cls(drafter, step_rate=lambda tokens: 100.0, lookup=lookup, lookup_prior=0.9, clock=lambda: 0.0)
    dec = SpeculativeDecoder(
        model, proposer, config=DecodeConfig(max_new_tokens=length, num_draft_tokens=3, seed=5), sampling=sampling, eos_token_ids=[]
    )
    result = dec.generate([prompt] * rows)
    return model, prompt, [o.tokens for o in result.outputs], sampling, vocab, proposer, result.metrics


def test_sampled_outputs_of_mixed_rounds_follow_the_target_distribution():
    model, prompt, outputs, sampling, vocab, proposer, metrics = sampled_outputs(HybridProposer)
    assert proposer.branches[LOOKUP] > 1000 and proposer.branches[DRAFTER] > 1000, proposer.branches
    assert 0 < metrics.accepted < metrics.drafted
    assert_target_distribution(model, prompt, outputs, sampling, vocab)


def test_sampled_outputs_with_suffix_drafting_follow_the_target_distribution():
    """Rows whose lookup is the answer corpus's continuation (prompt matches of 6 tokens are rare here) beside drafter
    rows: still distribution-exact, and the corpus's buckets are what the lookup was scored on."""
    from specdraft.decode.proposers.corpus import AnswerCorpus

    answers = [np.random.default_rng(seed).integers(0, 4, 200) for seed in range(3)]
    model, prompt, outputs, sampling, vocab, proposer, metrics = sampled_outputs(HybridProposer, lookup=Lookup(6, 6, AnswerCorpus(answers)))
    corpus_rounds = sum(sum(s.tried[:1]) for bucket, s in proposer.lookup_scores.by_bucket.items() if isinstance(bucket, tuple))
    assert proposer.branches[LOOKUP] > 1000 and proposer.branches[DRAFTER] > 1000 and corpus_rounds > 1000, proposer.branches
    assert 0 < metrics.accepted < metrics.drafted
    assert_target_distribution(model, prompt, outputs, sampling, vocab)


def test_the_distribution_check_catches_a_choice_that_reads_the_drafts():
    """The same check fails for a hybrid whose choice peeks at the sampled drafts: the test above can fail."""
    model, prompt, outputs, sampling, vocab, _, _ = sampled_outputs(PeekingHybrid)
    with pytest.raises(AssertionError):
        assert_target_distribution(model, prompt, outputs, sampling, vocab)


# -- spelling ----------------------------------------------------------------------------------------


def test_hybrid_is_a_registered_drafter_and_an_eval_spec(target, checkpoints, monkeypatch, tmp_path):
    from specdraft.data.dataset import write_prepared
    from specdraft.decode import sps
    from specdraft.eval.runner import resolve_drafter

    profiled = []
    monkeypatch.setattr(sps, "load_or_measure_sps", lambda model, fingerprint: profiled.append(fingerprint) or SpsTable((1,), (100.0,)))
    proposer = build_proposer(DecodeConfig(drafter="dspark+ngram", drafter_path=str(checkpoints["dspark"])), target)
    assert isinstance(proposer, HybridProposer) and proposer.provides_confidences and proposer.block_length == 4
    assert profiled == [target.fingerprint]  # priced by the target's measured profile
    spec = resolve_drafter(f"{checkpoints['dspark']}+ngram@scheduled", num_draft_tokens=4, max_new_tokens=8, seed=0)
    assert spec.decode.drafter == "dspark+ngram" and spec.verify_policy == "scheduled"
    assert spec.label == f"dspark+ngram:{checkpoints['dspark'].name}@scheduled"
    with pytest.raises(SpecdraftError, match="'\\+ngram' follows a checkpoint directory or 'reference'"):
        resolve_drafter("ngram+ngram", num_draft_tokens=4, max_new_tokens=8, seed=0)
    # with suffix drafting: the corpus (answers prepared for this target) reaches the hybrid's lookup
    data = str(
        write_prepared(
            tmp_path / "data",
            [{"sample_id": "a", "source": "x", "input_ids": [1, 2, 3, 4, 5], "loss_mask": [0, 1, 1, 1, 1]}],
            target_info={"tokenizer_hash": target.tokenizer_hash},
            config={},
            stats={},
            vocab_size=int(target.vocab_size),
        )
    )
    proposer = build_proposer(DecodeConfig(drafter="dspark+suffix", drafter_path=str(checkpoints["dspark"]), lookup_corpus=data), target)
    assert isinstance(proposer, HybridProposer) and proposer.lookup.corpus.source == data
    spec = resolve_drafter(f"{checkpoints['dspark']}+suffix", num_draft_tokens=4, max_new_tokens=8, seed=0, lookup_corpus=data)
    assert (spec.decode.drafter, spec.decode.lookup_corpus, spec.label) == (
        "dspark+suffix",
        data,
        f"dspark+suffix:{checkpoints['dspark'].name}",
    )
    assert resolve_drafter("suffix", num_draft_tokens=4, max_new_tokens=8, seed=0, lookup_corpus=data).label == "suffix"
    with pytest.raises(SpecdraftError, match="unknown drafter 'magic\\+ngram'"):
        build_proposer(DecodeConfig(drafter="magic+ngram"))


@pytest.mark.slow
def test_reference_hybrid_on_the_real_target_matches_hf_generate(smollm2_dir):
    """The shipped DSpark drafter with lookup on SmolLM2-135M: greedy output equals HF greedy decoding at
    batch 1 and 2, with both branches taken."""
    from specdraft.reference import reference_drafter
    from specdraft.targets import load_target

    real = load_target(str(smollm2_dir))
    chats = [
        "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog.",
        "Name three primary colours.",
    ]
    prompts = [
        real.tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True, return_dict=False)
        for c in chats
    ]
    n_new = 24
    with torch.no_grad():
        expected = [real.model.generate(torch.tensor([p]), max_new_tokens=n_new, do_sample=False)[0, len(p) :].tolist() for p in prompts]
    config = DecodeConfig(
        drafter="dspark+ngram", drafter_path=str(reference_drafter("smollm2-135m")), max_new_tokens=n_new, draft_dtype="fp32"
    )
    proposer = hybrid_for(config, real, lookup_prior=0.5)
    decoder = SpeculativeDecoder(real.model, proposer, config=config, sampling=SamplingConfig())
    assert [decoder.generate([p]).outputs[0].tokens for p in prompts] == expected
    assert [o.tokens for o in decoder.generate(prompts).outputs] == expected
    assert proposer.branches[LOOKUP] > 0 and proposer.branches[DRAFTER] > 0, proposer.branches
