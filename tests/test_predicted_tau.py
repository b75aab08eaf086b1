"""The predicted-tau log line of ``specdraft train`` (train/predicted_tau.py): the fit's arithmetic, the lookup, the line."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from specdraft.errors import SpecdraftError
from specdraft.train.batches import DataPlan
from specdraft.train.predicted_tau import FIT_FILE, ScalingFit, find_fit, load_fits, log_predicted_tau, prediction_line
from specdraft.train.split import Split

FIT = ScalingFit(
    target="smollm2-135m",
    target_fingerprint="748dc84065403f9c",
    method="dspark",
    recipe="dspark",
    tau_inf=1.5,
    a=10.0,
    b=0.5,
    tokens_range=(10_000, 100_000),
    epoch_token_multiplier={2.0: 1.6, 3.0: 2.0},
    measured="test",
)


def test_fit_evaluates_power_law_and_epoch_multiplier():
    assert FIT.tau(10_000) == pytest.approx(1.5 - 10.0 / 100)
    assert FIT.multiplier(1) == 1.0 and FIT.multiplier(0.5) == 0.5
    assert FIT.multiplier(2.5) == pytest.approx(1.8)  # linear between measured epoch counts
    assert FIT.multiplier(5) == 2.0  # beyond the measured ones: the largest, not extrapolated
    assert FIT.predict(10_000, 2) == pytest.approx(FIT.tau(16_000))
    assert FIT.predict(40_000, 1) > FIT.predict(10_000, 1)


def test_lookup_misses_other_method_and_target():
    assert find_fit((FIT,), target="smollm2-135m", fingerprint=None, method="dspark") is FIT
    assert find_fit((FIT,), target="/some/dir", fingerprint="748dc84065403f9c", method="dspark") is FIT  # same weights by path
    assert find_fit((FIT,), target="smollm2-135m", fingerprint=None, method="eagle3") is None
    assert find_fit((FIT,), target="qwen3-0.6b", fingerprint="other", method="dspark") is None


def fake_run(method: str, lengths: list[int], epochs: int) -> SimpleNamespace:
    ids = [f"s{i}" for i in range(len(lengths))]
    data = DataPlan.build(
        ids, lengths, split=Split(list(range(len(lengths) - 1)), [len(lengths) - 1], {}), pack_tokens=512, batch_rows=1, seed=0
    )
    return SimpleNamespace(method=method, data=data, total_steps=data.total_steps(epochs))


def test_log_line_names_tokens_epochs_and_says_prediction(caplog):
    run = fake_run("dspark", [400] * 10 + [300], epochs=2)  # 10 training samples of 400 tokens, one held out
    target = SimpleNamespace(name="smollm2-135m", fingerprint="x")
    with caplog.at_level(logging.INFO, logger="specdraft.train.predicted_tau"):
        line = log_predicted_tau(run, target, fits=(FIT,))
    assert line is not None and line in caplog.text
    # 6,400 fresh-data tokens lie below the measured 10,000-100,000, where the power law runs off: no number
    assert line.startswith("no predicted decoded tau for 4,000 training tokens x 2 epochs: 6,400 fresh-data tokens lie below")
    assert "(10,000 tokens)" in line and "prediction" not in line
    line = prediction_line(FIT, 8_000, 2)
    assert f"predicted decoded tau for 8,000 training tokens x 2 epochs: {FIT.predict(8000, 2):.2f}" in line
    assert "a prediction" in line and "measured tau comes from validation" in line and "extrapolated" not in line
    assert "extrapolated: the fit measured 10,000-100,000 tokens" in prediction_line(FIT, 200_000, 1)
    assert "x 0.308 epochs" in prediction_line(FIT, 50_000, 4 / 13)  # a probe's fraction of an epoch, readable


def test_no_fit_logs_nothing(caplog):
    target = SimpleNamespace(name="smollm2-135m", fingerprint="x")
    with caplog.at_level(logging.INFO, logger="specdraft.train.predicted_tau"):
        assert log_predicted_tau(fake_run("eagle3", [400] * 4, epochs=1), target, fits=(FIT,)) is None
    assert caplog.text == ""


def test_malformed_fit_file_is_refused(tmp_path: Path):
    path = tmp_path / "fits.json"
    path.write_text(json.dumps({"format": "specdraft.data_scaling", "fits": [{"target": "t"}]}))
    with pytest.raises(SpecdraftError, match="malformed"):
        load_fits(path)


def test_packaged_fit_covers_the_default_recipe_on_the_embedded_target():
    fit = find_fit(load_fits(FIT_FILE), target="smollm2-135m", fingerprint=None, method="dspark")
    assert fit is not None and fit.recipe == "dspark"
    low, high = fit.tokens_range
    assert 1.0 < fit.tau(low) < fit.tau(high) < fit.tau_inf  # rising toward its plateau over the measured range
