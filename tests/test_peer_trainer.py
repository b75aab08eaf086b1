"""benchmarks/peer_trainer.py: speculators 0.9.0's own trainer on a specdraft store, on CPU (issue 16, item 4)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from test_interop import INTEROP_PYTHON, ROOT

pytestmark = [
    pytest.mark.interop,
    pytest.mark.slow,
    pytest.mark.skipif(not INTEROP_PYTHON.exists(), reason=f"speculators environment {INTEROP_PYTHON} not built (scripts/bootstrap.sh)"),
]
PEER_FLAGS = "--num-layers 1 --block-size 4 --max-anchors 8 --markov-rank 16"


@pytest.fixture(scope="module")
def store(tiny_llama_dir, tiny_target, tmp_path_factory):
    from specdraft.data.dataset import write_prepared
    from specdraft.hidden_states.config import ExtractConfig
    from specdraft.hidden_states.extract import extract_hidden_states

    root = tmp_path_factory.mktemp("peer")
    g = torch.Generator().manual_seed(0)
    rows = [{"sample_id": f"c{i // 2}_{i % 2}", "source": "t:sharegpt", "input_ids": torch.randint(0, 1000, (24,), generator=g).tolist(),
             "loss_mask": [int(j >= 6) for j in range(24)]} for i in range(16)]
    data = write_prepared(root / "data", rows, target_info=tiny_target.describe(), config={}, stats={}, vocab_size=tiny_target.vocab_size)
    out = root / "hs"
    # dspark's slots (outputs of layers 1-3) plus one it does not read: the conversion must pick the method's
    extract_hidden_states(ExtractConfig(dataset=str(data), out=str(out), layers="input:5,output:1,output:2,output:3",
                                        target=str(tiny_llama_dir), dtype="float32"), progress=False)
    return out


def _peer(store, target_dir, out, *flags):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.run([str(INTEROP_PYTHON), str(ROOT / "benchmarks/peer_trainer.py"), "--store", str(store), "--target", str(target_dir),
                           "--out", str(out), "--val-fraction", "0.3", "--total-seq-len", "64", "--extra", PEER_FLAGS, *flags],
                          capture_output=True, text=True, timeout=900, env=env)


def test_peer_trains_dspark_on_our_store_on_cpu(store, tiny_llama_dir, tiny_target, tmp_path):
    from specdraft.hidden_states.dataset import HiddenStateDataset
    from specdraft.models import load_drafter
    from specdraft.models.common.vocab import build_draft_vocab
    from specdraft.train.split import dataset_split
    from specdraft.train.data import token_counts

    # without the harness it stops where it assumes an accelerator
    bare = _peer(store, tiny_llama_dir, tmp_path / "bare", "--steps", "1", "--no-cpu-harness")
    assert bare.returncode != 0 and "Cannot access accelerator device when none is available" in bare.stderr
    assert "self.model.to(self.local_rank)" in bare.stderr

    # two whole epochs, the draft vocabulary built from our counts
    run = _peer(store, tiny_llama_dir, tmp_path / "peer", "--epochs", "2", "--draft-vocab-size", "64")
    assert run.returncode == 0, run.stderr[-3000:]
    facts = json.loads(run.stdout[run.stdout.index("{\n"):])
    assert facts["layer_ids"] == [2, 3, 4] and "--draft-attn-impl" in facts["argv"]
    dataset = HiddenStateDataset(store)
    split = dataset_split(dataset, val_fraction=0.3, seed=0)
    assert (facts["train_rows"], facts["val_rows"]) == (len(split.train), len(split.val)) and facts["val_rows"] > 0
    assert len(list((tmp_path / "peer/data/hidden_states").glob("hs_*.safetensors"))) == 16
    # every training token, twice, counted from the peer's own step records (what tokens/s divides)
    assert facts["tokens"] == 2 * facts["train_tokens"] == 2 * sum(dataset.lengths()[i] for i in split.train)
    assert facts["steps"] >= 2 and facts["step_seconds"] > 0
    checkpoint = max((p for p in (tmp_path / "peer/run").iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    assert json.loads((checkpoint / "training_state.json").read_text())["global_step"] == facts["steps"]
    drafter = load_drafter(checkpoint, target=tiny_target)  # the peer's checkpoint loads in specdraft
    assert drafter.method == "dspark" and drafter.config.block_size == 4
    ours_d2t, _ = build_draft_vocab(token_counts(dataset), 64)  # the vocabulary our trainer would pick
    assert torch.equal(drafter.d2t.cpu(), ours_d2t)
