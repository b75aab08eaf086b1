"""Hidden-state payloads in a Mooncake distributed store, for producers and consumers on other nodes.

Location: ``mooncake://HOST:PORT/NAMESPACE[?option=value&...]`` where HOST:PORT is the master's RPC
address, NAMESPACE separates runs sharing one master, and the options are the fields of
:class:`MooncakeBackendConfig` (e.g. ``?segment_mb=0&admin=127.0.0.1:9003``); keyword options
given to :func:`open_backend` override the URL.

Object layout for sample ``K`` (quoted, so ``/`` in sample ids is safe) in namespace ``NS``::

    NS/s/K/hidden_states   raw tensor bytes, row-major, as recorded in the manifest
    NS/s/K/token_ids
    NS/s/K/last_hidden
    NS/s/K/manifest        JSON, written LAST: {"format", "format_version", "status": "ok",
                           "payload": <HiddenStatePayload.manifest>, "nbytes": {tensor: n}}
                           or, when the producer failed: {"status": "error", "error": "..."}
    NS/store-manifest      the store-level manifest (``write_manifest``)

Protocol: the producer writes the tensor objects, then the manifest. A Mooncake put returns only
once the object is complete, so a consumer that polls the manifest never sees one before its
tensors. If writing fails, the producer removes what it wrote and publishes an error manifest,
so a waiting consumer fails at once with the producer's reason instead of timing out. The consumer
fetches the tensors straight into freshly allocated tensors (registered memory, no extra copy),
verifies checksums with :meth:`HiddenStatePayload.verify`, and may delete the sample after reading.
Mooncake 0.3.13.post1 never frees an object's old allocation when an upsert gives it another size
(verified), so the store manifest is removed before it is rewritten. Sample tensors are still
upserted, because a put must replace the debris of a killed producer, which Mooncake refuses to
remove (-703); re-putting a sample with another length leaks its old allocation.

``keys()``: Mooncake's client API cannot list keys, and a shared key index would need an atomic
read-modify-write that Mooncake lacks. ``keys()`` therefore asks the master's admin HTTP server
(``/get_all_keys``, bound to the master host); pass its address as the ``admin`` option (shown by
``specdraft store status``). Without it ``keys()`` raises. ``recover()`` removes nothing: debris of
a killed producer (tensors without a manifest) cannot be told apart from another producer's write
in progress; a later ``put`` of that key overwrites it.
"""

from __future__ import annotations

import dataclasses
import json
import time
import typing
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

import numpy as np
import torch

from specdraft.errors import SpecdraftError
from specdraft.hidden_states.backends.base import BACKENDS, HiddenStateBackend
from specdraft.hidden_states.payload import STORAGE_DTYPES, TENSOR_KEYS, HiddenStatePayload
from specdraft.integrations.mooncake.client import MooncakeClient, MooncakeClientConfig, parse_address, shared_client
from specdraft.utils.config import config_field, require_finite

OBJECT_FORMAT = "specdraft.mooncake_sample"
OBJECT_FORMAT_VERSION = 1
SCHEME = "mooncake"
_TORCH_DTYPES = {**STORAGE_DTYPES, "int64": torch.int64}


@dataclass(frozen=True)
class MooncakeBackendConfig:
    namespace: str = config_field(help="prefix of every object of this store, so runs can share one master")
    client: MooncakeClientConfig = config_field(MooncakeClientConfig(), help="transport settings (master address, memory, protocol)")
    admin: str | None = config_field(None, help="HOST:PORT of the master's admin/metrics HTTP server; needed only by keys()")
    wait_s: float = config_field(30.0, help="how long get() polls for a sample's manifest before giving up")
    poll_s: float = config_field(0.01, help="interval between manifest polls")
    zero_copy: bool = config_field(True, help="move tensors from/into registered tensor memory instead of byte copies")
    delete_after_read: bool = config_field(False, help="get() deletes the sample once it is verified (streaming consumers)")
    force_delete: bool = config_field(
        True, help="delete without waiting for read leases; safe because reads are checksum-verified, so a racing reader fails loudly"
    )

    def __post_init__(self) -> None:
        require_finite(self)
        if not self.namespace or "/" in self.namespace:
            raise SpecdraftError(f"Mooncake namespace {self.namespace!r} must be non-empty and contain no '/'")
        if self.admin is not None:
            parse_address(self.admin, what="Mooncake admin address")


def parse_location(location: str, **options: Any) -> MooncakeBackendConfig:
    """``mooncake://HOST:PORT/NS?opt=v`` (+ keyword overrides) -> config; client fields may be given flat."""
    parts = urlsplit(location)
    namespace = parts.path.strip("/")
    if parts.scheme != SCHEME or not parts.netloc or not namespace:
        raise SpecdraftError(f"Mooncake location {location!r} is not mooncake://HOST:PORT/NAMESPACE (e.g. mooncake://127.0.0.1:50051/run1)")
    values: dict[str, Any] = dict(parse_qsl(parts.query, strict_parsing=False))
    values.update(options)
    client_fields = _typed_fields(MooncakeClientConfig)
    backend_fields = _typed_fields(MooncakeBackendConfig)
    client_values: dict[str, Any] = {"master": parts.netloc}
    backend_values: dict[str, Any] = {"namespace": namespace}
    for name, value in values.items():
        if name in client_fields:
            client_values[name] = _coerce(value, client_fields[name], name, location)
        elif name in backend_fields and name not in ("namespace", "client"):
            backend_values[name] = _coerce(value, backend_fields[name], name, location)
        else:
            known = sorted((set(client_fields) | set(backend_fields)) - {"namespace", "client", "master"})
            raise SpecdraftError(f"unknown Mooncake option {name!r} in {location!r}; known: {', '.join(known)}")
    return MooncakeBackendConfig(client=MooncakeClientConfig(**client_values), **backend_values)


def _typed_fields(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(value: Any, tp: Any, name: str, location: str) -> Any:
    if not isinstance(value, str):
        return value
    base = next((a for a in typing.get_args(tp) if a is not type(None)), tp)
    if base is str:
        return value
    if base is bool:
        if value.lower() in ("1", "true", "yes"):
            return True
        if value.lower() in ("0", "false", "no"):
            return False
    else:
        try:
            return base(value)
        except ValueError:
            pass
    raise SpecdraftError(f"Mooncake option {name}={value!r} in {location!r} is not a valid {getattr(base, '__name__', base)}")


@BACKENDS.register("mooncake")
class MooncakeBackend(HiddenStateBackend):
    def __init__(self, location: str, *, client: MooncakeClient | None = None, **options: Any):
        self.config = parse_location(location, **options)
        self.location = location
        self.client = client or shared_client(self.config.client)
        self._prefix = f"{self.config.namespace}/s/"

    # -- object names ----------------------------------------------------------------------------

    def _base(self, key: str) -> str:
        return self._prefix + quote(key, safe="")

    def manifest_key(self, key: str) -> str:
        return self._base(key) + "/manifest"

    def tensor_keys(self, key: str) -> dict[str, str]:
        return {name: f"{self._base(key)}/{name}" for name in TENSOR_KEYS}

    def _where(self, key: str) -> str:
        return f"{self.location} sample {key!r}"

    def stored_size(self, payload: HiddenStatePayload) -> int:
        return sum(int(getattr(payload, name).nbytes) for name in TENSOR_KEYS)  # as put counts them

    def producer_location(self) -> str:
        """This location with ``segment_mb=0``: objects must not live in a producer that may exit first."""
        parts = urlsplit(self.location)
        query = [(k, v) for k, v in parse_qsl(parts.query) if k != "segment_mb"] + [("segment_mb", "0")]
        return urlunsplit(parts._replace(query=urlencode(query, safe=":,")))

    # -- producer --------------------------------------------------------------------------------

    def put(self, key: str, payload: HiddenStatePayload) -> int:
        """Tensors first, manifest last; on failure remove the partial objects and publish an error."""
        if payload.sample_id != key:
            raise SpecdraftError(f"payload of sample {payload.sample_id!r} cannot be stored under key {key!r}")
        manifest_key = self.manifest_key(key)
        tensor_keys = self.tensor_keys(key)
        # A consumer must never pair an old manifest with new tensors: retract it first.
        self.client.remove([manifest_key], force=self.config.force_delete)
        arrays = {tensor_keys[name]: _byte_view(getattr(payload, name)) for name in TENSOR_KEYS}
        try:
            if self.config.zero_copy:
                self.client.put_arrays(arrays)
            else:
                self.client.put_many(arrays)
        except Exception as exc:
            self.publish_error(key, f"{type(exc).__name__}: {exc}")
            raise SpecdraftError(f"{self._where(key)}: storing the tensors failed ({exc}); an error manifest was published") from exc
        record = {
            "format": OBJECT_FORMAT,
            "format_version": OBJECT_FORMAT_VERSION,
            "status": "ok",
            "payload": payload.manifest,
            "nbytes": {name: int(arrays[tensor_keys[name]].nbytes) for name in TENSOR_KEYS},
        }
        self.client.put(manifest_key, json.dumps(record, sort_keys=True).encode())
        return self.stored_size(payload)

    def publish_error(self, key: str, message: str) -> None:
        """Remove ``key``'s tensor objects and publish an error manifest, so consumers fail fast with ``message``."""
        self.client.remove(list(self.tensor_keys(key).values()), force=True)
        record = {"format": OBJECT_FORMAT, "format_version": OBJECT_FORMAT_VERSION, "status": "error", "error": message}
        self.client.put(self.manifest_key(key), json.dumps(record, sort_keys=True).encode())

    # -- consumer --------------------------------------------------------------------------------

    def _read_record(self, key: str, *, wait_s: float) -> dict | None:
        deadline = time.monotonic() + wait_s
        while True:
            raw = self.client.get(self.manifest_key(key))
            if raw is not None:
                try:
                    record = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    raise SpecdraftError(f"{self._where(key)}: the manifest object is not JSON ({exc}); re-extract it") from None
                if record.get("format") != OBJECT_FORMAT or record.get("format_version") != OBJECT_FORMAT_VERSION:
                    raise SpecdraftError(
                        f"{self._where(key)}: manifest format {record.get('format')!r} v{record.get('format_version')!r} "
                        f"is not {OBJECT_FORMAT!r} v{OBJECT_FORMAT_VERSION}"
                    )
                return record
            if time.monotonic() >= deadline:
                return None
            time.sleep(self.config.poll_s)

    @property
    def deletes_on_read(self) -> bool:
        return self.config.delete_after_read

    def get(self, key: str) -> HiddenStatePayload:
        record = self._read_record(key, wait_s=self.config.wait_s)
        if record is None:
            raise SpecdraftError(
                f"{self._where(key)}: no manifest appeared within {self.config.wait_s:g} s; is a producer writing this "
                f"namespace to master {self.config.client.master}? (raise wait_s to wait longer)"
            )
        if record.get("status") != "ok":
            raise SpecdraftError(f"{self._where(key)}: the producer failed: {record.get('error')}")
        manifest = record["payload"]
        tensor_keys = self.tensor_keys(key)
        tensors = {}
        for name in TENSOR_KEYS:
            info = manifest["tensors"][name]
            if info["dtype"] not in _TORCH_DTYPES:
                raise SpecdraftError(f"{self._where(key)}: tensor {name!r} has unsupported dtype {info['dtype']!r}")
            tensors[name] = torch.empty(info["shape"], dtype=_TORCH_DTYPES[info["dtype"]])
        views = {tensor_keys[name]: _byte_view(tensors[name]) for name in TENSOR_KEYS}
        if self.config.zero_copy:
            got = self.client.get_into_arrays(views)
        else:
            blobs = self.client.get_many(views)
            got = {}
            for k, blob in blobs.items():
                got[k] = None if blob is None else len(blob)
                if blob is not None and len(blob) == views[k].nbytes:
                    views[k][:] = np.frombuffer(blob, dtype=np.uint8)
        for name in TENSOR_KEYS:
            n, expected = got[tensor_keys[name]], record["nbytes"][name]
            if n is None:
                raise SpecdraftError(
                    f"{self._where(key)}: tensor object {name!r} is missing although its manifest exists (deleted meanwhile?)"
                )
            if n != expected:
                raise SpecdraftError(
                    f"{self._where(key)}: tensor object {name!r} has {n} bytes, the manifest says {expected}; re-extract it"
                )
        payload = HiddenStatePayload(manifest=manifest, **tensors)
        payload.verify(source=self._where(key))
        if payload.sample_id != key:
            raise SpecdraftError(f"{self._where(key)}: holds sample {payload.sample_id!r}, expected {key!r}; re-extract it")
        if self.config.delete_after_read:
            self.delete(key)
        return payload

    def exists(self, key: str) -> bool:
        """True once a complete payload (not an error manifest) is published."""
        record = self._read_record(key, wait_s=0)
        return record is not None and record.get("status") == "ok"

    def delete(self, key: str) -> None:
        """Manifest first (so no new reader starts), then the tensors."""
        self.client.remove([self.manifest_key(key)], force=self.config.force_delete)
        self.client.remove(list(self.tensor_keys(key).values()), force=self.config.force_delete)

    def keys(self) -> list[str]:
        if self.config.admin is None:
            raise SpecdraftError(
                f"{self.location}: Mooncake cannot list keys through its client; add ?admin=HOST:METRICS_PORT "
                "(the master's metrics address, see `specdraft store status`) to list them via the master"
            )
        try:
            with urllib.request.urlopen(f"http://{self.config.admin}/get_all_keys", timeout=10) as response:
                listing = response.read().decode().splitlines()
        except (urllib.error.URLError, OSError) as exc:
            raise SpecdraftError(f"cannot list keys from the Mooncake admin server at {self.config.admin} ({exc})") from None
        suffix = "/manifest"
        candidates = sorted(
            unquote(name[len(self._prefix) : -len(suffix)])
            for name in listing
            if name.startswith(self._prefix) and name.endswith(suffix) and "/" not in name[len(self._prefix) : -len(suffix)]
        )
        raws = self.client.get_many([self.manifest_key(k) for k in candidates])
        return [k for k in candidates if _is_ok(raws[self.manifest_key(k)])]

    # -- store manifest --------------------------------------------------------------------------

    def _store_manifest_key(self) -> str:
        return f"{self.config.namespace}/store-manifest"

    def read_manifest(self) -> dict | None:
        raw = self.client.get(self._store_manifest_key())
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise SpecdraftError(
                f"{self.location}: the store manifest object is corrupt ({exc}); delete it and rerun `specdraft extract`"
            ) from None

    def write_manifest(self, manifest: dict) -> None:
        """Remove, then put: Mooncake 0.3.13.post1 never frees the old allocation when an upsert
        changes an object's size (verified), and the count in the manifest changes its size. A
        reader racing this rewrite sees no manifest and fails loudly; extraction rewrites it only
        at its start and end."""
        self.delete_manifest()
        self.client.put(self._store_manifest_key(), json.dumps(manifest, indent=2, sort_keys=True).encode())

    def delete_manifest(self) -> None:
        self.client.remove([self._store_manifest_key()], force=self.config.force_delete)


def _byte_view(t: torch.Tensor) -> np.ndarray:
    """The tensor's memory as a flat uint8 array (no copy; bfloat16 has no numpy dtype)."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise SpecdraftError("Mooncake stores contiguous CPU tensors only")
    return t.reshape(-1).view(torch.uint8).numpy()


def _is_ok(raw: bytes | None) -> bool:
    if raw is None:
        return False
    try:
        return json.loads(raw).get("status") == "ok"
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return False
