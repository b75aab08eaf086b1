"""Trained-drafter proposers (EAGLE-3, DFlash, DFlash2, DSpark) in the runtime, with random drafters.

A random drafter rarely agrees with the target, which is exactly what exercises rejection,
cache cropping and feature hand-over; the output must still be the target's own greedy output.
"""

from __future__ import annotations

import pytest
import torch

from specdraft.decode.config import DecodeConfig, SchedulerConfig
from specdraft.decode.runtime import SpeculativeDecoder, build_proposer
from specdraft.decode.sampling import SamplingConfig
from specdraft.decode.sps import SpsTable
from specdraft.errors import SpecdraftError
from specdraft.models import METHODS
from test_models_support import VOCAB, make_target

SMALL = {
    "eagle3": {"draft_vocab_size": VOCAB},
    "dflash": {"block_size": 4, "num_layers": 1},
    "dflash2": {"block_size": 4, "num_layers": 1, "selector_rank": 16, "selector_top_k": 8},
    "dspark": {"block_size": 4, "num_layers": 1, "markov_rank": 16, "confidence_temperatures": [1.5, 1.2, 1.0, 0.8]},
    "dspark-uncalibrated": {"block_size": 4, "num_layers": 1, "markov_rank": 16},
    # reduced draft vocabularies: drafts are draft ids mapped through d2t, q scattered into V
    "dflash-draft-vocab": {"block_size": 4, "num_layers": 1, "draft_vocab_size": 40},
    "dspark-draft-vocab": {
        "block_size": 4,
        "num_layers": 1,
        "markov_rank": 16,
        "draft_vocab_size": 40,
        "confidence_temperatures": [1.5, 1.2, 1.0, 0.8],
    },
}
RUNTIME_CASES = ["eagle3", "dflash", "dflash2", "dspark", "dflash-draft-vocab", "dspark-draft-vocab"]
PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17]]


@pytest.fixture(scope="module")
def target():
    return make_target()


@pytest.fixture(scope="module")
def checkpoints(target, tmp_path_factory):
    out = {}
    for method, overrides in SMALL.items():
        spec = METHODS.get(method.split("-")[0])
        torch.manual_seed(1)
        drafter = spec.build(spec.config_cls(**overrides), target, counts=torch.arange(VOCAB, dtype=torch.int64))
        out[method] = tmp_path_factory.mktemp(method)
        drafter.save_pretrained(out[method])
    return out


@torch.no_grad()
def reference_greedy(model, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("case", RUNTIME_CASES)
def test_trained_drafters_keep_greedy_output_exact(target, checkpoints, case):
    method = case.split("-")[0]
    config = DecodeConfig(drafter=method, drafter_path=str(checkpoints[case]), max_new_tokens=16, num_draft_tokens=3)
    proposer = build_proposer(config, target)
    assert proposer.layer_slots and proposer.provides_confidences == (method == "dspark")
    scheduler, sps = SchedulerConfig(), None
    if method == "dspark":
        scheduler, sps = SchedulerConfig("scheduled"), SpsTable((1, 4, 16), (100.0, 90.0, 40.0))
    dec = SpeculativeDecoder(
        target.model, proposer, config=config, sampling=SamplingConfig(), scheduler=scheduler, sps=sps, eos_token_ids=[]
    )
    result = dec.generate(PROMPTS)
    assert [o.tokens for o in result.outputs] == [reference_greedy(target.model, p, 16) for p in PROMPTS]
    assert result.metrics.drafted > 0
    assert not proposer.caches, "draft caches of finished requests are released"
    # sampling runs too (losslessness itself is tested with stub drafters)
    sampled = SpeculativeDecoder(
        target.model,
        build_proposer(config, target),
        config=config,
        sampling=SamplingConfig(temperature=0.8),
        scheduler=scheduler,
        sps=sps,
        eos_token_ids=[],
    ).generate(PROMPTS)
    assert [len(o.tokens) for o in sampled.outputs] == [16, 16, 16]


def test_drafter_checkpoint_errors(target, checkpoints):
    with pytest.raises(SpecdraftError, match="--drafter-path"):
        build_proposer(DecodeConfig(drafter="dspark"), target)
    with pytest.raises(SpecdraftError, match="dspark"):
        build_proposer(DecodeConfig(drafter="dflash", drafter_path=str(checkpoints["dspark"])), target)
    for method in ("dflash", "dflash2"):  # no confidences: the scheduled policy is refused, the draft gate alone runs them
        with pytest.raises(SpecdraftError, match="confidence"):
            config = DecodeConfig(drafter=method, drafter_path=str(checkpoints[method]))
            SpeculativeDecoder(
                target.model,
                build_proposer(config, target),
                config=config,
                sampling=SamplingConfig(),
                scheduler=SchedulerConfig("scheduled"),
                sps=SpsTable((1,), (1.0,)),
            )
    config = DecodeConfig(drafter="dspark", drafter_path=str(checkpoints["dspark-uncalibrated"]))
    with pytest.raises(SpecdraftError, match="not calibrated.*specdraft calibrate"):
        SpeculativeDecoder(
            target.model,
            build_proposer(config, target),
            config=config,
            sampling=SamplingConfig(),
            scheduler=SchedulerConfig("scheduled"),
            sps=SpsTable((1,), (1.0,)),
        )
    # the threshold policy only compares confidences with a user-chosen level: no calibration required
    SpeculativeDecoder(
        target.model, build_proposer(config, target), config=config, sampling=SamplingConfig(), scheduler=SchedulerConfig("threshold")
    )


@pytest.mark.parametrize("case", RUNTIME_CASES)
def test_incremental_features_give_the_same_drafts_as_one_shot(target, checkpoints, case):
    """Each round's drafts (draft cache extended round by round) equal drafts from a fresh cache fed
    the whole context at once: positions, token pairing and the anchor are handed over right.

    Compared as distributions (sampling at temperature 1, the one-shot replaying the round's random
    draws), in fp32: ``draft_dtype auto`` picks bf16 where it measures faster, and a random drafter's
    greedy argmax sits on near-ties that bf16 rounding flips, which says nothing about the hand-over."""
    from dataclasses import replace

    from specdraft.hidden_states.capture import HiddenStateCapture

    config = DecodeConfig(
        drafter=case.split("-")[0], drafter_path=str(checkpoints[case]), max_new_tokens=12, num_draft_tokens=3, draft_dtype="fp32"
    )
    proposer = build_proposer(config, target)
    capture = HiddenStateCapture(target.model, list(proposer.layer_slots))
    checked = []
    original = proposer.propose

    def propose(inputs):
        replay = torch.Generator().set_state(inputs.generator.get_state())
        draft = original(inputs)
        for i, tokens in enumerate(inputs.tokens):
            ((features, _),) = capture([tokens[:-1]])
            one_shot = proposer.draft_row(
                proposer.drafter.new_cache(),
                replace(inputs, new_hidden=[None] * i + [features], new_start=[0] * (i + 1), generator=replay),
                i,
            )
            k = int(draft.lengths[i])
            assert draft.tokens[i, :k].tolist() == one_shot.tokens[:k].tolist()
            torch.testing.assert_close(draft.probs[i, :k], one_shot.probs[:k].to(draft.probs.dtype), atol=1e-5, rtol=1e-4)
            checked.append(k)
        return draft

    proposer.propose = propose
    SpeculativeDecoder(target.model, proposer, config=config, sampling=SamplingConfig(temperature=1.0), eos_token_ids=[]).generate(PROMPTS)
    assert len(checked) > len(PROMPTS) and sum(checked) > 0


@pytest.mark.slow
def test_decoder_for_target_profiles_sps_for_the_scheduler(target, checkpoints, tmp_path, monkeypatch):
    from specdraft.decode.runtime import decoder_for_target

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    config = DecodeConfig(drafter="dspark", drafter_path=str(checkpoints["dspark"]), max_new_tokens=10, num_draft_tokens=3)
    dec = decoder_for_target(target, config=config, sampling=SamplingConfig(), scheduler=SchedulerConfig("scheduled"))
    assert dec.sps is not None and len(list((tmp_path / "sps").glob(f"{target.fingerprint}-cpu-float32-*.json"))) == 1
    result = dec.generate(PROMPTS[:2])
    assert [o.tokens for o in result.outputs] == [reference_greedy(target.model, p, 10) for p in PROMPTS[:2]]


@pytest.mark.slow
def test_every_method_is_exact_on_the_real_target_at_batch_1_and_2(smollm2_dir, tmp_path):
    """Random EAGLE-3 / DFlash / DFlash2 / DSpark drafters built for SmolLM2-135M: greedy output equals HF greedy
    decoding of the real target, for one request alone and for two decoded together."""
    from specdraft.targets import load_target

    real = load_target(str(smollm2_dir))
    chats = ["Repeat exactly: the quick brown fox jumps over the lazy dog.", "Name three primary colours."]
    prompts = [
        real.tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True, return_dict=False)
        for c in chats
    ]
    n_new = 12
    with torch.no_grad():
        expected = [real.model.generate(torch.tensor([p]), max_new_tokens=n_new, do_sample=False)[0, len(p) :].tolist() for p in prompts]
    counts = torch.arange(real.vocab_size, dtype=torch.int64)
    configs = {
        "eagle3": {"draft_vocab_size": 4096},
        "dflash": {"block_size": 4, "num_layers": 1},
        "dflash2": {"block_size": 4, "num_layers": 1, "selector_rank": 32},
        "dspark": {"block_size": 4, "num_layers": 1, "markov_rank": 32, "confidence_temperatures": [1.0] * 4},
        "dspark-draft-vocab": {
            "block_size": 4,
            "num_layers": 1,
            "markov_rank": 32,
            "confidence_temperatures": [1.0] * 4,
            "draft_vocab_size": 8192,
        },
    }
    for case, overrides in configs.items():
        method = case.split("-")[0]
        spec = METHODS.get(method)
        torch.manual_seed(0)
        spec.build(spec.config_cls(**overrides), real, counts=counts).save_pretrained(tmp_path / case)
        config = DecodeConfig(drafter=method, drafter_path=str(tmp_path / case), max_new_tokens=n_new, num_draft_tokens=3)
        scheduler, sps = (
            (SchedulerConfig("scheduled"), SpsTable((1, 4, 16), (10.0, 6.0, 3.0))) if method == "dspark" else (SchedulerConfig(), None)
        )
        decoder = SpeculativeDecoder(
            real.model, build_proposer(config, real), config=config, sampling=SamplingConfig(), scheduler=scheduler, sps=sps
        )
        assert [decoder.generate([p]).outputs[0].tokens for p in prompts] == expected, case
        together = decoder.generate(prompts)
        assert [o.tokens for o in together.outputs] == expected, case
        assert together.metrics.drafted > 0


@pytest.mark.parametrize("method, block_drafts", [("dflash", 3), ("dspark", 4)])
def test_block_drafters_verify_their_whole_block_whatever_k(target, checkpoints, method, block_drafts):
    config = DecodeConfig(drafter=method, drafter_path=str(checkpoints[method]), max_new_tokens=24, num_draft_tokens=1)
    proposer = build_proposer(config, target)
    assert proposer.block_length == block_drafts  # DFlash drafts B-1 tokens, DSpark B (block size 4 here)
    result = SpeculativeDecoder(target.model, proposer, config=config, sampling=SamplingConfig(), eos_token_ids=[]).generate(PROMPTS)
    assert len(result.metrics.position_drafted) == block_drafts
    assert [o.tokens for o in result.outputs] == [reference_greedy(target.model, p, 24) for p in PROMPTS]


def test_closed_draft_gate_does_no_drafter_work(target, checkpoints, monkeypatch):
    """With the gate shut, a DSpark decoder's steps do what plain decoding does: no drafter call, no
    drafter module forward, and no more tensor joins than autoregressive decoding (the features of
    skipped steps are kept as chunks and joined only at the next drafting round)."""
    from specdraft.decode.scheduler import DraftGate

    config = DecodeConfig(drafter="dspark", drafter_path=str(checkpoints["dspark"]), max_new_tokens=12)
    proposer = build_proposer(config, target)
    drafter_forwards = []
    for module in proposer.drafter.modules():
        module.register_forward_hook(lambda *args: drafter_forwards.append(1))
    propose_calls = []
    real_propose = proposer.propose
    monkeypatch.setattr(proposer, "propose", lambda inputs: propose_calls.append(1) or real_propose(inputs))
    gated = SpeculativeDecoder(
        target.model,
        proposer,
        config=config,
        sampling=SamplingConfig(),
        scheduler=SchedulerConfig("scheduled"),
        sps=SpsTable((1, 16), (100.0, 90.0)),
        eos_token_ids=[],
    )
    gated.draft_gates[len(PROMPTS)] = DraftGate(plain_rate=100.0, skip_left=10**6)  # closed for the whole run
    plain = SpeculativeDecoder(
        target.model,
        build_proposer(DecodeConfig(drafter="none", max_new_tokens=12)),
        config=config,
        sampling=SamplingConfig(),
        eos_token_ids=[],
    )

    def joins(decoder) -> tuple[int, list]:
        calls = []
        real_cat = torch.cat
        monkeypatch.setattr(torch, "cat", lambda *a, **k: calls.append(1) or real_cat(*a, **k))
        try:
            result = decoder.generate(PROMPTS)
        finally:
            monkeypatch.setattr(torch, "cat", real_cat)
        return len(calls), result

    plain_joins, expected = joins(plain)
    gated_joins, result = joins(gated)
    assert [o.tokens for o in result.outputs] == [o.tokens for o in expected.outputs]
    assert result.metrics.rounds == 0 and result.metrics.plain_steps == 11 * len(PROMPTS)
    assert not propose_calls and not drafter_forwards
    assert gated_joins == plain_joins


@pytest.mark.parametrize("bf16_seconds, expected", [(0.2, "bf16"), (13.0, "fp32")])
def test_draft_dtype_auto_picks_the_faster_round(target, checkpoints, tmp_path, monkeypatch, bf16_seconds, expected):
    from specdraft.decode.proposers.drafters import DrafterProposer

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    real_round = DrafterProposer.round_seconds
    timed = {}

    def injected(self, dtype, **kwargs):
        timed[dtype] = real_round(self, dtype, repeats=1)  # the real round runs in that dtype; its timing is replaced
        return {"fp32": 1.0, "bf16": bf16_seconds}[dtype]

    monkeypatch.setattr(DrafterProposer, "round_seconds", injected)
    config = DecodeConfig(drafter="dspark", drafter_path=str(checkpoints["dspark"]), max_new_tokens=8)
    proposer = build_proposer(config, target)
    assert proposer.compute_dtype == expected and set(timed) == {"fp32", "bf16"} and all(t > 0 for t in timed.values())
    assert not proposer.caches, "the probe's synthetic request is released"
    assert build_proposer(config, target).compute_dtype == expected and len(timed) == 2  # cached: not timed again
    assert build_proposer(DecodeConfig(**{**vars(config), "draft_dtype": "fp32"}), target).compute_dtype == "fp32"  # a flag wins
    dec = SpeculativeDecoder(target.model, proposer, config=config, sampling=SamplingConfig(), eos_token_ids=[])
    assert [o.tokens for o in dec.generate(PROMPTS).outputs] == [reference_greedy(target.model, p, 8) for p in PROMPTS]
