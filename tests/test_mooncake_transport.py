"""The Mooncake byte-blob transport and master lifecycle, against a real mooncake_master on loopback.

This file is also the producer process of the cross-process test: ``python test_mooncake_transport.py
produce MASTER`` writes the blobs of :func:`blob` and exits.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from specdraft.errors import SpecdraftError
from specdraft.integrations.mooncake.client import (
    MooncakeClient,
    MooncakeClientConfig,
    explain_import_error,
    import_store_module,
    shared_client,
)
from specdraft.integrations.mooncake.master import PID_FILE, MooncakeMaster, free_port

# Sizes straddle the 2 MiB byte-copy limit (half the 4 MiB buffer): 6 MiB takes the registered path.
BLOB_SIZES = {"tiny": 1, "small": 1000, "mid": 3 << 19, "large": 6 << 20}


def blob(name: str) -> bytes:
    return np.random.default_rng(len(name) * 1000 + BLOB_SIZES[name]).integers(0, 256, BLOB_SIZES[name], dtype=np.uint8).tobytes()


def client_config(master: str, **kw) -> MooncakeClientConfig:
    return MooncakeClientConfig(master=master, **{"segment_mb": 32, "buffer_mb": 4, **kw})


@pytest.fixture(scope="module")
def client(master):
    """The consumer: it holds the store's memory, so objects outlive the producer process."""
    c = MooncakeClient(client_config(master.address))
    yield c
    c.close()


@pytest.fixture
def clean(client, master):
    """Each test leaves the store as it found it: empty."""
    yield
    assert master.metrics()["master_key_count"] == 0


def test_blobs_round_trip_across_processes(master, client, clean):
    # The producer contributes no memory (segment 0) and exits before anything is read.
    subprocess.run([sys.executable, __file__, "produce", master.address], check=True, timeout=120)
    names = list(BLOB_SIZES)
    got = client.get_many(f"blob/{n}" for n in names)
    assert all(got[f"blob/{n}"] == blob(n) for n in names)
    assert client.get("blob/absent") is None
    assert client.exists_many(["blob/large", "blob/absent"]) == {"blob/large": True, "blob/absent": False}
    # Zero-copy into caller-owned memory (larger than the object is fine).
    out = {f"blob/{n}": np.zeros(BLOB_SIZES[n] + 7, np.uint8) for n in ("mid", "large")}
    sizes = client.get_into_arrays({**out, "blob/absent": np.zeros(4, np.uint8)})
    assert sizes == {"blob/mid": 3 << 19, "blob/large": 6 << 20, "blob/absent": None}
    assert out["blob/large"][: 6 << 20].tobytes() == blob("large")
    assert client.remove([f"blob/{n}" for n in names] + ["blob/absent"]) == len(names)


def test_put_replaces_and_registered_put(client, clean):
    client.put("k", b"old value")
    client.put("k", b"new")
    assert client.get("k") == b"new"
    arr = np.arange(5 << 20, dtype=np.uint8)
    client.put_arrays({"arr": arr})
    assert client.get("arr") == arr.tobytes()
    with pytest.raises(SpecdraftError, match="empty"):
        client.put("empty", b"")
    client.remove(["k", "arr"])


def test_remove_waits_for_read_lease(client, clean, monkeypatch):
    client.put("leased", b"x" * 100)
    assert client.get("leased") == b"x" * 100  # takes a 300 ms read lease
    monkeypatch.setattr(client, "config", dataclasses.replace(client.config, lease_timeout_s=0.0))
    with pytest.raises(SpecdraftError, match="read lease"):
        client.remove(["leased"])
    monkeypatch.setattr(client, "config", dataclasses.replace(client.config, lease_timeout_s=10.0))
    start = time.monotonic()
    assert client.remove(["leased"]) == 1
    assert time.monotonic() - start < 5
    assert not client.exists("leased")


def test_full_store_makes_puts_wait(client, clean, monkeypatch):
    """Hard-pinned objects are never evicted: a full store blocks the producer until space is freed."""
    monkeypatch.setattr(client, "config", dataclasses.replace(client.config, full_timeout_s=0.0))
    block = b"f" * (2 << 20)
    stored = []
    with pytest.raises(SpecdraftError, match="store stayed full"):
        for i in range(64):
            client.put(f"fill/{i}", block)
            stored.append(f"fill/{i}")
    assert 8 <= len(stored) < 16  # 32 MiB of segment
    assert all(client.exists_many(stored).values())  # nothing was evicted
    monkeypatch.setattr(client, "config", dataclasses.replace(client.config, full_timeout_s=30.0))
    freer = threading.Timer(0.3, lambda: client.remove(stored[:2], force=True))
    start = time.monotonic()
    freer.start()
    client.put("fill/late", block)
    freer.join()
    assert time.monotonic() - start >= 0.25
    client.remove(stored[2:] + ["fill/late"], force=True)


def test_threads_share_one_client(master, clean):
    config = client_config(master.address, segment_mb=0)
    shared = shared_client(config)
    assert shared_client(config) is shared
    errors = []

    def work(t: int) -> None:
        try:
            for j in range(20):
                key, value = f"t{t}/{j}", os.urandom(1000 + 97 * j)
                shared.put(key, value)
                if shared.get(key) != value:
                    errors.append(key)
                shared.remove([key], force=True)
        except SpecdraftError as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []


def test_forked_child_is_refused_instead_of_hanging(master):
    config = client_config(master.address, segment_mb=0)
    shared_client(config)
    pid = os.fork()
    if pid == 0:  # the child only runs Python code, then leaves without cleanup
        try:
            shared_client(config)
            code = 1
        except SpecdraftError as exc:
            code = 0 if "spawn" in str(exc) else 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_unreachable_master_fails_fast_and_clearly():
    port = free_port()
    start = time.monotonic()
    with pytest.raises(SpecdraftError, match=rf"127.0.0.1:{port} is unreachable.*specdraft store start"):
        MooncakeClient(MooncakeClientConfig(master=f"127.0.0.1:{port}"))
    assert time.monotonic() - start < 5


def test_missing_package_and_library_messages(monkeypatch):
    missing = ModuleNotFoundError("No module named 'mooncake'", name="mooncake")
    assert "pip install 'specdraft[mooncake]'" in explain_import_error(missing)
    no_verbs = ImportError("libibverbs.so.1: cannot open shared object file: No such file or directory")
    assert "apt-get install -y libibverbs1" in explain_import_error(no_verbs)

    def fail(name):
        raise no_verbs

    monkeypatch.setattr("importlib.import_module", fail)
    with pytest.raises(SpecdraftError, match="apt-get install -y libibverbs1"):
        import_store_module()


def test_bad_addresses_are_rejected():
    with pytest.raises(SpecdraftError, match="HOST:PORT"):
        MooncakeClientConfig(master="localhost")
    with pytest.raises(SpecdraftError, match="protocol"):
        MooncakeClientConfig(protocol="udp")


def test_cli_store_start_status_stop(tmp_path, capsys):
    from specdraft.cli.main import main

    run_dir = tmp_path / "master"
    assert main(["store", "start", "--dir", str(run_dir), "--port", "0", "--lease-ttl-ms", "500"]) == 0
    pid = int((run_dir / PID_FILE).read_text())
    try:
        assert "mooncake master running" in capsys.readouterr().out
        assert main(["store", "status", "--dir", str(run_dir)]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"running: pid {pid}") and "accepting connections" in out and "keys 0" in out
        assert main(["store", "start", "--dir", str(run_dir), "--port", "0"]) == 2
        assert "already running" in capsys.readouterr().err
    finally:
        assert main(["store", "stop", "--dir", str(run_dir)]) == 0
    assert f"stopped mooncake master pid {pid}" in capsys.readouterr().out
    assert not (run_dir / PID_FILE).exists()
    assert main(["store", "status", "--dir", str(run_dir)]) == 1
    assert "not running" in capsys.readouterr().out
    assert main(["store", "stop", "--dir", str(run_dir)]) == 0
    assert "no mooncake master was running" in capsys.readouterr().out


def test_stale_pid_file_is_cleaned(tmp_path, capsys):
    from specdraft.cli.main import main

    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / PID_FILE).write_text(f"{dead.pid}\n")
    assert main(["store", "status", "--dir", str(tmp_path)]) == 1
    assert not (tmp_path / PID_FILE).exists()
    # A stale pid file does not block a new start.
    (tmp_path / PID_FILE).write_text(f"{dead.pid}\n")
    with MooncakeMaster(dir=str(tmp_path), port=0) as m:
        assert int((tmp_path / PID_FILE).read_text()) == m.state["pid"]
    assert not (tmp_path / PID_FILE).exists()


def test_start_refuses_a_busy_port(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(SpecdraftError, match="already in use"):
            MooncakeMaster(dir=str(tmp_path), port=port).__enter__()
    assert not (tmp_path / PID_FILE).exists()


def _produce(master_address: str) -> None:
    producer = MooncakeClient(client_config(master_address, segment_mb=0))
    producer.put_many({f"blob/{n}": blob(n) for n in BLOB_SIZES})
    producer.close()


if __name__ == "__main__":
    assert sys.argv[1] == "produce", sys.argv
    _produce(sys.argv[2])


def test_master_config_orders_put_timeouts():
    from specdraft.integrations.mooncake.master import MasterConfig

    with pytest.raises(SpecdraftError, match="put-discard-timeout-s"):
        MasterConfig(put_discard_timeout_s=40, put_release_timeout_s=30)
