"""The decoding-runtime helpers agree with the teacher-forced training forward."""

from __future__ import annotations

import pytest
import torch

from specdraft.models import METHODS
from specdraft.models.dspark.heads import MARKOV_HEADS
from test_models_support import VOCAB, make_batch


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


def _build(method, target, **overrides):
    spec = METHODS.get(method)
    torch.manual_seed(1)
    counts = torch.arange(VOCAB, dtype=torch.int64)
    return spec.build(spec.config_cls(**overrides), target, counts=counts).eval()


#: Eagle 3.1's normalisations: as the paper (per-layer norms, normed output fed back) and as speculators' eagle3 defaults
EAGLE31 = {
    "plain": {},
    "fc_norm+norm_output": {"fc_norm": True, "norm_output": True},
    "norm_before_fc+norm_output": {"norm_before_fc": True, "norm_output": True},
}


@pytest.mark.parametrize("variant", list(EAGLE31))
def test_eagle3_extend_and_speculate_match_ttt_unroll(target, variant):
    model = _build("eagle3", target, draft_vocab_size=VOCAB, ttt_steps=4, **EAGLE31[variant])
    if variant != "plain":  # the norms start at gain 1: move them so that a norm applied in one path only shows
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.startswith(("input_norm", "fc_norm", "norm.")):
                    p.add_(0.3 * torch.randn_like(p))
    batch = make_batch(target, "eagle3", count=1, length=16)
    with torch.no_grad():
        ttt = model.ttt_hidden(batch)
    tokens, aux, pos = batch.token_ids[0], batch.aux_hidden[0], batch.position_ids[0]
    for t in (0, 5, 9):
        cache = model.new_cache()
        hidden = model.extend(cache, features=aux[: t + 1], next_tokens=tokens[1 : t + 2], positions=pos[: t + 1])[-1]
        torch.testing.assert_close(hidden, ttt[0][0, t], atol=1e-5, rtol=1e-5)
        draft_kv = model.new_cache()
        for step in range(1, 4):
            hidden = model.speculate(cache, draft_kv, hidden=hidden, token=tokens[t + 1 + step], step=step, base_position=int(pos[t]))
            torch.testing.assert_close(hidden, ttt[step][0, t], atol=1e-5, rtol=1e-5)
        assert cache.length == t + 1  # draft keys never enter the committed cache


def test_eagle3_extend_in_rounds_equals_one_shot(target):
    model = _build("eagle3", target, draft_vocab_size=VOCAB)
    batch = make_batch(target, "eagle3", count=1, length=12)
    tokens, aux, pos = batch.token_ids[0], batch.aux_hidden[0], batch.position_ids[0]
    one = model.extend(model.new_cache(), features=aux[:10], next_tokens=tokens[1:11], positions=pos[:10])
    cache = model.new_cache()
    model.extend(cache, features=aux[:6], next_tokens=tokens[1:7], positions=pos[:6])
    two = model.extend(cache, features=aux[6:10], next_tokens=tokens[7:11], positions=pos[6:10])
    torch.testing.assert_close(two, one[6:], atol=1e-5, rtol=1e-5)


def test_eagle3_draft_proposal_respects_draft_vocab(target):
    model = _build("eagle3", target, draft_vocab_size=40)
    batch = make_batch(target, "eagle3", count=1, length=12)
    tokens, aux, pos = batch.token_ids[0], batch.aux_hidden[0], batch.position_ids[0]
    allowed = model.draft_target_ids()
    greedy = model.draft(model.new_cache(), features=aux[:8], next_tokens=tokens[1:9], positions=pos[:8], num_tokens=3)
    assert greedy.tokens.shape == (3,) and bool(torch.isin(greedy.tokens, allowed).all())
    assert greedy.probs is None  # argmaxes: point masses, no full-vocabulary table
    g = torch.Generator().manual_seed(3)
    sampled = model.draft(
        model.new_cache(), features=aux[:8], next_tokens=tokens[1:9], positions=pos[:8], num_tokens=3, temperature=0.7, generator=g
    )
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[allowed] = False
    assert float(sampled.probs[:, outside].sum()) == 0.0
    assert torch.allclose(sampled.probs.sum(-1), torch.ones(3))


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_block_hidden_matches_packed_training_forward(target, method):
    model = _build(method, target, block_size=4, num_layers=2, **({"markov_rank": 16} if method == "dspark" else {}))
    batch = make_batch(target, method, count=1, length=20)
    anchors = torch.tensor([[6, 11, 15]])
    with torch.no_grad():
        packed = model.forward_blocks(batch, anchors)[0]
    tokens, aux, pos = batch.token_ids[0], batch.aux_hidden[0], batch.position_ids[0]
    for j, a in enumerate(anchors[0].tolist()):
        cache = model.new_cache()
        model.append_context(cache, features=aux[:3], positions=pos[:3])  # two rounds, like decoding
        model.append_context(cache, features=aux[3:a], positions=pos[3:a])
        hidden = model.block_hidden(cache, anchor_token=int(tokens[a]), anchor_position=int(pos[a]))
        torch.testing.assert_close(hidden, packed[j], atol=1e-5, rtol=1e-5)


def _target_ids(model, draft_tokens):
    ids = model.draft_target_ids()
    return draft_tokens if ids is None else ids[draft_tokens]


@pytest.mark.parametrize("draft_vocab", [None, 40])
def test_dflash_draft_block_is_argmax_of_slots(target, draft_vocab):
    model = _build("dflash", target, block_size=4, num_layers=1, draft_vocab_size=draft_vocab)
    batch = make_batch(target, "dflash", count=1, length=16)
    tokens, aux, pos = batch.token_ids[0], batch.aux_hidden[0], batch.position_ids[0]
    proposal = model.draft_block(
        model.new_cache(), context_features=aux[:9], context_positions=pos[:9], anchor_token=int(tokens[9]), anchor_position=9
    )
    with torch.no_grad():
        hidden = model.forward_blocks(batch, torch.tensor([[9]]))[0, 0]
    assert proposal.tokens.tolist() == _target_ids(model, model.lm_logits(hidden[1:]).argmax(-1)).tolist()
    assert proposal.confidences is None and proposal.probs is None  # greedy: point masses


@pytest.mark.parametrize("head", MARKOV_HEADS.names())
def test_markov_head_step_matches_block_bias(head):
    torch.manual_seed(0)
    module = MARKOV_HEADS.get(head)(vocab_size=VOCAB, draft_vocab_size=40, rank=8, hidden_size=16)
    prev = torch.randint(0, VOCAB, (3, 5))
    hidden = torch.randn(3, 5, 16)
    emb = module.prev_embeddings(prev)
    block = module.block_bias(emb, hidden)
    assert block.shape == (3, 5, 40)  # W1 reads target ids, W2 writes draft ids
    state = module.init_state(3, emb[:, 0])
    for k in range(5):
        bias, state = module.step(state, emb[:, k], hidden[:, k])
        torch.testing.assert_close(bias, block[:, k])


@pytest.mark.parametrize("head,draft_vocab", [("vanilla", None), ("rnn", None), ("vanilla", 40), ("rnn", 40)])
def test_dspark_sequential_draft_matches_teacher_forced_heads(target, head, draft_vocab):
    model = _build("dspark", target, block_size=5, num_layers=1, markov_rank=16, markov_head=head, draft_vocab_size=draft_vocab)
    with torch.no_grad():  # make the Markov bias matter
        model.markov_head.markov_w2.weight.normal_(std=2.0)
    batch = make_batch(target, "dspark", count=1, length=16)
    tokens, aux, pos = batch.token_ids[0], batch.aux_hidden[0], batch.position_ids[0]
    anchor = 8
    proposal = model.draft_block(
        model.new_cache(),
        context_features=aux[:anchor],
        context_positions=pos[:anchor],
        anchor_token=int(tokens[anchor]),
        anchor_position=anchor,
    )
    assert proposal.tokens.shape == (5,) and proposal.confidences.shape == (5,) and proposal.probs is None  # greedy: point masses
    assert bool(((proposal.confidences > 0) & (proposal.confidences < 1)).all())
    # Teacher-force the drafter's own tokens: the corrected logits must pick the same tokens.
    with torch.no_grad():
        hidden = model.forward_blocks(batch, torch.tensor([[anchor]]))[0]
        prev = torch.cat([tokens[anchor : anchor + 1], proposal.tokens[:-1]])[None]
        logits, conf = model.corrected_block(hidden, prev)
    assert _target_ids(model, logits[0].argmax(-1)).tolist() == proposal.tokens.tolist()
    torch.testing.assert_close(torch.sigmoid(conf[0]), proposal.confidences)
    g = torch.Generator().manual_seed(0)
    sampled = model.draft_block(
        model.new_cache(),
        context_features=aux[:anchor],
        context_positions=pos[:anchor],
        anchor_token=int(tokens[anchor]),
        anchor_position=anchor,
        temperature=1.0,
        generator=g,
    )
    assert sampled.probs.shape == (5, VOCAB) and torch.allclose(sampled.probs.sum(-1), torch.ones(5))
    assert bool((sampled.probs[torch.arange(5), sampled.tokens] > 0).all())
    if draft_vocab:
        # Lossless rejection sampling needs q over the whole target vocabulary: zero off the draft ids.
        outside = torch.ones(VOCAB, dtype=torch.bool)
        outside[model.draft_target_ids()] = False
        assert float(sampled.probs[:, outside].abs().sum()) == 0.0 and bool(outside.any())
        # The Markov head is fed the target id of each drawn token (teacher-forcing them reproduces q).
        with torch.no_grad():
            prev = torch.cat([tokens[anchor : anchor + 1], sampled.tokens[:-1]])[None]
            logits, _ = model.corrected_block(hidden, prev)
        torch.testing.assert_close(sampled.probs[:, model.draft_target_ids()], torch.softmax(logits[0], -1))
