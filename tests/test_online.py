"""Online/hybrid data (``hidden_states/data_modes.py``, ``streaming.py``, ``client.py``) from in-process producers, file transport."""

from __future__ import annotations

import json
import socket

import pytest
import torch

from specdraft.data.dataset import PreparedDataset, write_prepared
from specdraft.errors import SpecdraftError
from specdraft.hidden_states.backends.file import FileBackend
from specdraft.hidden_states.capture import HiddenStateCapture
from specdraft.hidden_states.client import ProducerClient
from specdraft.hidden_states.data_modes import DATA_MODES, SourceOptions
from specdraft.hidden_states.dataset import HiddenStateDataset
from specdraft.hidden_states.layers import LayerSlot
from specdraft.hidden_states.service import HiddenStateService, ServiceConfig
from specdraft.hidden_states.streaming import StreamingSource

SLOTS = [LayerSlot(1, "output"), LayerSlot(4, "output")]
NUM = 10


def make_prepared(directory, target, num=NUM, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(num):
        n = int(torch.randint(6, 20, (1,), generator=g))
        rows.append(
            {
                "sample_id": f"on/{i}",
                "source": "t",
                "input_ids": torch.randint(0, 1000, (n,), generator=g).tolist(),
                "loss_mask": [int(j >= 2) for j in range(n)],
            }
        )
    return write_prepared(directory, rows, target_info=target.describe(), config={}, stats={}, vocab_size=target.vocab_size)


@pytest.fixture(scope="module")
def prepared(tiny_target, tmp_path_factory):
    return make_prepared(tmp_path_factory.mktemp("prepared") / "data", tiny_target)


@pytest.fixture(scope="module")
def transport(tmp_path_factory):
    return tmp_path_factory.mktemp("transport")


@pytest.fixture(scope="module")
def producers(tiny_llama_dir, transport):
    """Two producers writing into one shared directory; each holds its own copy of the target (capture hooks are per model)."""
    from specdraft.targets import load_target

    services = [
        HiddenStateService(
            ServiceConfig(target="tiny", backend="file", store=str(transport), port=0, max_batch=4), target=load_target(str(tiny_llama_dir))
        ).start()
        for _ in range(2)
    ]
    yield services
    for s in services:
        s.close()


def options(prepared, transport, urls, **kw) -> SourceOptions:
    values = dict(
        data=None,
        dataset=str(prepared),
        producers=urls,
        store=str(transport),
        slots=lambda n: SLOTS,
        dtype="float32",
        prefetch=4,
        token=None,
        timeout_s=30.0,
        delivery_log=None,
    )
    values.update(kw)
    return SourceOptions(**values)


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def stored_files(directory) -> list:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".safetensors"))


def test_online_delivers_every_sample_once_and_leaves_the_store_empty(prepared, transport, producers, tiny_target, tmp_path):
    log_path = tmp_path / "run" / "delivered.jsonl"
    order = list(range(NUM)) + list(reversed(range(NUM)))  # two "epochs": the same sample is requested again
    with DATA_MODES.get("online")(options(prepared, transport, [p.url for p in producers], delivery_log=str(log_path))) as source:
        assert len(source) == NUM and source.slots == SLOTS and source.target_info["fingerprint"] == tiny_target.fingerprint
        source.start(order)
        items = [source[i] for i in order]
        extra = source[3]  # out of the announced order (e.g. validation): fetched synchronously
        stats = source.stats()
    assert [it["sample_id"] for it in items] + [extra["sample_id"]] == [f"on/{i}" for i in order] + ["on/3"]
    assert [json.loads(line)["sample_id"] for line in log_path.read_text().splitlines()] == source.delivered
    assert stats["delivered"] == 2 * NUM + 1 and stats["requests"] == 2 * NUM + 1 and 0.0 <= stats["fetch_fraction"] <= 1.0
    assert all(p.health()["requests"] > 0 for p in producers)  # requests were spread over both
    assert stored_files(transport) == []  # consumed samples are deleted
    capture = HiddenStateCapture(tiny_target.model, SLOTS)
    for item in items[:3]:
        hidden, last = capture([item["token_ids"]])[0]
        torch.testing.assert_close(item["hidden_states"], hidden, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(item["last_hidden"], last, rtol=1e-5, atol=1e-5)
        assert item["loss_mask"].dtype == torch.bool


def test_requests_to_a_producer_that_died_go_to_another(prepared, transport, producers):
    doomed = HiddenStateService(
        ServiceConfig(target="tiny", backend="file", store=str(transport), port=0), target=producers[1].engine.target
    ).start()  # producers[1] gets no requests here
    with DATA_MODES.get("online")(options(prepared, transport, [doomed.url, dead_url(), producers[0].url])) as source:
        assert set(source.client.unavailable()) == {source.client.urls[1]}  # found dead when the source opened
        doomed.close()
        source.start(range(NUM))
        assert [source[i]["sample_id"] for i in range(NUM)] == [f"on/{i}" for i in range(NUM)]
        assert source.counters["retries"] >= 1 and source.counters["requests"] == NUM + source.counters["retries"]
    assert stored_files(transport) == []


def test_a_producer_that_does_not_answer_times_out_and_is_bypassed(prepared, transport, producers):
    with socket.socket() as silent:  # accepts connections (kernel backlog) but never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        hung = f"http://127.0.0.1:{silent.getsockname()[1]}"
        client = ProducerClient([hung, producers[0].url], timeout_s=1.0)
        with StreamingSource(
            prepared=PreparedDataset(prepared),
            client=client,
            transport=FileBackend(transport),
            target_info=producers[0].target_info,
            slots=SLOTS,
            dtype="float32",
            prefetch=2,
        ) as source:
            source.start(range(4))
            assert [source[i]["sample_id"] for i in range(4)] == [f"on/{i}" for i in range(4)]
            assert source.counters["retries"] >= 1
            assert "timed out" in client.unavailable()[hung]
    assert stored_files(transport) == []


def test_no_reachable_producer_is_a_clear_error(prepared, transport):
    with pytest.raises(SpecdraftError, match="no producer is reachable.*serve-hidden-states"):
        DATA_MODES.get("online")(options(prepared, transport, [dead_url()]))


class CorruptingTransport:
    """Flips one byte of the first ``times`` payloads read back (as a bad transfer would)."""

    def __init__(self, backend, times: int):
        self.backend, self.times = backend, times

    def get(self, key):
        payload = self.backend.get(key)
        if self.times > 0:
            self.times -= 1
            payload.hidden_states.view(-1)[0] += 1.0
            payload.verify(source=key)  # raises: the checksum no longer matches
        return payload

    def __getattr__(self, name):
        return getattr(self.backend, name)


@pytest.mark.parametrize("times, ok", [(1, True), (2, False)])
def test_corrupt_payload_is_refetched_once_then_reported(prepared, transport, producers, times, ok):
    source = DATA_MODES.get("online")(options(prepared, transport, [producers[0].url], prefetch=1))
    source.transport = CorruptingTransport(source.transport, times)
    with source:
        if ok:
            assert source[0]["sample_id"] == "on/0" and source.counters["refetches"] == 1
        else:
            with pytest.raises(SpecdraftError, match="'on/0' arrived corrupt twice.*checksum"):
                source[0]
    assert stored_files(transport) == []


class RefusingTransport:
    """Refuses the first ``times`` deletes (as Mooncake does for objects of an unfinished put)."""

    def __init__(self, backend, times: int):
        self.backend, self.times = backend, times

    def delete(self, key):
        if self.times > 0:
            self.times -= 1
            raise SpecdraftError(f"{key}: -703 REPLICA_IS_NOT_READY")
        self.backend.delete(key)

    def __getattr__(self, name):
        return getattr(self.backend, name)


def test_deletes_the_store_refuses_are_retried_at_close(prepared, transport, producers):
    source = DATA_MODES.get("online")(options(prepared, transport, [producers[0].url], prefetch=1))
    source.transport = RefusingTransport(source.transport, 3)
    with source:
        assert [source[i]["sample_id"] for i in range(2)] == ["on/0", "on/1"]
        assert len(stored_files(transport)) == 2  # read, but their deletes were refused
    assert stored_files(transport) == []


def test_hybrid_caches_requested_samples_for_offline_use(prepared, transport, producers, tmp_path, tiny_target):
    cache = tmp_path / "cache"
    opts = options(prepared, transport, [p.url for p in producers], data=str(cache))
    with DATA_MODES.get("hybrid")(opts) as source:
        source.start(range(0, NUM, 2))
        first = {i: source[i] for i in range(0, NUM, 2)}
    assert source.counters["requests"] == NUM // 2 and not source.counters["cache_hits"]
    assert stored_files(transport) == [] and len(stored_files(cache)) == NUM // 2
    with DATA_MODES.get("hybrid")(opts) as source:
        source.start(range(NUM))
        items = [source[i] for i in range(NUM)]
    assert source.counters["cache_hits"] == NUM // 2 and source.counters["requests"] == NUM - NUM // 2
    for i, item in first.items():
        assert torch.equal(items[i]["hidden_states"], item["hidden_states"])
    offline = HiddenStateDataset(cache)  # the cache is a complete store now
    assert offline.manifest["complete"] and offline.slots == SLOTS and len(offline) == NUM
    assert torch.equal(offline[1]["last_hidden"], items[1]["last_hidden"])
    with pytest.raises(SpecdraftError, match="made with other settings"):
        DATA_MODES.get("hybrid")(options(prepared, transport, [producers[0].url], data=str(cache), slots=lambda n: SLOTS[:1]))
    reprepared = make_prepared(tmp_path / "reprepared", tiny_target, seed=1)  # the same sample ids, other tokens
    with pytest.raises(
        SpecdraftError, match=rf"{cache} was started from dataset .*its first {NUM} rows \(sample ids or token ids\) differ"
    ):
        DATA_MODES.get("hybrid")(options(reprepared, transport, [producers[0].url], data=str(cache)))


def test_mismatched_target_and_missing_options(prepared, transport, producers, tmp_path, tiny_target):
    other = make_prepared(tmp_path / "other", type(tiny_target)(**{**vars(tiny_target), "fingerprint": "f" * 16}))
    with pytest.raises(SpecdraftError, match="prepared for target .* but the producers serve"):
        DATA_MODES.get("online")(options(other, transport, [producers[0].url]))
    with pytest.raises(SpecdraftError, match="--store"):
        DATA_MODES.get("online")(options(prepared, transport, [producers[0].url], store=None))
    with pytest.raises(SpecdraftError, match="hybrid mode needs --data"):
        DATA_MODES.get("hybrid")(options(prepared, transport, [producers[0].url]))
    with pytest.raises(SpecdraftError, match="unknown data mode 'streaming'"):
        DATA_MODES.get("streaming")
    with DATA_MODES.get("online")(options(prepared, transport, [producers[0].url])) as source:
        assert isinstance(source, StreamingSource)


def test_train_config_data_mode_fields():
    from specdraft.train.config import TrainConfig

    cfg = TrainConfig(data_mode="online", producers=[" http://127.0.0.1:1 ", ""], prefetch=2)
    assert cfg.producers == ["http://127.0.0.1:1"]
    with pytest.raises(SpecdraftError, match="unknown data mode 'streamed'; choose one of: hybrid, offline, online"):
        TrainConfig(data_mode="streamed")
    with pytest.raises(SpecdraftError, match="prefetch must be >= 1"):
        TrainConfig(prefetch=0)


def test_producers_listed_in_a_file_join_and_leave_while_a_source_runs(prepared, transport, producers, tmp_path):
    """`--producers @FILE`: a URL added to the file gets requests; one removed gets no new ones."""
    listing = tmp_path / "producers.txt"

    def write(text: str) -> None:  # atomically, as a cluster's membership service must
        (tmp_path / "next.txt").write_text(text)
        (tmp_path / "next.txt").rename(listing)

    write(f"# the inference nodes\n{producers[0].url}\n")
    before = [p.health()["requests"] for p in producers]
    with DATA_MODES.get("online")(options(prepared, transport, ["@" + str(listing)], prefetch=1)) as source:
        source.client.refresh_s = 0.0
        source.start(range(NUM))
        assert source.client.urls == [producers[0].url]
        source[0]
        write(f"{producers[0].url}\n{producers[1].url}\n")
        for i in range(1, 4):
            source[i]
        assert source.client.urls == [producers[0].url, producers[1].url]
        write(f"{producers[1].url}\n")
        middle = [p.health()["requests"] for p in producers]
        assert [source[i]["sample_id"] for i in range(4, NUM)] == [f"on/{i}" for i in range(4, NUM)]
        assert source.client.urls == [producers[1].url]
    after = [p.health()["requests"] for p in producers]
    assert middle[1] > before[1]  # the joiner served requests
    assert after[0] - middle[0] <= 2  # after it left, producer 0 got at most the requests already in flight
    assert stored_files(transport) == []
    write("not-a-url\n")
    with pytest.raises(SpecdraftError, match=r"producer URL 'not-a-url' \(in .*producers.txt\) is not http://HOST:PORT"):
        ProducerClient([], membership=listing)


def test_a_restarted_consumer_deletes_what_its_killed_predecessor_left(prepared, transport, producers):
    urls = [p.url for p in producers]
    dead = DATA_MODES.get("online")(options(prepared, transport, urls, owner="run1r0"))
    other = DATA_MODES.get("online")(options(prepared, transport, urls, owner="run2r0"))
    left, kept = (
        dead._request({"token_ids": [1, 2, 3], "slots": [s.to_json() for s in SLOTS], "dtype": "float32"}, "on/0")[0],
        other._request({"token_ids": [4, 5], "slots": [s.to_json() for s in SLOTS], "dtype": "float32"}, "on/1")[0],
    )
    assert FileBackend(transport).keys() == sorted([left, kept])  # `dead` never reads or closes: its host was lost
    with DATA_MODES.get("online")(options(prepared, transport, urls, owner="run1r0")):
        assert FileBackend(transport).keys() == [kept]  # only its own predecessor's, not another run's
    other.close()
    assert stored_files(transport) == []
