"""Nothing lost, nothing silently wrong (issue 17, items 1-2): ownership before replacement,
no frozen target tensors in checkpoints, checksums on everything a run reads back, the store
verified before the first step. Tiny random targets; every case failed before its fix."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch
from safetensors.torch import load_file, save_file

from specdraft.cli.main import main
from specdraft.errors import SpecdraftError
from specdraft.models.common import checkpoint as drafter_ckpt
from specdraft.models.common.drafter import load_drafter
from specdraft.train import checkpoint_files as ckpt
from specdraft.train.trainer import train
from test_data_prepare import SHAREGPT_ROW
from test_train_methods import config as train_config
from test_train_methods import stores  # noqa: F401  (module fixture)

FROZEN = ("embed_tokens.", "verifier_lm_head.", "verifier_norm.")


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _flip_byte(path: Path) -> None:
    """Flip one bit in the middle of a safetensors file (tensor data, past the header)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ----- 1. ownership before replacement ---------------------------------------------------------


def test_prepare_into_a_directory_with_other_files_refuses_and_keeps_them(tmp_path, tiny_llama_dir, capsys):
    work = tmp_path / "work"
    work.mkdir()
    data = _jsonl(work / "good.jsonl", [SHAREGPT_ROW])
    (work / "notes.txt").write_text("mine")
    before = _tree(work)
    assert main(["prepare", "--data", str(data), "--out", str(work), "--target", str(tiny_llama_dir)]) == 2
    err = capsys.readouterr().err
    assert str(work) in err and "good.jsonl" in err and "notes.txt" in err
    assert _tree(work) == before  # the input and the other file are still there, unchanged
    # its own output is replaced on a rerun
    out = work / "ds"
    for _ in range(2):
        assert main(["prepare", "--data", str(data), "--out", str(out), "--target", str(tiny_llama_dir)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["data.parquet", "manifest.json", "token_counts.safetensors"]
    # an input inside the dataset it would replace (there under a name the dataset owns) is never deleted
    inside = out / ".work"
    inside.mkdir()
    _jsonl(inside / "more.jsonl", [SHAREGPT_ROW])
    assert main(["prepare", "--data", str(inside / "more.jsonl"), "--out", str(out), "--target", str(tiny_llama_dir)]) == 2
    assert "lies inside" in capsys.readouterr().err and (inside / "more.jsonl").is_file()


def test_a_directory_that_only_looks_like_a_dataset_is_not_replaced(tmp_path, tiny_llama_dir, capsys):
    out = tmp_path / "ds"
    out.mkdir()
    (out / "manifest.json").write_text('{"format": "something else"}')
    data = _jsonl(tmp_path / "good.jsonl", [SHAREGPT_ROW])
    assert main(["prepare", "--data", str(data), "--out", str(out), "--target", str(tiny_llama_dir)]) == 2
    assert "is not a prepared dataset" in capsys.readouterr().err
    assert (out / "manifest.json").read_text() == '{"format": "something else"}'


@pytest.fixture(scope="module")
def run(stores, tmp_path_factory):
    """A 4-step DSpark run on the tiny target with checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("integrity") / "run"
    target, store = stores[0], stores[1]["dspark"]
    result = train(train_config("dspark", store, out), target=target)
    assert result.completed
    return target, store, out


def test_calibrate_refuses_foreign_directories_and_training_checkpoints(run, tmp_path):
    from specdraft.train.calibrate import CalibrateConfig, calibrate

    target, store, out = run
    final = tmp_path / "final"
    shutil.copytree(out / "final", final)
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("years of work")
    with pytest.raises(SpecdraftError, match=r"mine already exists and holds entries a drafter checkpoint does not \(thesis.tex\)"):
        calibrate(CalibrateConfig(drafter=str(final), data=str(store), out=str(foreign), val_fraction=0.5), target=target, progress=False)
    assert (foreign / "thesis.tex").read_text() == "years of work"
    # a training checkpoint (trainer state beside the drafter) is not calibrated in place
    step = tmp_path / "step-2"
    shutil.copytree(out / "checkpoints/step-2", step)
    with pytest.raises(SpecdraftError, match="trainer_state.json, trainer_state.safetensors"):
        calibrate(CalibrateConfig(drafter=str(step), data=str(store), val_fraction=0.5), target=target, progress=False)
    assert (step / ckpt.STATE_TENSORS).is_file()
    # a drafter checkpoint is rewritten in place, again and again
    for _ in range(2):
        calibrate(CalibrateConfig(drafter=str(final), data=str(store), val_fraction=0.5), target=target, progress=False)
    # the training run's card is carried over
    assert sorted(p.name for p in final.iterdir()) == ["MODEL_CARD.md", "calibration.json", "config.json", "model.safetensors"]
    assert load_drafter(final, target=target).config.confidence_temperatures


def test_a_rerun_refuses_a_final_directory_with_other_files(run, tmp_path):
    target, store, reference = run
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    (out / "final" / "notes.txt").write_text("mine")
    with pytest.raises(SpecdraftError, match=r"final already exists and holds entries a drafter checkpoint does not \(notes.txt\)"):
        train(train_config("dspark", store, out), target=target)
    assert (out / "final" / "notes.txt").read_text() == "mine"


# ----- 2. frozen target tensors --------------------------------------------------------------


def _rewrite_state(step_dir: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Replace a checkpoint's trainer-state tensors as a writer would (checksums recorded afresh)."""
    save_file(tensors, str(step_dir / ckpt.STATE_TENSORS))
    state = json.loads((step_dir / ckpt.STATE_JSON).read_text())
    state["checksums"][ckpt.STATE_TENSORS] = hashlib.sha256((step_dir / ckpt.STATE_TENSORS).read_bytes()).hexdigest()
    rest = {k: v for k, v in state.items() if k != "content_sha256"}
    state["content_sha256"] = hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()
    (step_dir / ckpt.STATE_JSON).write_text(json.dumps(state))


def test_checkpoints_hold_no_frozen_target_tensors_and_a_resume_keeps_the_targets(run, tmp_path):
    target, store, reference = run
    state = load_file(str(reference / "checkpoints/step-2" / ckpt.STATE_TENSORS))
    frozen = [k for k in state if k.removeprefix("model.drafter.").startswith(FROZEN)]
    assert not frozen, f"trainer state carries frozen target tensors: {frozen}"
    # a checkpoint that does carry them (as older ones did), with wrong values: the resume ignores them
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    for name in ("checkpoints/step-4", "final"):
        shutil.rmtree(out / name)
    head = target.model.get_output_embeddings().weight
    _rewrite_state(out / "checkpoints/step-2", {**state, "model.drafter.verifier_lm_head.weight": torch.zeros_like(head)})
    resumed = train(train_config("dspark", store, out), target=target)
    assert resumed.completed
    assert torch.equal(resumed.drafter.verifier_lm_head.weight, head.to(resumed.drafter.verifier_lm_head.weight.dtype))
    final, ref = load_file(str(out / "final/model.safetensors")), load_file(str(reference / "final/model.safetensors"))
    assert final.keys() == ref.keys() and all(torch.equal(final[k], ref[k]) for k in ref)


# ----- checksums on everything a run reads back ----------------------------------------------


def test_a_flipped_byte_in_the_trainer_state_stops_the_resume(run, tmp_path):
    target, store, reference = run
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    for name in ("checkpoints/step-4", "final"):
        shutil.rmtree(out / name)
    _flip_byte(out / "checkpoints/step-2" / ckpt.STATE_TENSORS)
    with pytest.raises(SpecdraftError, match=r"step-2/trainer_state.safetensors is corrupt"):
        train(train_config("dspark", store, out), target=target)
    state = out / "checkpoints/step-2" / ckpt.STATE_JSON
    state.write_text(state.read_text().replace('"step": 2', '"step": 3'))
    with pytest.raises(SpecdraftError, match="trainer_state.json is corrupt"):
        ckpt.read_state(out / "checkpoints/step-2")


def test_a_flipped_byte_in_a_final_drafter_is_refused(run, tmp_path, monkeypatch):
    target, _, reference = run
    final = tmp_path / "final"
    shutil.copytree(reference / "final", final)
    _flip_byte(final / "model.safetensors")
    with pytest.raises(SpecdraftError, match=r"final/model.safetensors is corrupt: its sha256"):
        load_drafter(final, target=target)
    # a specdraft config without the checksum is refused too, with the fix in the message
    shutil.copy(reference / "final/model.safetensors", final / "model.safetensors")
    config = json.loads((final / "config.json").read_text())
    del config["specdraft"]["checksums"]
    (final / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecdraftError, match='records no checksum of model.safetensors.*add "checksums"'):
        load_drafter(final, target=target)
    # an intact one is hashed and parsed once
    shutil.copy(reference / "final/config.json", final / "config.json")
    calls = []
    for module, name in ((drafter_ckpt, "sha256_file"), (safetensors.torch, "load_file")):
        monkeypatch.setattr(
            module,
            name,
            lambda *a, _f=getattr(module, name), _n=name, **k: (  # noqa: B008  (binds the original now)
                calls.append(_n) or _f(*a, **k)
            ),
        )
    load_drafter(final, target=target)
    assert sorted(calls) == ["load_file", "sha256_file"]


# ----- the store, verified before the first step ---------------------------------------------


def _bad_store(store: Path, tmp_path: Path, damage) -> tuple[Path, Path]:
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    victim = sorted(copy.glob("*.safetensors"))[3]
    damage(victim)
    return copy, victim


@pytest.mark.parametrize(
    "damage, verify, message",
    [
        (lambda p: p.write_bytes(p.read_bytes()[:-64]), "quick", "is truncated or damaged"),
        (lambda p: p.unlink(), "quick", "is listed in the store manifest but missing"),
        (_flip_byte, "full", "checksum"),
    ],
    ids=["truncated", "deleted", "flipped"],
)
def test_a_bad_store_sample_stops_training_before_the_first_step(run, tmp_path, damage, verify, message):
    target, store, _ = run
    bad, victim = _bad_store(store, tmp_path, damage)
    out = tmp_path / "run"
    with pytest.raises(SpecdraftError, match=message) as info:
        train(train_config("dspark", bad, out, **({"verify": verify} if verify != "quick" else {})), target=target)
    assert victim.name in str(info.value) or repr(victim.name.removesuffix(".safetensors").replace("%2F", "/")) in str(info.value)
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()
