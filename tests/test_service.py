"""The hidden-state producer service (``specdraft serve-hidden-states``) with the file backend, in process."""

from __future__ import annotations

import concurrent.futures
import json
import time
import urllib.error
import urllib.request

import pytest
import torch

from specdraft.errors import SpecdraftError
from specdraft.hidden_states.backends.file import FileBackend
from specdraft.hidden_states.capture import HiddenStateCapture
from specdraft.hidden_states.client import ProducerClient
from specdraft.hidden_states.layers import LayerSlot
from specdraft.hidden_states.service import HiddenStateService, ServiceConfig

SLOTS = [LayerSlot(1, "output"), LayerSlot(3, "input")]
TOKEN = "s3cret"


@pytest.fixture(scope="module")
def service(tiny_target, tmp_path_factory):
    store = tmp_path_factory.mktemp("produced")
    config = ServiceConfig(target="tiny", backend="file", store=str(store), port=0, token=TOKEN, max_batch=4, batch_wait_ms=200)
    with HiddenStateService(config, target=tiny_target) as svc:
        yield svc


def body(key: str, ids: list[int], **extra) -> dict:
    return {"key": key, "token_ids": ids, "slots": [s.to_json() for s in SLOTS], "dtype": "float32", **extra}


def post(url: str, data: bytes, token: str | None = TOKEN) -> tuple[int, dict]:
    request = urllib.request.Request(url + "/extract", data=data, method="POST")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_extract_stores_what_a_local_capture_computes(service, tiny_target):
    client = ProducerClient([service.url], token=TOKEN)
    assert client.describe_target()["fingerprint"] == tiny_target.fingerprint
    ids = [[5, 17, 300, 42, 9, 1000, 3], [8, 8, 8, 12]]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # concurrent requests share one forward pass
        replies = list(pool.map(lambda i: client.extract(body(f"k/{i}", ids[i % 2]))[1], range(4)))
    assert [r["key"] for r in replies] == [f"k/{i}" for i in range(4)]
    assert service.health()["largest_batch"] > 1
    deadline = time.monotonic() + 10  # the worker adds a batch's busy time after its replies went out
    while service.health()["busy_s"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert service.health()["busy_s"] > 0
    store = FileBackend(service.config.store, create=False)
    local = HiddenStateCapture(tiny_target.model, SLOTS)([torch.tensor(x) for x in ids])
    for i in range(4):
        payload = store.get(f"k/{i}")
        hidden, last = local[i % 2]
        assert payload.slots == SLOTS and torch.equal(payload.token_ids, torch.tensor(ids[i % 2]))
        torch.testing.assert_close(payload.hidden_states, hidden, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(payload.last_hidden, last, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "data, token, status, message",
    [
        (json.dumps(body("a", [1, 2])).encode(), "wrong", 401, "bearer token"),
        (json.dumps(body("a", [1, 2])).encode(), None, 401, "bearer token"),
        (b"{not json", TOKEN, 400, "not valid JSON"),
        (b"[1, 2]", TOKEN, 400, "must be a JSON object"),
        (json.dumps({**body("a", [1]), "slots": [{"layer": 6, "side": "output"}]}).encode(), TOKEN, 400, "layer index 6 is out of range"),
        (json.dumps({**body("a", [1]), "slots": [{"layer": 1}]}).encode(), TOKEN, 400, "slots[0]: the field 'side' is missing"),
        (json.dumps(body("a", [1, 10**7])).encode(), TOKEN, 400, "outside the target's vocabulary"),
        (json.dumps(body("a", [])).encode(), TOKEN, 400, "non-empty list of integers"),
        (json.dumps(body("", [1])).encode(), TOKEN, 400, "'key' must be"),
        (
            json.dumps(body("a", [1], dtype="int8")).encode(),
            TOKEN,
            400,
            "dtype must be one of 'bfloat16', 'float16', 'float32', got a string \"int8\"",
        ),
        (json.dumps(body("a", [1], extra=1)).encode(), TOKEN, 400, "unknown field"),
        (json.dumps(body("a", [1], target_fingerprint="f" * 16)).encode(), TOKEN, 409, "fingerprint"),
    ],
)
def test_bad_requests_get_a_4xx_with_a_clear_message(service, data, token, status, message):
    code, reply = post(service.url, data, token)
    assert code == status and message in reply["error"]
    assert not FileBackend(service.config.store, create=False).exists("a")


def test_unknown_path_and_client_errors(service):
    for method, path in (("GET", "/nope"), ("POST", "/nope"), ("GET", "/extract"), ("POST", "/health")):
        request = urllib.request.Request(
            service.url + path, data=b"{}" if method == "POST" else None, method=method, headers={"Authorization": f"Bearer {TOKEN}"}
        )
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, timeout=10)
        assert err.value.code == 404 and "POST /extract" in json.loads(err.value.read())["error"], (method, path)
    client = ProducerClient([service.url], token=TOKEN)
    with pytest.raises(SpecdraftError, match=r"refused the request \(400\).*out of range"):
        client.extract({**body("b", [1]), "slots": [{"layer": 99, "side": "input"}]})


def test_a_busy_port_is_a_clear_error(service, tiny_target):
    port = int(service.url.rsplit(":", 1)[1])
    with pytest.raises(SpecdraftError, match=f"cannot listen on 127.0.0.1:{port}.*another --port"):
        HiddenStateService(ServiceConfig(target="t", backend="file", store=service.config.store, port=port), target=tiny_target)


def test_non_loopback_bind_requires_a_token():
    with pytest.raises(SpecdraftError, match="--token"):
        ServiceConfig(target="t", backend="file", store="x", host="0.0.0.0")
    ServiceConfig(target="t", backend="file", store="x", host="0.0.0.0", token="t")
    ServiceConfig(target="t", backend="file", store="x", host="localhost")
