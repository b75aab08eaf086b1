"""The quickstart's data split (``tuning/data_split.py``): regeneration gets what extraction, the capped epochs of
training and the comparison leave of the budget, from rates injected here as a pilot would measure them."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from specdraft.errors import SpecdraftError
from specdraft.quickstart import QuickstartConfig
from specdraft.quickstart.data import _regeneration_facts
from specdraft.quickstart.report import training_table
from specdraft.tuning.data_split import DRIFT_SHARE, SplitInputs, choose_data_split, engine_candidates, plan_data_split

#: The issue-41 machine, as its figures give it: 320 samples regenerated in 5 minutes (0.94 s each), 641 steps of 6
#: epochs over them in under 3 minutes (about 0.09 s per sample and epoch), at a 20-minute budget of which the
#: comparison's sizing and the pilot have spent 2 minutes.
TODAY_DATA_S = 5 * 60
MACHINE = SplitInputs(
    seconds_left=18 * 60,
    engine="hf",
    regen_s_per_sample=0.94,
    engine_start_s=0.0,
    extract_s_per_sample=0.05,
    train_s_per_sample_epoch=0.09,
    epochs=6,
    pilot_samples=32,
    max_new_samples=10_000,
    batch_samples=16,
    reserve_s=180.0,
    overhead_s=40.0,
    train_headroom=0.9,
)


def _later_s(i: SplitInputs) -> float:
    return i.extract_s_per_sample + i.epochs * i.train_s_per_sample_epoch / i.train_headroom


def test_slow_regeneration_and_fast_training_get_more_regeneration_time_than_the_fixed_five_minutes():
    split = plan_data_split(MACHINE)
    assert split.bound_by == "budget"
    assert split.regen_s > TODAY_DATA_S + 120  # the run left 5.3 of 20 minutes unused after 5 of regeneration
    assert split.new_samples + MACHINE.pilot_samples > 320 + 120
    assert split.new_samples % MACHINE.batch_samples == 0  # whole batches


def test_fast_regeneration_and_slow_training_give_data_a_smaller_share():
    slow_train = dataclasses.replace(MACHINE, regen_s_per_sample=0.2, train_s_per_sample_epoch=0.6)
    fast, slow = plan_data_split(MACHINE), plan_data_split(slow_train)
    assert slow.regen_s / slow.total_s < 0.5 * fast.regen_s / fast.total_s
    assert slow.regen_s < fast.regen_s
    assert slow.projected_s["train"] > slow.projected_s["regenerate"]


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"regen_s_per_sample": 0.2, "train_s_per_sample_epoch": 0.6},
        {"regen_s_per_sample": 3.0, "extract_s_per_sample": 0.5, "epochs": 2},
        {"seconds_left": 5 * 60, "reserve_s": 30.0, "batch_samples": 4},
        {"seconds_left": 60 * 60, "epochs": 1, "batch_samples": 1},
        {"engine_start_s": 90.0, "regen_s_per_sample": 0.1},  # a vLLM server: minutes to start, then fast
    ],
)
def test_the_projection_fits_the_budget_and_one_batch_more_would_not(changes):
    inputs = dataclasses.replace(MACHINE, **changes)
    split = plan_data_split(inputs)
    usable = inputs.seconds_left * (1 - DRIFT_SHARE)
    assert split.total_s <= usable
    # near the budget: one batch more would not fit
    assert split.total_s + inputs.batch_samples * (inputs.regen_s_per_sample + _later_s(inputs)) > usable
    # regeneration's deadline falls inside the last planned batch: it is started, the one after it is not
    batches = split.new_samples / inputs.batch_samples
    # (after the engine's start, which runs inside it)
    started = inputs.engine_start_s + (batches - 1) * inputs.batch_samples * inputs.regen_s_per_sample
    assert started < split.regen_s < split.projected_s["regenerate"]
    # the epoch cap counts: training is projected at every capped pass over every sample, pilot's included
    samples = inputs.pilot_samples + split.new_samples
    assert split.projected_s["train"] == pytest.approx(samples * inputs.epochs * inputs.train_s_per_sample_epoch / inputs.train_headroom)


def test_time_over_buys_samples_not_passes():
    """Fewer epochs (the cap) leave more of the budget for data: the split never plans passes beyond the cap."""
    assert plan_data_split(dataclasses.replace(MACHINE, epochs=3)).new_samples > plan_data_split(MACHINE).new_samples


def test_samples_cap_and_a_budget_the_pilot_fills():
    capped = plan_data_split(dataclasses.replace(MACHINE, max_new_samples=40))
    assert (capped.new_samples, capped.bound_by) == (40, "samples")
    assert capped.regen_s == pytest.approx((3 - 0.5) * 16 * 0.94)  # three batches, the last one partial
    full = plan_data_split(dataclasses.replace(MACHINE, seconds_left=200.0))
    assert (full.new_samples, full.regen_s, full.bound_by) == (0, 0.0, "budget")


@pytest.mark.parametrize(
    ("name", "value", "why"),
    [
        ("regen_s_per_sample", 0.0, "must be > 0"),
        ("train_s_per_sample_epoch", math.nan, "is not finite"),
        ("extract_s_per_sample", -1.0, "must be >= 0"),
        ("engine_start_s", -5.0, "must be >= 0"),
        ("seconds_left", math.inf, "is not finite"),
        ("epochs", 0, "must be >= 1"),
    ],
)
def test_unusable_rates_are_refused_naming_the_rate_and_the_flag_that_fixes_the_split(name, value, why):
    with pytest.raises(SpecdraftError, match=rf"pilot's {name.replace('_', ' ')} \(.*\) {why}; pass --data-budget MINUTES"):
        plan_data_split(dataclasses.replace(MACHINE, **{name: value}))


def test_the_split_is_described_with_its_rates_and_recorded():
    split = plan_data_split(MACHINE)
    text = split.describe()
    assert "0.94 s/sample" in text and "x 6 epochs (cap)" in text and f"{split.new_samples} samples more" in text
    facts = json.loads(json.dumps(split.facts()))
    assert facts["rates"]["regen_s_per_sample"] == 0.94 and facts["new_samples"] == split.new_samples
    row = next(line for line in training_table({"size-data": {**facts, "pilot_read": 40}}).splitlines() if "data split" in line)
    assert f"{split.new_samples} samples planned after a pilot of 32 (bound by budget)" in row


def test_a_server_that_starts_in_minutes_regenerates_after_the_pilot_only_where_the_budget_pays_for_its_start():
    """The engine probe's figures (tokens/s predicted per engine, the server's start) scale the pilot's HF rate."""
    figures = {"hf_tokens_per_s": 130.0, "vllm_tokens_per_s": 780.0, "vllm_start_s": 100.0}
    hf, vllm = engine_candidates(MACHINE, figures, auto=True)
    assert (hf.engine, hf.engine_start_s) == ("hf", 0.0)
    assert (vllm.engine, vllm.engine_start_s, vllm.regen_s_per_sample) == ("vllm", 100.0, pytest.approx(0.94 / 6))
    assert choose_data_split([hf, vllm]).inputs.engine == "vllm"  # 18 minutes: its start pays off
    short = [dataclasses.replace(c, seconds_left=4 * 60, reserve_s=60.0) for c in (hf, vllm)]
    assert choose_data_split(short).inputs.engine == "hf"  # 4 minutes: the start would eat the data share
    # a given engine, or no probe figures: only the pilot's own engine, whose server start is paid again
    assert engine_candidates(MACHINE, figures, auto=False) == [hf]
    assert engine_candidates(MACHINE, {}, auto=True) == [MACHINE]
    on_vllm = dataclasses.replace(MACHINE, engine="vllm", regen_s_per_sample=0.15)
    assert engine_candidates(on_vllm, figures, auto=False)[0].engine_start_s == 100.0


def test_data_budget_unset_is_the_measured_split_and_a_given_one_must_be_positive():
    assert QuickstartConfig().data_budget is None
    assert QuickstartConfig(data_budget=5).data_budget == 5
    for bad in (0, -1):
        with pytest.raises(SpecdraftError, match="--data-budget must be > 0 minutes"):
            QuickstartConfig(data_budget=bad)


def test_measuring_clock_counts_outermost_measurements_once(tmp_path):
    from specdraft.tuning import measured

    before = measured.measuring_seconds()
    measured._CLOCK.time(lambda: measured._CLOCK.time(lambda: {"x": 1.0}))
    inner = measured.measuring_seconds() - before
    assert 0 <= inner < 0.05  # nested: once, not twice
    measured.measured_figures("clock-test", {}, lambda: {"x": 1.0}, cache_dir=tmp_path)
    after = measured.measuring_seconds()
    measured.measured_figures("clock-test", {}, lambda: {"x": 1.0}, cache_dir=tmp_path)  # cached: nothing measured
    assert measured.measuring_seconds() == after


def test_the_pilots_one_off_measurements_are_left_out_of_the_rates_it_projects_with(tmp_path, monkeypatch):
    """A pilot stage that spent seconds measuring settings (cached for the later stages) projects without them: the
    prepare's engine probe is no fixed cost of later prepares, the extraction's thread probe no per-sample cost."""
    from types import SimpleNamespace

    from specdraft.hidden_states import extract
    from specdraft.quickstart import data
    from specdraft.train import budget
    from specdraft.tuning import measured

    def measuring(seconds: float) -> None:  # a stage that measured for this long (cached afterwards)
        measured._CLOCK.seconds += seconds

    def regenerate(path, minutes, samples):
        measuring(80.0)
        return {"kept": 30, "regenerated": 30, "read": 30, "seconds": 96.0, "generation_seconds": 12.0, "engine": "hf"}

    def extract_states(config, target):
        measuring(10.0)
        return SimpleNamespace(seconds=13.0, samples_extracted=30)

    def probe(config, target):
        measuring(4.0)
        return {"seconds_per_step": 0.2, "probe_seconds": 9.0}

    monkeypatch.setattr(extract, "extract_hidden_states", extract_states)
    monkeypatch.setattr(budget, "probe_training", probe)
    monkeypatch.setattr(budget, "epoch_steps", lambda config: 10)
    config = QuickstartConfig(out=str(tmp_path / "run"), engine="hf")
    facts = data.size_data(
        config, None, tmp_path, regenerate=regenerate, train_config=lambda **kw: kw, seconds_left=lambda: 900.0, reserve_s=300.0
    )
    rates = facts["rates"]
    assert rates["extract_s_per_sample"] == pytest.approx(3.0 / 30)  # 13 s less the 10 s thread probe, over 30 samples
    assert rates["overhead_s"] == pytest.approx(2 * (96.0 - 12.0 - 80.0) + 2 * (9.0 - 4.0))
    assert rates["train_s_per_sample_epoch"] == pytest.approx(0.2 * 10 / 30, abs=1e-4)  # the facts keep 4 decimals


def test_the_joined_datasets_regeneration_facts_add_up():
    pilot = {"engine": "hf", "engine_source": "measured", "generated_tokens": 100, "generation_seconds": 10.0, "regenerated": 4}
    more = {"engine": "hf", "engine_source": "cached", "threads": 2, "generated_tokens": 300, "generation_seconds": 20.0, "regenerated": 12}
    facts = _regeneration_facts([pilot, more])
    assert (facts["generated_tokens"], facts["regenerated"], facts["generated_tokens_per_second"]) == (400, 16, pytest.approx(13.33))
    assert (facts["engine_source"], facts["threads"]) == ("cached", 2)


@pytest.mark.slow
def test_quickstart_without_a_data_budget_measures_a_pilot_and_grows_the_data_from_it(tiny_llama_dir, tmp_path, capsys):
    from specdraft.cli.main import main
    from test_quickstart import TINY_RECIPE

    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(TINY_RECIPE)
    run = tmp_path / "run"
    argv = ["quickstart", "--out", str(run), "--target", str(tiny_llama_dir), "--recipe", str(recipe), "--samples", "12"]
    argv += ["--max-new-tokens", "8", "--regen-batch-size", "3", "--budget", "2", "--epochs", "2", "--eval-max-new-tokens", "6"]
    assert main([*argv, "--threads", "1", "--engine", "hf", "--served", "off"]) == 0
    journal = json.loads((run / "quickstart.json").read_text())
    stages = journal["stages"]
    split = stages["size-data"]
    assert split["pilot_prompts"] == 6 and split["rates"]["pilot_samples"] >= 2
    assert all(split["rates"][k] > 0 for k in ("regen_s_per_sample", "extract_s_per_sample", "train_s_per_sample_epoch"))
    # a tiny target regenerates fast: the split is bound by --samples, and the data joins the pilot and the rest
    assert split["bound_by"] == "samples" and split["new_samples"] == 6
    assert stages["prepare"]["kept"] > split["rates"]["pilot_samples"] and stages["prepare"]["generated_tokens"] > 0
    assert stages["extract"]["samples_extracted"] == stages["prepare"]["kept"]
    assert journal["wall_s"] < 2 * 60
    out = capsys.readouterr().out
    assert "quickstart data split (rates measured now, on the pilot):" in out and "| data split | 6 samples planned" in out
