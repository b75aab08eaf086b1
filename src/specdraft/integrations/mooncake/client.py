"""A thread-safe byte-blob client for a Mooncake distributed store (``mooncake-transfer-engine``).

Why a wrapper: the raw ``MooncakeDistributedStore`` reports failures as negative integers, fails
silently in ways that look like success (``get`` returns ``b""`` both for a missing key and for an
object larger than the local transfer buffer; ``put`` of an existing key keeps the old value), and
``setup`` spends ~90 s retrying when the master is down. This module turns all of that into
explicit results and ``SpecdraftError`` messages, and knows nothing about what the blobs mean.

Facts this relies on (checked against mooncake-transfer-engine-non-cuda 0.3.13.post1):
  * Objects live in the memory *segments* that clients contribute (``segment_mb``); when a client
    closes, the objects in its segment are gone. Consumers (or a long-lived process) must hold the
    memory, not short-lived producers.
  * Un-pinned objects are evicted once the store passes its high watermark (90 %); with
    ``with_hard_pin`` they never are and a put fails with -200 (store full) instead, which we turn
    into back-pressure: the put waits for consumers to free space.
  * ``get``/``is_exist`` take a read lease (master flag ``--default_kv_lease_ttl``, 10 s by
    default) during which ``remove`` answers -706; removal is retried until the lease expires.
  * Byte copies go through the client's local buffer (``buffer_mb``); a blob or batch that does not
    fit fails with -600, so batches are capped at half the buffer and larger blobs are sent from
    temporarily registered memory instead.

Network exposure (checked against the 0.3.13.post1 sources, ``transfer_metadata_plugin.cpp``
``findAvailableTcpPort``/``startHandshakeDaemon`` and ``tcp_transport.cpp`` ``TcpContext``): the
engine binds its handshake/RPC socket to ``INADDR_ANY`` and its TCP data socket to ``::`` (dual
stack) unconditionally; ``local_hostname`` (and ``MC_TCP_BIND_ADDRESS``) only set the address
advertised to peers, and no API or variable chooses the bind address. So every client with a
segment, trainers and producers alike, listens on all interfaces on two ports in 15000-17000
(``MC_MIN_RPC_PORT``/``MC_MAX_RPC_PORT``); peers can read and write the registered memory there
without authentication. Mitigation: firewall that range from other hosts (on one machine, drop
non-loopback traffic to it), or run in a network namespace with only the interfaces the cluster
uses. The client reads its own listening sockets after ``setup`` and logs the exposed ports
(``exposed_ports``) so this is never silent.

One client per process and master (:func:`shared_client`): the transfer engine is heavyweight
(listening sockets, a registered buffer, a heartbeat thread), so loader threads share it. The
engine does not survive ``fork``: a child forked from a process that holds a client hangs when it
uses or creates one, so worker processes must be started with ``spawn``.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import astuple, dataclass
from typing import Any

import numpy as np

from specdraft.errors import SpecdraftError
from specdraft.utils.config import config_field, require_finite
from specdraft.utils.net import wildcard_listeners

log = logging.getLogger(__name__)

METADATA_MODE = "P2PHANDSHAKE"
"""Peers exchange segment descriptors directly; no etcd/HTTP metadata server (the master's built-in
HTTP metadata server would listen on 0.0.0.0)."""

OK = 0
NO_AVAILABLE_HANDLE = -200  # store full (no segment has room)
INVALID_PARAMS = -600  # e.g. value larger than the local buffer
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706  # a reader's lease is held; remove later
ERROR_NAMES = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -101: "SEGMENT_NOT_FOUND",
    -103: "CLIENT_NOT_FOUND",
    NO_AVAILABLE_HANDLE: "NO_AVAILABLE_HANDLE (store full)",
    -400: "INVALID_KEY",
    -500: "WRITE_FAIL",
    INVALID_PARAMS: "INVALID_PARAMS",
    -700: "INVALID_WRITE",
    -701: "INVALID_READ",
    -703: "REPLICA_IS_NOT_READY",
    OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    OBJECT_HAS_LEASE: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL",
}

_INSTALL_HINT = "pip install 'specdraft[mooncake]' (or rerun scripts/bootstrap.sh)"
_IBVERBS_HINT = "install the system libraries: apt-get install -y libibverbs1 libnuma1 (as root)"


def error_name(code: int) -> str:
    return f"{code} {ERROR_NAMES.get(code, 'UNKNOWN')}"


def explain_import_error(exc: BaseException) -> str:
    """Turn a failed ``import mooncake.store`` into what the user has to do."""
    text = str(exc)
    if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == "mooncake":
        return f"the Mooncake transport is not installed ({text}); {_INSTALL_HINT}"
    if "libibverbs" in text or "libnuma" in text:
        return f"Mooncake cannot load a system library ({text}); {_IBVERBS_HINT}"
    return f"Mooncake failed to load ({type(exc).__name__}: {text}); reinstall it: {_INSTALL_HINT}"


def import_store_module() -> Any:
    """``mooncake.store``, imported on first use so the core never needs the package."""
    try:
        return importlib.import_module("mooncake.store")
    except (ImportError, OSError) as exc:
        raise SpecdraftError(explain_import_error(exc)) from exc


def parse_address(address: str, *, what: str = "Mooncake master address") -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SpecdraftError(f"{what} {address!r} is not HOST:PORT (e.g. 127.0.0.1:50051)")
    return host, int(port)


def check_reachable(host: str, port: int, *, timeout: float = 2.0) -> None:
    """Fail in seconds, not the ~90 s ``setup`` spends retrying, when no master listens."""
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        raise SpecdraftError(
            f"Mooncake master at {host}:{port} is unreachable ({exc.strerror or exc}); "
            f"start it with `specdraft store start --host {host} --port {port}`, or give the master's HOST:PORT in the mooncake:// URL"
        ) from None


@dataclass(frozen=True)
class MooncakeClientConfig:
    master: str = config_field("127.0.0.1:50051", help="HOST:PORT of the mooncake_master RPC service")
    local_hostname: str = config_field(
        "",
        help="address peers use to reach this process (default: this node's address on the route to the master, "
        "never a loopback address for a remote master)",
    )
    protocol: str = config_field("tcp", help="transfer protocol", metadata={"choices": ["tcp", "rdma"]})
    device_names: str = config_field("", help="RDMA devices for protocol rdma, comma-separated (e.g. mlx5_0,mlx5_1)")
    segment_mb: int = config_field(
        256, help="memory this process contributes to the store in MiB (0 = client only; objects vanish when their holder exits)"
    )
    buffer_mb: int = config_field(64, help="local transfer buffer for byte copies in MiB; larger blobs use registered memory")
    hard_pin: bool = config_field(True, help="never evict objects: a full store makes producers wait instead of dropping unread samples")
    full_timeout_s: float = config_field(300.0, help="how long a put waits for free space while the store is full")
    lease_timeout_s: float = config_field(30.0, help="how long a remove retries while a reader's lease is held (-706)")

    def __post_init__(self) -> None:
        require_finite(self)
        host, port = parse_address(self.master)
        if not self.local_hostname:  # peers on other nodes cannot reach an advertised 127.0.0.1
            from specdraft.utils.net import local_address_towards

            object.__setattr__(self, "local_hostname", local_address_towards(host, port))
        if self.protocol not in ("tcp", "rdma"):
            raise SpecdraftError(f"Mooncake protocol {self.protocol!r} is not 'tcp' or 'rdma'")
        if self.segment_mb < 0 or self.buffer_mb < 1:
            raise SpecdraftError(f"segment_mb must be >= 0 and buffer_mb >= 1 (got {self.segment_mb}, {self.buffer_mb})")


def _as_uint8(data: Any) -> np.ndarray:
    """A flat uint8 view (no copy) of a C-contiguous buffer: bytes, bytearray, memoryview, ndarray."""
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            raise SpecdraftError("Mooncake blobs must be C-contiguous arrays")
        return data.reshape(-1).view(np.uint8)
    return np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)


class MooncakeClient:
    """put/get/exists/remove of named byte blobs; safe to share between threads of one process."""

    def __init__(self, config: MooncakeClientConfig):
        self.config = config
        host, port = parse_address(config.master)
        check_reachable(host, port)
        module = import_store_module()
        self._store = module.MooncakeDistributedStore()
        before = set(wildcard_listeners())
        rc = self._store.setup(
            config.local_hostname,
            METADATA_MODE,
            config.segment_mb << 20,
            config.buffer_mb << 20,
            config.protocol,
            config.device_names,
            config.master,
        )
        if rc != OK:
            raise SpecdraftError(
                f"Mooncake client setup against master {config.master} failed ({error_name(rc)}); check that the master "
                f"is running (`specdraft store status`), that {config.local_hostname!r} is an address of this host and, "
                f"for rdma, that devices {config.device_names!r} exist"
            )
        self.exposed_ports = sorted(set(wildcard_listeners()) - before)
        if self.exposed_ports:
            log.warning(
                "Mooncake's transfer engine listens on all interfaces (TCP ports %s), not only on local_hostname %s: "
                "mooncake-transfer-engine binds 0.0.0.0/:: unconditionally. Block ports 15000-17000 from other hosts "
                "with a firewall (see specdraft/integrations/mooncake/client.py)",
                ", ".join(map(str, self.exposed_ports)),
                config.local_hostname,
            )
        self._replicate = module.ReplicateConfig()
        self._replicate.with_hard_pin = config.hard_pin
        # The local buffer's allocator loses space to alignment and fragmentation: a batch filling
        # it completely fails with -600, so byte copies use at most half of it per call.
        self._batch_bytes = (config.buffer_mb << 20) // 2
        self._closed = False
        self._lock = threading.Lock()  # guards close(); data calls are thread-safe in the C++ client

    # -- writes ---------------------------------------------------------------------------------

    def put(self, key: str, data: Any) -> None:
        """Store ``data`` under ``key``, replacing an existing value."""
        self.put_many({key: data})

    def put_many(self, items: Mapping[str, Any]) -> None:
        """Store several blobs; byte copies are batched up to half the local buffer.

        Not atomic across keys: on an error some keys may be stored (callers that need
        all-or-nothing, like the hidden-state backend, remove them again).
        """
        small: list[tuple[str, np.ndarray]] = []
        large: dict[str, np.ndarray] = {}
        for key, data in items.items():
            arr = _as_uint8(data)
            if arr.nbytes == 0:
                raise SpecdraftError(f"Mooncake cannot store empty blobs ({key!r})")
            if arr.nbytes > self._batch_bytes:
                large[key] = arr
            else:
                small.append((key, arr))
        for chunk in _chunks_by_size(small, self._batch_bytes):
            keys = [k for k, _ in chunk]
            self._retry_full(keys, lambda: self._store.upsert_batch(keys, [a for _, a in chunk], self._replicate))  # noqa: B023 - called now
        if large:
            self.put_arrays(large)

    def put_arrays(self, items: Mapping[str, np.ndarray]) -> None:
        """Zero-copy put: the engine reads straight from the arrays' memory (registered for the call)."""
        arrays = {k: _as_uint8(v) for k, v in items.items()}
        empty = [k for k, a in arrays.items() if a.nbytes == 0]
        if empty:
            raise SpecdraftError(f"Mooncake cannot store empty blobs ({_keys_text(empty)})")
        with _Registered(self._store, arrays.values()):
            keys = list(arrays)
            ptrs = [a.ctypes.data for a in arrays.values()]
            sizes = [a.nbytes for a in arrays.values()]

            def attempt() -> int:
                codes = self._store.batch_upsert_from(keys, ptrs, sizes, self._replicate)
                return next((c for c in codes if c != OK), OK)

            self._retry_full(keys, attempt)

    def _retry_full(self, keys: list[str], attempt: Callable[[], Any]) -> None:
        """Run ``attempt`` until it succeeds; wait (bounded) while the store is full."""
        deadline = time.monotonic() + self.config.full_timeout_s
        delay = 0.01
        while True:
            rc = attempt()
            if rc == OK:
                return
            if rc == NO_AVAILABLE_HANDLE and time.monotonic() < deadline:
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
                continue
            hint = {
                NO_AVAILABLE_HANDLE: f"the store stayed full (or no client contributed memory) for {self.config.full_timeout_s:g} s: "
                "consumers must delete what they read, or more memory must be contributed (segment_mb > 0)",
            }.get(rc, "see the client log above for the cause")
            raise SpecdraftError(f"Mooncake put of {_keys_text(keys)} failed ({error_name(rc)}); {hint}")

    # -- reads ----------------------------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        """The blob under ``key``, or ``None`` if there is none."""
        data = self._store.get(key)
        return data if data else self._get_slow(key)

    def get_many(self, keys: Iterable[str]) -> dict[str, bytes | None]:
        keys = list(keys)
        values = self._store.get_batch(keys) if keys else []
        return {k: (v if v else self._get_slow(k)) for k, v in zip(keys, values)}

    def _get_slow(self, key: str) -> bytes | None:
        """``get`` returned b"": the key is missing, or the object is larger than the local buffer."""
        size = self._store.get_size(key)
        if size == OBJECT_NOT_FOUND:
            return None
        if size < 0:
            raise SpecdraftError(f"Mooncake get_size of {key!r} failed ({error_name(size)})")
        out = np.empty(size, dtype=np.uint8)
        got = self.get_into_arrays({key: out})[key]
        return None if got is None else out.tobytes()

    def get_into_arrays(self, items: Mapping[str, np.ndarray]) -> dict[str, int | None]:
        """Zero-copy get into caller-owned writable arrays; returns bytes read per key (``None`` = missing).

        An array must be at least as large as its object.
        """
        arrays = {k: _as_uint8(v) for k, v in items.items()}
        if not arrays:
            return {}
        if not all(a.flags.writeable for a in arrays.values()):
            raise SpecdraftError("Mooncake get_into needs writable arrays")
        with _Registered(self._store, arrays.values()):
            codes = self._store.batch_get_into(list(arrays), [a.ctypes.data for a in arrays.values()], [a.nbytes for a in arrays.values()])
        result: dict[str, int | None] = {}
        for (key, arr), rc in zip(arrays.items(), codes):
            if rc == OBJECT_NOT_FOUND:
                result[key] = None
            elif rc < 0:
                size = self._store.get_size(key)
                if size == OBJECT_NOT_FOUND:
                    result[key] = None
                    continue
                raise SpecdraftError(
                    f"Mooncake get of {key!r} into a {arr.nbytes}-byte buffer failed ({error_name(rc)}; object size {size})"
                )
            else:
                result[key] = rc
        return result

    def exists(self, key: str) -> bool:
        return self.exists_many([key])[key]

    def exists_many(self, keys: Iterable[str]) -> dict[str, bool]:
        keys = list(keys)
        codes = self._store.batch_is_exist(keys) if keys else []
        bad = [k for k, c in zip(keys, codes) if c < 0]
        if bad:
            raise SpecdraftError(f"Mooncake could not check {_keys_text(bad)}; is the master at {self.config.master} still running?")
        return {k: c == 1 for k, c in zip(keys, codes)}

    # -- removal --------------------------------------------------------------------------------

    def remove(self, keys: Iterable[str], *, force: bool = False) -> int:
        """Remove ``keys`` (missing ones are fine); returns how many existed.

        Retries keys whose read lease is held (-706) for up to ``lease_timeout_s``. ``force``
        skips the lease check: only safe when no other process may be reading these keys.
        """
        pending = list(dict.fromkeys(keys))
        removed = 0
        deadline = time.monotonic() + self.config.lease_timeout_s
        delay = 0.02
        while pending:
            codes = self._store.batch_remove(pending, force)
            removed += sum(c == OK for c in codes)
            leased = [k for k, c in zip(pending, codes) if c == OBJECT_HAS_LEASE]
            failed = [(k, c) for k, c in zip(pending, codes) if c not in (OK, OBJECT_NOT_FOUND, OBJECT_HAS_LEASE)]
            if failed:
                raise SpecdraftError(f"Mooncake remove failed for {_keys_text([k for k, _ in failed])} ({error_name(failed[0][1])})")
            if leased and time.monotonic() >= deadline:
                raise SpecdraftError(
                    f"Mooncake remove of {_keys_text(leased)}: a read lease was still held after {self.config.lease_timeout_s:g} s; "
                    "raise lease_timeout_s or start the master with a shorter `specdraft store start --lease-ttl-ms`"
                )
            pending = leased
            if pending:
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
        return removed

    def close(self) -> None:
        """Unmount this process's segment (its objects disappear) and stop the engine."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._store.close()


class _Registered:
    """Register memory with the transfer engine for one call (~30 us per buffer over TCP)."""

    def __init__(self, store: Any, arrays: Iterable[np.ndarray]):
        self._store = store
        self._arrays = [a for a in arrays if a.nbytes]
        self._done: list[int] = []

    def __enter__(self) -> _Registered:
        for arr in self._arrays:
            rc = self._store.register_buffer(arr.ctypes.data, arr.nbytes)
            if rc != OK:
                self.__exit__()
                raise SpecdraftError(f"Mooncake could not register a {arr.nbytes}-byte buffer ({error_name(rc)})")
            self._done.append(arr.ctypes.data)
        return self

    def __exit__(self, *exc: Any) -> None:
        while self._done:
            self._store.unregister_buffer(self._done.pop())


def _chunks_by_size(items: list[tuple[str, np.ndarray]], limit: int) -> Iterable[list[tuple[str, np.ndarray]]]:
    chunk: list[tuple[str, np.ndarray]] = []
    total = 0
    for key, arr in items:
        if chunk and total + arr.nbytes > limit:
            yield chunk
            chunk, total = [], 0
        chunk.append((key, arr))
        total += arr.nbytes
    if chunk:
        yield chunk


def _keys_text(keys: list[str], limit: int = 3) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


_CLIENTS: dict[tuple, tuple[int, MooncakeClient]] = {}
_CLIENTS_LOCK = threading.Lock()


def shared_client(config: MooncakeClientConfig) -> MooncakeClient:
    """The process-wide client for ``config`` (created on first use; refused in a forked child)."""
    key = astuple(config)
    with _CLIENTS_LOCK:
        if any(pid != os.getpid() for pid, _ in _CLIENTS.values()):
            raise SpecdraftError(
                "this process was forked from one that holds a Mooncake client, and Mooncake's transfer engine does "
                "not survive fork (it would hang); start worker processes with 'spawn' "
                "(e.g. DataLoader(..., multiprocessing_context='spawn'))"
            )
        entry = _CLIENTS.get(key)
        if entry is None or entry[1]._closed:
            entry = (os.getpid(), MooncakeClient(config))
            _CLIENTS[key] = entry
        return entry[1]


def close_shared_clients(master: str | None = None) -> None:
    """Close this process's shared clients, or only those of ``master`` (HOST:PORT); their segments
    and the objects in them go away. Close them before their master stops: a client left without
    its master retries the connection for tens of seconds when the process exits."""
    with _CLIENTS_LOCK:
        for key, (pid, client) in list(_CLIENTS.items()):
            if master is None or client.config.master == master:
                if pid == os.getpid():
                    client.close()
                del _CLIENTS[key]


atexit.register(close_shared_clients)
