"""Measured speed defaults (tuning/measured.py, tuning/dtype.py): the decision logic with injected
timings, the per-machine cache, and `--dtype auto` deciding what training runs in."""

from __future__ import annotations

import json

import pytest

from specdraft.tuning import measured
from specdraft.tuning.measured import choose, machine_identity, measured_choice


@pytest.mark.parametrize(
    "seconds, expected",
    [
        ({"fp32": 1.0, "bf16": 0.5}, "bf16"),  # AVX-512-BF16 / AMX / GPU: bf16 wins
        ({"fp32": 1.0, "bf16": 13.0}, "fp32"),  # AVX2-only EPYC: bf16 13x slower
        ({"fp32": 1.0, "bf16": 0.95}, "fp32"),  # within the margin: keep the exact one
        ({"fp32": 1.0}, "fp32"),
    ],
)
def test_choice_follows_the_timings(seconds, expected):
    assert choose(seconds, preferred="fp32", margin=0.1) == expected


def test_measurements_are_cached_per_machine_and_context(tmp_path, monkeypatch):
    calls = []

    def timers(fp32: float, bf16: float):
        return {"fp32": lambda: calls.append("fp32") or fp32, "bf16": lambda: calls.append("bf16") or bf16}

    first = measured_choice("probe", {"shape": 1}, timers(1.0, 0.4), preferred="fp32", cache_dir=tmp_path)
    assert first.choice == "bf16" and not first.cached and calls == ["fp32", "bf16"]
    again = measured_choice("probe", {"shape": 1}, timers(9.0, 9.0), preferred="fp32", cache_dir=tmp_path)
    assert again.cached and again.choice == "bf16" and again.seconds == {"fp32": 1.0, "bf16": 0.4} and len(calls) == 2
    stored = json.loads(next((tmp_path / "measured").glob("probe-*.json")).read_text())
    assert stored["machine"] == machine_identity() and stored["machine"]["torch"] and stored["choice"] == "bf16"
    # other work, or other software on the same machine, is measured afresh -- and here bf16 is the slow one
    other = measured_choice("probe", {"shape": 2}, timers(1.0, 13.0), preferred="fp32", cache_dir=tmp_path)
    assert other.choice == "fp32" and not other.cached
    monkeypatch.setattr(measured, "machine_identity", lambda device="cpu": {"torch": "9.9"})
    assert not measured_choice("probe", {"shape": 1}, timers(1.0, 2.0), preferred="fp32", cache_dir=tmp_path).cached


@pytest.mark.parametrize("bf16_seconds, expected", [(0.01, "bf16"), (13.0, "fp32")])
def test_dtype_auto_trains_in_the_measured_dtype(tmp_path, monkeypatch, bf16_seconds, expected):
    """The trainer's probe times its real step in each dtype; with injected timings the choice flips."""
    from specdraft.train import step, trainer
    from specdraft.train.trainer import train
    from test_train_toy import ToyStore, ToyTarget, toy_config

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    timed, autocast_dtypes = [], []

    def fake_fastest_time(fn, **kwargs):
        fn()  # the real step runs (forward + backward); only its timing is injected (fp32 first, then bf16)
        timed.append(fn)
        return 1.0 if len(timed) == 1 else bf16_seconds

    monkeypatch.setattr(trainer, "fastest_time", fake_fastest_time)
    real_autocast = step.autocast
    monkeypatch.setattr(step, "autocast", lambda name, device: autocast_dtypes.append(name) or real_autocast(name, device))
    # the path pinned: its own probe (tests/test_forward_path.py) would time fp32 steps before these
    result = train(toy_config(tmp_path / "run", dtype="auto", max_steps=2, forward_path="eager"), target=ToyTarget(), dataset=ToyStore())
    assert len(timed) == 2 and result.completed
    # the probe's two steps (one per dtype), then the training steps: the same train_step, in the chosen dtype
    assert result.compute_dtype == expected and autocast_dtypes[:2] == ["fp32", "bf16"] and set(autocast_dtypes[2:]) == {expected}
    assert result.dtype_probe == {"choice": expected, "seconds": {"fp32": 1.0, "bf16": bf16_seconds}, "cached": False}
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {r["dtype"] for r in records if r["split"] == "train"} == {expected}
    assert list((tmp_path / "cache" / "measured").glob("train-dtype-*.json"))


def test_machine_settings_log_one_block_naming_each_choice_and_its_source(caplog):
    """A stage's settings log as one record: every choice it uses, whether measured now, cached or given, and the
    figures; a choice the stage does not use is left out."""
    import logging

    from specdraft.tuning.settings import Choice, MachineSettings

    settings = MachineSettings(
        "generate",
        forward_path=Choice.from_facts(
            {"forward_path": "prepacked", "forward_path_source": "cached", "forward_path_seconds": {"eager": 0.02, "prepacked": 0.01}},
            "forward_path",
        ),
        threads=Choice(2, "flag"),
    )
    with caplog.at_level(logging.INFO, logger="specdraft.tuning.settings"):
        settings.log()
    assert len(caplog.records) == 1
    assert caplog.records[0].getMessage() == (
        "generate machine settings:\n  forward path: prepacked (from cache: eager 20.0 ms, prepacked 10.0 ms)\n  threads: 2 (given)"
    )
