"""``specdraft train --sequence-parallel N``: the trainer's data x sequence mesh (``train/sequence_parallel.py``).

The model-level exactness (loss and gradients at N = 2, 4 for every family) is ``test_sequence_parallel.py``; here the
trainer around it: a rank collates only its shard of each row, bad settings are refused naming the flag, and a
2-process run at N = 2 (DDP or FSDP) trains the drafter a 1-process run trains on the same data and seed, and resumes bit
for bit; a 4-process FSDP run (2 data groups x N = 2) shards every parameter over all 4 and trains the drafter of 2
data-parallel processes.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specdraft.errors import SpecdraftError
from specdraft.train.batches import RowWindow, collate
from specdraft.train.config import TrainConfig
from specdraft.train.trainer import train
from test_train_toy import ToyStore, ToyTarget, toy_config
from torchrun import torchrun

# fp32, 4 AdamW steps at lr 6e-4: the split changes only the order of the loss's and gradients' sums. Measured largest
# weight difference against the 1-process run: 1.7e-7 (dspark, DDP and FSDP), 7.0e-7 (eagle3); the tolerance leaves ~7x
# of that. FSDP over data 2 x N 2 against DDP over data 2: 2.5e-6 (fc.weight), half the tolerance at that weight.
WEIGHT_ATOL, WEIGHT_RTOL = 5e-6, 1e-5


def _rows(store: ToyStore) -> list[list[dict]]:
    """Two packed rows: three samples (segments meet inside shards and at boundaries) and one long sample."""
    return [[store[0], store[1], store[2]], [store[3]]]


@pytest.mark.parametrize(("size", "min_rows"), [(2, 0), (3, 0), (4, 0), (4, 30)])
def test_a_rank_collates_its_shard_of_the_padded_row(size, min_rows):
    """``RowWindow`` collation is ``rows_of(pad_rows(...))`` of the whole batch, padded further to ``min_rows`` per
    shard (the halo) where the row is shorter, with the positions and segments the whole row gives those rows."""
    from specdraft.train.sequence_parallel import pad_rows, rows_of

    rows = _rows(ToyStore())
    whole = collate(rows, sample_tokens=64)
    assert whole.token_ids.shape[1] < 4 * 30  # (4, 30): the halo, not the group size, sets the width
    padded = pad_rows(whole, size * min_rows if min_rows else size)
    for rank in range(size):
        got = collate(rows, sample_tokens=64, window=RowWindow(rank, size, min_rows))
        want = rows_of(padded, rank, size)
        for name, value in vars(want).items():
            assert torch.equal(getattr(got, name), value), (rank, name)


def test_non_finite_states_in_a_shard_name_the_sample_and_token():
    """The token is the sample's own index, not the shard's row (the last sample of row 0 ends in shard 1)."""
    rows = _rows(ToyStore())
    bad = dict(rows[0][2], hidden_states=rows[0][2]["hidden_states"].clone())
    n = len(bad["token_ids"])
    bad["hidden_states"][n - 2, 0, 0] = float("nan")
    with pytest.raises(
        SpecdraftError, match=rf"sample 's002' holds non-finite values \(NaN or inf\) in its hidden_states at token {n - 2}\b"
    ):
        collate([[*rows[0][:2], bad], rows[1]], sample_tokens=64, window=RowWindow(1, 2))
    collate([[*rows[0][:2], bad], rows[1]], sample_tokens=64, window=RowWindow(0, 2))  # not in shard 0


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"sequence_parallel": 0}, r"--sequence-parallel must be >= 1 \(1 = off\), got 0"),
    ],
)
def test_unsupported_settings_are_refused(values, message):
    with pytest.raises(SpecdraftError, match=message):
        TrainConfig(method="dspark", **values)


def test_process_count_must_split_into_groups(tmp_path, monkeypatch):
    """One process cannot hold a group of 2, nor 3 processes groups of 2; nothing is written."""
    out = tmp_path / "run"
    with pytest.raises(SpecdraftError, match=r"--sequence-parallel 2 .* 1 process\(es\) do not form groups of 2"):
        train(toy_config(out, sequence_parallel=2), target=ToyTarget(), dataset=ToyStore())
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(SpecdraftError, match=r"3 process\(es\) do not form groups of 2: launch a multiple of 2"):
        train(toy_config(out, sequence_parallel=2), target=ToyTarget(), dataset=ToyStore())
    assert not out.exists()


def test_a_family_without_the_hook_is_refused_before_any_process_group(tmp_path, monkeypatch):
    """The toy drafter has no ``sequence_halo``: refused on every rank before ``init_process_group`` (which would wait
    for the other rank here)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SpecdraftError, match="toy drafters cannot train sequence-parallel: the family defines no sequence_halo"):
        train(toy_config(tmp_path / "run", sequence_parallel=2), target=ToyTarget(), dataset=ToyStore())
    assert not torch.distributed.is_initialized()


# --------------------------------------------------------------------------------------------------------------------
# The real trainer: 1 process against 2 gloo processes at N = 2 (one sequence group: the same data plan and seeds).


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    from test_train_methods import build_stores

    return build_stores(tmp_path_factory.mktemp("train-sp"))


def _config(method: str, stores, out: Path, **kw) -> TrainConfig:
    from test_train_methods import config, store_for

    # rows of up to 64 tokens packing 2-5 samples: blocks (4 tokens) on both sides of the shard boundary, which segments cross
    return config(method, store_for(method, stores), out, max_steps=4, eval_interval=2, checkpoint_interval=2, decode_prompts=0, **kw)


def _torchrun(cfg: TrainConfig, side: Path, nproc: int = 2) -> None:
    """Train ``cfg`` with ``nproc`` gloo processes (this file as the entry, ``_rank_main``)."""
    side.mkdir(parents=True, exist_ok=True)
    torchrun(__file__, json.dumps(cfg.to_dict()), str(side), nproc=nproc)


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "final/model.safetensors"))


def _records(out: Path, split: str) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["split"] == split]


@pytest.mark.slow  # two 2-process torchrun launches and a 1-process run of the real trainer (about 2 minutes on 2 cores)
@pytest.mark.parametrize(("method", "parallel"), [("dspark", "ddp"), ("dspark", "fsdp")])
def test_two_ranks_at_n2_train_the_one_process_drafter_and_resume_bit_for_bit(method, parallel, stores, tmp_path):
    from test_train_methods import tiny_target

    one = train(_config(method, stores, tmp_path / "one"), target=tiny_target())
    assert one.completed
    out = tmp_path / "sp"
    cfg = _config(method, stores, out, sequence_parallel=2, parallel=parallel)
    _torchrun(cfg, tmp_path / "side")

    _assert_same_run(tmp_path / "one", out)  # the drafter and the logs of the 1-process run
    _assert_held_as(parallel, _weights(out), tmp_path / "side", 2)
    # each rank trained on its half of every row (plus the halo rows of the next), never the whole row
    steps = [json.loads((tmp_path / "side" / f"steps-{r}.json").read_text()) for r in range(2)]
    assert len(steps[0]) == len(steps[1]) == 4
    for a, b in zip(*steps):
        assert a["start"] == 0 and b["start"] == a["length"] == b["length"] and a["rows"] == a["length"] + a["halo"] > a["halo"] > 0
        assert a["tokens"] > 0 and b["tokens"] > 0  # both halves hold real tokens: the split cuts through the row
    state = json.loads((out / "checkpoints/step-4/trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["sequence_parallel"] == 2

    # lose everything after step 2 and rerun: the N = 2 resume reproduces the weights bit for bit
    shutil.copytree(out / "final", tmp_path / "first-final")
    shutil.rmtree(out / "final")
    shutil.rmtree(out / "checkpoints/step-4")
    _torchrun(cfg, tmp_path / "side-resumed")
    again = _weights(out)
    first = load_file(str(tmp_path / "first-final/model.safetensors"))
    assert all(torch.equal(first[k], again[k]) for k in first)

    # a resume at another N is refused before anything is written
    shutil.rmtree(out / "final")
    before = (out / "metrics.jsonl").read_text()
    with pytest.raises(SpecdraftError, match=r"trained with --sequence-parallel 2, and continuing it with 1 would not .* bit for bit"):
        train(_config(method, stores, out), target=tiny_target())
    assert (out / "metrics.jsonl").read_text() == before


@pytest.mark.slow  # a 4-process and a 2-process torchrun launch (65 s on 2 shared cores)
def test_fsdp_over_two_data_groups_of_two_trains_the_data_parallel_drafter(stores, tmp_path):
    """World 4 = data 2 x sequence 2 under FSDP: each parameter sharded over all 4 processes, and the drafter (and
    logs) of 2 data-parallel processes without the split (DDP, N = 1): the same data plan, keyed by the data rank."""
    _torchrun(_config("dspark", stores, tmp_path / "ddp"), tmp_path / "side-ddp")
    out = tmp_path / "mesh"
    _torchrun(_config("dspark", stores, out, sequence_parallel=2, parallel="fsdp"), tmp_path / "side", nproc=4)
    _assert_same_run(tmp_path / "ddp", out)
    _assert_held_as("fsdp", _weights(out), tmp_path / "side", 4)
    state = json.loads((out / "checkpoints/step-4/trainer_state.json").read_text())
    assert state["world_size"] == 4 and state["sequence_parallel"] == 2


def _assert_same_run(want: Path, got: Path) -> None:
    """Run ``got`` trained the drafter of run ``want`` within fp32 rounding of the sums' order, and its logs count
    each sample once: the whole rows' tokens and labels, and the loss and gradient norm, as without the split."""
    a, b = _weights(want), _weights(got)
    assert a.keys() == b.keys()
    for name, value in a.items():
        torch.testing.assert_close(b[name], value, atol=WEIGHT_ATOL, rtol=WEIGHT_RTOL, msg=lambda m, name=name: f"{name}: {m}")
    for split in ("train", "val"):
        x_records, y_records = _records(want, split), _records(got, split)
        assert [r["step"] for r in x_records] == [r["step"] for r in y_records]
        for x, y in zip(x_records, y_records):
            for key in ("tokens", "labels", "anchors"):
                if key in x:
                    assert x[key] == y[key], (split, key)
            for key in ("loss", "grad_norm"):  # the gradient's scale: AdamW's update barely depends on it
                if key in x:
                    assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-5), (split, key)


def _assert_held_as(parallel: str, final: dict[str, torch.Tensor], side: Path, world: int) -> None:
    """What each rank held at the end (``_rank_main``'s dump): under DDP the whole drafter, equal on every rank; under
    FSDP a dim-0 shard of each parameter, sharded over every process of the data x sequence mesh, the shards in rank
    order making up the final drafter."""
    ranks = [load_file(str(side / f"weights-{r}.safetensors")) for r in range(world)]
    if parallel == "ddp":
        assert all(torch.equal(ranks[0][k], r[k]) for r in ranks for k in ranks[0])  # DDP keeps the replicas equal
        return
    for name, whole in final.items():
        shards = [r[name] for r in ranks]
        assert shards[0].shape[0] == -(-whole.shape[0] // world), name  # 1/world of the rows each, not 1/data
        assert torch.equal(torch.cat(shards)[: whole.shape[0]], whole), name


def _rank_main(cfg_json: str, side_dir: str) -> None:
    """torchrun entry: train with ``tiny_target()``, recording each step's shard (where this rank's rows start, how
    many it owns, the halo and its real tokens), and dump this rank's weights."""
    from safetensors.torch import save_file

    import specdraft.train.trainer as trainer
    from test_train_methods import tiny_target

    steps, step = [], trainer.train_step

    def recording(module, batch, **kw):
        shard = kw.get("shard")
        if shard is not None:  # a training step (the forward-path probe on rank 0 steps a whole synthetic batch)
            own = shard.own(batch.segment_ids)
            steps.append(
                {"start": shard.start, "length": shard.length, "rows": batch.token_ids.shape[1]}
                | {"halo": batch.token_ids.shape[1] - shard.length, "tokens": int((own >= 0).sum())}
            )
        return step(module, batch, **kw)

    trainer.train_step = recording
    result = train(TrainConfig(**json.loads(cfg_json)), target=tiny_target())
    rank = os.environ["RANK"]
    (Path(side_dir) / f"steps-{rank}.json").write_text(json.dumps(steps))
    # this rank's own tensors: the whole drafter under DDP, its shard of each parameter under FSDP
    local = {k: (v.to_local() if hasattr(v, "to_local") else v).contiguous() for k, v in result.drafter.state_dict().items()}
    save_file(local, str(Path(side_dir) / f"weights-{rank}.safetensors"))


if __name__ == "__main__":
    _rank_main(sys.argv[1], sys.argv[2])
