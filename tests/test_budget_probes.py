"""``tuning/budget_probes.py``: the plans made from a timing probe, tested with injected step times on any machine."""

from __future__ import annotations

import json

import pytest

from specdraft.errors import SpecdraftError
from specdraft.tuning.budget_probes import (
    DecoderCost,
    estimate_eval_seconds,
    median_record,
    overhead_per_round,
    round_seconds,
    seconds_per_step,
    steps_in_budget,
)

#: Target forwards per second by tokens: 50 ms for one token, 100 ms for 8, 200 ms for 64.
SPS = {1: 20.0, 8: 10.0, 64: 5.0}.__getitem__


def test_the_comparison_reserve_is_measured_worst_case_decoding():
    """Each decoder's worst-case round (nothing accepted), prefills and warm-ups."""
    plain = round_seconds(SPS, overhead_s=0.005)
    assert plain == pytest.approx(0.055)
    assert round_seconds(SPS, overhead_s=0.005, verify_tokens=8, draft_s=0.01) == pytest.approx(0.115)
    assert round_seconds(SPS, overhead_s=0.005, verify_tokens=8, draft_s=0.01, gate_floor=1.03) == pytest.approx(1.03 * 0.055)
    costs = [DecoderCost("autoregressive", plain), DecoderCost("drafter@full", 0.115)]
    estimate = estimate_eval_seconds([8, 64], 10, costs, SPS, warmup_tokens=16)
    prefill = 0.1 + 0.2
    assert estimate["per_decoder_s"]["drafter@full"] == pytest.approx(prefill + 0.115 * (2 * 10 + 16), abs=0.05)
    assert estimate["seconds"] == pytest.approx(2 * prefill + (0.055 + 0.115) * (20 + 16))


def test_the_round_overhead_is_what_a_plain_decode_spends_beyond_the_forward():
    # 2 requests, 18 tokens: 16 later tokens in 1.0 s after the first ones = 62.5 ms each, 50 ms of them the forward
    assert overhead_per_round(wall_s=1.2, ttft_s=0.2, output_tokens=18, requests=2, sps=SPS) == pytest.approx(0.0125)
    assert overhead_per_round(wall_s=0.5, ttft_s=0.2, output_tokens=18, requests=2, sps=SPS) == 0.0  # noise: never negative


def test_the_step_time_is_the_median_logged_step_without_the_first(tmp_path):
    log = tmp_path / "metrics.jsonl"
    records = [
        {"split": "train", "seconds": 9.0},
        {"split": "train", "seconds": 2.0},
        {"split": "train", "seconds": 6.0, "steps": 2},
        {"split": "train", "seconds": 4.0},
        {"split": "val", "seconds": 50.0, "anchors_per_s": 1.0},
    ]
    log.write_text("".join(json.dumps({**r, "anchors_per_s": r.get("anchors_per_s", 10.0 * i)}) + "\n" for i, r in enumerate(records)))
    assert seconds_per_step(log) == 3.0  # of 2, 3 (6 s over 2 steps) and 4; the first step's one-off 9 s left out
    assert median_record(log, "anchors_per_s") == 20.0 and median_record(log, "missing") is None
    log.write_text(json.dumps({"split": "val", "seconds": 1.0}) + "\n")
    with pytest.raises(SpecdraftError, match="no training steps were logged"):
        seconds_per_step(log)


@pytest.mark.parametrize("train_seconds, per_step, expected", [(99.0, 2.0, 44), (99.0, 20.0, 4), (99.0, 200.0, 0)])
def test_steps_fill_the_headroom_of_what_is_left(train_seconds, per_step, expected):
    assert steps_in_budget(train_seconds, per_step, headroom=0.9) == expected
