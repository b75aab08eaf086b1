"""Long prompts: the long-context suite, chunked prefill with boolean masks, per-request tau and its report."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_FAMILIES
from specdraft.decode.runtime import DecodeMetrics
from specdraft.errors import SpecdraftError
from specdraft.eval.suites import bucket_label
from specdraft.utils.lengths import length_bucket


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_chunked_prefill_is_exact_batched_with_padding_only_chunks(family, monkeypatch):
    """Two rows of 45 and 13 tokens prefilled 8 columns a forward (the short row's first four chunks are all padding),
    sliding windows of 3 where the family slides, half the drafts rejected: every token is the uncached full forward's.
    The mask is boolean where the model runs HF's sdpa attention (it adds no float mask), float where it runs eager."""
    import specdraft.decode.runtime as runtime
    from test_decode import OracleProposer, decoder, reference_greedy
    from test_families import tiny_family_model

    model = tiny_family_model(family, vocab=64, seed=2)
    with torch.no_grad():  # larger weights so that greedy text varies
        for p in model.parameters():
            p.mul_(4) if p.dim() == 2 else None
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 64, (n,), generator=generator).tolist() for n in (45, 13)]
    refs = [reference_greedy(model, p, 12) for p in prompts]
    monkeypatch.setattr(runtime, "PREFILL_CHUNK", 8)
    dec = decoder(model, OracleProposer(prompts, [r + [0] * 8 for r in refs], 64, miss=0.5), max_new_tokens=12)
    masks = dec.attention.masks(torch.ones(1, 3, dtype=torch.bool), torch.tensor([[2]]), model.dtype)
    mask = next(iter(masks.values())) if isinstance(masks, dict) else masks
    assert dec.attention.boolean == (model.config._attn_implementation == "sdpa") == (mask.dtype == torch.bool)
    assert dec.attention.boolean != (family == "gpt_oss")  # gpt-oss's sinks run in eager attention only
    result = dec.generate(prompts)
    assert [o.tokens for o in result.outputs] == refs
    assert 0 < result.metrics.accepted < result.metrics.drafted


def test_boolean_masks_never_leave_a_query_without_columns():
    """A padding query before its row's first token (a chunk of padding only) would get an all-False row, which SDPA
    turns into NaN that the cache keeps; it attends to every column instead, and real queries keep their exact mask."""
    from specdraft.targets.attention import FULL, AttentionLayout

    layout = AttentionLayout((FULL,), {FULL: None}, boolean=True)
    valid = torch.tensor([[False, False, True, True]])
    mask = layout.masks(valid[:, :2], torch.tensor([[0, 0]]), torch.float32)  # the first chunk: padding only
    assert mask.dtype == torch.bool and mask.all()
    mask = layout.masks(valid, torch.tensor([[0, 1]]), torch.float32)[0, 0]  # the real queries at positions 0 and 1
    assert mask.tolist() == [[False, False, True, False], [False, False, True, True]]
    float_mask = AttentionLayout((FULL,), {FULL: None}).masks(valid, torch.tensor([[0, 1]]), torch.float32)[0, 0]
    assert ((float_mask == 0) == mask).all()


def test_per_request_counters_follow_rows_and_concatenate_on_merge():
    first = DecodeMetrics(requests=3)
    first.record_round([4, 4], [3, 0], [0, 2])  # rows 0 and 2 drafted (row 1 had finished)
    first.record_round([4], [1], [2])
    assert first.request_tau == [4.0, None, 1.5] and first.tau == pytest.approx(7 / 3)
    second = DecodeMetrics(requests=1)
    second.record_round([2], [2], [0])
    merged = first.merge(second)
    assert merged.request_tau == [4.0, None, 1.5, 3.0] and merged.requests == 4
    assert merged.position_drafted == [4, 4, 3, 3]  # per-position counters still add up by position
    assert merged.to_json()["request_tau"] == [4.0, None, 1.5, 3.0]


def test_tau_distribution_and_macro_tau():
    from specdraft.eval.report import macro_tau, tau_distribution

    taus = [1.0 + i / 10 for i in range(20)] + [None]
    d = tau_distribution(taus)
    assert d["requests"] == 20 and d["median"] == pytest.approx(1.95)
    assert d["top10_floor"] == pytest.approx(2.8)  # the best two of twenty: 2.9 and 2.8
    assert d["p90"] == pytest.approx(2.71)  # interpolated at rank 0.9 x 19 = 17.1: 2.7 + 0.1 x 0.1
    assert tau_distribution([None]) == {"requests": 0, "median": None, "p90": None, "top10_floor": None}
    per_domain = {"a": {"tau": 3.0, "rounds": 100}, "b": {"tau": 1.0, "rounds": 1}, "c": {"tau": 0.0, "rounds": 0}}
    assert macro_tau(per_domain) == 2.0  # each domain once; one that never drafted is left out


def test_length_buckets_are_powers_of_two():
    assert [length_bucket(n) for n in (1, 256, 257, 1024, 1025, 4096, 7936)] == [256, 256, 512, 1024, 2048, 4096, 8192]
    assert [bucket_label(e) for e in (512, 1024, 8192)] == ["<=512", "<=1k", "<=8k"]


def test_long_context_refuses_lengths_past_the_targets_context(smollm2_dir):
    from specdraft.eval.suites import long_context

    with pytest.raises(SpecdraftError, match=r"prompt length 8000 \+ 256 new tokens does not fit .* context is 8192 tokens"):
        long_context(lengths=(1024, 8000))
    with pytest.raises(SpecdraftError, match="unknown domains"):
        long_context(domains=("novels",))


def test_long_context_prompts_fill_their_buckets_deterministically(smollm2_dir):
    from transformers import AutoTokenizer

    from specdraft.eval.suites import long_context

    domains = ("stdlib-code", "stdlib-docs", "specdraft-source")
    prompts = long_context(lengths=(512, 1024), per_length=2, domains=domains)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    lengths = {p.prompt_id: len(p.token_ids(tokenizer)) for p in prompts}
    assert [p.domain for p in prompts] == [d for d in domains for _ in range(4)]
    for p in prompts:
        nominal = int(p.prompt_id.split("-")[-2])
        assert 0.6 * nominal <= lengths[p.prompt_id] <= nominal and length_bucket(lengths[p.prompt_id]) == nominal
    assert len({p.messages[0]["content"] for p in prompts}) == len(prompts)  # every prompt its own document
    assert "Continue the code" in prompts[0].messages[-1]["content"]
    assert long_context(lengths=(512, 1024), per_length=2, domains=domains) == prompts
    assert long_context(lengths=(512, 1024), per_length=2, domains=domains, seed=1) != prompts


@pytest.mark.slow
def test_default_long_context_suite_reaches_the_targets_context(smollm2_dir):
    """The registered suite: four domains (ShareGPT chats included) at 1k, 2k, 4k and 8192 - 256 tokens."""
    from collections import Counter

    from transformers import AutoTokenizer

    from specdraft.eval.suites import LONG_CONTEXT_DOMAINS, SUITES

    prompts = SUITES.get("long-context")()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    buckets = Counter((p.domain, length_bucket(len(p.token_ids(tokenizer)))) for p in prompts)
    assert buckets == {(d, b): 2 for d in LONG_CONTEXT_DOMAINS for b in (1024, 2048, 4096, 8192)}
    assert max(len(p.token_ids(tokenizer)) for p in prompts) > 7800
    chats = [p for p in prompts if p.domain == "sharegpt-long"]
    assert all(p.messages[-1]["role"] == "user" and any(m["role"] == "assistant" for m in p.messages) for p in chats)


def test_eval_reports_buckets_request_tau_and_the_plot(tmp_path, tiny_target):
    import json

    from specdraft.decode.config import SamplingConfig
    from specdraft.eval.config import EvalConfig
    from specdraft.eval.runner import run_eval

    path = tmp_path / "prompts.jsonl"
    long = " ".join(["red green blue"] * 120)  # ~360 tokens: bucket <=512, the short ones <=256
    rows = [{"prompt": "one two three one two three", "domain": "a"}, {"prompt": long, "domain": "a"}, {"prompt": "Say hi.", "domain": "b"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "eval"
    config = EvalConfig(out=str(out), prompts=str(path), drafters=["ngram"], max_new_tokens=8, threads=1)
    report = run_eval(config, SamplingConfig(), target=tiny_target, progress=False)
    ngram = next(r for r in report["runs"] if r["drafter"] == "ngram")
    assert list(ngram["per_bucket"]) == ["<=256", "<=512"]
    assert sum(m["requests"] for m in ngram["per_bucket"].values()) == 3
    taus = [p["outputs"]["ngram"]["1"]["tau"] for p in report["prompts"]]
    assert ngram["tau_distribution"]["requests"] == sum(t is not None for t in taus) > 0
    assert ngram["macro_tau"] == pytest.approx(sum(m["tau"] for m in ngram["per_domain"].values()) / 2)
    text = (out / "report.md").read_text()
    assert "tau per prompt-length bucket" in text and "| ngram | " in text and "top-10% floor" in text
    assert (out / "tau_vs_context.png").stat().st_size > 0


@pytest.mark.slow
def test_embedded_target_is_exact_at_its_longest_prompts_batched(smollm2_dir):
    """Two rows of ~8.2k and ~2k tokens (the suite's longest specdraft-source prompts), decoded together:
    ngram's output equals autoregressive decoding's in both rows."""
    from specdraft.decode.config import DecodeConfig, SamplingConfig
    from specdraft.decode.runtime import decoder_for_target
    from specdraft.eval.suites import long_context
    from specdraft.targets import load_target

    target = load_target("smollm2-135m")
    prompts = [
        p.token_ids(target.tokenizer)
        for p in long_context(lengths=(8192 - 8, 2048), per_length=1, domains=("specdraft-source",), max_new_tokens=8)
    ]
    assert len(prompts[0]) > 8100 and len(prompts[1]) < 2100
    plain = decoder_for_target(target, config=DecodeConfig(drafter="none", max_new_tokens=8), sampling=SamplingConfig())
    ngram = decoder_for_target(target, config=DecodeConfig(drafter="ngram", max_new_tokens=8), sampling=SamplingConfig())
    expected = plain.generate(prompts)
    result = ngram.generate(prompts)
    assert [o.tokens for o in result.outputs] == [o.tokens for o in expected.outputs]
    assert all(len(o.tokens) == 8 for o in expected.outputs)
