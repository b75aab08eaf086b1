"""Run ``mooncake_master`` in the background: start/stop/status with a pid file, a state file and a log.

Layout of the run directory (``--dir``)::

    master.pid    the master's process id (text)
    master.json   {"pid", "host", "port", "metrics_port", "lease_ttl_ms", "log", "command", "started_at"}
    master.log    the master's stdout/stderr (glog)

The master is bound to ``host`` for both its RPC service and its HTTP metrics/admin server, and
its built-in HTTP metadata server stays off (it would listen on 0.0.0.0); clients use peer-to-peer
handshakes instead (``client.METADATA_MODE``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from specdraft.errors import SpecdraftError, setting
from specdraft.utils.config import config_field, require_finite
from specdraft.utils.io import DirKind, atomic_write_bytes, atomic_write_json, json_field_is
from specdraft.utils.lock import claims_output, pid_alive

PID_FILE = "master.pid"
STATE_FILE = "master.json"
LOG_FILE = "master.log"
#: A master's --dir holds its three files and nothing else, so a start never lands among a dataset's or a run's
#: files; a stopped master leaves its log (and a killed one its pid file) without the state file.
MASTER_DIR = DirKind(
    name="Mooncake master directory",
    marker=STATE_FILE,
    recognise=json_field_is("pid", ...),
    files=frozenset({PID_FILE, STATE_FILE, LOG_FILE}),
    scratch=frozenset({PID_FILE, LOG_FILE}),
    replaced=False,
)


@dataclass
class MasterConfig:
    host: str = config_field(
        "127.0.0.1", help="address the master's RPC and metrics servers bind to (this node's cluster IP on a multi-node run)"
    )
    port: int = config_field(50051, help="RPC port clients connect to (0 = any free port)")
    metrics_port: int = config_field(0, help="HTTP metrics/admin port, bound to the same host (0 = any free port)")
    lease_ttl_ms: int = config_field(
        10000, help="read lease: after a get, removal of that object waits this long (must exceed the slowest transfer)"
    )
    put_discard_timeout_s: int = config_field(
        20, help="an unfinished put (its producer died mid-write) is discarded after this many seconds"
    )
    put_release_timeout_s: int = config_field(
        30,
        help="the objects of a discarded put become removable after this many seconds (Mooncake's default is 600; "
        "consumers give up cleaning after 60)",
    )
    dir: str = config_field("runs/mooncake", help="directory for the master's pid, state and log files")
    wait_s: float = config_field(30.0, help="how long start waits for the master to accept connections")

    def __post_init__(self) -> None:
        require_finite(self)
        for name in ("port", "metrics_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise SpecdraftError(f"{setting(name)} {getattr(self, name)} is not a TCP port (0-65535)")
        try:
            socket.getaddrinfo(self.host, None)  # a name that does not resolve fails here, not as a gaierror from bind
        except (socket.gaierror, UnicodeError) as exc:
            raise SpecdraftError(
                f"{setting('host')} {self.host!r} does not resolve ({exc}); use 127.0.0.1 or this node's cluster IP"
            ) from None
        if not self.dir.strip():
            raise SpecdraftError(f"{setting('dir')} is empty: name the directory for the master's pid, state and log files")
        if os.path.exists(self.dir) and not os.path.isdir(self.dir):
            raise SpecdraftError(f"{setting('dir')} {self.dir} is a file; name a directory for the master's pid, state and log files")
        if self.lease_ttl_ms < 1:
            raise SpecdraftError(f"{setting('lease_ttl_ms')} must be >= 1, got {self.lease_ttl_ms}")
        if not 1 <= self.put_discard_timeout_s <= self.put_release_timeout_s:
            raise SpecdraftError(
                f"need 1 <= {setting('put_discard_timeout_s')} ({self.put_discard_timeout_s}) <= {setting('put_release_timeout_s')} "
                f"({self.put_release_timeout_s})"
            )

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def master_command() -> list[str]:
    """The ``mooncake_master`` executable shipped in the wheel (the console script as a fallback)."""
    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.submodule_search_locations:
        binary = Path(next(iter(spec.submodule_search_locations))) / "mooncake_master"
        if binary.is_file() and os.access(binary, os.X_OK):
            return [str(binary)]
    script = Path(sys.executable).parent / "mooncake_master"
    if script.is_file():
        return [str(script)]
    raise SpecdraftError("mooncake_master is not installed; pip install 'specdraft[mooncake]' (or rerun scripts/bootstrap.sh)")


def _pid_alive(pid: int) -> bool:
    """True if ``pid`` is a live mooncake_master (a recycled pid of another program does not count)."""
    if not pid_alive(pid):
        return False
    cmdline = Path(f"/proc/{pid}/cmdline")
    if cmdline.exists():
        try:
            text = cmdline.read_bytes()
        except OSError:
            return False
        if not text:  # a zombie: exited but not yet reaped
            return False
        return b"mooncake_master" in text
    return True


def _accepts(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=0.5).close()
        return True
    except OSError:
        return False


def _read_state(run_dir: Path) -> dict | None:
    """The recorded state if the pid file names a live master; stale files are removed."""
    pid_path = run_dir / PID_FILE
    try:
        pid = int(pid_path.read_text().strip())
    except FileNotFoundError:
        return None
    except ValueError:
        pid = -1
    if pid > 0 and _pid_alive(pid):
        try:
            state = json.loads((run_dir / STATE_FILE).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            state = {}
        state["pid"] = pid
        return state
    pid_path.unlink(missing_ok=True)
    (run_dir / STATE_FILE).unlink(missing_ok=True)
    return None


_CHILDREN: dict[int, subprocess.Popen] = {}


# Two racing starts: the second is refused (a running master recorded in --dir is refused below too).
@claims_output(MASTER_DIR, out=lambda config: config.dir, what=lambda config: setting("dir"))
def start_master(config: MasterConfig) -> dict:
    """Start the master in the background and wait until it accepts connections; returns its state."""
    run_dir = Path(config.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    running = _read_state(run_dir)
    if running is not None:
        raise SpecdraftError(
            f"a Mooncake master from {run_dir} is already running (pid {running['pid']}, "
            f"{running.get('host')}:{running.get('port')}); stop it with `specdraft store stop --dir {run_dir}`"
        )
    config = replace(
        config,
        port=config.port or free_port(config.host),
        metrics_port=config.metrics_port or free_port(config.host),
    )
    if _accepts(config.host, config.port):
        raise SpecdraftError(f"port {config.address} is already in use; choose another {setting('port')} (0 = any free port)")
    command = master_command() + [
        f"--rpc_address={config.host}",
        f"--rpc_port={config.port}",
        f"--metrics_host={config.host}",
        f"--metrics_port={config.metrics_port}",
        f"--default_kv_lease_ttl={config.lease_ttl_ms}",
        f"--put_start_discard_timeout_sec={config.put_discard_timeout_s}",
        f"--put_start_release_timeout_sec={config.put_release_timeout_s}",
        "--enable_http_metadata_server=false",
    ]
    log_path = run_dir / LOG_FILE
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    _CHILDREN[proc.pid] = proc
    deadline = time.monotonic() + config.wait_s
    while not _accepts(config.host, config.port):
        if proc.poll() is not None or time.monotonic() > deadline:
            _terminate(proc.pid)
            tail = _log_tail(log_path)
            hint = (
                "install the system libraries: apt-get install -y libibverbs1 libnuma1"
                if "libibverbs" in tail or "libnuma" in tail
                else f"see {log_path}"
            )
            why = (
                f"exited with code {proc.returncode}"
                if proc.returncode is not None
                else f"did not accept connections within {config.wait_s:.0f} s"
            )
            raise SpecdraftError(f"mooncake_master on {config.address} {why}; {hint}. Last log lines:\n{tail}")
        time.sleep(0.05)
    state = {k: v for k, v in asdict(config).items() if k not in ("dir", "wait_s")}
    state.update(pid=proc.pid, log=str(log_path), command=command, started_at=time.time())
    atomic_write_json(run_dir / STATE_FILE, state)
    atomic_write_bytes(run_dir / PID_FILE, f"{proc.pid}\n".encode())
    return state


def stop_master(run_dir: str | os.PathLike, *, timeout: float = 10.0) -> dict | None:
    """Stop the master recorded in ``run_dir``; returns its state, or ``None`` if none was running."""
    run_dir = Path(run_dir)
    state = _read_state(run_dir)
    if state is None:
        return None
    _terminate(state["pid"], timeout=timeout)
    (run_dir / PID_FILE).unlink(missing_ok=True)
    (run_dir / STATE_FILE).unlink(missing_ok=True)
    return state


def master_status(run_dir: str | os.PathLike) -> dict:
    """``{"running": bool, ...state, "metrics": {...}}``; metrics come from the master's /metrics page."""
    state = _read_state(Path(run_dir))
    if state is None:
        return {"running": False, "dir": str(run_dir)}
    status = {"running": True, "dir": str(run_dir), **state}
    if "host" not in state:  # state file lost or corrupt: the pid is all we know
        return status | {"accepting": False, "metrics": {}}
    status["accepting"] = _accepts(state["host"], state["port"])
    status["metrics"] = read_metrics(state["host"], state["metrics_port"])
    return status


METRICS = ("master_key_count", "master_allocated_bytes", "master_total_capacity_bytes", "master_active_clients")


def read_metrics(host: str, metrics_port: int, *, timeout: float = 2.0) -> dict[str, float]:
    """A few gauges from the master's Prometheus page (empty if it does not answer)."""
    try:
        with urllib.request.urlopen(f"http://{host}:{metrics_port}/metrics", timeout=timeout) as response:
            text = response.read().decode()
    except (urllib.error.URLError, OSError):
        return {}
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in METRICS:
            values[name] = float(value)
    return values


def _terminate(pid: int, *, timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``timeout``; reaps the child if this process started it."""
    proc = _CHILDREN.pop(pid, None)
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None:
            if proc.poll() is not None:
                return
        elif not _pid_alive(pid):
            return
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    if proc is not None:
        proc.wait()


def _log_tail(path: Path, lines: int = 8) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class MooncakeMaster:
    """``with MooncakeMaster(dir=..., port=0) as master:`` runs a master for the block (tests, benchmarks)."""

    def __init__(self, config: MasterConfig | None = None, **overrides: Any):
        self.config = replace(config or MasterConfig(), **overrides)
        self.state: dict | None = None

    @property
    def address(self) -> str:
        if self.state is None:
            raise SpecdraftError("the Mooncake master is not running")
        return f"{self.state['host']}:{self.state['port']}"

    def metrics(self) -> dict[str, float]:
        if self.state is None:
            raise SpecdraftError("the Mooncake master is not running")
        return read_metrics(self.state["host"], self.state["metrics_port"])

    def __enter__(self) -> MooncakeMaster:
        self.state = start_master(self.config)
        return self

    def __exit__(self, *exc: Any) -> None:
        from specdraft.integrations.mooncake.client import close_shared_clients

        close_shared_clients(master=self.address)
        stop_master(self.config.dir)
        self.state = None
