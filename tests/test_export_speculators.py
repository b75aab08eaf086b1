"""``specdraft export-speculators``: a store as speculators' training data, and the peer flags for our shape."""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest
import torch

from specdraft.errors import SpecdraftError
from test_interop import INTEROP_PYTHON, ROOT

needs_interop = pytest.mark.skipif(
    not INTEROP_PYTHON.exists(), reason=f"speculators environment {INTEROP_PYTHON} not built (scripts/bootstrap.sh)"
)


def _prepare(out, target):
    """16 random rows of 8 two-turn conversations, prepared for ``target``."""
    from specdraft.data.dataset import write_prepared

    g = torch.Generator().manual_seed(0)
    rows = [
        {
            "sample_id": f"c{i // 2}_{i % 2}",
            "source": "t:sharegpt",
            "input_ids": torch.randint(0, 1000, (24,), generator=g).tolist(),
            "loss_mask": [int(j >= 6) for j in range(24)],
        }
        for i in range(16)
    ]
    return write_prepared(out, rows, target_info=target.describe(), config={}, stats={}, vocab_size=target.vocab_size)


@pytest.fixture(scope="module")
def prepared(tiny_target, tmp_path_factory):
    return _prepare(tmp_path_factory.mktemp("export") / "data", tiny_target)


def _extract(data, out, tiny_llama_dir, **layers):
    from specdraft.hidden_states.config import ExtractConfig
    from specdraft.hidden_states.extract import extract_hidden_states

    extract_hidden_states(
        ExtractConfig(dataset=str(data), out=str(out), target=str(tiny_llama_dir), dtype="float32", **layers), progress=False
    )
    return out


@pytest.fixture(scope="module")
def store(prepared, tiny_llama_dir):
    # dspark's slots (outputs of layers 1-3) plus one it does not read: the export must pick the method's
    return _extract(prepared, prepared.parent / "hs", tiny_llama_dir, layers="input:5,output:1,output:2,output:3")


def _export(store, out, *flags):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [
            str(INTEROP_PYTHON),
            "-m",
            "specdraft.cli.main",
            "export-speculators",
            "--store",
            str(store),
            "--out",
            str(out),
            "--val-fraction",
            "0.3",
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


@pytest.mark.slow
@pytest.mark.interop
@needs_interop
def test_export_writes_what_the_peer_trainer_reads_with_our_split_and_vocabulary(store, tmp_path):
    from safetensors.torch import load_file

    from specdraft.hidden_states.dataset import HiddenStateDataset
    from specdraft.models.common.vocab import build_draft_vocab
    from specdraft.train.split import dataset_split

    run = _export(store, tmp_path / "data", "--draft-vocab-size", "64")
    assert run.returncode == 0, run.stderr[-3000:]
    facts = json.loads(run.stdout[run.stdout.index("{\n") :])
    assert facts["layer_ids"] == [2, 3, 4]  # outputs of layers 1-3, as speculators numbers them; input:5 left out
    dataset = HiddenStateDataset(store)
    split = dataset_split(dataset, val_fraction=0.3, seed=0)
    assert (facts["train_rows"], facts["val_rows"]) == (len(split.train), len(split.val)) and facts["val_rows"] > 0
    assert int(facts["train_data_ratio"] * 16) == len(split.train)  # the peer's cut keeps our validation side last
    files = sorted((tmp_path / "data/hidden_states").glob("hs_*.safetensors"))
    assert len(files) == 16
    assert facts["train_tokens"] == sum(dataset.lengths()[i] for i in split.train) and facts["tokens"] == sum(dataset.lengths())
    first = dataset[split.train[0]]
    row = load_file(str(tmp_path / "data/hidden_states/hs_0.safetensors"))
    slot_index = [dataset.slots.index(s) for s in dataset.slots if str(s) != "input:5"]
    assert torch.equal(row["token_ids"], torch.as_tensor(first["token_ids"], dtype=torch.long))
    assert torch.equal(row["hidden_states"], torch.cat([first["hidden_states"][:, slot_index], first["last_hidden"].unsqueeze(1)], dim=1))
    ours_d2t, ours_t2d = build_draft_vocab(dataset.token_counts(), 64)  # the vocabulary our trainer would pick
    assert np.array_equal(np.load(tmp_path / "data/d2t-64.npy"), ours_d2t.numpy())
    assert np.array_equal(np.load(tmp_path / "data/t2d-64.npy"), ours_t2d.numpy())
    # the columns the peer's dataset loader reads, in our order
    columns = subprocess.run(
        [
            str(INTEROP_PYTHON),
            "-c",
            "import sys, json, datasets; d = datasets.load_from_disk(sys.argv[1]); "
            "print(json.dumps({'names': d.column_names, 'seq_len': [int(n) for n in d.with_format(None)['seq_len']]}))",
            str(tmp_path / "data"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    read = json.loads(columns.stdout.strip().splitlines()[-1])
    assert sorted(read["names"]) == ["input_ids", "loss_mask", "seq_len"]
    assert [int(n) for n in read["seq_len"]] == [int(dataset.lengths()[i]) for i in split.train + split.val]
    again = _export(store, tmp_path / "data")  # same store, slots and split: reused
    assert again.returncode == 0 and json.loads(again.stdout[again.stdout.index("{\n") :]) == facts


def test_export_without_datasets_says_where_to_run_it(store, tmp_path):
    from specdraft.integrations.speculators.data import ExportSpeculatorsConfig, export_speculators_data

    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(SpecdraftError, match="needs the `datasets` package.*.venv-interop"):
            export_speculators_data(ExportSpeculatorsConfig(store=str(store), out=str(tmp_path / "data")))
    with pytest.raises(SpecdraftError, match="--val-fraction must be in"):
        ExportSpeculatorsConfig(store=str(store), out=str(tmp_path / "data"), val_fraction=0.0)


def test_peer_gets_our_shape_and_blocks_per_step():
    """The peer is given our recipe's drafter shape and our run's draft work per step."""
    from specdraft.integrations.speculators.data import trainer_flags
    from specdraft.train.config import resolve_config

    model = resolve_config("dspark").model
    # ours samples up to 64 blocks per *sample*; a packed row of ~14 gets ~740: the peer counts blocks per packed row
    assert trainer_flags(model, anchors_per_step=737) == [
        "--num-layers",
        str(model["num_layers"]),
        "--block-size",
        str(model["block_size"]),
        "--draft-vocab-size",
        str(model["draft_vocab_size"]),
        "--markov-rank",
        str(model["markov_rank"]),
        "--max-anchors",
        "737",
    ]
    dflash = trainer_flags(resolve_config("dflash").model)
    assert "--markov-rank" not in dflash and "--max-anchors" not in dflash and dflash[dflash.index("--block-size") + 1] == "8"
    assert "--draft-vocab-size" not in trainer_flags({"num_layers": 2, "draft_vocab_size": None})  # None: the peer's default


def test_peer_gets_eagle3_unroll_and_normalisation():
    """EAGLE-3's training unroll, its loss decay and its norm switches reach the peer under its flag names: the Eagle 3.1
    norms the peer's eagle3 turns on by default are turned off when ours are off, and its on-only --fc-norm is given
    only when on."""
    import dataclasses

    from specdraft.integrations.speculators.data import trainer_flags
    from specdraft.models import METHODS
    from specdraft.train.config import resolve_config

    model = {**dataclasses.asdict(METHODS.get("eagle3").config_cls()), **resolve_config("eagle3").model}  # config.resolved.yaml
    flags = trainer_flags(model)
    assert flags[flags.index("--ttt-steps") + 1] == str(model["ttt_steps"])
    assert flags[flags.index("--ttt-step-loss-decay") + 1] == str(model["ttt_decay"])
    assert flags[flags.index("--draft-vocab-size") + 1] == str(model["draft_vocab_size"])
    assert {"--no-norm-before-residual", "--no-norm-before-fc", "--no-norm-output"} <= set(flags)
    assert not any("fc-norm" in flag for flag in flags)
    on = trainer_flags({**model, "norm_before_residual": True, "fc_norm": True, "norm_output": True})
    assert {"--norm-before-residual", "--fc-norm", "--norm-output", "--no-norm-before-fc"} <= set(on)


def test_peer_methods_are_the_registered_decodable_methods(monkeypatch):
    """peer_compare/peer_trainer's method list is read from the method registry (DFlash2 and EAGLE-3 included): a
    decodable family registered later joins it without being named anywhere, one that cannot be decoded does not."""
    import dataclasses

    from specdraft.integrations.speculators.data import peer_methods
    from specdraft.models import METHODS

    assert {"dflash", "dflash2", "dspark", "eagle3"} <= set(peer_methods())
    monkeypatch.setitem(METHODS._items, "toychain", dataclasses.replace(METHODS.get("eagle3"), name="toychain"))
    monkeypatch.setitem(METHODS._items, "toyundecodable", dataclasses.replace(METHODS.get("dflash2"), name="toyundecodable", proposer=None))
    assert "toychain" in peer_methods() and "toyundecodable" not in peer_methods()


def test_peer_gets_dflash2_convolution_and_selector_shape():
    """DFlash2's recipe fields reach the peer under its own flag names (speculators' DFlash2Args); no reduced vocabulary."""
    from specdraft.integrations.speculators.data import trainer_flags
    from specdraft.train.config import resolve_config

    model = resolve_config("dflash2").model
    flags = trainer_flags(model)
    pairs = dict(zip(flags[::2], flags[1::2]))
    assert pairs == {
        "--num-layers": str(model["num_layers"]),
        "--block-size": str(model["block_size"]),
        "--conv-kernel-size": str(model["conv_kernel_size"]),
        "--conv-group-size": str(model["conv_group_size"]),
        "--selector-rank": str(model["selector_rank"]),
        "--selector-top-k": str(model["selector_top_k"]),
        "--selector-loss-alpha": str(model["selector_weight"]),
    }


def test_loss_summary_names_each_family_terms_and_the_peer_keys():
    import dataclasses

    from specdraft.integrations.speculators.data import loss_summary, peer_methods
    from specdraft.models import METHODS

    full = {name: dataclasses.asdict(METHODS.get(name).config_cls()) for name in peer_methods()}  # as config.resolved.yaml's model
    assert loss_summary(full["dflash"]) == "CE (hard target argmax)"
    assert loss_summary(full["dflash2"]) == "unary_loss kl, selector_weight 1.0"
    assert loss_summary(full["dspark"]) == "ce_weight 0.1, l1_weight 0.9, bce_weight 1.0"
    peer = {"confidence_head_alpha": 1.0, "selector_loss_alpha": 0.5}
    assert loss_summary(full["dflash2"], peer) == "selector_loss_alpha 0.5" and loss_summary(full["dflash"], peer) == ""


@pytest.mark.interop
@needs_interop
def test_the_peer_trainer_has_every_shape_flag():
    """Each flag SHAPE_FLAGS maps to is one speculators 0.9.0's trainer accepts (its --help), DFlash2's and EAGLE-3's
    included, and so are both sides of each switch."""
    from specdraft.integrations.speculators.data import ON_ONLY, SHAPE_FLAGS, SWITCH_FLAGS

    done = subprocess.run([str(INTEROP_PYTHON), "-m", "speculators.train", "--help"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    switches = [f"--{side}{switch}" for switch in SWITCH_FLAGS.values() for side in ("", "no-")[: 1 if switch in ON_ONLY else 2]]
    missing = [flag for flag in [*SHAPE_FLAGS.values(), *switches] if flag not in done.stdout]
    assert not missing, missing
    assert all(f"--no-{switch}" not in done.stdout for switch in ON_ONLY)  # else a False must be passed as such
