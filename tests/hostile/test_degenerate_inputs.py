"""Inputs that left no data or no signal, or were of the wrong type (issue 37, mechanism 4): each is refused at the
boundary with an error naming what and where, or held to a counted warning; a run that learned nothing never
writes a final drafter.

Each test is built from the sweep's reproduction: a ``--config`` recipe with ``model: "block_size=3"``, ``prepare
--data D,D``, ``train --pack-tokens 1``, ``--val-fraction 0.2`` on 12 samples, NaN validation states whose checksums
were updated, and ``calibrate`` on held-out samples holding NaN.
"""

from __future__ import annotations

import enum
import json
import logging
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest
import torch
from test_integrity import run  # noqa: F401  (module fixture: a 4-step dspark run on ``stores``)

from specdraft.cli.main import main
from specdraft.errors import SpecdraftError
from specdraft.train.trainer import train
from test_data_prepare import SHAREGPT_ROW
from test_train_methods import config as train_config
from test_train_methods import stores  # noqa: F401  (module fixture)
from test_train_toy import ToyStore, ToyTarget, toy_config


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


# ----- YAML sub-configs are type-checked ---------------------------------------------------------------


@pytest.mark.parametrize(
    "text, message",
    [
        ('model: "block_size=3"\n', r"model must be a mapping \(key: value\), got 'block_size=3' \(str\)"),
        ("model: [1, 2]\n", r"model must be a mapping \(key: value\), got \[1, 2\] \(list\)"),
        ("method: dspark\nmodel:\n  block_size: three\n", r"model\.block_size must be an integer, got 'three' \(str\)"),
        ("method: dspark\nmodel:\n  confidence_temperatures: [1.0, x]\n", r"model\.confidence_temperatures must be a list of numbers"),
        ("method: dspark\nmodel:\n  blok_size: 3\n", r"unknown field\(s\) model\.blok_size; valid fields of model: .*block_size"),
        ("betas: 0.9\n", r"betas must be a list, got 0\.9 \(float\)"),
        ("pack_tokens: null\n", r"pack_tokens must be set \(not null\), got None"),
    ],
)
def test_recipe_sub_configs_are_type_checked_naming_file_key_type_and_value(tmp_path, capsys, text, message):
    """Was a ValueError / TypeError traceback from ``dict("block_size=3")`` or ``dict([1, 2])``."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(text)
    assert main(["train", "--config", str(recipe), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"config file {recipe}: " in err and "Traceback" not in err
    assert re.search(message, err), err
    assert not (tmp_path / "run").exists()


def test_model_flag_values_are_checked_against_the_method_config(tmp_path, capsys):
    assert main(["train", "--config", "dspark", "--model", "block_size=three", "--out", str(tmp_path / "run")]) == 2
    assert "--model: model.block_size must be an integer, got 'three' (str)" in capsys.readouterr().err


class _Color(enum.Enum):
    RED = "red"


@dataclass
class _Inner:
    mode: Literal["a", "b"] = "a"
    ids: list[int] = field(default_factory=list)


@dataclass
class _Outer:
    inner: _Inner = field(default_factory=_Inner)
    limit: int | None = None
    color: _Color = _Color.RED
    extra: dict[str, float] = field(default_factory=dict)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"inner": {"mode": "c"}}, "f.yaml: inner.mode must be one of 'a', 'b', got 'c' (str)"),
        ({"inner": {"ids": [1, "2"]}}, "f.yaml: inner.ids must be a list of integers, got [1, '2'] (list)"),
        ({"inner": {"nope": 1}}, "f.yaml: unknown field(s) inner.nope; valid fields of inner: ids, mode"),
        ({"inner": 3}, "f.yaml: inner must be a _Inner, got 3 (int)"),
        ({"limit": "5"}, "f.yaml: limit must be an integer, got '5' (str)"),
        ({"color": "blue"}, "f.yaml: color must be one of 'red', got 'blue' (str)"),
        ({"extra": {"a": "x"}}, "f.yaml: extra must be a mapping whose values are each a number, got {'a': 'x'} (dict)"),
    ],
)
def test_the_generic_check_walks_nested_dataclasses_lists_optionals_enums_and_literals(values, message):
    from specdraft.utils.config import check_fields

    check_fields(_Outer, {"inner": {"mode": "b", "ids": [1]}, "limit": None, "color": "red", "extra": {"a": 1}}, "f.yaml")
    with pytest.raises(SpecdraftError) as caught:
        check_fields(_Outer, values, "f.yaml")
    assert str(caught.value) == message


# ----- duplicated inputs -----------------------------------------------------------------------------------


def test_prepare_refuses_a_source_named_twice_however_spelled(tmp_path, capsys, monkeypatch):
    """``prepare --data D,D`` held every sample twice."""
    rows = tmp_path / "chats.jsonl"
    rows.write_text(json.dumps(SHAREGPT_ROW) + "\n")
    (tmp_path / "alias.jsonl").symlink_to(rows)
    monkeypatch.chdir(tmp_path)
    for data, named in [
        (f"{rows},{rows}", f"'{rows}' twice"),
        (f"{rows},./chats.jsonl", f"'./chats.jsonl' twice (as '{rows}')"),
        ("chats.jsonl,alias.jsonl", "'alias.jsonl' twice (as 'chats.jsonl')"),
        ("sharegpt,sharegpt", "'sharegpt' twice"),
    ]:
        assert main(["prepare", "--data", data, "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert f"names the source {named}: every sample would be held twice; name each source once" in err, err
    assert not (tmp_path / "out").exists()


# ----- rows too short to learn from; a run that learned nothing --------------------------------------------


@pytest.mark.parametrize("method, need", [("dspark", 5), ("eagle3", 3)])
def test_pack_tokens_below_one_block_is_refused_before_training(stores, tmp_path, method, need):
    """``train --pack-tokens 1`` trained on 0 anchors at loss 0.0 and wrote a "completed" drafter."""
    target, store = stores[0], stores[1]["eagle3" if method == "eagle3" else "dspark"]
    with pytest.raises(
        SpecdraftError,
        match=rf"--pack-tokens 1 is below the {need} tokens one {method} block spans .* never "
        rf"supervise draft position\(s\) 1-{need - 1}; use --pack-tokens {need} or more",
    ):
        train(train_config(method, store, tmp_path / "run", pack_tokens=1), target=target)
    assert not (tmp_path / "run" / "final").exists()


def test_prompts_longer_than_the_rows_are_refused_before_training(tmp_path):
    store = ToyStore(n=12)
    for item in store.items:  # the reply is the last token of each sample, past the 4 tokens a row reads of it
        item["loss_mask"][:] = False
        item["loss_mask"][-1] = True
    with pytest.raises(
        SpecdraftError,
        match=r"none of the 12 training samples has a response token within the first 4 tokens a row "
        r"reads of it \(--pack-tokens, --max-sample-tokens\)",
    ):
        train(toy_config(tmp_path / "run", pack_tokens=4, val_fraction=0.0), target=ToyTarget(), dataset=store)
    assert not (tmp_path / "run" / "final").exists()


def test_a_run_whose_steps_supervised_no_label_writes_no_final(tmp_path):
    """What the plan's checks cannot see: the one sample with a reply is never in a step that ran."""
    from specdraft.train.batches import DataPlan
    from specdraft.train.split import dataset_split

    store = ToyStore(n=24)
    cfg = toy_config(tmp_path / "run", max_steps=1, batch_rows=1, val_fraction=0.0, eval_interval=0, checkpoint_interval=0)
    split = dataset_split(store, val_fraction=0.0, seed=cfg.split_seed)
    plan = DataPlan.build(store.sample_ids, store.lengths(), split=split, pack_tokens=cfg.pack_tokens, batch_rows=1, seed=cfg.seed)
    first_step = {i for row in plan.train_rows(0) for i in row}
    keep = next(i for i in range(len(store)) if i not in first_step)
    for i, item in enumerate(store.items):
        if i != keep:
            item["loss_mask"][:] = False
    with pytest.raises(
        SpecdraftError,
        match=r"the 1 training step\(s\) supervised 0 labels \(metrics.jsonl\), so the drafter learned "
        r"nothing and final/ is not written",
    ):
        train(cfg, target=ToyTarget(), dataset=store)
    assert not (tmp_path / "run" / "final").exists()
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])["labels"] == 0


# ----- a validation split that draws nothing --------------------------------------------------------------


def _seed_drawing_nothing(keys, fraction: float) -> int:
    from specdraft.train.split import held_out

    return next(seed for seed in range(10_000) if not any(held_out(keys, fraction, seed)))


def test_a_val_fraction_that_draws_nothing_holds_out_the_closest_conversation_and_says_so(tmp_path, caplog):
    """``--val-fraction 0.2`` on 12 samples held out 0 with no word, and the card said "(val_fraction 0)"."""
    from specdraft.train.split import SPLIT_FILE, resolve_split, sample_keys

    store = ToyStore(n=12)
    seed = _seed_drawing_nothing(sample_keys(store), 0.2)
    cfg = toy_config(tmp_path / "run", val_fraction=0.2, split_seed=seed, max_steps=2, eval_interval=0, checkpoint_interval=0)
    with caplog.at_level(logging.WARNING, logger="specdraft.train.split"):
        result = train(cfg, target=ToyTarget(), dataset=store)
    assert result.completed
    assert "--val-fraction 0.2 drew none of the 12 conversation(s) (12 samples) for validation; holding out the 1 sample(s)" in caplog.text
    record = json.loads((tmp_path / "run" / SPLIT_FILE).read_text())
    assert record["validation_samples"] == 1 and record["held_out_closest"] and record["drawn_groups_kept_in_training"] == 0
    card = (tmp_path / "run" / "final" / "MODEL_CARD.md").read_text()
    assert "1 of 12 samples in 1 whole conversations, val_fraction 0.2, seed" in card and "the fraction drew none of them" in card
    assert "No validation ran" not in card and "| teacher_forced |" in card
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specdraft.train.split"):  # a resume recomputes the same split: no "data differ"
        again = resolve_split(store, val_fraction=0.2, seed=seed, recorded=tmp_path / "run" / SPLIT_FILE)
    assert again.val == [store.sample_ids.index(record["validation_ids"][0])] and "differ" not in caplog.text


def test_a_val_fraction_that_draws_nothing_of_one_linked_component_is_refused():
    from specdraft.train.split import SplitKey, compute_split

    keys = [SplitKey(f"g{i}", "the same prompt") for i in range(12)]  # linked into one component: nothing can be held out
    seed = _seed_drawing_nothing(keys, 0.2)
    with pytest.raises(
        SpecdraftError,
        match=r"--val-fraction 0.2 holds out none of the 12 samples \(12 conversation\(s\) linked by shared "
        r"prompts into 1 component\(s\).*or set --val-fraction 0 to train on all of them",
    ):
        compute_split([f"s{i}" for i in range(12)], keys, val_fraction=0.2, seed=seed)


# ----- NaN statistics -----------------------------------------------------------------------------------


def _poison(store: Path, sample_id: str, token: int) -> None:
    """NaN in one stored sample's hidden states, its checksums updated: the store still verifies."""
    from specdraft.hidden_states.backends.file import FileBackend
    from specdraft.hidden_states.dataset import HiddenStateDataset
    from specdraft.hidden_states.payload import tensor_sha256

    backend = FileBackend(store, create=False)
    payload = backend.get(sample_id)
    payload.hidden_states = payload.hidden_states.clone()
    payload.hidden_states[token] = float("nan")
    payload.manifest["tensors"]["hidden_states"]["sha256"] = tensor_sha256(payload.hidden_states)
    backend.put(sample_id, payload)
    HiddenStateDataset(store, verify="full")


def _nan_refused(store: Path, sample: str, token: int) -> str:
    return re.escape(
        f"{store}: sample '{sample}' holds non-finite values (NaN or inf) in its hidden_states at token {token}; the store verifies"
    )


def test_nan_validation_states_are_refused_naming_store_sample_and_tensor(stores, tmp_path):
    """NaN validation states gave a NaN validation loss, yet the card reported tau 1.000."""
    from specdraft.hidden_states.dataset import HiddenStateDataset
    from specdraft.train.split import dataset_split

    target, store = stores[0], tmp_path / "hs"
    shutil.copytree(stores[1]["dspark"], store)
    cfg = train_config("dspark", store, tmp_path / "run", max_steps=2, eval_interval=0, checkpoint_interval=0, decode_prompts=0)
    dataset = HiddenStateDataset(store)
    sample = dataset.sample_ids[dataset_split(dataset, val_fraction=cfg.val_fraction, seed=cfg.split_seed).val[0]]
    _poison(store, sample, token=2)
    with pytest.raises(SpecdraftError, match=_nan_refused(store, sample, token=2)):
        train(cfg, target=target)
    assert not (tmp_path / "run" / "final").exists()


def test_a_nan_validation_loss_reaches_the_card_as_not_a_number():
    from specdraft.models.base import TrainOutput
    from specdraft.train.metrics import MetricSums
    from specdraft.train.model_card import model_card

    sums = MetricSums()
    sums.add(
        TrainOutput(
            loss=torch.tensor(float("nan")), position_acc=torch.zeros(3), position_cond_acc=torch.zeros(3), position_count=torch.ones(3)
        ),
        tokens=10,
    )
    summary = sums.summary()
    assert summary["loss"] is None and summary["non_finite_loss"] and "accept_len" not in summary
    json.dumps(summary, allow_nan=False)  # metrics.jsonl stays JSON
    split = {"hash": "h", "validation_samples": 2, "samples": 12, "validation_groups_count": 2, "val_fraction": 0.2, "seed": 0}
    card = model_card(
        method="dspark",
        step=4,
        data="S",
        split=split,
        validation={"split": "val", "step": 4, **summary, "tau_teacher_forced": summary.get("accept_len")},
    )
    assert "| teacher_forced | - | not a number: the validation loss was NaN or inf" in card and "1.000" not in card


def test_calibrate_on_nan_held_out_states_names_the_sample(run, tmp_path):
    """Was a RuntimeError in torch.bincount."""
    from specdraft.train.calibrate import CalibrateConfig, calibrate

    target, source, out = run
    store = tmp_path / "hs"
    shutil.copytree(source, store)
    sample = json.loads((out / "split.json").read_text())["validation_ids"][0]
    _poison(store, sample, token=1)
    config = CalibrateConfig(drafter=str(out / "final"), data=str(store), out=str(tmp_path / "calibrated"))
    with pytest.raises(SpecdraftError, match=_nan_refused(store, sample, token=1)):
        calibrate(config, target=target, progress=False)
    assert not (tmp_path / "calibrated").exists()


def test_temperature_scaling_refuses_non_finite_confidences():
    from specdraft.models.dspark.temperature_scaling import sequential_temperature_scaling

    logits = torch.zeros(4, 3)
    logits[1, 2] = float("nan")
    with pytest.raises(
        SpecdraftError,
        match=r"1 supervised confidence logit\(s\) or acceptance\(s\) are NaN or inf \(the first at "
        r"block 1, draft position 3\)",
    ):
        sequential_temperature_scaling(logits=logits, accept=torch.ones(4, 3), valid=torch.ones(4, 3, dtype=torch.bool))


def _collate_on_rank(rank: int, world: int, port: int, results: Path) -> None:
    """One gloo rank of ``test_every_rank_refuses_a_batch_with_nan_on_one``: rank 1's batch holds NaN. Each rank
    writes what collate did after a barrier (so neither waits for ever, whatever the other did)."""
    import datetime

    import torch.distributed as dist

    from specdraft.train.batches import collate
    from specdraft.train.distributed import Dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    try:
        hidden = torch.zeros(4, 2, 3)
        if rank == 1:
            hidden[2, 1, 0] = float("nan")
        item = {
            "sample_id": f"s{rank}",
            "token_ids": torch.arange(4),
            "loss_mask": torch.ones(4),
            "hidden_states": hidden,
            "last_hidden": torch.zeros(4, 3),
        }
        try:
            collate([[item]], sample_tokens=4, where="S", agree=lambda bad: Dist(rank, world).any(bad, torch.device("cpu")))
            outcome = "collated"
        except SpecdraftError as exc:
            outcome = str(exc)
        dist.barrier()  # the step's next collective: reached by every rank only when all of them stopped alike
        (results / f"rank-{rank}").write_text(outcome)
    finally:
        dist.destroy_process_group()


def test_every_rank_refuses_a_batch_with_nan_on_one(tmp_path):
    """NaN states in one rank's batch raised on that rank only: under DDP the others went on into the step's
    all-reduce and waited for ever. Every rank now agrees (``Dist.any``) and refuses; the one holding the sample names it."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_collate_on_rank, args=(2, port, tmp_path), nprocs=2, join=True, start_method="spawn")
    refused = "S: sample 's1' holds non-finite values (NaN or inf) in its hidden_states at token 2"
    assert (tmp_path / "rank-1").read_text().startswith(refused)
    assert (tmp_path / "rank-0").read_text().startswith("S: another process's batch holds non-finite values")
