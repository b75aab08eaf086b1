"""Verify-length policies: the DSpark prefix scheduler (lossless thanks to its break) and the SPS table."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from scipy import stats

from specdraft.decode import sps as sps_module
from specdraft.decode.config import SchedulerConfig
from specdraft.decode.sampling import sample
from specdraft.decode.scheduler import choose_verify_lengths, prefix_survival, schedule_prefix
from specdraft.decode.sps import SpsTable, default_token_counts, load_or_measure_sps
from specdraft.decode.verification import verify_rejection
from specdraft.errors import SpecdraftError


def test_worked_example_from_docstring():
    # c = [0.9, 0.8, 0.2]; SPS flat up to 3 tokens, then halved -> l = 2.
    table = SpsTable((1, 3, 4), (100.0, 100.0, 50.0))
    survival = prefix_survival(torch.tensor([[0.9, 0.8, 0.2]]), torch.tensor([3]))
    assert torch.allclose(survival, torch.tensor([[0.9, 0.72, 0.144]], dtype=torch.float64))
    assert schedule_prefix(survival, torch.tensor([3]), table).tolist() == [2]


def test_scheduler_spends_the_batch_on_the_most_likely_drafts():
    # Two requests, room for two extra tokens at full speed: the two best candidates win,
    # even though both belong to request 1.
    table = SpsTable((1, 2, 3, 4, 5), (10.0, 10.0, 10.0, 10.0, 1.0))
    conf = torch.tensor([[0.3, 0.9], [0.95, 0.9]])
    lengths = torch.tensor([2, 2])
    assert choose_verify_lengths(confidences=conf, lengths=lengths, config=SchedulerConfig("scheduled"), sps=table).tolist() == [0, 2]
    # A verify length never exceeds the drafted length.
    assert choose_verify_lengths(
        confidences=conf, lengths=torch.tensor([2, 1]), config=SchedulerConfig("scheduled"), sps=table
    ).tolist() == [1, 1]


def test_full_and_threshold_policies():
    conf = torch.tensor([[0.9, 0.8, 0.2], [0.4, 1.0, 1.0]])
    lengths = torch.tensor([3, 2])
    assert choose_verify_lengths(confidences=conf, lengths=lengths, config=SchedulerConfig("full")).tolist() == [3, 2]
    assert choose_verify_lengths(confidences=None, lengths=lengths, config=SchedulerConfig("full")).tolist() == [3, 2]
    # survival [0.9, 0.72, 0.144] and [0.4, 0.4, (past length)] against 0.5
    assert choose_verify_lengths(confidences=conf, lengths=lengths, config=SchedulerConfig("threshold", 0.5)).tolist() == [2, 0]
    assert choose_verify_lengths(confidences=conf, lengths=lengths, config=SchedulerConfig("threshold", 0.4)).tolist() == [2, 2]


def test_policy_errors():
    with pytest.raises(SpecdraftError, match="confidence head"):
        choose_verify_lengths(confidences=None, lengths=torch.tensor([2]), config=SchedulerConfig("scheduled"), sps=SpsTable((1,), (1.0,)))
    with pytest.raises(SpecdraftError, match="steps/s"):
        choose_verify_lengths(confidences=torch.ones(1, 2), lengths=torch.tensor([2]), config=SchedulerConfig("scheduled"))
    with pytest.raises(SpecdraftError, match="unknown verify policy 'best'"):
        SchedulerConfig("best")
    with pytest.raises(SpecdraftError, match="confidence_threshold"):
        SchedulerConfig("threshold", 1.5)
    with pytest.raises(ValueError, match="confidences"):
        prefix_survival(torch.tensor([[1.2]]), torch.tensor([1]))


def schedule_lookahead(survival: torch.Tensor, lengths: torch.Tensor, sps) -> torch.Tensor:
    """The tempting variant WITHOUT the break: take the best-scoring prefix of the candidate list,
    looking past candidates that do not improve Theta. Kept here only to show that it is biased."""
    rows = survival.shape[0]
    candidates = sorted(
        ((survival[r, j].item(), j, r) for r in range(rows) for j in range(int(lengths[r]))), key=lambda c: (-c[0], c[1], c[2])
    )
    tau, batch = float(rows), rows
    best, best_n = tau * sps(batch), 0
    for n, (a, _, _) in enumerate(candidates, 1):
        tau, batch = tau + a, batch + 1
        if tau * sps(batch) > best:
            best, best_n = tau * sps(batch), n
    chosen = [0] * rows
    for _, j, r in candidates[:best_n]:
        chosen[r] = max(chosen[r], j + 1)
    return torch.tensor(chosen)


# A Markov "world" on 3 tokens: target P[prev] and drafter Q[prev] are next-token distributions;
# the drafter's confidence for x_j depends on x_{j-1} only (as DSpark's head reads W1[x_{j-1}]).
TARGET = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.5, 0.3], [0.3, 0.3, 0.4]], dtype=torch.float64)
DRAFT = torch.tensor([[0.5, 0.4, 0.1], [0.6, 0.2, 0.2], [0.2, 0.2, 0.6]], dtype=torch.float64)
CONFIDENCE = torch.tensor([0.95, 0.5, 0.05], dtype=torch.float64)
# From anchor 1 (c_1 = 0.5) verifying x_1 alone does not pay (1.5 * 0.55 < 1), so the break
# stops at l = 0. Verifying x_1 and x_2 pays only if c_2 = CONFIDENCE[x_1] is high, i.e. if x_1 == 0:
# (1 + 0.5 + 0.5 * 0.95) * 0.54 > 1. A look-ahead therefore verifies x_1 only when x_1 == 0.
SPS = SpsTable((1, 2, 3, 4), (1.0, 0.55, 0.54, 0.4))


def sample_outputs(schedule, *, rows: int = 10_000, k: int = 3, length: int = 3, start: int = 1, seed: int = 0) -> torch.Tensor:
    """Speculative decoding in the Markov world with per-row verify lengths from ``schedule``; [rows, length]."""
    gen = torch.Generator().manual_seed(seed)
    anchors = torch.full((rows,), start)
    out = [[] for _ in range(rows)]
    while min(len(o) for o in out) < length:
        prev, drafts = anchors, []
        for _ in range(k):
            prev = sample(DRAFT[prev], gen)
            drafts.append(prev)
        drafts = torch.stack(drafts, 1)  # [rows, k]
        previous = torch.cat([anchors[:, None], drafts[:, :-1]], 1)  # x_{j-1} for each draft
        survival = prefix_survival(CONFIDENCE[previous], torch.full((rows,), k))
        lengths = torch.cat([schedule(survival[r : r + 1], torch.tensor([k]), SPS) for r in range(rows)])
        states = torch.cat([anchors[:, None], drafts], 1)  # target row j scores the token after states[:, j]
        result = verify_rejection(
            draft_tokens=drafts, draft_lengths=lengths, draft_probs=DRAFT[previous], target_probs=TARGET[states], generator=gen
        )
        for r in range(rows):
            out[r].extend(result.committed(r))
        anchors = result.tokens.gather(1, result.num_accepted[:, None]).squeeze(1)
    return torch.tensor([o[:length] for o in out])


def markov_p_value(outputs: torch.Tensor, start: int = 1) -> float:
    vocab, length = TARGET.shape[0], outputs.shape[1]
    codes = (outputs * torch.tensor([vocab ** (length - 1 - i) for i in range(length)])).sum(1)
    observed = np.bincount(codes.numpy(), minlength=vocab**length)
    expected = np.zeros(vocab**length)
    for code in range(vocab**length):
        seq = [(code // vocab ** (length - 1 - i)) % vocab for i in range(length)]
        p, prev = 1.0, start
        for t in seq:
            p, prev = p * TARGET[prev, t].item(), t
        expected[code] = p * len(outputs)
    return stats.chisquare(observed, expected).pvalue


@pytest.mark.slow
def test_prefix_scheduler_with_break_is_lossless_and_lookahead_is_not():
    chosen = []

    def with_break(survival, lengths, sps):
        l = schedule_prefix(survival, lengths, sps)
        chosen.append(int(l))
        return l

    assert markov_p_value(sample_outputs(with_break)) > 1e-3
    assert set(chosen) == {0, 2}, "from anchors 1 and 2 the break stops at once, from anchor 0 it verifies two drafts"
    assert markov_p_value(sample_outputs(schedule_lookahead)) < 1e-6


def test_sps_table_interpolates_step_time():
    table = SpsTable((1, 4, 8), (100.0, 50.0, 25.0))  # 10 ms, 20 ms, 40 ms
    assert table(1) == 100.0 and table(4) == 50.0
    assert table(2) == pytest.approx(1 / (0.010 + 0.010 / 3))
    assert table(12) == pytest.approx(1 / 0.060)  # extrapolated with the last slope
    assert SpsTable.from_json(json.loads(json.dumps(table.to_json()))) == table
    with pytest.raises(SpecdraftError, match="increasing"):
        SpsTable((4, 2), (1.0, 1.0))
    assert default_token_counts(40) == list(range(1, 17)) + [32, 40]


def _tiny_llama():
    """A one-layer random Llama whose forward costs next to nothing: what the SPS profile times."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=32
    )
    return LlamaForCausalLM(config).eval()


def test_sps_is_measured_once_and_cached(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = _tiny_llama()
    calls, spot_checks = [], []
    real = sps_module.measure_sps
    monkeypatch.setattr(sps_module, "STALE_FACTOR", 1e9)  # a tiny model's sub-millisecond timings: no staleness verdict here
    monkeypatch.setattr(
        sps_module, "measure_sps", lambda *a, **kw: (calls if len(kw["token_counts"]) > 1 else spot_checks).append(kw) or real(*a, **kw)
    )
    first = load_or_measure_sps(model, fingerprint="abc", cache_dir=tmp_path, max_tokens=4, context_tokens=8, repeats=1)
    again = load_or_measure_sps(model, fingerprint="abc", cache_dir=tmp_path, max_tokens=4, context_tokens=8, repeats=1)
    assert len(calls) == 1 and first == again and first.tokens == (1, 2, 3, 4)
    assert spot_checks == []  # measured by this process: nothing to check
    monkeypatch.setattr(sps_module, "_CHECKED", set())  # a later process
    load_or_measure_sps(model, fingerprint="abc", cache_dir=tmp_path, max_tokens=4, context_tokens=8, repeats=1)
    load_or_measure_sps(model, fingerprint="abc", cache_dir=tmp_path, max_tokens=4, context_tokens=8, repeats=1)
    assert len(calls) == 1 and [kw["token_counts"] for kw in spot_checks] == [[1]]  # one spot check of its first point, once
    (path,) = (tmp_path / "sps").iterdir()
    assert path.name.startswith("abc-cpu-float32") and json.loads(path.read_text())["fingerprint"] == "abc"
    load_or_measure_sps(model, fingerprint="other", cache_dir=tmp_path, max_tokens=4, context_tokens=8, repeats=1)
    assert len(calls) == 2


def test_a_cached_profile_taken_under_load_is_measured_again(tmp_path, monkeypatch, caplog):
    """A profile far slower than a spot check now was taken on a busier machine (interference only adds time): measured
    again and replaced. One faster than the spot check stands: the machine is busy now, not then."""
    from specdraft.decode.sps import stale_profile

    assert stale_profile(SpsTable((1, 2), (2.0, 1.9)), SpsTable((1,), (36.0,)))  # the 14x-loaded profile that broke a quickstart
    assert not stale_profile(SpsTable((1, 2), (36.0, 30.0)), SpsTable((1,), (20.0,)))  # busy now: the quiet profile stands
    assert not stale_profile(SpsTable((1,), (30.0,)), SpsTable((1,), (40.0,)))  # within the factor: noise
    torch.manual_seed(0)
    model = _tiny_llama()
    fresh = load_or_measure_sps(model, fingerprint="abc", cache_dir=tmp_path, max_tokens=2, context_tokens=8, repeats=1)
    (path,) = (tmp_path / "sps").iterdir()
    entry = json.loads(path.read_text())
    loaded = SpsTable(fresh.tokens, tuple(v / 1000 for v in fresh.steps_per_second))  # as if measured under a 1000x load
    monkeypatch.setattr(sps_module, "measure_sps", lambda *a, **kw: loaded)  # the machine under load: cached slow
    path.unlink()
    assert load_or_measure_sps(model, fingerprint="abc", cache_dir=tmp_path, max_tokens=2, context_tokens=8, repeats=1) == loaded
    monkeypatch.setattr(sps_module, "measure_sps", lambda *a, **kw: fresh)  # the machine is quiet again, in a later process
    monkeypatch.setattr(sps_module, "_CHECKED", set())
    with caplog.at_level(logging.WARNING, logger="specdraft.decode.sps"):
        again = load_or_measure_sps(model, fingerprint="abc", cache_dir=tmp_path, max_tokens=2, context_tokens=8, repeats=1)
    assert again == fresh and "taken on a busier machine" in caplog.text and str(path) in caplog.text
    assert json.loads(path.read_text())["steps_per_second"] == entry["steps_per_second"]  # the cache holds the new profile


def test_draft_cost_makes_longer_verify_lengths_worth_it():
    from specdraft.decode.scheduler import with_draft_cost

    survival = prefix_survival(torch.tensor([[0.6, 0.5, 0.5]]), torch.tensor([3]))  # a = 0.6, 0.3, 0.15
    steps = SpsTable((1, 2, 4), (100.0, 60.0, 50.0))  # 10, ~16.7, 20 ms
    assert schedule_prefix(survival, torch.tensor([3]), steps).tolist() == [0]  # 1.6/16.7 < 1/10
    # a 20 ms draft is spent either way: 1.6/36.7 > 1/30, 1.9/~18.3+20 > 1.6/36.7, ...
    assert schedule_prefix(survival, torch.tensor([3]), with_draft_cost(steps, 0.020)).tolist() == [3]
    assert with_draft_cost(steps, 0.0)(2) == pytest.approx(60.0)
    with pytest.raises(ValueError):
        with_draft_cost(steps, -1.0)


def test_draft_gate_backs_off_and_recovers():
    from specdraft.decode.scheduler import DraftGate

    gate = DraftGate(plain_rate=100.0, max_interval=8, probe_cost=0.5)
    pattern = []
    for _ in range(12):  # drafting commits 50 tok/s against 100 plain: 2, then 4, then 8 (the cap) plain rounds
        drafting = gate.should_draft()
        pattern.append(drafting)
        gate.record(drafted=drafting, tokens=1, seconds=0.02 if drafting else 0.01)
    assert pattern == [True, False, False, True, False, False, False, False, True, False, False, False]
    assert gate.plain_measured and gate.plain_rate == pytest.approx(100.0)
    for _ in range(8):  # drafting becomes fast: the next probe pays and drafting continues every round
        if gate.should_draft():
            gate.record(drafted=True, tokens=4, seconds=0.01)
    assert gate.interval == 1 and gate.skip_left == 0 and gate.draft_rate > gate.plain_rate
    assert all(gate.should_draft() for _ in range(3))
    # a costly useless probe buys a long plain stretch at once: 15 ms extra per probe at 1% -> 150 rounds of 10 ms
    costly = DraftGate(plain_rate=100.0)
    costly.record(drafted=True, tokens=1, seconds=0.025)
    assert costly.skip_left == 150
    ruinous = DraftGate(plain_rate=100.0)  # 30 ms extra would buy 300: capped at max_interval
    ruinous.record(drafted=True, tokens=1, seconds=0.04)
    assert ruinous.skip_left == ruinous.max_interval == 256
    with pytest.raises(ValueError):
        DraftGate(plain_rate=0.0)


def test_sps_profile_is_monotone_and_ignores_slow_outliers(monkeypatch):
    import itertools as it
    import time as time_module

    model = _tiny_llama()
    # a fake clock: each forward of B tokens "takes" 10 ms, except every third run, hit by a 1 s stall,
    # and B=3 is impossibly cheap (as a noisy profile can claim)
    clock = it.count()
    ticks = {"now": 0.0}
    real_forward = model.forward

    def timed_forward(*args, input_ids=None, **kwargs):
        b = input_ids.shape[1]
        ticks["now"] += (0.002 if b == 3 else 0.010) + (1.0 if next(clock) % 3 == 0 else 0.0)
        return real_forward(*args, input_ids=input_ids, **kwargs)

    monkeypatch.setattr(model, "forward", timed_forward)
    monkeypatch.setattr(time_module, "perf_counter", lambda: ticks["now"])
    table = sps_module.measure_sps(model, token_counts=[1, 2, 3, 4], context_tokens=8, repeats=3)
    assert [round(1 / s, 3) for s in table.steps_per_second] == [0.010, 0.010, 0.010, 0.010]
