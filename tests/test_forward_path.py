"""Forward paths (``tuning/forward_path.py``) and the runtime's growing KV cache: exact, measured, reversible."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from specdraft.decode.config import DecodeConfig, SamplingConfig
from specdraft.decode.runtime import SpeculativeDecoder, build_proposer
from specdraft.errors import SpecdraftError
from specdraft.tuning import forward_path as fp
from test_decode import PROMPTS, SLIDING, OracleProposer, assert_target_distribution, tiny_model

pytestmark = pytest.mark.skipif(
    not fp.path_applies(fp.FORWARD_PATHS.get("prepacked"), nn.Linear(2, 2)), reason="oneDNN is not available in this torch build"
)


def fp32_model(**kwargs):
    return tiny_model(**kwargs).float()


def test_configs_accept_exactly_the_registered_paths():
    """The configs' choices are the registry's (``tuning/paths.py``), not a second list kept equal by hand."""
    import dataclasses

    from specdraft.tuning.paths import path_choices

    assert path_choices() == ["auto", *fp.FORWARD_PATHS.names()]
    assert {f.name: f.metadata.get("choices") for f in dataclasses.fields(DecodeConfig)}["forward_path"] == path_choices()
    with pytest.raises(
        SpecdraftError,
        match=r"forward_path must be one of auto, eager, gqa, prepacked, prepacked\+gqa, prepacked\+streamed, "
        r"prepacked\+streamed\+gqa, got 'fast'",
    ):
        DecodeConfig(forward_path="fast")


def test_prepacked_linear_matches_eager_and_falls_back_where_it_cannot_serve():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 96), nn.ReLU(), nn.Linear(96, 32, bias=False))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(3, 5, 48)
    with torch.no_grad():
        expected = model(x)
    fp.use_path(model, "prepacked")
    assert fp.current_path(model) == "prepacked" and all(isinstance(m, nn.Linear) for m in (model[0], model[2]))
    assert type(model[0]) is fp.PrepackedLinear and list(model.state_dict()) == list(state)
    with torch.no_grad():
        assert torch.allclose(model(x), expected, atol=1e-5)
        assert torch.allclose(model(x[0]), expected[0], atol=1e-5)  # 2-D input
        with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast: F.linear, as eager computes it
            autocast_out = model(x)
        fp.use_path(model, "eager")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(model(x), autocast_out)
        fp.use_path(model, "prepacked")
    # autograd goes through F.linear: gradients flow to the real parameters, and through a frozen layer to its input
    model(x).sum().backward()
    assert model[0].weight.grad is not None and model[0].weight.grad.abs().sum() > 0
    model[2].weight.requires_grad_(False)
    model.zero_grad()
    model(x).sum().backward()
    assert model[0].weight.grad.abs().sum() > 0 and model[2].weight.grad is None
    model[2].weight.requires_grad_(True)
    # an in-place update (an optimizer step) bumps the weight's version: the packed copy follows
    with torch.no_grad():
        model[2].weight.mul_(2.0)
        assert torch.allclose(model(x), 2 * expected, atol=1e-5)
    fp.use_path(model, "eager")
    assert fp.current_path(model) == "eager" and type(model[0]) is nn.Linear and not hasattr(model[0], "_packed")


def _streamed_ops():
    from specdraft.tuning.streamed import build_failure, streamed_ops

    if streamed_ops() is None:
        pytest.skip(f"specdraft's streamed linear cannot be built here: {build_failure()}")
    return streamed_ops()


def test_streamed_kernel_matches_linear_and_a_row_does_not_depend_on_its_neighbours():
    """The kernel against F.linear (odd sizes: a 16-lane body plus a tail; with and without bias), and each row of
    a multi-row call bit for bit its own one-row call: a position's logits do not change with the tokens beside it."""
    ops = _streamed_ops()
    gen = torch.Generator().manual_seed(0)
    for n_in, n_out in ((48, 96), (37, 5), (576, 192)):
        weight, bias, x = torch.randn(n_out, n_in, generator=gen), torch.randn(n_out, generator=gen), torch.randn(9, n_in, generator=gen)
        for b in (None, bias):
            full = ops.streamed_linear(x, weight, b)
            torch.testing.assert_close(full, nn.functional.linear(x, weight, b), atol=1e-4, rtol=1e-5)
            for i in range(9):
                assert torch.equal(ops.streamed_linear(x[i : i + 1].contiguous(), weight, b)[0], full[i])
    with pytest.raises(RuntimeError, match="float32 CPU tensors only"):
        ops.streamed_linear(x.double(), weight.double(), None)


def test_streamed_linear_serves_small_row_counts_and_leaves_the_rest(monkeypatch, tmp_path):
    """Up to the cap the module calls the kernel, above it oneDNN's prepacked op, and autograd or autocast plain
    F.linear; every answer matches eager; uninstalling restores nn.Linear with no leftovers."""
    from specdraft.tuning import streamed

    _streamed_ops()
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    monkeypatch.setattr(fp, "stream_rows", lambda model: 3)
    calls = []
    real = streamed.streamed_linear
    monkeypatch.setattr(streamed, "streamed_linear", lambda x, w, b: (calls.append(x.shape[0]), real(x, w, b))[1])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 96), nn.ReLU(), nn.Linear(96, 32, bias=False))
    x = torch.randn(2, 3, 48)
    with torch.no_grad():
        expected = model(x)
    assert fp.use_path(model, "prepacked+streamed") == "prepacked+streamed" and type(model[0]) is fp.StreamedLinear
    with torch.no_grad():
        torch.testing.assert_close(model(x[:1]), expected[:1], atol=1e-5, rtol=1e-5)  # 3 rows: streamed
        assert calls == [3, 3]
        torch.testing.assert_close(model(x), expected, atol=1e-5, rtol=1e-5)  # 6 rows: prepacked
        assert calls == [3, 3]
    model(x[:1]).sum().backward()  # autograd: F.linear, gradients reach the weights
    assert calls == [3, 3] and model[0].weight.grad.abs().sum() > 0
    assert fp.use_path(model, "prepacked") == "prepacked" and type(model[0]) is fp.PrepackedLinear
    fp.use_path(model, "prepacked+streamed")
    assert fp.use_path(model, "eager") == "eager" and type(model[0]) is nn.Linear
    assert not {"_packed", "_packed_version", "_stream_rows"} & model[0].__dict__.keys()


def test_stream_cap_takes_the_rows_where_the_streamed_pass_was_clearly_faster():
    """The decision from injected timings (seconds per pass by row count)."""
    prepacked = {1: 31.0, 2: 34.0, 3: 29.0, 4: 29.0, 5: 28.0}
    assert fp.stream_cap({1: 20.0, 2: 20.0, 3: 23.0, 4: 35.0, 5: 20.0}, prepacked) == 3  # 5 does not count past the loss at 4
    assert fp.stream_cap({1: 30.0, 2: 20.0, 3: 20.0, 4: 20.0, 5: 20.0}, prepacked) == 0  # one row within the margin: never
    assert fp.stream_cap(dict.fromkeys(prepacked, 1.0), prepacked) == 5


def test_stream_rows_measures_once_per_machine_and_shapes(monkeypatch, tmp_path):
    """The cap comes from timed passes (injected here), is cached per set of linear shapes and read back after."""
    from specdraft.tuning import measured

    _streamed_ops()
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    times = iter([0.5, 1.0] * 2 + [2.0, 1.0] * 6)  # per row count: streamed, then prepacked
    calls = []
    monkeypatch.setattr(measured, "fastest_time", lambda fn, **kw: (fn(), calls.append(1), next(times))[2])
    model = nn.Sequential(nn.Linear(48, 96))
    fp.use_path(model, "prepacked")
    assert fp.stream_rows(model) == 2 and len(calls) == 2 * fp.STREAM_PROBE_ROWS
    assert fp.stream_rows(model) == 2 and len(calls) == 2 * fp.STREAM_PROBE_ROWS  # cached


def test_timings_of_an_earlier_kernel_are_measured_again(monkeypatch, tmp_path):
    """A changed streamed kernel (its source or flags: ``kernel_version``) invalidates what was timed with the old one:
    the row cap, the path probes and the SPS profiles all key on it (``path_version``)."""
    from specdraft.decode.sps import sps_cache_path
    from specdraft.tuning import measured, streamed

    _streamed_ops()
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(measured, "fastest_time", lambda fn, **kw: (calls.append(1), 1.0)[1])
    model = nn.Sequential(nn.Linear(48, 96))
    fp.use_path(model, "prepacked")
    fp.stream_rows(model)
    fp.stream_rows(model)
    assert len(calls) == 2 * fp.STREAM_PROBE_ROWS  # cached for this kernel
    old = fp.path_version("prepacked+streamed")
    sps_old = sps_cache_path(
        tmp_path,
        fingerprint="t",
        device=torch.device("cpu"),
        dtype=torch.float32,
        context_tokens=8,
        max_tokens=4,
        forward_path="prepacked+streamed",
    )
    monkeypatch.setattr(streamed, "kernel_version", lambda: "0123456789ab")
    fp.stream_rows(model)
    assert len(calls) == 4 * fp.STREAM_PROBE_ROWS  # another kernel: timed again
    assert fp.path_version("prepacked+streamed") == "prepacked+streamed@0123456789ab" != old
    assert fp.path_version("prepacked+gqa") == "prepacked+gqa"  # parts without code of their own add nothing
    sps_new = sps_cache_path(
        tmp_path,
        fingerprint="t",
        device=torch.device("cpu"),
        dtype=torch.float32,
        context_tokens=8,
        max_tokens=4,
        forward_path="prepacked+streamed",
    )
    assert sps_new != sps_old and "prepacked+streamed@0123456789ab" in sps_new.name


def test_a_path_that_cannot_apply_is_refused_naming_what_can():
    model = nn.Linear(8, 8).double()
    with pytest.raises(
        SpecdraftError,
        match=r"--forward-path prepacked does not apply to a float64 model on cpu here \(it needs CPU fp32 with oneDNN\); "
        r"use one of auto, eager$",
    ):
        fp.use_path(model, "prepacked")


def test_the_streamed_path_without_its_kernel_is_refused_naming_what_it_needs(monkeypatch):
    """Where the kernel cannot be built (no compiler), ``--forward-path prepacked+streamed`` is a clear error and the
    model is left as it was, while ``auto``'s candidates simply lack the streamed paths."""
    from specdraft.tuning import streamed

    monkeypatch.setattr(streamed, "streamed_ops", lambda: None)
    model = nn.Sequential(nn.Linear(8, 8))
    with pytest.raises(
        SpecdraftError,
        match=r"--forward-path prepacked\+streamed does not apply to a float32 model on cpu here "
        r"\(it needs CPU fp32 with oneDNN and a C\+\+ compiler that builds specdraft's streamed "
        r"linear \(the log says why it did not\)\); use one of auto, eager, prepacked$",
    ):
        fp.use_path(model, "prepacked+streamed")
    assert type(model[0]) is nn.Linear and fp.applicable_paths(model) == ["eager", "prepacked"]


def test_auto_picks_the_measured_faster_path_and_caches_it(monkeypatch, tmp_path):
    """The decision from injected timings: prepacked only when clearly faster; measured once per context."""
    from specdraft.tuning import streamed

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    monkeypatch.setattr(streamed, "streamed_ops", lambda: None)  # two candidates here: eager and prepacked
    model = nn.Sequential(nn.Linear(8, 8))
    calls = []

    def timings(table):
        def work() -> float:
            calls.append(fp.current_path(model))
            return table[fp.current_path(model)]

        return work

    choice = fp.resolve_path(model, "auto", "test", {"case": 1}, timings({"eager": 1.0, "prepacked": 0.5}))
    assert (choice.name, choice.source, fp.current_path(model)) == ("prepacked", "measured", "prepacked")
    assert choice.seconds == {"eager": 1.0, "prepacked": 0.5} and sorted(calls) == ["eager", "prepacked"]
    again = fp.resolve_path(model, "auto", "test", {"case": 1}, timings({"eager": 0.1, "prepacked": 9.0}))
    assert (again.name, again.source, len(calls)) == ("prepacked", "cached", 2)  # read back, not re-timed
    near_tie = fp.resolve_path(model, "auto", "test", {"case": 2}, timings({"eager": 1.0, "prepacked": 0.95}))
    assert near_tie.name == "eager" and fp.current_path(model) == "eager"  # within the margin: the preferred path
    flag = fp.resolve_path(model, "prepacked", "test", {"case": 3}, timings({}))
    assert (flag.name, flag.source, flag.seconds) == ("prepacked", "flag", {})


def test_growing_cache_is_bit_identical_to_dynamic_cache_through_crops_and_row_drops():
    from transformers import DynamicCache

    from specdraft.decode.kv_cache import GrowingCache

    model = fp32_model(layers=2, vocab=64)
    torch.manual_seed(1)
    caches = (DynamicCache(), GrowingCache())
    ids = torch.randint(0, 64, (3, 12))
    outs = []
    with torch.no_grad():
        for cache in caches:
            logits = [model(input_ids=ids, cache=cache, use_cache=True).logits]
            step = torch.randint(0, 64, (3, 5), generator=torch.Generator().manual_seed(2))
            for round_ in range(40):  # past the first buffer's spare columns: it regrows
                logits.append(model(input_ids=step, cache=cache, use_cache=True).logits)
                cache.crop(-3)  # keep 2 of 5, as after rejected drafts
                if round_ == 20:
                    cache.batch_select_indices(torch.tensor([0, 2]))
                    step = step[[0, 2]]
            outs.append(logits)
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    layer = caches[1].layers[0]
    assert layer.keys.data_ptr() == layer._key_buffer.data_ptr() and layer._key_buffer.shape[-2] > layer.keys.shape[-2]


def test_growing_cache_does_not_reallocate_in_a_steady_decode():
    from specdraft.decode.kv_cache import GrowingCache

    model = fp32_model(layers=1, vocab=64)
    cache = GrowingCache()
    with torch.no_grad():
        model(input_ids=torch.zeros((1, 8), dtype=torch.long), cache=cache, use_cache=True)
        model(input_ids=torch.zeros((1, 1), dtype=torch.long), cache=cache, use_cache=True)
        buffer = cache.layers[0]._key_buffer.data_ptr()
        for _ in range(30):
            model(input_ids=torch.zeros((1, 1), dtype=torch.long), cache=cache, use_cache=True)
    assert cache.layers[0]._key_buffer.data_ptr() == buffer


@pytest.mark.parametrize("path", ["prepacked", "gqa", "prepacked+gqa", "prepacked+streamed+gqa"])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_speculative_greedy_equals_autoregressive_on_the_same_path(family, path, monkeypatch, tmp_path):
    """fp32 on each path, batched rows with different accepted lengths (oracle drafts wrong half the
    time): every token equals plain decoding on that path, and the logits stay within tolerance of eager.
    On ``streamed`` forwards of up to 6 rows take the streamed kernel and wider ones oneDNN's, so plain steps
    and verify forwards mix both kernels."""
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    monkeypatch.setattr(fp, "stream_rows", lambda model: 6)  # the measured cap of a tiny model is timing noise
    model = fp32_model(seed=2, **(SLIDING[family] if family != "llama" else {}))
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # clear argmax margins: float reassociation must not decide a token
        eager_logits = model(torch.tensor([PROMPTS[0]])).logits
    assert fp.use_path(model, path) == path and fp.current_path(model) == path
    with torch.no_grad():
        assert (model(torch.tensor([PROMPTS[0]])).logits - eager_logits).abs().max() < fp.LOGIT_TOLERANCE

    def run(proposer):
        config = DecodeConfig(max_new_tokens=20, num_draft_tokens=4)
        return SpeculativeDecoder(model, proposer, config=config, sampling=SamplingConfig(), eos_token_ids=[]).generate(PROMPTS)

    plain = [o.tokens for o in run(build_proposer(DecodeConfig(drafter="none"))).outputs]
    spec = run(OracleProposer(PROMPTS, [p + [0] * 8 for p in plain], 64, miss=0.5))
    assert [o.tokens for o in spec.outputs] == plain
    assert 0 < spec.metrics.accepted < spec.metrics.drafted and len(set(spec.metrics.position_accepted)) > 1


def test_gqa_path_lets_sdpa_group_heads_instead_of_copying_the_cache(monkeypatch):
    """On ``gqa`` a masked multi-token forward (a verify forward) never calls HF's ``repeat_kv`` (which copies every
    layer's K/V per grouped head) and gives eager's logits, without touching the process environment: another model,
    off the path, still runs HF's default in the same process. A model without grouped attention (a drafter) takes the
    rest of a path naming ``gqa``; uninstalling restores the forward."""
    from transformers.integrations import sdpa_attention

    copies = []
    real = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda x, n: (copies.append(n), real(x, n))[1])
    environment = dict(os.environ)
    model, other = fp32_model(seed=4), fp32_model(seed=4)
    ids = torch.tensor([PROMPTS[0] + PROMPTS[1]])
    mask = torch.ones_like(ids)
    mask[0, 2] = 0  # a hole, as the runtime masks rejected drafts: HF builds a 4-D mask, SDPA gets it
    with torch.no_grad():
        eager = model(input_ids=ids, attention_mask=mask).logits
        assert copies  # eager attention copies
        copies.clear()
        assert fp.use_path(model, "gqa") == "gqa"
        grouped = model(input_ids=ids, attention_mask=mask).logits
        assert copies == [] and (grouped - eager).abs().max() < fp.LOGIT_TOLERANCE
        other(input_ids=ids, attention_mask=mask)
    assert copies and dict(os.environ) == environment
    assert fp.use_path(model, "eager") == "eager" and "forward" not in model.__dict__
    drafter = nn.Sequential(nn.Linear(8, 8))
    assert fp.applicable_paths(drafter) == ["eager", "prepacked", "prepacked+streamed"]
    assert fp.use_path(drafter, "prepacked+gqa") == "prepacked"
    assert fp.applicable_paths(model) == ["eager", "gqa", "prepacked", "prepacked+gqa", "prepacked+streamed", "prepacked+streamed+gqa"]


def test_auto_times_every_combination_on_a_grouped_attention_target(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    model = fp32_model(seed=4)
    monkeypatch.setattr(fp, "stream_rows", lambda model: 4)
    table = {"eager": 1.0, "gqa": 0.8, "prepacked": 0.75, "prepacked+gqa": 0.6, "prepacked+streamed": 0.7, "prepacked+streamed+gqa": 0.65}
    table = {path: table[path] for path in fp.applicable_paths(model)}  # the streamed ones where the kernel builds
    choice = fp.resolve_path(model, "auto", "test", {"case": "gqa"}, lambda: table[fp.current_path(model)])
    assert (choice.name, choice.seconds, fp.current_path(model)) == ("prepacked+gqa", table, "prepacked+gqa")
    assert type(model.lm_head) is fp.PrepackedLinear and "forward" in model.__dict__


@pytest.mark.slow
def test_prepacked_gqa_rejection_sampling_follows_the_target_distribution():
    from test_decode import DistributionProposer

    vocab, length, rows = 4, 4, 6000
    model = fp32_model(vocab=vocab, layers=2, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
    fp.use_path(model, "prepacked+gqa")
    sampling = SamplingConfig(temperature=0.8, top_k=3)
    prompt = [0, 1, 2, 3, 2, 1]
    proposer = DistributionProposer(torch.tensor([2.0, 0.0, 1.0, -1.0]))
    dec = SpeculativeDecoder(
        model, proposer, config=DecodeConfig(max_new_tokens=length, num_draft_tokens=3, seed=5), sampling=sampling, eos_token_ids=[]
    )
    result = dec.generate([prompt] * rows)
    assert result.metrics.accepted > 0.1 * rows and result.metrics.accepted < result.metrics.drafted
    assert_target_distribution(model, prompt, [o.tokens for o in result.outputs], sampling, vocab)


def test_training_runs_on_the_path_its_probe_chose_and_still_learns(tmp_path, monkeypatch):
    """``--forward-path auto`` in training: the path probe times the fp32 step per path (timings injected
    here), the steps run on the winner, and the trained weights still receive gradients (the prepacked
    op has no autograd, so trainable linears must go through F.linear)."""
    from specdraft.train import trainer
    from specdraft.train.trainer import train
    from test_train_toy import ToyStore, ToyTarget, toy_config

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(fp, "stream_rows", lambda model: 4)
    seconds = dict(zip(fp.applicable_paths(nn.Linear(2, 2)), [1.0, 0.5, 0.6]))  # eager, prepacked, prepacked+streamed where it builds
    timings = iter(seconds.values())  # timed in the registry's order
    monkeypatch.setattr(trainer, "fastest_time", lambda fn, **kw: (fn(), next(timings))[1])
    result = train(toy_config(tmp_path / "run", max_steps=3, eval_interval=0), target=ToyTarget(), dataset=ToyStore())
    assert result.forward_path == {"forward_path": "prepacked", "forward_path_source": "measured", "forward_path_seconds": seconds}
    assert type(result.drafter.fc) is fp.PrepackedLinear and result.step == 3
    first = train(
        toy_config(tmp_path / "eager", max_steps=3, eval_interval=0, forward_path="eager"), target=ToyTarget(), dataset=ToyStore()
    )
    assert first.forward_path["forward_path_source"] == "flag" and type(first.drafter.fc) is nn.Linear
    # the same data and seed on either path: trained weights agree to float reassociation (gradients flowed alike)
    for (name, a), b in zip(result.drafter.state_dict().items(), first.drafter.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-5), name


def test_auto_threads_training_probes_its_path_at_the_default_count_so_a_later_run_reuses_it(tmp_path, monkeypatch):
    """With ``num_threads`` auto the path probe runs at the default count, not at what an earlier stage of the process
    left (the quickstart's sizing probe, then its training, in one process): keyed by that count, each run re-timed
    every path."""
    from specdraft.train.trainer import train
    from specdraft.tuning.measured import available_cores
    from test_train_toy import ToyStore, ToyTarget, toy_config

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(fp, "stream_rows", lambda model: 4)
    before = torch.get_num_threads()
    sources = []
    try:
        for run, left_behind in (("a", available_cores()), ("b", available_cores() + 1)):
            torch.set_num_threads(left_behind)
            result = train(toy_config(tmp_path / run, max_steps=1, eval_interval=0, num_threads=0), target=ToyTarget(), dataset=ToyStore())
            sources.append(result.forward_path["forward_path_source"])
    finally:
        torch.set_num_threads(before)
    assert sources == ["measured", "cached"]
