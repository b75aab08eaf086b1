"""Sequential Temperature Scaling: the pure fit, and `specdraft calibrate` on a tiny trained DSpark drafter."""

from __future__ import annotations

import json

import pytest
import torch

from specdraft.errors import SpecdraftError
from specdraft.models.dspark.config import DSparkConfig
from specdraft.models.dspark.temperature_scaling import expected_calibration_error, sequential_temperature_scaling
from test_train_methods import config as train_config
from test_train_methods import stores  # noqa: F401  (module fixture)


def test_ece_is_zero_when_calibrated_and_large_when_not():
    g = torch.Generator().manual_seed(0)
    p = torch.rand(20000, generator=g)
    outcome = (torch.rand(20000, generator=g) < p).double()
    assert expected_calibration_error(p, outcome) < 0.02
    assert expected_calibration_error(torch.full_like(p, 0.99), outcome) > 0.4


def test_sts_recovers_the_temperature_of_overconfident_logits_position_by_position():
    g = torch.Generator().manual_seed(1)
    n, temps = 40000, (2.0, 0.5, 3.0)
    true_logits = torch.randn(n, 3, generator=g) * 1.5 + 1.0
    reported = torch.stack([true_logits[:, k] * temps[k] for k in range(3)], 1)  # what an uncalibrated head says
    accept = (torch.rand(n, 3, generator=g) < torch.sigmoid(true_logits)).double()
    valid = torch.ones(n, 3, dtype=torch.bool)
    valid[: n // 4, 2] = False  # a shorter block: position 3 unsupervised for some rows
    result = sequential_temperature_scaling(logits=reported, accept=accept, valid=valid)
    for k, t in enumerate(temps):
        assert result.temperatures[k] == pytest.approx(t, rel=0.15)
        assert result.ece_after[k] < result.ece_before[k]
    assert result.counts == [n, n, n - n // 4]


def test_sts_keeps_unit_temperature_where_there_is_no_data():
    logits = torch.zeros(4, 2)
    valid = torch.tensor([[True, False]] * 4)
    result = sequential_temperature_scaling(logits=logits, accept=torch.ones(4, 2), valid=valid)
    assert result.temperatures[1] == 1.0 and result.counts == [4, 0]


def test_config_validates_temperatures():
    with pytest.raises(SpecdraftError, match="confidence_temperatures"):
        DSparkConfig(block_size=4, confidence_temperatures=[1.0, 2.0])
    with pytest.raises(SpecdraftError, match="confidence_temperatures"):
        DSparkConfig(block_size=2, confidence_temperatures=[1.0, 0.0])


@pytest.mark.slow
def test_calibrate_writes_temperatures_used_at_inference(stores, tmp_path):
    from specdraft.models.common.drafter import load_drafter
    from specdraft.train.calibrate import CalibrateConfig, calibrate
    from specdraft.train.trainer import train

    target, store = stores[0], stores[1]["dspark"]
    result = train(train_config("dspark", store, tmp_path / "run", max_steps=3), target=target)
    final = result.final
    stats = calibrate(
        CalibrateConfig(drafter=str(final), data=str(store), out=str(tmp_path / "cal"), val_fraction=0.5), target=target, progress=False
    )
    assert len(stats["temperatures"]) == 4 and stats["blocks"] > 0
    assert json.loads((tmp_path / "cal" / "calibration.json").read_text())["temperatures"] == stats["temperatures"]
    raw, cal = load_drafter(final, target=target), load_drafter(tmp_path / "cal", target=target)
    assert cal.config.confidence_temperatures == stats["temperatures"] and not raw.config.confidence_temperatures
    # Same weights, so the same drafts; the confidences differ exactly by the per-position temperature.
    hidden = torch.randn(4, 64)
    a = raw.propose(hidden, anchor_token=3, temperature=0.0, generator=None)
    b = cal.propose(hidden, anchor_token=3, temperature=0.0, generator=None)
    assert torch.equal(a.tokens, b.tokens)
    logit = torch.logit(a.confidences.double())
    expected = torch.sigmoid(logit / torch.tensor(stats["temperatures"], dtype=torch.float64))
    assert torch.allclose(b.confidences.double(), expected, atol=1e-5)


@pytest.mark.slow
def test_calibrate_rejects_drafters_without_confidences(stores, tmp_path, capsys):
    from specdraft.train.trainer import train

    target, store = stores[0], stores[1]["dspark"]
    final = train(train_config("dflash", store, tmp_path / "run", max_steps=1), target=target).final
    from specdraft.train.calibrate import CalibrateConfig, calibrate

    with pytest.raises(SpecdraftError, match="no confidence head"):
        calibrate(CalibrateConfig(drafter=str(final), data=str(store)), target=target, progress=False)
    with pytest.raises(SpecdraftError, match="--mode"):
        CalibrateConfig(drafter="x", data="y", mode="nope")
