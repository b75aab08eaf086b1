"""The ``mooncake`` hidden-state backend: producer and consumer processes on loopback.

This file is also the producer process: ``python test_mooncake_backend.py produce LOCATION FIRST COUNT``
puts the payloads :func:`make_payload` builds for ids FIRST..FIRST+COUNT-1 and exits.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from specdraft.errors import SpecdraftError
from specdraft.hidden_states.layers import LayerSlot
from specdraft.hidden_states.payload import TENSOR_KEYS, HiddenStatePayload
from specdraft.integrations.mooncake.backend import MooncakeBackend, parse_location
from specdraft.integrations.mooncake.client import MooncakeClient, MooncakeClientConfig

TARGET = {"name": "tiny", "fingerprint": "fp", "tokenizer_hash": "th", "num_layers": 6, "hidden_size": 64}


def make_payload(i: int, tokens: int = 24, hidden: int = 64, slots: int = 3) -> HiddenStatePayload:
    g = torch.Generator().manual_seed(i)
    return HiddenStatePayload.create(
        sample_id=f"sample/{i}",
        target_info={**TARGET, "hidden_size": hidden},
        slots=[LayerSlot(layer, "output") for layer in range(slots)],
        token_ids=torch.randint(0, 1000, (tokens + i,), generator=g),
        hidden_states=torch.randn(tokens + i, slots, hidden, generator=g),
        last_hidden=torch.randn(tokens + i, hidden, generator=g),
    )


def assert_same(a: HiddenStatePayload, b: HiddenStatePayload) -> None:
    assert a.manifest == b.manifest
    for name in TENSOR_KEYS:
        assert torch.equal(getattr(a, name), getattr(b, name))


@pytest.fixture(scope="module")
def store_client(master):
    """The consumer's client: it contributes the memory the objects live in."""
    c = MooncakeClient(MooncakeClientConfig(master=master.address, segment_mb=64, buffer_mb=8))
    yield c
    c.close()


@pytest.fixture
def location(master, request):
    admin = f"{master.state['host']}:{master.state['metrics_port']}"
    return f"mooncake://{master.address}/{request.node.name.replace('[', '-').rstrip(']')}?admin={admin}"


@pytest.fixture
def consumer(location, store_client, master):
    backend = MooncakeBackend(location, client=store_client, wait_s=10.0)
    yield backend
    for key in backend.keys():
        backend.delete(key)
    backend.delete_manifest()
    assert master.metrics()["master_key_count"] == 0


def produce(location: str, first: int, count: int, **options) -> subprocess.Popen:
    args = [sys.executable, __file__, "produce", location, str(first), str(count), json.dumps(options)]
    return subprocess.Popen(args)


@pytest.mark.slow  # a producer process that imports torch
@pytest.mark.parametrize("zero_copy", [True, False])
def test_payloads_round_trip_across_processes(location, consumer, zero_copy):
    producer = produce(location, 0, 4, zero_copy=zero_copy)
    assert producer.wait(timeout=120) == 0
    reader = MooncakeBackend(location, client=consumer.client, zero_copy=zero_copy)
    assert reader.keys() == [f"sample/{i}" for i in range(4)]
    for i in range(4):
        assert reader.exists(f"sample/{i}")
        assert_same(reader.get(f"sample/{i}"), make_payload(i))
    assert not reader.exists("sample/99")


@pytest.mark.slow  # a producer process that imports torch
def test_consumer_polling_never_sees_a_manifest_before_its_tensors(location, consumer):
    """A consumer racing a producer: whenever a manifest is visible, all its tensors already are."""
    count = 12
    producer = produce(location, 100, count, tokens=400, hidden=512, slots=4)  # ~1.6 MiB of tensors per sample
    seen: set[int] = set()
    deadline = time.monotonic() + 120
    while len(seen) < count and time.monotonic() < deadline:
        for i in range(100, 100 + count):
            if i in seen or not consumer.client.exists(consumer.manifest_key(f"sample/{i}")):
                continue
            present = consumer.client.exists_many(consumer.tensor_keys(f"sample/{i}").values())
            assert all(present.values()), f"manifest of sample {i} visible before its tensors: {present}"
            seen.add(i)
    assert producer.wait(timeout=120) == 0
    assert seen == set(range(100, 100 + count))
    assert_same(consumer.get("sample/105"), make_payload(105, tokens=400, hidden=512, slots=4))


class RecordingClient:
    """Wraps a client, logging write calls in order; ``fail_after`` puts make the next tensor write fail."""

    def __init__(self, client: MooncakeClient, fail_after: int | None = None):
        self.client = client
        self.fail_after = fail_after
        self.writes: list[str] = []

    def put_arrays(self, items):
        for key, arr in items.items():
            if self.fail_after is not None and len(self.writes) >= self.fail_after:
                raise SpecdraftError("injected transfer failure")
            self.client.put_arrays({key: arr})
            self.writes.append(key)

    def put(self, key, data):
        self.client.put(key, data)
        self.writes.append(key)

    def __getattr__(self, name):
        return getattr(self.client, name)


def test_manifest_is_written_last(location, consumer):
    spy = RecordingClient(consumer.client)
    producer = MooncakeBackend(location, client=spy)
    producer.put("sample/1", make_payload(1))
    assert spy.writes[-1] == producer.manifest_key("sample/1")
    assert set(spy.writes[:-1]) == set(producer.tensor_keys("sample/1").values())


def test_failed_producer_publishes_error_manifest(location, consumer):
    producer = MooncakeBackend(location, client=RecordingClient(consumer.client, fail_after=1))
    with pytest.raises(SpecdraftError, match="error manifest was published"):
        producer.put("sample/2", make_payload(2))
    # The tensor written before the failure was removed again; a waiting consumer fails at once.
    assert not any(consumer.client.exists_many(consumer.tensor_keys("sample/2").values()).values())
    assert not consumer.exists("sample/2")
    start = time.monotonic()
    with pytest.raises(SpecdraftError, match="producer failed: SpecdraftError: injected transfer failure"):
        consumer.get("sample/2")
    assert time.monotonic() - start < 2
    # A retry by a healthy producer replaces the error.
    MooncakeBackend(location, client=consumer.client).put("sample/2", make_payload(2))
    assert_same(consumer.get("sample/2"), make_payload(2))


def test_get_without_producer_times_out_clearly(location, store_client):
    backend = MooncakeBackend(location, client=store_client, wait_s=0.2)
    with pytest.raises(SpecdraftError, match="no manifest appeared within 0.2 s"):
        backend.get("sample/never")


def test_delete_leaves_the_store_empty(location, consumer, master):
    for i in range(3):
        consumer.put(f"sample/{i}", make_payload(i))
    consumer.write_manifest({"format": "x", "count": 3})
    assert consumer.read_manifest() == {"format": "x", "count": 3}
    assert master.metrics()["master_key_count"] == 3 * 4 + 1
    reader = MooncakeBackend(location, client=consumer.client, delete_after_read=True)
    assert reader.deletes_on_read and not consumer.deletes_on_read  # what a sequence group's source refuses
    assert_same(reader.get("sample/0"), make_payload(0))
    assert consumer.keys() == ["sample/1", "sample/2"]
    for key in consumer.keys():
        consumer.delete(key)
    consumer.delete("sample/absent")
    consumer.delete_manifest()
    metrics = master.metrics()
    assert metrics["master_key_count"] == 0 and metrics["master_allocated_bytes"] == 0
    assert consumer.read_manifest() is None and consumer.keys() == []


def test_corrupt_tensor_object_is_detected(location, consumer):
    consumer.put("sample/3", make_payload(3))
    key = consumer.tensor_keys("sample/3")["last_hidden"]
    data = bytearray(consumer.client.get(key))
    data[0] ^= 0xFF
    consumer.client.put(key, bytes(data))
    with pytest.raises(SpecdraftError, match="checksum"):
        consumer.get("sample/3")


def test_locations_and_options():
    config = parse_location("mooncake://10.0.0.1:50051/run1?segment_mb=0&zero_copy=false&admin=10.0.0.1:9003", wait_s=5)
    assert config.namespace == "run1" and config.client.master == "10.0.0.1:50051"
    assert config.client.segment_mb == 0 and config.zero_copy is False and config.wait_s == 5
    with pytest.raises(SpecdraftError, match="mooncake://HOST:PORT/NAMESPACE"):
        parse_location("mooncake://10.0.0.1:50051")
    with pytest.raises(SpecdraftError, match="unknown Mooncake option 'segmentmb'"):
        parse_location("mooncake://10.0.0.1:50051/run1?segmentmb=3")
    with pytest.raises(SpecdraftError, match="not a valid int"):
        parse_location("mooncake://10.0.0.1:50051/run1?segment_mb=lots")


def test_keys_needs_the_admin_address(master, store_client):
    backend = MooncakeBackend(f"mooncake://{master.address}/noadmin", client=store_client)
    with pytest.raises(SpecdraftError, match=r"\?admin=HOST:METRICS_PORT"):
        backend.keys()


def test_registered_as_a_backend():
    from specdraft.hidden_states.backends.base import BACKENDS

    assert BACKENDS.get("mooncake") is MooncakeBackend


@pytest.mark.slow  # builds a tiny target and runs extract twice
def test_extract_into_mooncake_matches_the_file_backend(location, consumer, tmp_path):
    """``specdraft extract`` with ``--backend mooncake`` stores what the file backend stores, and resumes."""
    import transformers

    from specdraft.data.dataset import write_prepared
    from specdraft.hidden_states.backends.file import FileBackend
    from specdraft.hidden_states.config import ExtractConfig
    from specdraft.hidden_states.extract import extract_hidden_states
    from specdraft.targets.base import Target

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
    )
    model = transformers.LlamaForCausalLM(config).eval().requires_grad_(False)
    target = Target(name="tiny", path=tmp_path, model=model, tokenizer=None, fingerprint="f" * 16, tokenizer_hash="t" * 16)
    g = torch.Generator().manual_seed(1)
    rows = [
        {"sample_id": f"sharegpt/{i}", "source": "t", "input_ids": torch.randint(0, 128, (n,), generator=g).tolist(), "loss_mask": [1] * n}
        for i, n in enumerate((7, 12, 3))
    ]
    data = write_prepared(tmp_path / "data", rows, target_info=target.describe(), config={}, stats={}, vocab_size=128)

    def extract(backend: str, out: str):
        cfg = ExtractConfig(dataset=str(data), out=out, backend=backend, layers="output:1,input:3", dtype="float32")
        return extract_hidden_states(cfg, target=target, progress=False)

    extract("file", str(tmp_path / "hs"))
    remote = location + "&segment_mb=0"  # the consumer holds the memory
    first = extract("mooncake", remote)
    assert (first.samples_extracted, first.samples_skipped) == (3, 0)
    files = FileBackend(tmp_path / "hs")
    assert consumer.keys() == files.keys() == [f"sharegpt/{i}" for i in range(3)]
    for key in files.keys():
        assert_same(consumer.get(key), files.get(key))
    manifest = consumer.read_manifest()
    assert manifest["count"] == 3 and manifest["complete"] is True
    again = extract("mooncake", remote)
    assert (again.samples_extracted, again.samples_skipped) == (0, 3)


def _produce(location: str, first: int, count: int, options: dict) -> None:
    shape = {k: options.pop(k) for k in ("tokens", "hidden", "slots") if k in options}
    with MooncakeBackend(location, segment_mb=0, **options) as backend:
        for i in range(first, first + count):
            backend.put(f"sample/{i}", make_payload(i, **shape))


if __name__ == "__main__":
    assert sys.argv[1] == "produce", sys.argv
    _produce(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5]))
