"""benchmarks/peer_compare.py: the peer is given our recipe's drafter shape and our run's draft work per step."""

from __future__ import annotations

import argparse
import sys

from test_interop import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import peer_compare  # noqa: E402


def _args(anchors: str) -> argparse.Namespace:
    return argparse.Namespace(epochs=1, val_fraction=0.05, split_seed=0, peer_anchors=anchors)


def test_peer_gets_our_shape_and_blocks_per_step():
    from specdraft.train.config import resolve_config

    ours_run = {"anchors_per_step": 737}  # ours samples up to 64 blocks per *sample*; a packed row of ~14 gets ~740
    flags = peer_compare.peer_flags("dspark", _args("matched"), ours_run)
    model = resolve_config("dspark").model
    assert flags == ["--num-layers", str(model["num_layers"]), "--block-size", str(model["block_size"]), "--draft-vocab-size",
                     str(model["draft_vocab_size"]), "--markov-rank", str(model["markov_rank"]), "--max-anchors", "737"]  # not the per-sample 64: the peer counts blocks per packed row
    dflash = peer_compare.peer_flags("dflash", _args("default"), ours_run)
    assert "--markov-rank" not in dflash and "--max-anchors" not in dflash and dflash[dflash.index("--block-size") + 1] == "8"
