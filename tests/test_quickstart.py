"""`specdraft quickstart` end to end on a tiny random target (the real target runs in scripts/main.sh)."""

from __future__ import annotations

import json

import pytest

from specdraft.cli.main import main
from specdraft.errors import SpecdraftError
from specdraft.quickstart import QuickstartConfig

TINY_RECIPE = """\
method: dspark
model: {num_layers: 1, block_size: 4, markov_rank: 16, max_anchors: 8, intermediate_size: 64}
pack_tokens: 256
val_fraction: 0.3
eval_interval: 1
checkpoint_interval: 0
dtype: fp32
"""


@pytest.mark.slow
def test_quickstart_runs_every_stage_and_resumes(tiny_llama_dir, tmp_path, capsys):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(TINY_RECIPE)
    run = tmp_path / "run"
    argv = [
        "quickstart",
        "--out",
        str(run),
        "--target",
        str(tiny_llama_dir),
        "--recipe",
        str(recipe),
        "--samples",
        "6",
        "--max-new-tokens",
        "8",
        "--regen-batch-size",
        "6",
        "--budget",
        "1.5",
        "--data-budget",
        "0.3",
        "--epochs",
        "2",
        "--eval-max-new-tokens",
        "6",
        "--threads",
        "1",
        "--engine",
        "hf",
        "--served",
        "off",
    ]
    assert main(argv) == 0
    journal = json.loads((run / "quickstart.json").read_text())
    stages = journal["stages"]
    assert set(stages) == {"prepare", "extract", "size-eval", "size-training", "train", "calibrate", "eval"}
    assert all(s["status"] == "done" for s in stages.values())
    # the comparison's reserve is measured (no --eval-reserve), bounds what the comparison took, and is what training was left
    reserve = stages["size-eval"]
    assert set(reserve["round_ms"]) == {"autoregressive", "ngram", "suffix", "drafter@full", "drafter@scheduled", "drafter+suffix"}
    assert stages["eval"]["seconds"] + stages["calibrate"]["seconds"] < reserve["reserve_s"] < 60
    # two passes over ~4 training samples take fewer steps than the time budget would allow: the epochs cap binds
    sized = stages["size-training"]
    assert stages["train"]["steps"] == sized["steps"] == sized["epoch_steps"] < sized["train_seconds"] / sized["seconds_per_step"]
    assert stages["prepare"]["kept"] == 6 and stages["prepare"]["generated_tokens"] > 0
    assert stages["extract"]["samples_extracted"] == 6
    # validation runs once, at the end, whatever the recipe's eval_interval: its decoding is not in the step plan
    records = [json.loads(line) for line in (run / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("split") == "val"] == [stages["train"]["steps"]]
    assert len(json.loads((run / "train" / "final" / "config.json").read_text())["specdraft"]["config"]["confidence_temperatures"]) == 4
    report = json.loads((run / "eval" / "report.json").read_text())
    labels = {r["drafter"] for r in report["runs"]}
    assert labels == {"autoregressive", "ngram", "suffix", "dspark:final", "dspark:final@scheduled", "dspark+suffix:final"}
    assert all(r["identical_to_autoregressive"] == report["num_prompts"] for r in report["runs"])
    assert (run / "eval" / "tau_per_domain.png").is_file()
    out = capsys.readouterr().out
    assert "| dspark:final@scheduled | 1 |" in out and "report:" in out
    assert "| compute dtype | fp32 |" in out and f"| steps | {sized['steps']} done of {sized['steps']} planned" in out

    # A rerun skips every finished stage and only redoes the comparison.
    assert main(argv) == 0
    out = capsys.readouterr().out
    for stage in ("prepare", "extract", "size-eval", "size-training", "train", "calibrate"):
        assert f"[quickstart] {stage}: done earlier, skipped" in out


def test_quickstart_config_errors():
    with pytest.raises(
        SpecdraftError, match="--budget 5 min is too small for a run: it must hold --data-budget 5 min, --eval-reserve 6 min"
    ):
        QuickstartConfig(budget=5, data_budget=5, eval_reserve=6)
    with pytest.raises(SpecdraftError, match=r"it must hold --eval-reserve 6 min and at least .*, or a smaller --eval-reserve$"):
        QuickstartConfig(budget=5, eval_reserve=6)  # no --data-budget: the split gives data what the rest leaves
    with pytest.raises(SpecdraftError, match=r"--eval-reserve 9.5 min and at least 0.25 min of training; pass --budget 14.75 or more"):
        QuickstartConfig(budget=12, data_budget=5, eval_reserve=9.5)
    with pytest.raises(SpecdraftError, match=r"--eval-reserve 9.5 min and at least 0.25 min of training; pass --budget 9.75 or more"):
        QuickstartConfig(budget=9, eval_reserve=9.5)  # the measured split's data stage has no least minutes to hold
    QuickstartConfig(budget=12)  # the default reserve is measured when the run gets there
    with pytest.raises(SpecdraftError, match="--data-budget must be > 0 minutes .*, got -1"):
        QuickstartConfig(data_budget=-1)
    with pytest.raises(SpecdraftError, match="--epochs must be >= 1"):
        QuickstartConfig(epochs=0)
    with pytest.raises(SpecdraftError, match="--samples must be >= 1"):
        QuickstartConfig(samples=0)


def test_quickstart_compares_the_reference_drafter_when_one_ships(tmp_path):
    from specdraft.quickstart.comparison import eval_drafters

    final = tmp_path / "final"
    assert eval_drafters(QuickstartConfig(), final) == [
        "ngram",
        "suffix",
        str(final),
        f"{final}@scheduled",
        f"{final}+suffix",
        "reference@full",
        "reference@scheduled",
    ]
    assert eval_drafters(QuickstartConfig(compare_reference=False), final) == [
        "ngram",
        "suffix",
        str(final),
        f"{final}@scheduled",
        f"{final}+suffix",
    ]
    assert eval_drafters(QuickstartConfig(target=str(tmp_path)), final) == [
        "ngram",
        "suffix",
        str(final),
        f"{final}@scheduled",
        f"{final}+suffix",
    ]


def test_training_cut_by_the_time_budget_counts_as_done_but_a_signal_does_not(tmp_path):
    from specdraft.quickstart.stages import _train_facts
    from specdraft.train.trainer import TrainResult

    cut = _train_facts(TrainResult(tmp_path, 40, 100, False, "max_time", tmp_path / "final", None))
    assert cut == {"steps": 40, "final": str(tmp_path / "final"), "stopped_by_time_budget": True}
    assert _train_facts(TrainResult(tmp_path, 100, 100, True, None, tmp_path / "final", None))["stopped_by_time_budget"] is False
    with pytest.raises(SpecdraftError, match="stopped early \\(signal\\) at step 40"):
        _train_facts(TrainResult(tmp_path, 40, 100, False, "signal", None, None))


def test_final_table_states_dtype_speed_steps_epochs_and_data():
    from specdraft.quickstart.report import training_table

    stages = {
        "prepare": {
            "kept": 400,
            "tokens": 123456,
            "loss_tokens": 51000,
            "engine": "vllm",
            "engine_source": "measured",
            "engine_figures": {"hf_tokens_per_s": 8.0, "vllm_tokens_per_s": 48.0, "vllm_start_s": 97.0},
            "generated_tokens": 9000,
            "generated_tokens_per_second": 47.5,
        },
        "size-training": {
            "steps": 120,
            "seconds_per_step": 0.41,
            "steps_per_epoch": 50,
            "dtype": "fp32",
            "anchors_per_s": 60.0,
            "dtype_probe": {"choice": "fp32", "seconds": {"fp32": 0.412, "bf16": 5.31}, "cached": False},
        },
        "train": {
            "steps": 120,
            "dtype": "fp32",
            "anchors_per_s": 61.25,
            "stopped_by_time_budget": False,
            "threads": 1,
            "threads_source": "measured",
            "threads_seconds": {"1": 0.4, "2": 0.9},
        },
    }
    table = training_table(stages)
    assert "| CPU threads | 1 (measured: 1 400 ms, 2 900 ms) |" in table
    assert "| regeneration | vllm (measured: hf 8.0, vllm 48.0 tokens/s predicted + 97 s start); 9,000 tokens at 47.5 tokens/s |" in table
    assert "| compute dtype | fp32 (step probe: fp32 0.412 s, bf16 5.310 s) |" in table
    assert "| anchors/s | 61.2 |" in table and "| steps | 120 done of 120 planned" in table
    assert "| epochs | 2.40 (50 steps each) |" in table and "| data | 400 samples, 123,456 tokens (51,000 response tokens) |" in table
    assert "note" not in table
    stages["train"].update(steps=80, stopped_by_time_budget=True)
    assert "stopped training at step 80 of 120; raise --budget" in training_table(stages)


def test_a_slow_step_gets_a_smaller_complete_plan(tmp_path, monkeypatch):
    """The plan is what the probe's step time allows (after the probe's own time), with no floor that the
    budget cannot pay for; when not even one step fits, it says so."""
    from specdraft.quickstart.report import training_table
    from specdraft.train import budget
    from specdraft.train.trainer import TrainResult
    from test_train_toy import toy_config

    def fake_train(cfg, target=None):
        path = budget.Path(cfg.out)
        path.mkdir(parents=True)
        lines = [{"split": "train", "step": i + 1, "seconds": seconds, "anchors_per_s": 50.0} for i in range(4)]
        (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        return TrainResult(
            path,
            4,
            4,
            True,
            None,
            None,
            None,
            compute_dtype="fp32",
            dtype_probe={"choice": "fp32", "seconds": {"fp32": seconds, "bf16": 13 * seconds}},
        )

    monkeypatch.setattr("specdraft.train.trainer.train", fake_train)
    monkeypatch.setattr(budget, "epoch_steps", lambda cfg: 1000 * cfg.epochs)
    cfg = toy_config(tmp_path / "run")
    seconds = 2.0
    fast = budget.steps_for_budget(cfg, 101.0)
    assert fast["steps"] == 45 and fast["dtype"] == "fp32" and fast["anchors_per_s"] == 50.0  # 0.9 * (101 s - the probe's) / 2 s
    seconds = 20.0
    assert budget.steps_for_budget(cfg, 101.0)["steps"] == 4  # fewer steps, no floor of 8 that would be cut at step 4
    seconds = 200.0
    short = budget.steps_for_budget(cfg, 101.0)  # not even one step fits: one, and the table says what to change
    assert short["steps"] == 1 and short["budget_short"]
    assert "less than one 200.0 s step: raise --budget" in training_table({"size-training": short, "train": {"steps": 1}})


def test_a_slow_machine_reserves_more_for_the_comparison_and_trains_less(tiny_llama_dir, tmp_path, monkeypatch):
    """`size_eval` on the tiny target with injected target step times: the reserve follows the machine (a target
    forward 10x slower reserves ~10x more), so the training plan gets what is really left."""
    from specdraft.decode import sps as sps_module
    from specdraft.decode.proposers.drafters import DrafterProposer
    from specdraft.eval import budget
    from specdraft.quickstart.comparison import size_eval
    from specdraft.targets import load_target
    from specdraft.train.config import resolve_config

    target = load_target(str(tiny_llama_dir))
    config = QuickstartConfig(target=str(tiny_llama_dir), out=str(tmp_path), threads=1)
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(TINY_RECIPE)
    train_config = resolve_config(str(recipe), {"data": str(tmp_path), "out": str(tmp_path / "train")})
    monkeypatch.setattr(budget, "plain_overhead_seconds", lambda target, sps: 0.002)
    # the draft round injected too: measured, it grows with the machine's load and bends the ratio below
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))  # the draft probes time the injected round, not a cached one
    monkeypatch.setattr(DrafterProposer, "round_seconds", lambda self, dtype, **kw: 0.003)
    reserves = {}
    for step_s in (0.01, 0.1):
        monkeypatch.setattr(
            sps_module,
            "load_or_measure_sps",
            lambda model, fingerprint, forward_path=None, s=step_s: sps_module.SpsTable((1, 64), (1 / s, 1 / (4 * s))),
        )
        sized = size_eval(config, target, train_config, final=tmp_path / "final")
        assert set(sized["round_ms"]) == {
            "autoregressive",
            "ngram",
            "suffix",
            "drafter@full",
            "drafter@scheduled",
            "drafter+suffix",
        }  # no reference for a local target
        assert sized["round_ms"]["autoregressive"] == pytest.approx(1e3 * step_s + 2)
        assert sized["round_ms"]["drafter@full"] > sized["round_ms"]["ngram"] > sized["round_ms"]["autoregressive"]
        reserves[step_s] = sized["reserve_s"] - 30  # less the fixed margin for what the comparison's time limit does not cover
    assert 8 < reserves[0.1] / reserves[0.01] < 10.5


@pytest.mark.parametrize("recipe", ["dspark", "dflash", "dflash2", "eagle3"])
def test_every_packaged_recipe_gets_a_training_config(recipe, tiny_llama_dir, tmp_path):
    """``--recipe eagle3`` once failed at once: the quickstart gave it --max-anchors, a block drafter's setting that
    EAGLE-3's config refuses. Anchors go to the methods that draft blocks only."""
    from specdraft.quickstart.stages import _open_run

    run = _open_run(QuickstartConfig(target=str(tiny_llama_dir), out=str(tmp_path / "run"), recipe=recipe, max_anchors=5, threads=1))
    cfg = run.train_config()
    assert cfg.method == recipe
    assert cfg.model.get("max_anchors") == (None if recipe == "eagle3" else 5)
