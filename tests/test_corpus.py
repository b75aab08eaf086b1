"""Suffix drafting from the target's own answers (``decode/proposers/corpus.py``): the index, reading a prepared
dataset's answers, and decoding with it exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdraft.data.dataset import write_prepared
from specdraft.decode.config import DecodeConfig, SamplingConfig
from specdraft.decode.proposers.corpus import MIN_SHARE, AnswerCorpus, CorpusMatch
from specdraft.decode.proposers.ngram import Lookup, NgramProposer
from specdraft.decode.runtime import SpeculativeDecoder, build_proposer
from specdraft.errors import SpecdraftError
from specdraft.eval.lookup_replay import ReplayRound, replay, summarize
from test_decode import PROMPTS, reference_greedy, tiny_model


def test_the_corpus_chains_the_most_frequent_continuation_of_the_longest_context():
    corpus = AnswerCorpus([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], [1, 2, 3, 9], [8, 2, 3, 7], [8, 2, 3, 7], [8, 2, 3, 7]])
    # (1, 2, 3) was followed by 4 twice and 9 once: the 3-token context wins over (2, 3), whose favourite is 7
    assert corpus.propose([0, 1, 2, 3], 8) == CorpusMatch([4, 5, 6], context=3, share=pytest.approx(2 / 3))
    assert corpus.propose([0, 1, 2, 3], 8).bucket == ("corpus", 3, 6)
    assert corpus.propose([0, 1, 2, 3], 2).tokens == [4, 5]
    assert corpus.propose([5, 2, 3], 8).tokens[0] == 7  # (5, 2, 3) unseen: (2, 3) was followed by 7 three of six times
    assert corpus.propose([4, 9], 8) == CorpusMatch([])  # (4, 9) never seen; a 1-token context is not indexed
    assert AnswerCorpus([[1, 2, 3]]).propose([1, 2], 4).tokens == [3]  # seen once proposes (measured to pay) ...
    assert AnswerCorpus([[1, 2, 3]], min_occurrences=2).propose([1, 2], 4) == CorpusMatch([])  # ... unless a floor says no
    assert AnswerCorpus([[1, 2, 3, 4]], context_lengths=(3,)).propose([1, 2, 3], 4).tokens == [4]  # only 3-token contexts
    assert AnswerCorpus([[1, 2, 3, 4]], context_lengths=(3,)).propose([2, 3], 4) == CorpusMatch([])
    with pytest.raises(SpecdraftError, match="min_occurrences >= 1"):
        AnswerCorpus([[1, 2, 3]], min_occurrences=0)
    for bad in ({"min_share": 1.5}, {"context_lengths": (0, 2)}, {"context_lengths": ()}):
        with pytest.raises(SpecdraftError, match="answer corpus: need context lengths >= 1"):
            AnswerCorpus([[1, 2, 3]], **bad)
    assert corpus.tokens == 6 + 6 + 4 + 4 + 4 + 4


def test_chaining_stops_at_a_weak_continuation_and_ties_go_to_the_smaller_id():
    weak = int(1 / MIN_SHARE) + 1  # (2, 3) then has that many different continuations, each below MIN_SHARE
    corpus = AnswerCorpus([[1, 2, 3]] * 3 + [[2, 3, 10 + i] for i in range(weak)] * 2)
    assert AnswerCorpus([[1, 2, 3]] * 3 + [[2, 3, 10 + i] for i in range(weak)] * 2, min_share=0.0).propose([1, 2], 4).tokens == [3, 10]
    assert corpus.propose([1, 2], 4).tokens == [3]  # (1, 2) -> 3, then (2, 3)'s favourite is too weak to chain
    first = corpus.propose([9, 2, 3], 4)
    assert first.tokens == [10] and first.share < MIN_SHARE  # a first token is proposed whatever its share (tie: smallest id)
    assert AnswerCorpus([[4, 5, 1, 4, 5, 1], [4, 5, 2, 4, 5, 2]]).propose([4, 5], 1).tokens == [1]


def _write(directory, rows, tokenizer_hash="t" * 16):
    info = {"name": "fake", "path": "/nowhere", "fingerprint": "f" * 16, "tokenizer_hash": tokenizer_hash}
    return write_prepared(directory, rows, target_info=info, config={}, stats={}, vocab_size=64)


def test_a_prepared_datasets_answers_are_the_corpus_and_its_tokenizer_must_be_the_targets(tmp_path):
    prompt, answer = [1, 2, 3, 4], [20, 21, 22, 23]
    rows = [
        {
            "sample_id": f"s{i}",
            "source": "x",
            "input_ids": prompt + answer + prompt + answer,
            "loss_mask": [0] * 4 + [1] * 4 + [0] * 4 + [1] * 4,
        }
        for i in range(2)
    ]
    _write(tmp_path / "data", rows)
    corpus = AnswerCorpus.from_prepared(tmp_path / "data", tokenizer_hash="t" * 16)
    assert corpus.tokens == 16 and corpus.source == str(tmp_path / "data")
    assert corpus.propose([20, 21], 8).tokens == [22, 23]  # each answer turn is its own run: 23 was never followed by 1
    assert corpus.propose([1, 2], 8).tokens == []  # prompt tokens (loss_mask 0) are not the target's writing
    with pytest.raises(
        SpecdraftError, match=r"--lookup-corpus .*data: prepared with tokenizer 'tttttttttttttttt', but the target's is 'other'"
    ):
        AnswerCorpus.from_prepared(tmp_path / "data", tokenizer_hash="other")
    _write(tmp_path / "prompts", [{"sample_id": "p", "source": "x", "input_ids": prompt, "loss_mask": [0] * 4}])
    with pytest.raises(SpecdraftError, match="holds no answer tokens"):
        AnswerCorpus.from_prepared(tmp_path / "prompts")
    with pytest.raises(SpecdraftError, match="pass --lookup-corpus DATASET"):
        build_proposer(DecodeConfig(drafter="suffix"))
    with pytest.raises(SpecdraftError, match="pass --lookup-corpus DATASET"):
        build_proposer(DecodeConfig(drafter="dspark+suffix", drafter_path=str(tmp_path)))
    assert isinstance(build_proposer(DecodeConfig(drafter="suffix", lookup_corpus=str(tmp_path / "data"))), NgramProposer)


def test_suffix_decoding_equals_greedy_decoding_with_rows_accepting_differently():
    """The target's own greedy answers (and some noise) as the corpus: prompt lookup alone finds little in these
    prompts, the corpus proposes most rounds, drafts are accepted and rejected, and every row's output is the
    target's greedy one."""
    model = tiny_model(seed=5)
    new = 24
    expected = [reference_greedy(model, p, new) for p in PROMPTS]
    rng = np.random.default_rng(0)
    answers = [e[: new // 2] for e in expected] * 2 + [rng.integers(0, 64, 40) for _ in range(4)] * 2
    config = DecodeConfig(max_new_tokens=new, num_draft_tokens=4)

    def run(proposer):
        return SpeculativeDecoder(model, proposer, config=config, sampling=SamplingConfig(), eos_token_ids=[]).generate(PROMPTS)

    suffix = run(NgramProposer(max_ngram=3, min_ngram=2, corpus=AnswerCorpus(answers)))
    plain = run(NgramProposer(max_ngram=3, min_ngram=2))
    assert [o.tokens for o in suffix.outputs] == expected == [o.tokens for o in plain.outputs]
    assert 0 < suffix.metrics.accepted < suffix.metrics.drafted and suffix.metrics.accepted > plain.metrics.accepted
    assert len(set(suffix.metrics.request_rounds)) > 1  # rows accepted different numbers of drafts


def test_a_lookups_confidences_are_the_measured_acceptance_of_its_bucket():
    """Confidences start at the prior; once a row commits, its last proposal is scored against the committed tokens
    (matched 2 of 3 here) and the next proposal of the same bucket carries the measured conditional rates."""
    from specdraft.decode.proposers.base import ProposalInput

    proposer = NgramProposer(max_ngram=2, min_ngram=2)
    context = [5, 6, 7, 8, 9, 1, 5, 6]  # [5 6] matched 6 back: proposes [7 8 9], match length 2

    def round_(tokens):
        return proposer.propose(
            ProposalInput(
                row_ids=[0],
                tokens=[torch.tensor(tokens)],
                new_hidden=None,
                new_start=[0],
                max_draft=torch.tensor([3]),
                sampling=SamplingConfig(),
                generator=None,
            )
        )

    first = round_(context)
    assert first.tokens[0].tolist() == [7, 8, 9] and first.confidences[0].tolist() == [0.5, 0.5, 0.5]
    committed = context + [7, 8, 4, 3, 5, 6]  # the row went on 7 8 (accepted), 4 (not 9), then [5 6] again: same bucket
    second = round_(committed)
    torch.testing.assert_close(second.confidences[0], torch.tensor([2 / 3, 2 / 3, 1 / 3]))  # (accepted + 1) / (tried + 2)
    proposer.release([0])
    assert proposer.scores.last == {}


@pytest.mark.parametrize("drafter", ["ngram", "suffix"])
def test_scheduled_lookups_stay_exact_and_verify_less_where_long_verifies_cost_more(drafter, tmp_path):
    """``ngram@scheduled`` / ``suffix@scheduled``: the measured per-bucket acceptance prices each row's verify length
    against the target's step costs; outputs stay the target's greedy ones, and where a verify forward of more
    tokens costs much more, fewer drafts are verified than the lookup proposed."""
    from specdraft.decode.config import SchedulerConfig

    model = tiny_model(seed=5)
    new = 24
    expected = [reference_greedy(model, p, new) for p in PROMPTS]
    rng = np.random.default_rng(0)
    corpus = AnswerCorpus([e[: new // 2] for e in expected] * 2 + [rng.integers(0, 64, 40) for _ in range(4)] * 2)
    config = DecodeConfig(max_new_tokens=new, num_draft_tokens=4)

    def run(scheduler, sps):
        proposer = NgramProposer(max_ngram=3, min_ngram=2, corpus=corpus if drafter == "suffix" else None)
        return SpeculativeDecoder(
            model, proposer, config=config, sampling=SamplingConfig(), scheduler=scheduler, sps=sps, eos_token_ids=[]
        ).generate(PROMPTS)

    full = run(SchedulerConfig(), None)
    steep = run(SchedulerConfig("scheduled", adaptive_drafting=False), lambda tokens: 1.0 / tokens)  # k tokens cost k steps
    for result in (full, steep):
        assert [o.tokens for o in result.outputs] == expected
    assert full.metrics.drafted > 0 and steep.metrics.drafted < full.metrics.drafted


def test_the_lookup_prefers_a_prompt_match_and_buckets_each_source_apart():
    corpus = AnswerCorpus([[5, 6, 7, 8]] * 2)
    lookup = Lookup(3, 2, corpus)
    tokens, bucket = lookup(torch.tensor([1, 2, 9, 1, 2]), 3)
    assert tokens.tolist() == [9, 1, 2] and bucket == 2  # the prompt's own match, bucketed by its length
    tokens, bucket = lookup(torch.tensor([0, 5, 6]), 3)
    assert tokens.tolist() == [7, 8] and bucket == ("corpus", 2, 9)
    assert Lookup(3, 2)(torch.tensor([0, 5, 6]), 3)[0].tolist() == []


def test_replaying_the_greedy_text_gives_the_rounds_the_runtime_decodes():
    """eval/lookup_replay.py: prompt lookup and suffix drafting replayed on the target's greedy continuations run the
    very rounds (count, committed and accepted tokens) the runtime runs, so the replayed tau is exact."""
    model = tiny_model(seed=5)
    new = 24
    expected = [reference_greedy(model, p, new) for p in PROMPTS]
    rng = np.random.default_rng(0)
    answers = [e[: new // 2] for e in expected] * 2 + [rng.integers(0, 64, 40) for _ in range(4)] * 2
    for corpus in (None, AnswerCorpus(answers)):
        proposer = NgramProposer(max_ngram=3, min_ngram=2, corpus=corpus)
        decoded = (
            SpeculativeDecoder(
                model, proposer, config=DecodeConfig(max_new_tokens=new, num_draft_tokens=4), sampling=SamplingConfig(), eos_token_ids=[]
            )
            .generate(PROMPTS)
            .metrics
        )
        replayed = [replay(proposer.lookup, np.array(p + e), len(p), len(p) + new, 4) for p, e in zip(PROMPTS, expected)]
        assert [len(r) for r in replayed] == decoded.request_rounds
        assert [sum(x.accepted + 1 for x in r) for r in replayed] == decoded.request_committed
        assert sum(x.accepted for r in replayed for x in r) == decoded.accepted > 0
        assert sum(x.proposed for r in replayed for x in r) == decoded.drafted


def test_a_replays_speed_up_prices_each_round_by_its_verify_width():
    rounds = [ReplayRound(0, 0), ReplayRound(3, 3), ReplayRound(9, 1)]  # 1 + 4 + 2 tokens; widths 1, 4 and 10 (priced as 8)
    summary = summarize(rounds, {1: 10.0, 4: 12.0, 8: 20.0})
    assert summary.tokens == 7 and summary.tau == pytest.approx(7 / 3) and summary.drafted_share == pytest.approx(2 / 3)
    assert summary.speedup_est == pytest.approx(7 * 10.0 / (10.0 + 12.0 + 20.0)) and summary.accepted_per_proposed == pytest.approx(4 / 12)
