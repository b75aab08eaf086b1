"""Online training end to end on loopback: a Mooncake master, two producer processes, the trainer.

Producers are separate processes (``specdraft serve-hidden-states``, i.e. spawned, never forked) with
``segment_mb=0``; the trainer's process holds the store memory. Kept lean: a 6-layer random Llama,
14 short samples, a 1-layer DFlash drafter, one epoch.
"""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from specdraft.cli.main import main
from specdraft.hidden_states.capture import HiddenStateCapture
from specdraft.hidden_states.layers import spread_output_slots
from specdraft.integrations.mooncake.master import MooncakeMaster
from specdraft.train.batches import DELIVERY_LOG, open_sample_source
from specdraft.train.config import TrainConfig
from specdraft.train.trainer import train
from test_online import make_prepared

pytestmark = pytest.mark.slow  # producer processes load torch and a target
NUM = 14
DFLASH = {"num_layers": 1, "block_size": 4, "max_anchors": 8, "intermediate_size": 64}


def location(master, namespace: str, **options) -> str:
    admin = f"{master.state['host']}:{master.state['metrics_port']}"
    query = "&".join(f"{k}={v}" for k, v in {"admin": admin, **options}.items())
    return f"mooncake://{master.address}/{namespace}?{query}"


class Producers:
    """``count`` producer processes on free loopback ports; their URLs are read from the ready line."""

    def __init__(self, target_dir, store: str, count: int, log_dir):
        self.procs = []
        self.urls = []
        for i in range(count):
            log = open(log_dir / f"producer-{i}.log", "w")
            cmd = [
                sys.executable,
                "-m",
                "specdraft.cli.main",
                "serve-hidden-states",
                "--target",
                str(target_dir),
                "--backend",
                "mooncake",
                "--store",
                store,
                "--port",
                "0",
                "--num-threads",
                "1",
                "--max-batch",
                "4",
            ]
            self.procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True))
        for proc in self.procs:
            line = proc.stdout.readline()
            assert line, f"a producer exited before it was ready (see {log_dir})"
            self.urls.append(json.loads(line)["url"])

    def kill(self, i: int) -> None:
        self.procs[i].send_signal(signal.SIGKILL)
        self.procs[i].wait(timeout=30)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            proc.wait(timeout=60)


@pytest.fixture(scope="module")
def prepared(tiny_target, tmp_path_factory):
    return make_prepared(tmp_path_factory.mktemp("prepared") / "data", tiny_target, num=NUM, seed=3)


def config(tmp_path, prepared, master, namespace, producers, tiny_llama_dir, **kw) -> TrainConfig:
    values = dict(
        method="dflash",
        target=str(tiny_llama_dir),
        out=str(tmp_path / "run"),
        model=DFLASH,
        data_mode="online",
        dataset=str(prepared),
        producers=producers.urls,
        store=location(master, namespace, segment_mb=64, buffer_mb=8),
        stream_dtype="float32",
        prefetch=4,
        pack_tokens=48,
        batch_rows=1,
        val_fraction=0.0,
        eval_interval=0,
        checkpoint_interval=0,
        dtype="fp32",
        num_threads=1,
        seed=1,
    )
    values.update(kw)
    return TrainConfig(**values)


def delivered(out) -> list[str]:
    return [json.loads(line)["sample_id"] for line in (out / DELIVERY_LOG).read_text().splitlines()]


def test_online_training_with_two_producers(master, prepared, tiny_llama_dir, tiny_target, tmp_path, capsys):
    """`specdraft train --data-mode online --producers URL1,URL2 --store mooncake://...`"""
    with_producers = Producers(tiny_llama_dir, location(master, "e2e", segment_mb=0), 2, tmp_path)
    try:
        cfg = config(tmp_path, prepared, master, "e2e", with_producers, tiny_llama_dir)
        # what the trainer will receive equals a local capture of the same tokens
        with open_sample_source(cfg) as source:
            slots = spread_output_slots(tiny_target.num_layers)
            assert source.slots == slots
            capture = HiddenStateCapture(tiny_target.model, slots)
            for i in (0, 5):
                item = source[i]
                hidden, last = capture([item["token_ids"]])[0]
                torch.testing.assert_close(item["hidden_states"], hidden, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(item["last_hidden"], last, rtol=1e-5, atol=1e-5)
        os.remove(tmp_path / "run" / DELIVERY_LOG)
        argv = [
            "train",
            "--method",
            "dflash",
            "--target",
            str(tiny_llama_dir),
            "--out",
            str(tmp_path / "run"),
            "--data-mode",
            "online",
            "--dataset",
            str(prepared),
            "--producers",
            ",".join(with_producers.urls),
            "--store",
            cfg.store,
            "--stream-dtype",
            "float32",
            "--prefetch",
            "4",
            "--model",
            "num_layers=1,block_size=4,max_anchors=8,intermediate_size=64",
            "--pack-tokens",
            "48",
            "--val-fraction",
            "0",
            "--eval-interval",
            "0",
            "--checkpoint-interval",
            "0",
            "--dtype",
            "fp32",
            "--num-threads",
            "1",
        ]
        assert main(argv) == 0
    finally:
        with_producers.close()
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["completed"] and result["step"] == result["total_steps"] > 1
    counts = collections.Counter(delivered(tmp_path / "run"))
    assert set(counts.values()) == {1} and len(counts) == NUM  # one epoch: every sample exactly once
    records = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert all(0.0 <= r["fetch_fraction"] <= 1.0 for r in records if r["split"] == "train")
    assert master.metrics()["master_key_count"] == 0  # nothing left in the store


class QuickReleaseMaster:
    """A mooncake_master that releases puts cut off by a killed client after 3 s (the default is 600 s).

    Objects of an unfinished put cannot be removed (-703) until then, so this is what lets the
    source's cleanup leave an empty store after a producer is killed in the middle of a write.
    """

    def __init__(self):
        from specdraft.integrations.mooncake.master import free_port, master_command

        port, metrics_port = free_port(), free_port()
        self.state = {"host": "127.0.0.1", "port": port, "metrics_port": metrics_port}
        self.address = f"127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            master_command()
            + [
                "--rpc_address=127.0.0.1",
                f"--rpc_port={port}",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={metrics_port}",
                "--enable_http_metadata_server=false",
                "--default_kv_lease_ttl=300",
                "--put_start_discard_timeout_sec=2",
                "--put_start_release_timeout_sec=3",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        from specdraft.integrations.mooncake.client import check_reachable

        deadline = time.monotonic() + 30
        while True:
            try:
                check_reachable("127.0.0.1", port, timeout=0.5)
                break
            except Exception:
                assert time.monotonic() < deadline and self.proc.poll() is None, "mooncake_master did not start"
                time.sleep(0.1)

    def metrics(self) -> dict:
        from specdraft.integrations.mooncake.master import read_metrics

        return read_metrics("127.0.0.1", self.state["metrics_port"])

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def test_killing_a_producer_mid_run_loses_no_sample(prepared, tiny_llama_dir, tmp_path):
    master = QuickReleaseMaster()
    try:
        _killing_a_producer(master, prepared, tiny_llama_dir, tmp_path)
    finally:
        master.close()


def _killing_a_producer(master, prepared, tiny_llama_dir, tmp_path):
    with_producers = Producers(tiny_llama_dir, location(master, "fault", segment_mb=0), 2, tmp_path)
    try:
        cfg = config(tmp_path, prepared, master, "fault", with_producers, tiny_llama_dir, prefetch=6)
        source = open_sample_source(cfg)

        def kill_after_three() -> None:
            deadline = time.monotonic() + 300
            while len(source.delivered) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            with_producers.kill(1)

        killer = threading.Thread(target=kill_after_three)
        killer.start()
        with source:
            result = train(cfg, dataset=source)
        killer.join()
    finally:
        with_producers.close()
    assert result.completed
    assert source.counters["retries"] >= 1
    assert sorted(source.delivered) == sorted(f"on/{i}" for i in range(NUM))  # exactly once each
    assert delivered(tmp_path / "run") == source.delivered
    assert master.metrics()["master_key_count"] == 0


def consume_across_restart(options_json: str) -> None:
    """Child process (a trainer's data side): read sample 0, wait for the test to restart the master, read sample 1.

    A child, because Mooncake's client can crash natively (SIGSEGV) when used after its master restarted.
    """
    from specdraft.errors import SpecdraftError
    from specdraft.hidden_states.data_modes import DATA_MODES, SourceOptions
    from specdraft.hidden_states.layers import LayerSlot

    values = json.loads(options_json)
    source = DATA_MODES.get("online")(SourceOptions(**values, slots=lambda n: [LayerSlot(1, "output")]))
    print("got", source[0]["sample_id"], flush=True)
    sys.stdin.readline()
    try:
        source[1]
    except SpecdraftError as exc:
        print("error:", exc, flush=True)
    os._exit(0)


def test_a_master_restart_stops_training_with_a_clear_error(tiny_llama_dir, tiny_target, tmp_path):
    from specdraft.integrations.mooncake.master import free_port

    data = make_prepared(tmp_path / "data", tiny_target, num=4)
    port = free_port()
    first = MooncakeMaster(dir=str(tmp_path / "m1"), port=port, lease_ttl_ms=300).__enter__()
    with_producers = None
    try:
        with_producers = Producers(tiny_llama_dir, location(first, "restart", segment_mb=0), 1, tmp_path)
        options = dict(
            data=None,
            dataset=str(data),
            producers=with_producers.urls,
            prefetch=1,
            timeout_s=30,
            store=location(first, "restart", segment_mb=32, buffer_mb=8, wait_s=5),
        )
        code = (
            f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); from specdraft.cli.main import load_plugins; "
            "load_plugins(); import test_online_mooncake as t; t.consume_across_restart(sys.argv[1])"
        )
        consumer = subprocess.Popen(
            [sys.executable, "-c", code, json.dumps(options)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert consumer.stdout.readline().strip() == "got on/0"
        first.__exit__()
        with MooncakeMaster(dir=str(tmp_path / "m2"), port=port, lease_ttl_ms=300):
            consumer.stdin.write("go\n")
            consumer.stdin.flush()
            out, _ = consumer.communicate(timeout=120)
        assert re.match(r"error: every producer failed .*storing .*RPC_FAIL.*Mooncake master restart", out), out
    finally:
        if with_producers is not None:
            with_producers.close()
        if first.state is not None:
            first.__exit__()
