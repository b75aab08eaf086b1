"""``specdraft train --sequence-parallel N``: the trainer's data x sequence mesh (``train/sequence_parallel.py``).

The model-level exactness (loss and gradients at N = 2, 4 for every family) is ``test_sequence_parallel.py``; here the
trainer around it: a rank collates only its shard of each row, bad settings are refused naming the flag, and a
2-process run at N = 2 trains the drafter a 1-process run trains on the same data and seed, and resumes bit for bit.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
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

TESTS = Path(__file__).parent
# fp32, 4 AdamW steps at lr 6e-4: the split changes only the order of the loss's and gradients' sums. Measured largest
# weight difference against the 1-process run: 1.7e-7 (dspark), 7.0e-7 (eagle3); the tolerance leaves ~7x of that.
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
        ({"sequence_parallel": 2, "parallel": "fsdp"}, r"--sequence-parallel 2 runs under DDP only; --parallel fsdp .*not implemented"),
        ({"sequence_parallel": 2, "data_mode": "online"}, r"--sequence-parallel 2 reads an offline store only; --data-mode online"),
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


def _torchrun(cfg: TrainConfig, side: Path) -> None:
    """Train ``cfg`` with 2 gloo processes (this file as the entry, ``_rank_main``)."""
    side.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            __file__,
            json.dumps(cfg.to_dict()),
            str(side),
        ],
        cwd=TESTS,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "final/model.safetensors"))


def _records(out: Path, split: str) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["split"] == split]


@pytest.mark.slow  # two 2-process torchrun launches and a 1-process run of the real trainer (about 2 minutes on 2 cores)
@pytest.mark.parametrize("method", ["dspark", "eagle3"])
def test_two_ranks_at_n2_train_the_one_process_drafter_and_resume_bit_for_bit(method, stores, tmp_path):
    from test_train_methods import tiny_target

    one = train(_config(method, stores, tmp_path / "one"), target=tiny_target())
    assert one.completed
    out = tmp_path / "sp"
    cfg = _config(method, stores, out, sequence_parallel=2)
    _torchrun(cfg, tmp_path / "side")

    # the drafter the 1-process run trains, within fp32 rounding of the sums' order
    want, got = _weights(tmp_path / "one"), _weights(out)
    assert want.keys() == got.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, atol=WEIGHT_ATOL, rtol=WEIGHT_RTOL, msg=lambda m, name=name: f"{name}: {m}")
    ranks = [load_file(str(tmp_path / "side" / f"weights-{r}.safetensors")) for r in range(2)]
    assert all(torch.equal(ranks[0][k], ranks[1][k]) for k in ranks[0])  # DDP keeps the group's replicas equal
    # each rank trained on its half of every row (plus the halo rows of the next), never the whole row
    steps = [json.loads((tmp_path / "side" / f"steps-{r}.json").read_text()) for r in range(2)]
    assert len(steps[0]) == len(steps[1]) == 4
    for a, b in zip(*steps):
        assert a["start"] == 0 and b["start"] == a["length"] == b["length"] and a["rows"] == a["length"] + a["halo"] > a["halo"] > 0
        assert a["tokens"] > 0 and b["tokens"] > 0  # both halves hold real tokens: the split cuts through the row

    # the logs count each sample once: the whole rows' tokens and labels, as at N = 1
    for split in ("train", "val"):
        a, b = _records(tmp_path / "one", split), _records(out, split)
        assert [r["step"] for r in a] == [r["step"] for r in b]
        for x, y in zip(a, b):
            for key in ("tokens", "labels", "anchors"):
                if key in x:
                    assert x[key] == y[key], (split, key)
            assert y["loss"] == pytest.approx(x["loss"], rel=1e-4, abs=1e-5), split
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
    save_file({k: v.contiguous() for k, v in result.drafter.state_dict().items()}, str(Path(side_dir) / f"weights-{rank}.safetensors"))


if __name__ == "__main__":
    _rank_main(sys.argv[1], sys.argv[2])
