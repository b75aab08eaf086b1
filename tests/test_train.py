"""Trainer behaviour with the toy drafter (tests/test_train_toy.py): exact resume, signals, bad input, DDP."""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specdraft.errors import SpecdraftError
from specdraft.hidden_states.layers import LayerSlot
from specdraft.train import checkpoint_files as ckpt
from specdraft.train.config import TrainConfig, resolve_config
from specdraft.train.metrics import expected_accept_length, lr_factor
from specdraft.train.trainer import train
from test_train_toy import SignalAfterReads, ToyStore, ToyTarget, toy_config

TESTS = Path(__file__).parent


def weights(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "model.safetensors"))


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), f"{k} differs between {a} and {b}"


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def train_records(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["split"] == "train"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted 12-step toy run."""
    out = tmp_path_factory.mktemp("ref")
    result = train(toy_config(out), target=ToyTarget(), dataset=ToyStore())
    assert result.completed and result.step == 12 and result.final == out / "final"
    return out


def test_resume_after_signal_is_bitwise_equal(reference, tmp_path):
    out = tmp_path / "run"
    first = train(toy_config(out), target=ToyTarget(), dataset=SignalAfterReads(ToyStore(), 30))
    assert first.stopped_by == "signal" and 0 < first.step < 12 and first.final is None
    assert ckpt.latest_checkpoint(out) == out / "checkpoints" / f"step-{first.step}"
    assert not (out / "final").exists()
    second = train(toy_config(out), target=ToyTarget(), dataset=ToyStore())
    assert second.completed and second.step == 12
    assert_same_weights(reference / "final", out / "final")
    ref_state = load_file(str(reference / "checkpoints/step-12" / ckpt.STATE_TENSORS))
    state = load_file(str(out / "checkpoints/step-12" / ckpt.STATE_TENSORS))
    assert ref_state.keys() == state.keys() and all(torch.equal(ref_state[k], state[k]) for k in state)
    assert [r["step"] for r in train_records(out)] == list(range(1, 13))  # no duplicate records after the resume
    assert [r["loss"] for r in train_records(out)] == [r["loss"] for r in train_records(reference)]


def test_resume_reuses_the_recorded_split(reference, tmp_path):
    """OUT/split.json fixes the validation side: a resume with other split settings trains on the same samples."""
    out = tmp_path / "run"
    first = train(toy_config(out), target=ToyTarget(), dataset=SignalAfterReads(ToyStore(), 30))
    assert first.stopped_by == "signal"
    recorded = json.loads((out / "split.json").read_text())
    assert recorded == json.loads((reference / "split.json").read_text())
    assert recorded["validation_ids"] and recorded["train_samples"] + recorded["validation_samples"] == len(ToyStore())
    second = train(toy_config(out, val_fraction=0.5, split_seed=9), target=ToyTarget(), dataset=ToyStore())
    assert second.completed and json.loads((out / "split.json").read_text())["hash"] == recorded["hash"]
    assert_same_weights(reference / "final", out / "final")


def test_resume_from_periodic_checkpoint_and_dry_run(reference, tmp_path):
    out = tmp_path / "run"
    dry = train(toy_config(out, dry_run=True), target=ToyTarget(), dataset=ToyStore())
    assert dry.step == 0 and (out / "checkpoints/step-0/config.json").is_file() and not (out / "final").exists()
    # a "kill" right after the step-8 checkpoint: later checkpoints and the final drafter never got written
    train(toy_config(out), target=ToyTarget(), dataset=ToyStore())
    for name in ("checkpoints/step-12", "final"):
        shutil.rmtree(out / name)
    resumed = train(toy_config(out), target=ToyTarget(), dataset=ToyStore())
    assert resumed.completed
    assert_same_weights(reference / "final", out / "final")
    again = train(toy_config(out), target=ToyTarget(), dataset=ToyStore())  # already done: nothing retrained
    assert again.completed and again.step == 12
    assert_same_weights(reference / "final", out / "final")


@pytest.mark.slow
def test_sigterm_subprocess_leaves_resumable_checkpoint(tmp_path):
    out = tmp_path / "run"
    cfg = toy_config(out, max_steps=100000, checkpoint_interval=0, eval_interval=0).to_dict()
    proc = subprocess.Popen(
        [sys.executable, str(TESTS / "test_train_toy.py"), json.dumps(cfg)],
        cwd=TESTS,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not ((out / "metrics.jsonl").is_file() and len((out / "metrics.jsonl").read_text().splitlines()) >= 3):
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the training subprocess never logged a step"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["stopped_by"] == "signal"
    stopped = summary["step"]
    assert ckpt.latest_checkpoint(out) == out / "checkpoints" / f"step-{stopped}"
    resumed = train(toy_config(out, max_steps=stopped + 2, checkpoint_interval=0, eval_interval=0), target=ToyTarget(), dataset=ToyStore())
    assert resumed.completed and resumed.step == stopped + 2
    assert [r["step"] for r in train_records(out)][-3:] == [stopped, stopped + 1, stopped + 2]


@pytest.mark.slow
def test_sigkill_subprocess_then_rerun_equals_uninterrupted(reference, tmp_path):
    """A hard kill (no chance to save) mid-run; the rerun resumes from the last periodic checkpoint."""
    out = tmp_path / "run"
    cfg = toy_config(out, max_steps=12, checkpoint_interval=3)
    proc = subprocess.Popen(
        [sys.executable, str(TESTS / "test_train_toy.py"), json.dumps(cfg.to_dict()), "", "0.05"],
        cwd=TESTS,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while len(ckpt.list_checkpoints(out)) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it could be killed"
            time.sleep(0.05)
        proc.kill()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    killed_at = ckpt.list_checkpoints(out)[-1][0]
    assert 0 < killed_at < 12 and not (out / "final").exists()
    result = train(toy_config(out, max_steps=12, checkpoint_interval=3), target=ToyTarget(), dataset=ToyStore())
    assert result.completed and not list((out / "checkpoints").glob(".*"))  # debris of the killed write is gone
    # the reference checkpoints every 4 steps, this run every 3: checkpointing must not change the result
    assert_same_weights(reference / "final", out / "final")


def test_keep_checkpoints_prunes_old_ones(tmp_path):
    train(toy_config(tmp_path, max_steps=8, checkpoint_interval=2, keep_checkpoints=2), target=ToyTarget(), dataset=ToyStore())
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [6, 8]


def test_other_target_store_is_refused(tmp_path):
    with pytest.raises(SpecdraftError, match=r"extracted from target .*fingerprint"):
        train(toy_config(tmp_path / "run"), target=ToyTarget(), dataset=ToyStore(fingerprint="someoneelse"))
    assert not (tmp_path / "run").exists()


def test_store_with_wrong_layers_is_refused(tmp_path):
    store = ToyStore(slots=[LayerSlot(2, "input"), LayerSlot(4, "input")])
    with pytest.raises(SpecdraftError, match=r"holds layers \[input:2, input:4\] but this method reads \[output:1, output:4\]"):
        train(toy_config(tmp_path / "run"), target=ToyTarget(), dataset=store)
    assert not (tmp_path / "run").exists()


def test_data_dir_without_hidden_states_is_refused(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("not a store")
    with pytest.raises(SpecdraftError, match="is not a hidden-state store"):
        train(toy_config(tmp_path / "run", data=str(empty)), target=ToyTarget())
    with pytest.raises(SpecdraftError, match="does not exist"):
        train(toy_config(tmp_path / "run", data=str(tmp_path / "missing")), target=ToyTarget())
    assert not (tmp_path / "run").exists()


def test_incompatible_resume_is_refused_and_nothing_overwritten(tmp_path):
    out = tmp_path / "run"
    train(toy_config(out, max_steps=4), target=ToyTarget(), dataset=ToyStore())
    before = tree_digest(out)
    with pytest.raises(SpecdraftError, match=r"cannot resume .*model_config changed.*new --out"):
        train(toy_config(out, max_steps=4, model={"hidden": 32}), target=ToyTarget(), dataset=ToyStore())
    other = ToyTarget(fingerprint="toyfp0002")
    with pytest.raises(SpecdraftError, match=r"target_fingerprint changed"):
        train(toy_config(out, max_steps=8), target=other, dataset=ToyStore(fingerprint="toyfp0002"))
    assert tree_digest(out) == before


def test_plan_is_worked_out_without_side_effects(reference, tmp_path):
    """``plan_run`` needs no process group and writes nothing: a fresh OUT plans a fresh run, a finished
    one plans its resume (identity as checkpointed), and a changed model config is refused naming the checkpoint."""
    from specdraft.models.base import METHODS
    from specdraft.train.plan import build_method_config, plan_run

    spec = METHODS.get("toy")

    def plan(cfg):
        model_cfg = build_method_config(spec, cfg.model)
        drafter = spec.build(model_cfg, ToyTarget())
        return plan_run(cfg, spec=spec, model_cfg=model_cfg, drafter=drafter, target=ToyTarget(), dataset=ToyStore(), rank=0, world=1)

    before = tree_digest(reference)
    fresh = plan(toy_config(tmp_path / "new"))
    assert fresh.resume is None and fresh.total_steps == 12 and fresh.slot_index is None and not (tmp_path / "new").exists()
    resumed = plan(toy_config(reference))
    assert resumed.resume.step == 12 and resumed.resume.directory == reference / "checkpoints/step-12"
    assert resumed.identity == ckpt.read_state(reference / "checkpoints/step-12")["identity"]
    with pytest.raises(SpecdraftError, match=r"cannot resume from .*step-12: the run's model_config changed"):
        plan(toy_config(reference, model={"hidden": 32}))
    assert tree_digest(reference) == before and not torch.distributed.is_initialized()


def test_train_step_without_optimizer_leaves_the_parameters(tmp_path):
    """The probes' unit of work (``train_step`` without an optimizer) changes nothing; with one it updates."""
    from specdraft.train.step import StepModule, build_optimizer, synthetic_batch, train_step
    from test_train_toy import ToyConfig, ToyDrafter

    module = StepModule(ToyDrafter(ToyConfig(), 2, 8)).train()
    batch = synthetic_batch(rows=2, tokens=16, slots=2, hidden=8, vocab=64)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    probe = train_step(module, batch, dtype="fp32", device=torch.device("cpu"), grad_clip=1.0)
    assert probe.grad_norm is not None and all(p.grad is None for p in module.parameters())
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    optimizer = build_optimizer(module, name="adamw", lr=1e-2, betas=(0.9, 0.99), weight_decay=0.0, device=torch.device("cpu"))
    train_step(module, batch, dtype="fp32", device=torch.device("cpu"), optimizer=optimizer)
    assert not torch.equal(before["drafter.fc.weight"], module.state_dict()["drafter.fc.weight"])


def test_foreign_out_dir_and_bad_model_override(tmp_path):
    (tmp_path / "mine.txt").write_text("precious")
    with pytest.raises(SpecdraftError, match="not a specdraft training run"):
        train(toy_config(tmp_path), target=ToyTarget(), dataset=ToyStore())
    with pytest.raises(SpecdraftError, match=r"invalid --model override.*valid keys: hidden, positions, dropout"):
        train(toy_config(tmp_path / "x", model={"hiddn": 3}), target=ToyTarget(), dataset=ToyStore())


def test_max_time_stops_with_checkpoint_and_final(tmp_path):
    result = train(toy_config(tmp_path, max_time=1e-9, max_steps=50), target=ToyTarget(), dataset=ToyStore())
    assert result.stopped_by == "max_time" and result.step == 1 and not result.completed
    assert (tmp_path / "checkpoints/step-1").is_dir() and (tmp_path / "final/model.safetensors").is_file()


def test_lr_schedule_shape(reference):
    total, warm = 100, 4
    f = [lr_factor(s, total_steps=total, warmup_steps=warm) for s in range(total)]
    assert f[:warm] == [0.25, 0.5, 0.75, 1.0] and f[warm] == 1.0
    assert all(a >= b for a, b in zip(f[warm:], f[warm + 1 :])) and f[-1] < 1e-3
    assert lr_factor(52, total_steps=total, warmup_steps=warm) == pytest.approx(0.5)
    assert lr_factor(total, total_steps=total, warmup_steps=warm, min_ratio=0.1) == pytest.approx(0.1)
    # the run logs the lr each step used: warm-up of round(0.04 * 12) = 0 -> 1 step, then cosine over 12
    lrs = [r["lr"] for r in train_records(reference)]
    expected = [6e-4 * lr_factor(s, total_steps=12, warmup_steps=1) for s in range(12)]
    assert lrs == pytest.approx(expected, rel=1e-12)


def test_metrics_and_expected_accept_length(reference):
    assert expected_accept_length([1.0, 1.0, 1.0]) == 4.0
    assert expected_accept_length([0.5, 0.5]) == pytest.approx(1.75)
    assert expected_accept_length([0.0, 1.0]) == 1.0
    rec = train_records(reference)[0]
    assert {"loss", "ce", "lr", "tokens_per_s", "position_acc", "position_cond_acc", "accept_len", "grad_norm"} <= rec.keys()
    assert rec["accept_len"] == pytest.approx(expected_accept_length(rec["position_cond_acc"]), abs=1e-5)
    val = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines() if '"val"' in line]
    assert [r["step"] for r in val] == [5, 10, 12]


def test_recipe_then_cli_overrides(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("method: dspark\nlr: 6e-4\nmax_steps: 10\nmodel:\n  block_size: 7\n  num_layers: 2\n")
    cfg = resolve_config(recipe, {"max_steps": 3, "model": "num_layers=1,markov_rank=16"})
    assert cfg.lr == 6e-4 and cfg.max_steps == 3 and cfg.method == "dspark"
    assert cfg.model == {"block_size": 7, "num_layers": 1, "markov_rank": 16}
    recipe.write_text("methd: dspark\n")
    with pytest.raises(SpecdraftError, match=r"unknown field\(s\) methd"):
        resolve_config(recipe, {})
    with pytest.raises(SpecdraftError, match="--out is required"):
        TrainConfig(method="x").require("method", "out")


def test_resolved_config_is_written(reference):
    import yaml

    resolved = yaml.safe_load((reference / "config.resolved.yaml").read_text())
    assert resolved["model"] == {"hidden": 16, "positions": 3, "dropout": 0.1} and resolved["lr"] == 6e-4
    assert resolve_config(reference / "config.resolved.yaml", {}).max_steps == 12  # a resolved config is itself a recipe


def test_cli_reports_bad_data_dir(tmp_path, capsys):
    from specdraft.cli.main import main

    rc = main(["train", "--method", "toy", "--data", str(tmp_path / "nope"), "--out", str(tmp_path / "run")])
    assert rc == 2 and "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def torchrun_toy(cfg: dict, side_dir: Path) -> None:
    from torchrun import torchrun

    torchrun(TESTS / "test_train_toy.py", json.dumps(cfg), str(side_dir), timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_gloo_processes_disjoint_data_rank0_writes_exact_resume(parallel, tmp_path):
    out = tmp_path / "run"
    cfg = toy_config(out, max_steps=4, checkpoint_interval=2, batch_rows=1, parallel=parallel).to_dict()
    torchrun_toy(cfg, tmp_path)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-4"]
    state = json.loads((out / "checkpoints/step-4/trainer_state.json").read_text())
    assert state["world_size"] == 2
    seen = [set(json.loads((tmp_path / f"seen-{r}.json").read_text())) for r in range(2)]
    assert seen[0] and seen[1] and not seen[0] & seen[1]
    # the DDP wrapper (in reference cycles) is collected before its process group goes, not at exit (an abort)
    assert [json.loads((tmp_path / f"wrappers-{r}.json").read_text()) for r in range(2)] == [0, 0]
    assert not list(out.glob(".*")) and not list((out / "checkpoints").glob(".*"))  # no temporary debris
    assert [r["step"] for r in train_records(out)] == [1, 2, 3, 4]  # one writer (rank 0)

    # lose everything after step 2, rerun: the 2-process resume reproduces the weights bit for bit
    shutil.copytree(out / "final", tmp_path / "first-final")
    shutil.rmtree(out / "final")
    shutil.rmtree(out / "checkpoints/step-4")
    torchrun_toy(cfg, tmp_path)
    assert_same_weights(tmp_path / "first-final", out / "final")


@pytest.mark.parametrize("recipe", ["dspark", "dflash", "dflash2", "eagle3"])
def test_packaged_recipes_resolve_against_their_method(recipe):
    import specdraft.models  # noqa: F401  (registers the methods)
    from specdraft.models.base import METHODS
    from specdraft.train.config import recipe_path

    assert recipe_path(recipe).parent.name == "recipes"
    cfg = resolve_config(recipe, {})
    assert cfg.method == recipe and cfg.target is None  # the store's target, never a pinned one
    METHODS.get(cfg.method).config_cls(**cfg.model)  # every override is a field of the method config


def test_unknown_recipe_names_the_packaged_ones():
    with pytest.raises(SpecdraftError, match="neither a packaged recipe .*dflash, dflash2, dspark, eagle3"):
        resolve_config("no-such-recipe", {})
