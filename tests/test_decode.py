"""The speculative runtime: greedy exactness, lossless sampling end to end, features for drafters, limits."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy import stats

from specdraft.decode.config import DecodeConfig, SchedulerConfig
from specdraft.decode.proposers import PROPOSERS, Draft, ProposalInput, Proposer
from specdraft.decode.proposers.ngram import prompt_lookup
from specdraft.decode.runtime import SpeculativeDecoder, build_proposer
from specdraft.decode.sampling import SamplingConfig, sample, sampling_probs
from specdraft.errors import SpecdraftError
from specdraft.hidden_states.layers import LayerSlot


def tiny_model(vocab: int = 64, layers: int = 2, seed: int = 0, context: int = 256, family: str = "llama", **extra):
    """A random causal LM in float64, so batched/cached/uncached forwards agree far below argmax gaps."""
    import transformers

    torch.manual_seed(seed)
    config_cls = {
        "llama": transformers.LlamaConfig,
        "qwen3": transformers.Qwen3Config,
        "gemma3": transformers.Gemma3TextConfig,
        "mistral": transformers.MistralConfig,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "deepseek_v3": transformers.DeepseekV3Config,
        "glm4_moe": transformers.Glm4MoeConfig,
        "gpt_oss": transformers.GptOssConfig,
        "gemma4_text": transformers.Gemma4TextConfig,
        "qwen3_next": transformers.Qwen3NextConfig,
        "qwen3_5_text": transformers.Qwen3_5TextConfig,
        "qwen3_5_moe_text": transformers.Qwen3_5MoeTextConfig,
        "kimi_linear": transformers.KimiLinearConfig,
        "glm_moe_dsa": transformers.GlmMoeDsaConfig,
    }[family]
    config = config_cls(
        **{
            "vocab_size": vocab,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": layers,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "max_position_embeddings": context,
            "bos_token_id": None,
            "eos_token_id": None,
            "pad_token_id": None,
            **extra,
        }
    )
    return transformers.AutoModelForCausalLM.from_config(config).double().eval()


#: sliding-window targets with windows far shorter than prompt + output: Gemma 3 interleaves sliding
#: and full layers (per-layer-type masks), Mistral slides in every layer (one mask)
SLIDING = {
    "gemma3": dict(
        family="gemma3",
        layers=3,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        query_pre_attn_scalar=32,
    ),
    "mistral": dict(family="mistral", layers=2, sliding_window=4),
}


@pytest.fixture(scope="module")
def model():
    return tiny_model()


PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8], [9, 10, 11, 12, 13, 14, 15, 9, 10, 11]]


@torch.no_grad()
def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Plain greedy decoding without any cache: the ground truth."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


class OracleProposer(Proposer):
    """Test stub: drafts from a known continuation, corrupting each draft with probability ``miss``."""

    def __init__(self, prompts, continuations, vocab: int, miss: float, seed: int = 0):
        self.prompts, self.continuations, self.vocab, self.miss = prompts, continuations, vocab, miss
        self.rng = np.random.default_rng(seed)

    def propose(self, inputs: ProposalInput) -> Draft:
        width = int(inputs.max_draft.max())
        tokens = torch.zeros((len(inputs.row_ids), width), dtype=torch.long)
        for i, rid in enumerate(inputs.row_ids):
            done = len(inputs.tokens[i]) - len(self.prompts[rid])
            truth = self.continuations[rid][done : done + width]
            tokens[i, : len(truth)] = torch.tensor([t if self.rng.random() >= self.miss else (t + 1) % self.vocab for t in truth])
        return Draft(tokens=tokens, lengths=inputs.max_draft.clone())


def decoder(model, proposer, **config):
    config = DecodeConfig(**{"max_new_tokens": 20, "num_draft_tokens": 4, **config})
    return SpeculativeDecoder(model, proposer, config=config, sampling=SamplingConfig(), eos_token_ids=[])


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("drafter", ["ngram", "none", "always", "never", "random"])
def test_greedy_output_is_exactly_the_targets(model, drafter, batch):
    prompts = PROMPTS[:batch]
    refs = [reference_greedy(model, p, 20) for p in prompts]
    if drafter in PROPOSERS:
        proposer = build_proposer(DecodeConfig(drafter=drafter))
    else:
        proposer = OracleProposer(prompts, [r + [0] * 8 for r in refs], 64, miss={"always": 0.0, "never": 1.0, "random": 0.5}[drafter])
    result = decoder(model, proposer).generate(prompts)
    assert [o.tokens for o in result.outputs] == refs
    assert all(o.finish_reason == "length" for o in result.outputs)
    m = result.metrics
    assert m.output_tokens == 20 * batch and m.requests == batch
    if drafter == "always":
        assert m.acceptance_rate == 1.0 and m.tau > 4  # 1 prefill token + rounds of 5 (the last one shorter)
    if drafter in ("never", "none"):
        assert m.accepted == 0 and m.tau == 1.0
    if drafter == "none":
        assert m.drafted == 0 and m.target_forwards == 20
    assert m.committed >= m.output_tokens - batch  # the prefill token is not a round
    assert len(m.position_acceptance) <= 4 and all(0 <= a <= 1 for a in m.position_acceptance)


def test_qwen3_target_batched_greedy_is_exact():
    model = tiny_model(family="qwen3", seed=1)
    result = decoder(model, build_proposer(DecodeConfig())).generate(PROMPTS)
    assert [o.tokens for o in result.outputs] == [reference_greedy(model, p, 20) for p in PROMPTS]


@pytest.mark.parametrize("drafter", ["none", "ngram", "random"])
@pytest.mark.parametrize("family", sorted(SLIDING))
def test_sliding_window_targets_batched_greedy_is_exact(family, drafter):
    """Windows of 4-5 tokens, 8-10 token prompts, 20 new tokens, rejected drafts left as holes: every token is
    the uncached full forward's (whose HF mask is the true window), batched and left-padded."""
    model = tiny_model(seed=2, **SLIDING[family])
    refs = [reference_greedy(model, p, 20) for p in PROMPTS]
    if drafter == "random":
        proposer = OracleProposer(PROMPTS, [r + [0] * 8 for r in refs], 64, miss=0.5)
    else:
        proposer = build_proposer(DecodeConfig(drafter=drafter))
    result = decoder(model, proposer).generate(PROMPTS)
    assert [o.tokens for o in result.outputs] == refs
    if drafter == "random":
        assert 0 < result.metrics.accepted < result.metrics.drafted  # holes in the cache and accepted drafts


@pytest.mark.parametrize("family", sorted(SLIDING))
def test_sliding_window_layers_forget_what_no_query_reaches_and_stay_exact(family):
    """60 new tokens past windows of 4-5, drafts rejected at random (holes): sliding-window layers drop the leading
    columns every row is done with, so they hold about a window (plus the holes in it) while full-attention layers
    hold every column; every token is still the uncached full forward's, batched and left-padded."""
    model = tiny_model(seed=2, **SLIDING[family])
    refs = [reference_greedy(model, p, 60) for p in PROMPTS]
    dec = decoder(model, OracleProposer(PROMPTS, [r + [0] * 8 for r in refs], 64, miss=0.5), max_new_tokens=60)
    held = []
    forward = dec._forward

    def spy(ids, valid, positions, cache, trim, **kw):
        cached = valid.shape[1] - ids.shape[1]  # columns in the cache before this forward adds its own
        held.append((cached, [layer.keys.shape[-2] for layer in cache.layers if layer.is_initialized], trim.start))
        return forward(ids, valid, positions, cache, trim, **kw)

    dec._forward = spy
    result = dec.generate(PROMPTS)
    assert [o.tokens for o in result.outputs] == refs
    columns, per_layer, dropped = held[-1]
    window = SLIDING[family]["sliding_window"]
    types = getattr(model.config, "layer_types", None) or ["sliding_attention"] * len(per_layer)  # Mistral: every layer slides
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    assert dropped > 40 and all(per_layer[i] == columns - dropped <= 4 * window for i in sliding), held[-1]
    assert all(n == columns for i, n in enumerate(per_layer) if i not in sliding)


def test_gemma4_layers_that_reuse_another_layers_kv_decode_exactly_with_trimmed_windows():
    """Gemma 4's KV sharing: the last layers read the K/V a 'store' layer of their own type wrote, so a reusing sliding
    layer reads the trimmed columns and gets the trimmed mask. Window 3, 40 new tokens, random rejections: exact."""
    model = tiny_model(
        vocab=64,
        layers=4,
        seed=2,
        family="gemma4_text",
        hidden_size_per_layer_input=16,
        per_layer_config={},
        vocab_size_per_layer_input=64,
        sliding_window=3,
        num_kv_shared_layers=2,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    ).float()
    assert model.config.kv_sharing_modes == ["store", "store", "reuse", "reuse"]
    assert_exact_under_random_rejections(model, 40)


def assert_exact_under_random_rejections(model, new_tokens: int) -> None:
    """Weights x4 (so that greedy text varies), then ``PROMPTS`` batched with half of the drafts corrupted at random
    positions (rejected drafts stay as holes): every token is the uncached full forward's, and drafts were both
    accepted and rejected."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4) if p.dim() == 2 else None
    refs = [reference_greedy(model, p, new_tokens) for p in PROMPTS]
    proposer = OracleProposer(PROMPTS, [r + [0] * 8 for r in refs], 64, miss=0.5)
    result = decoder(model, proposer, max_new_tokens=new_tokens).generate(PROMPTS)
    assert [o.tokens for o in result.outputs] == refs
    assert 0 < result.metrics.accepted < result.metrics.drafted


def test_eos_and_context_limits():
    model = tiny_model(context=24)
    ref = reference_greedy(model, PROMPTS[0], 12)
    eos = ref[5]
    first = ref.index(eos)
    dec = SpeculativeDecoder(
        model,
        OracleProposer([PROMPTS[0]], [ref + [0] * 8], 64, miss=0.0),
        config=DecodeConfig(max_new_tokens=12),
        sampling=SamplingConfig(),
        eos_token_ids=[eos],
    )
    out = dec.generate([PROMPTS[0]]).outputs[0]
    assert out.tokens == ref[: first + 1] and out.finish_reason == "eos"
    # context 24, prompt 8: at most 16 tokens even though 100 were asked for
    long_run = decoder(model, build_proposer(DecodeConfig()), max_new_tokens=100).generate([PROMPTS[0], PROMPTS[1]])
    assert [len(o.tokens) for o in long_run.outputs] == [16, 22]
    assert {o.finish_reason for o in long_run.outputs} == {"context"}


def test_bad_inputs_are_clear_errors(model):
    dec = decoder(model, build_proposer(DecodeConfig()))
    with pytest.raises(SpecdraftError, match="prompt 1 has 256 tokens but the target's context is 256"):
        dec.generate([[1, 2], [3] * 256])
    with pytest.raises(SpecdraftError, match="prompt 0 is empty"):
        dec.generate([[]])
    with pytest.raises(SpecdraftError, match="outside the target vocabulary"):
        dec.generate([[1, 64]])
    with pytest.raises(SpecdraftError, match="max_new_tokens must be > 0"):
        DecodeConfig(max_new_tokens=0)
    with pytest.raises(SpecdraftError, match="num_draft_tokens"):
        DecodeConfig(num_draft_tokens=-1)
    with pytest.raises(SpecdraftError, match="unknown drafter 'magic'"):
        build_proposer(DecodeConfig(drafter="magic"))
    with pytest.raises(SpecdraftError, match="needs draft confidences, which the 'ngram' drafter does not produce"):
        SpeculativeDecoder(
            model,
            OracleProposer([[1]], [[1]], 64, miss=0.0),
            config=DecodeConfig(),
            sampling=SamplingConfig(),
            scheduler=SchedulerConfig("threshold"),
        )


def test_prompt_lookup():
    ctx = torch.tensor([5, 6, 7, 9, 5, 6])
    assert prompt_lookup(ctx, max_ngram=2, min_ngram=1, max_tokens=3).tolist() == [7, 9, 5]
    assert prompt_lookup(ctx, max_ngram=2, min_ngram=1, max_tokens=0).tolist() == []
    assert prompt_lookup(torch.tensor([1, 2, 3]), max_ngram=2, min_ngram=1, max_tokens=3).tolist() == []
    # repeated text: the most recent match that still has max_tokens after it
    loop = torch.tensor([1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2])
    assert prompt_lookup(loop, max_ngram=2, min_ngram=1, max_tokens=4).tolist() == [3, 1, 2, 3]
    assert prompt_lookup(torch.tensor([4, 8, 4]), max_ngram=3, min_ngram=1, max_tokens=5).tolist() == [8, 4]


class FeatureRecorder(Proposer):
    """Stub for feature-reading drafters: records what the runtime hands over, proposes nothing useful."""

    layer_slots = (LayerSlot(0, "input"), LayerSlot(1, "output"))

    def __init__(self, continuations):
        self.continuations = continuations
        self.features: dict[int, list[tuple[int, torch.Tensor]]] = {}
        self.released: list[int] = []

    def propose(self, inputs: ProposalInput) -> Draft:
        width = int(inputs.max_draft.max())
        tokens = torch.zeros((len(inputs.row_ids), width), dtype=torch.long)
        for i, rid in enumerate(inputs.row_ids):
            self.features.setdefault(rid, []).append((inputs.new_start[i], inputs.new_hidden[i]))
            done = len(inputs.tokens[i]) - len(PROMPTS[rid])
            truth = self.continuations[rid][done : done + width]
            tokens[i, : len(truth)] = torch.tensor(truth)
            if i % 2:
                tokens[i, 1] = (tokens[i, 1] + 1) % 64  # reject sometimes so that cropping is exercised
        return Draft(tokens=tokens, lengths=inputs.max_draft.clone())

    def release(self, row_ids):
        self.released.extend(row_ids)


def test_proposer_receives_target_features_of_verified_positions(model):
    refs = [reference_greedy(model, p, 12) for p in PROMPTS]
    recorder = FeatureRecorder([r + [0] * 8 for r in refs])
    result = decoder(model, recorder, max_new_tokens=12).generate(PROMPTS)
    assert [o.tokens for o in result.outputs] == refs
    assert sorted(recorder.released) == [0, 1, 2]
    assert_features_of_every_position(model, recorder, refs)


def assert_features_of_every_position(model, recorder: FeatureRecorder, refs: list[list[int]]) -> None:
    """What ``recorder`` was handed is contiguous from position 0, one feature row per position that entered
    the target cache, and equal to the features of an uncached forward over prompt + output."""
    from specdraft.hidden_states.capture import HiddenStateCapture

    full = HiddenStateCapture(model, list(FeatureRecorder.layer_slots))([torch.tensor(p + r) for p, r in zip(PROMPTS, refs)])
    assert recorder.features
    for rid, chunks in recorder.features.items():
        starts = [s for s, _ in chunks]
        stacked = torch.cat([h for _, h in chunks])
        assert starts == [0] + list(itertools.accumulate(len(h) for _, h in chunks))[:-1]
        assert torch.allclose(stacked, full[rid][0][: len(stacked)], atol=1e-9)


class DistributionProposer(Proposer):
    """Stub sampling drafter: draws k tokens i.i.d. from a fixed distribution q (through the sampling
    transform); with ``confidence`` [V] it also reports c_j = confidence[x_{j-1}] like DSpark's head."""

    def __init__(self, logits: torch.Tensor, confidence: torch.Tensor | None = None):
        self.logits = logits
        self.confidence = confidence
        self.provides_confidences = self.confidences_calibrated = confidence is not None

    def propose(self, inputs: ProposalInput) -> Draft:
        width = int(inputs.max_draft.max())
        probs = sampling_probs(self.logits, inputs.sampling).expand(len(inputs.row_ids), width, -1)
        tokens = sample(probs, inputs.generator)
        confidences = None
        if self.confidence is not None:
            anchors = torch.stack([t[-1] for t in inputs.tokens])
            confidences = self.confidence[torch.cat([anchors[:, None], tokens[:, :-1]], dim=1)]
        return Draft(tokens=tokens, lengths=inputs.max_draft.clone(), probs=probs, confidences=confidences)


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["distribution", "ngram", "scheduled", "sliding-gemma3"])
def test_sampled_outputs_follow_the_target_distribution(drafter):
    """Rejection sampling is lossless; ``sliding-gemma3``: on a target whose window (3) is shorter than prompt + output."""
    vocab, length, rows = 4, 4, 8000
    if drafter.startswith("sliding-"):
        model = tiny_model(vocab=vocab, seed=3, **{**SLIDING["gemma3"], "sliding_window": 3})
        drafter = "distribution"
    else:
        model = tiny_model(vocab=vocab, layers=2, seed=3)
    with torch.no_grad():  # sharpen the random model so that the target distribution is far from uniform
        model.lm_head.weight.mul_(6.0)
    sampling = SamplingConfig(temperature=0.8, top_k=3)
    prompt = [0, 1, 2, 3, 2, 1]
    draft_logits = torch.tensor([2.0, 0.0, 1.0, -1.0], dtype=torch.float64)
    scheduler, sps = SchedulerConfig(), None
    if drafter == "ngram":
        proposer = build_proposer(DecodeConfig(ngram_min=1, ngram_max=2))
    elif drafter == "distribution":
        proposer = DistributionProposer(draft_logits)
    else:  # DSpark-style: verify lengths chosen by the prefix scheduler from token-dependent confidences
        proposer = DistributionProposer(draft_logits, confidence=torch.tensor([0.9, 0.2, 0.6, 0.4], dtype=torch.float64))
        # flat (memory-bound) up to 2.5 tokens per request, then slower: the scheduler spends the
        # budget on the most likely drafts across all requests and stops at the knee
        budget = int(2.5 * rows)
        scheduler, sps = SchedulerConfig("scheduled"), lambda tokens: 1.0 if tokens <= budget else 1.0 / (1.0 + (tokens - budget) / 500)
    dec = SpeculativeDecoder(
        model,
        proposer,
        config=DecodeConfig(max_new_tokens=length, num_draft_tokens=3, seed=5),
        sampling=sampling,
        scheduler=scheduler,
        sps=sps,
        eos_token_ids=[],
    )
    result = dec.generate([prompt] * rows)
    assert result.metrics.accepted > 0.1 * rows and result.metrics.accepted < result.metrics.drafted
    if drafter == "scheduled":
        assert 0 < result.metrics.drafted < 0.9 * 3 * result.metrics.rounds, "the scheduler should shorten some verify lengths"
    assert_target_distribution(model, prompt, [o.tokens for o in result.outputs], sampling, vocab)


def assert_target_distribution(model, prompt: list[int], outputs: list[list[int]], sampling: SamplingConfig, vocab: int) -> None:
    """Chi-square test of sampled continuations against the target's exact distribution (by enumeration)."""
    length, rows = len(outputs[0]), len(outputs)
    observed = np.zeros(vocab**length)
    for tokens in outputs:
        observed[int(np.ravel_multi_index(tokens, [vocab] * length))] += 1
    seqs = torch.tensor(list(itertools.product(range(vocab), repeat=length)))
    with torch.no_grad():
        logits = model(torch.cat([torch.tensor(prompt).expand(len(seqs), -1), seqs], 1)).logits[:, len(prompt) - 1 : -1]
    probs = sampling_probs(logits.double(), sampling).gather(2, seqs[..., None]).squeeze(2).prod(1).numpy()
    expected = probs / probs.sum() * rows
    assert observed[expected == 0].sum() == 0
    big = expected >= 5  # pool rare cells so the chi-square approximation holds
    obs, exp = observed[big], expected[big]
    if expected[~big].sum() > 0:
        obs, exp = np.append(obs, observed[~big].sum()), np.append(exp, expected[~big].sum())
    assert stats.chisquare(obs, exp).pvalue > 1e-3


@pytest.mark.slow
def test_real_target_greedy_ngram_matches_hf_generate(smollm2_dir):
    from specdraft.targets import load_target

    target = load_target(str(smollm2_dir))
    chats = ["Repeat exactly: the quick brown fox jumps over the lazy dog.", "List the numbers from 1 to 8, comma separated."]
    prompts = [
        target.tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True, return_dict=False)
        for c in chats
    ]
    config = DecodeConfig(drafter="ngram", max_new_tokens=24)
    result = SpeculativeDecoder(target.model, build_proposer(config), config=config, sampling=SamplingConfig()).generate(prompts)
    with torch.no_grad():
        for prompt, out in zip(prompts, result.outputs):
            hf = target.model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt) :].tolist()
            assert out.tokens == hf
    assert result.metrics.accepted > 0


class VirtualClock:
    """The decoder's clock in a test: time passes only as the test says (``advance``), so timing-driven
    decisions do not depend on the machine's load."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class GatedRecorder(FeatureRecorder):
    """A feature-reading drafter with confidences whose quality is set by ``miss``; each draft costs
    ``cost_s`` on ``clock``, like a real drafter's forward."""

    provides_confidences = confidences_calibrated = True

    def __init__(self, continuations, *, miss: float, cost_s: float, clock: VirtualClock):
        super().__init__(continuations)
        self.oracle = OracleProposer(PROMPTS, continuations, vocab=64, miss=miss)
        self.cost_s, self.clock = cost_s, clock
        self.calls = 0

    def propose(self, inputs: ProposalInput) -> Draft:
        self.calls += 1
        for i, rid in enumerate(inputs.row_ids):
            self.features.setdefault(rid, []).append((inputs.new_start[i], inputs.new_hidden[i]))
        self.clock.advance(self.cost_s)
        draft = self.oracle.propose(inputs)
        return Draft(tokens=draft.tokens, lengths=draft.lengths, confidences=torch.full(draft.tokens.shape, 0.95))


@pytest.mark.parametrize("miss, drafts_mostly", [(1.0, False), (0.0, True)])
def test_draft_gate_skips_drafting_only_when_it_does_not_pay(model, miss, drafts_mostly, request):
    from specdraft.decode.sps import SpsTable
    from specdraft.hidden_states.capture import HiddenStateCapture

    refs = [reference_greedy(model, p, 48) for p in PROMPTS]
    # injected timings: a draft costs 10 ms and a target forward of any width 5 ms (what the SPS profile says), so a
    # drafting round commits 5 tokens a row in 15 ms with miss 0 (drafting pays, 333/s > 200/s) and 1 with miss 1 (67/s)
    clock = VirtualClock()
    hook = model.register_forward_hook(lambda *_: clock.advance(0.005))
    request.addfinalizer(hook.remove)
    proposer = GatedRecorder([r + [0] * 8 for r in refs], miss=miss, cost_s=0.01, clock=clock)
    config = DecodeConfig(max_new_tokens=48, num_draft_tokens=4)
    flat = SpsTable((1, 64), (200.0, 200.0))
    dec = SpeculativeDecoder(
        model,
        proposer,
        config=config,
        sampling=SamplingConfig(),
        scheduler=SchedulerConfig("scheduled"),
        sps=flat,
        eos_token_ids=[],
        clock=clock,
    )
    result = dec.generate(PROMPTS)
    assert [o.tokens for o in result.outputs] == refs
    m = result.metrics
    if drafts_mostly:
        assert m.plain_steps == 0 and m.drafting_fraction == 1.0 and m.tau > 4
    else:  # a useless 10 ms drafter: after the first rounds, drafting is only probed with back-off
        assert m.drafting_fraction < 0.35 and m.plain_steps > 2 * m.rounds
    # features of skipped rounds reach the drafter at its next round: contiguous from position 0
    full = HiddenStateCapture(model, list(FeatureRecorder.layer_slots))([torch.tensor(p + r) for p, r in zip(PROMPTS, refs)])
    for rid, chunks in proposer.features.items():
        starts = [s for s, _ in chunks]
        assert starts == [0] + list(itertools.accumulate(len(h) for _, h in chunks))[:-1]
        stacked = torch.cat([h for _, h in chunks])
        assert torch.allclose(stacked, full[rid][0][: len(stacked)], atol=1e-9)
    if not drafts_mostly:  # the gate remembers: the next requests hardly draft at all
        again = dec.generate(PROMPTS)
        assert [o.tokens for o in again.outputs] == refs
        assert again.metrics.rounds < m.rounds and again.metrics.drafting_fraction < 0.1
    off = SpeculativeDecoder(
        model,
        GatedRecorder([r + [0] * 8 for r in refs], miss=miss, cost_s=0.0, clock=clock),
        config=config,
        sampling=SamplingConfig(),
        scheduler=SchedulerConfig("scheduled", adaptive_drafting=False),
        sps=flat,
        eos_token_ids=[],
        clock=clock,
    ).generate(PROMPTS)
    assert off.metrics.plain_steps == 0 and [o.tokens for o in off.outputs] == refs
