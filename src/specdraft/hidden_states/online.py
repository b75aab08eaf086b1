"""Online and hybrid training data: hidden states requested from producer services while training runs.

Three data modes, dispatched by name through ``DATA_MODES`` (each opener takes ``SourceOptions``):

  offline  the existing hidden-state store (``HiddenStateDataset``) -- nothing is requested.
  online   every sample is requested from a producer (``service.py``), read back through the
           transport backend (Mooncake or a shared directory), verified, and deleted from the
           transport once it is in memory. Nothing is kept.
  hybrid   like online, but a sample already in the local file store (``data``) is read from
           there, and a requested one is written there, so a later epoch or run reads it locally.

``StreamingSource`` has the item interface of ``HiddenStateDataset`` (``sample_id``,
``token_ids``, ``loss_mask``, ``hidden_states``, ``last_hidden``). Prefetching: ``start(order)``
hands it the indices the consumer will ask for, in order; it keeps ``prefetch`` of them in flight
on a thread pool, so ``source[i]`` returns at once when producers keep up. An index asked for out
of that order (validation) is fetched synchronously. ``stats()`` reports the fetch-time fraction:
seconds the consumer spent waiting inside ``__getitem__`` / seconds since ``start``.

Faults: a producer that refuses the connection, times out or answers 5xx is marked down and the
request goes to another producer under a fresh key (a late write of the abandoned key is deleted
at ``close``). A payload that fails verification is deleted and requested once more, then
reported. ``close`` deletes whatever is still in flight or abandoned, so the transport is left
empty (retrying for up to ``cleanup_wait_s`` deletes the store refuses, e.g. objects a killed
producer left half-written). Each delivered sample id is appended to ``delivery_log`` (JSON
lines ``{"sample_id", "wait_s", "at"}``: seconds the consumer waited for it, wall-clock time of the
delivery) when one is given, so a run can prove every sample was delivered exactly once and show
how long each rank waited.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import json
import logging
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator
from urllib.parse import urlsplit

from specdraft.errors import SpecdraftError
from specdraft.hidden_states.layers import LayerSlot
from specdraft.hidden_states.source import SampleSource
from specdraft.registry import Registry

log = logging.getLogger(__name__)


#: How long ``close`` keeps retrying deletes the store refuses. A producer killed mid-write leaves
#: objects Mooncake will not remove (-703 REPLICA_IS_NOT_READY) until its master releases the
#: unfinished put (``mooncake_master --put_start_release_timeout_sec``, 600 s by default).
CLEANUP_WAIT_S = 60.0


class ProducerUnavailable(Exception):
    """A producer did not serve a request (down, timed out, or failed internally); try another."""

    def __init__(self, url: str, message: str):
        super().__init__(message)
        self.url = url


#: How often a producer list file (``--producers @FILE``) is reread.
MEMBERSHIP_REFRESH_S = 2.0


def _check_urls(urls: Iterable[str], where: str) -> list[str]:
    checked = []
    for url in urls:
        url = url.strip().rstrip("/")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise SpecdraftError(f"producer URL {url!r} ({where}) is not http://HOST:PORT")
        checked.append(url)
    return checked


def read_producer_list(path: Path) -> list[str]:
    """Producer URLs in a list file: one per line; blank lines and ``#`` comments are skipped."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise SpecdraftError(f"cannot read the producer list {path} ({exc.strerror or exc})") from None
    return _check_urls((line for line in lines if line.strip() and not line.lstrip().startswith("#")), f"in {path}")


class ProducerClient:
    """Spreads extraction requests over several producer URLs (least in-flight first).

    A producer that fails is skipped for ``down_s`` seconds, then tried again. With ``membership``
    (a file of URLs, ``--producers @FILE``) the list is reread every ``refresh_s`` seconds:
    a URL added there joins once its health check shows the same target, one removed gets no new
    requests (those in flight finish), so producers can be added and retired while training runs.
    """

    def __init__(self, urls: Iterable[str], *, token: str | None = None, timeout_s: float = 120.0, down_s: float = 30.0,
                 membership: str | Path | None = None, refresh_s: float = MEMBERSHIP_REFRESH_S):
        self.membership = Path(membership) if membership else None
        self.urls = read_producer_list(self.membership) if self.membership else _check_urls(urls, "--producers")
        if not self.urls:
            where = f"the producer list {self.membership}" if self.membership else "--producers"
            raise SpecdraftError(f"no producer URLs given in {where}; pass --producers http://HOST:PORT[,http://HOST:PORT...] or @FILE")
        self.token = token
        self.timeout_s = timeout_s
        self.down_s = down_s
        self.refresh_s = refresh_s
        self._lock = threading.Lock()
        self._refreshing = threading.Lock()
        self._last_refresh = time.monotonic()
        self._fingerprint: str | None = None
        self._inflight = {u: 0 for u in self.urls}
        self._down: dict[str, tuple[float, str]] = {}  # url -> (since, reason)
        self._order = itertools.count()

    def _call(self, url: str, path: str, body: dict | None, timeout: float) -> dict:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url + path, data=data, method="GET" if body is None else "POST")
        request.add_header("Content-Type", "application/json")
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read()).get("error", "")
            except (ValueError, AttributeError):
                message = exc.reason
            if exc.code >= 500:
                raise ProducerUnavailable(url, f"{url} answered {exc.code}: {message}") from None
            raise SpecdraftError(f"producer {url} refused the request ({exc.code}): {message}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:  # refused, reset, timed out, garbage
            reason = getattr(exc, "reason", exc)
            raise ProducerUnavailable(url, f"{url} is unreachable ({reason})") from None

    def health(self, url: str) -> dict:
        return self._call(url, "/health", None, timeout=min(self.timeout_s, 10.0))

    def describe_target(self) -> dict:
        """The target all reachable producers serve (they must agree)."""
        infos, errors = {}, []
        for url in self.urls:
            try:
                infos[url] = self.health(url)["target"]
            except ProducerUnavailable as exc:
                errors.append(str(exc))
                self._mark_down(url, str(exc))
        if not infos:
            raise SpecdraftError(f"no producer is reachable: {'; '.join(errors)}; start them with `specdraft serve-hidden-states`")
        fingerprints = {info["fingerprint"] for info in infos.values()}
        if len(fingerprints) > 1:
            listing = ", ".join(f"{u}: {i['name']} ({i['fingerprint']})" for u, i in infos.items())
            raise SpecdraftError(f"the producers serve different targets ({listing}); every producer must run the same target")
        info = next(iter(infos.values()))
        self._fingerprint = info["fingerprint"]
        return info

    def refresh(self) -> None:
        """Reread the membership file (at most every ``refresh_s``); admit new producers, retire unlisted ones."""
        if self.membership is None or time.monotonic() < self._last_refresh + self.refresh_s or not self._refreshing.acquire(blocking=False):
            return
        try:
            self._last_refresh = time.monotonic()
            try:
                wanted = read_producer_list(self.membership)
                if not wanted:  # more likely a write in progress than every producer retired at once
                    raise SpecdraftError(f"the producer list {self.membership} is empty (replace it atomically: write, then rename)")
            except SpecdraftError as exc:
                log.warning("%s; keeping the producers %s", exc, ", ".join(self.urls))
                return
            with self._lock:
                current = list(self.urls)
            admitted = []
            for url in (u for u in wanted if u not in current):
                try:
                    fingerprint = self.health(url)["target"]["fingerprint"]
                except (ProducerUnavailable, KeyError, TypeError) as exc:
                    log.warning("producer %s listed in %s does not answer its health check (%s); not used yet", url, self.membership, exc)
                    continue
                if self._fingerprint is not None and fingerprint != self._fingerprint:
                    log.error("producer %s listed in %s serves another target (fingerprint %s, not %s); not used", url,
                              self.membership, fingerprint, self._fingerprint)
                    continue
                admitted.append(url)
            left = [u for u in current if u not in wanted]
            with self._lock:
                for url in left:
                    self.urls.remove(url)
                    self._down.pop(url, None)
                for url in admitted:
                    self.urls.append(url)
                    self._inflight.setdefault(url, 0)
            for url in admitted:
                log.warning("producer %s joined (listed in %s)", url, self.membership)
            for url in left:
                log.warning("producer %s left (no longer listed in %s); its requests in flight finish", url, self.membership)
        finally:
            self._refreshing.release()

    def unavailable(self) -> dict[str, str]:
        """Producers currently skipped, with the reason each failed."""
        with self._lock:
            return {url: reason for url, (_, reason) in self._down.items()}

    def _mark_down(self, url: str, reason: str) -> None:
        with self._lock:
            self._down[url] = (time.monotonic(), reason)

    def _pick(self, avoid: set[str]) -> str:
        with self._lock:
            now = time.monotonic()
            for url, (since, _) in list(self._down.items()):
                if now - since >= self.down_s:
                    del self._down[url]
            live = [u for u in self.urls if u not in self._down]
            if not live:
                reasons = "; ".join(reason for _, reason in self._down.values())
                raise SpecdraftError(
                    f"every producer failed ({reasons}). If they are down, restart them (`specdraft serve-hidden-states`); if they "
                    "report storage errors (e.g. RPC_FAIL after a Mooncake master restart, which loses every object), fix the "
                    "store, restart the producers, then rerun training to resume from its last checkpoint"
                )
            fresh = [u for u in live if u not in avoid] or live
            tie = next(self._order)
            url = min(fresh, key=lambda u: (self._inflight[u], (self.urls.index(u) - tie) % len(self.urls)))
            self._inflight[url] += 1
            return url

    def extract(self, body: dict, *, avoid: set[str] = frozenset()) -> tuple[str, dict]:
        """Send one request to a live producer (preferring ones not in ``avoid``); returns (url, reply).

        ``ProducerUnavailable`` marks that producer down; the caller retries with a new key.
        """
        self.refresh()
        url = self._pick(set(avoid))
        try:
            return url, self._call(url, "/extract", body, timeout=self.timeout_s)
        except ProducerUnavailable as exc:
            self._mark_down(url, str(exc))
            raise
        finally:
            with self._lock:
                self._inflight[url] -= 1


@dataclass
class SourceOptions:
    """Everything a data-mode opener may need (``TrainConfig`` is where the defaults live)."""

    data: str | None  # offline: the store to read; hybrid: the local file cache
    dataset: str | None  # prepared dataset: sample ids, tokens, loss masks (offline: default the one the store recorded)
    producers: list[str]
    store: str | None  # transport location: a directory (file backend) or mooncake://...
    slots: Callable[[int], list[LayerSlot]] | None  # target layer count -> slots to request
    dtype: str = "bfloat16"
    prefetch: int = 8
    token: str | None = None
    timeout_s: float = 120.0
    delivery_log: str | None = None
    owner: str | None = None  # stable across restarts of one consumer (a trainer rank): see StreamingSource.sweep
    verify: str = "quick"  # offline: how the store is checked before training (``HiddenStateDataset.verify``)


DATA_MODES: Registry[Callable[[SourceOptions], Any]] = Registry("data mode")


@DATA_MODES.register("offline")
def open_offline(options: SourceOptions) -> Any:
    from specdraft.hidden_states.dataset import HiddenStateDataset

    if not options.data:
        raise SpecdraftError("--data is required (or set `data:` in the --config recipe)")
    path = Path(options.data)
    if not path.is_dir():
        raise SpecdraftError(f"--data {path} does not exist; point it at a hidden-state store written by `specdraft extract`")
    return HiddenStateDataset(path, options.dataset, verify=options.verify)  # --dataset overrides the path the manifest recorded (a moved run)


@DATA_MODES.register("online")
def open_online(options: SourceOptions) -> "StreamingSource":
    return StreamingSource.open(options, cache=None)


@DATA_MODES.register("hybrid")
def open_hybrid(options: SourceOptions) -> "StreamingSource":
    from specdraft.hidden_states.backends.file import FileBackend

    if not options.data:
        raise SpecdraftError("hybrid mode needs --data: the local hidden-state directory that caches requested samples")
    return StreamingSource.open(options, cache=FileBackend(options.data))


def backend_name(location: str) -> str:
    """A location's URL scheme names its backend (``mooncake://...``); a plain path is the file backend."""
    from specdraft.hidden_states.backends import BACKENDS

    scheme = urlsplit(location).scheme
    return scheme if scheme in BACKENDS else "file"


class StreamingSource(SampleSource):
    """Online/hybrid sample source; see the module docstring. Close it (or use ``with``) to clean up."""

    def __init__(self, *, prepared: Any, client: ProducerClient, transport: Any, target_info: dict, slots: list[LayerSlot],
                 dtype: str = "bfloat16", prefetch: int = 8, cache: Any = None, delivery_log: str | None = None,
                 owner: str | None = None):
        if prefetch < 1:
            raise SpecdraftError(f"prefetch must be >= 1, got {prefetch}")
        self.prepared = prepared
        self.client = client
        self.transport = transport
        self.cache = cache
        self._target_info = dict(target_info)
        self.slots = list(slots)
        self.dtype = dtype
        self.prefetch = prefetch
        self.sample_ids = list(prepared.sample_ids)
        self.delivered: list[str] = []
        self.counters = collections.Counter()  # requests, retries, refetches, cache_hits
        self._nonce = uuid.uuid4().hex[:8]
        self.owner = owner
        self._keys = itertools.count()
        self._lock = threading.Lock()
        self._live_keys: set[str] = set()  # issued, not yet deleted
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=prefetch, thread_name_prefix="specdraft-prefetch")
        self._order: Iterator[int] | None = None
        self._window: collections.deque[tuple[int, concurrent.futures.Future]] = collections.deque()
        self._started: float | None = None
        self._wait_s = 0.0
        self._delivery_log = Path(delivery_log) if delivery_log else None
        self._log_file: Any = None  # opened on the first delivery (the run directory may not exist before)
        self._closed = False
        self.cleanup_wait_s = CLEANUP_WAIT_S
        if cache is not None:
            self._init_cache()

    @classmethod
    def open(cls, options: SourceOptions, *, cache: Any) -> "StreamingSource":
        from specdraft.data.dataset import PreparedDataset
        from specdraft.hidden_states.backends import open_backend

        if not options.dataset:
            raise SpecdraftError("online/hybrid data needs --dataset: the prepared dataset whose samples are requested")
        if not options.store:
            raise SpecdraftError("online/hybrid data needs --store: where producers write (a shared directory or mooncake://HOST:PORT/NS)")
        if options.slots is None:
            raise SpecdraftError("online/hybrid data needs the layer slots to request")
        prepared = PreparedDataset(options.dataset)
        listed = options.producers[0][1:] if len(options.producers) == 1 and options.producers[0].startswith("@") else None
        client = ProducerClient(options.producers, membership=listed, token=options.token, timeout_s=options.timeout_s)
        target_info = client.describe_target()
        recorded = prepared.target_info
        if recorded.get("fingerprint") != target_info.get("fingerprint"):
            raise SpecdraftError(
                f"dataset {prepared.directory} was prepared for target {recorded.get('name')!r} (fingerprint {recorded.get('fingerprint')}) "
                f"but the producers serve {target_info.get('name')!r} (fingerprint {target_info.get('fingerprint')})"
            )
        slots = options.slots(int(target_info["num_layers"]))
        transport = open_backend(backend_name(options.store), options.store)
        source = cls(prepared=prepared, client=client, transport=transport, target_info=target_info, slots=slots,
                     dtype=options.dtype, prefetch=options.prefetch, cache=cache, delivery_log=options.delivery_log,
                     owner=options.owner)
        source.sweep()
        return source

    # -- the HiddenStateDataset interface ---------------------------------------------------------

    @property
    def target_info(self) -> dict:
        return dict(self._target_info)

    def __len__(self) -> int:
        return len(self.sample_ids)

    def __getitem__(self, index: int) -> dict:
        if self._closed:
            raise SpecdraftError("the streaming data source is closed")
        started = time.perf_counter()
        if self._window and self._window[0][0] == index:
            _, future = self._window.popleft()
            self._top_up()
            item = future.result()
        else:
            item = self._fetch(index)
        waited = time.perf_counter() - started
        self._wait_s += waited
        if self._started is None:
            self._started = started
        self.delivered.append(item["sample_id"])
        if self._delivery_log is not None:
            if self._log_file is None:
                self._delivery_log.parent.mkdir(parents=True, exist_ok=True)
                self._log_file = open(self._delivery_log, "a")
            record = {"sample_id": item["sample_id"], "wait_s": round(waited, 6), "at": round(time.time(), 6)}
            self._log_file.write(json.dumps(record) + "\n")
            self._log_file.flush()
        return item

    # -- prefetching ------------------------------------------------------------------------------

    def start(self, order: Iterable[int]) -> None:
        """Prefetch ``order`` (the indices the consumer will read next, in that order)."""
        self._order = iter(order)
        self._started = time.perf_counter()
        self._wait_s = 0.0
        self._top_up()

    def _top_up(self) -> None:
        while self._order is not None and len(self._window) < self.prefetch:
            index = next(self._order, None)
            if index is None:
                self._order = None
                return
            self._window.append((index, self._pool.submit(self._fetch, index)))

    def stats(self) -> dict:
        elapsed = time.perf_counter() - self._started if self._started is not None else 0.0
        return {"delivered": len(self.delivered), "wait_s": self._wait_s, "elapsed_s": elapsed,
                "fetch_fraction": self._wait_s / elapsed if elapsed > 0 else 0.0, **dict(self.counters)}

    # -- one sample -------------------------------------------------------------------------------

    def _count(self, name: str) -> None:
        with self._lock:
            self.counters[name] += 1

    def _new_key(self, sample_id: str) -> str:
        tag = f"{self.owner}.{self._nonce}" if self.owner else self._nonce
        key = f"{sample_id}#{tag}-{next(self._keys)}"
        with self._lock:
            self._live_keys.add(key)
        return key

    def _drop(self, key: str) -> None:
        self.transport.delete(key)
        with self._lock:
            self._live_keys.discard(key)

    def _try_drop(self, key: str) -> None:
        """Delete ``key`` now if the store lets us; otherwise it stays owned and ``close`` retries."""
        try:
            self._drop(key)
        except SpecdraftError as exc:
            log.warning("%s; retrying when the data source closes", exc)

    def _fetch(self, index: int) -> dict:
        from specdraft.hidden_states.payload import HiddenStatePayload

        sid = self.sample_ids[index]
        row = self.prepared[self.prepared.index_of(sid)]
        if self.cache is not None and self.cache.exists(sid):
            try:
                payload = self.cache.get(sid)
                self._check(payload, row, where=f"{self.cache.location} sample {sid!r}")
                self._count("cache_hits")
                return self._item(sid, row, payload)
            except SpecdraftError as exc:
                log.warning("%s; requesting it from a producer instead", exc)
        body = {"token_ids": row["input_ids"].tolist(), "slots": [s.to_json() for s in self.slots], "dtype": self.dtype,
                "target_fingerprint": self._target_info["fingerprint"]}
        corrupt: str | None = None
        while True:
            key, url = self._request(body, sid)
            try:
                payload = self.transport.get(key)  # verifies checksums, shapes and dtypes
                self._check(payload, row, where=f"{self.transport.location} key {key!r} from {url}")
            except SpecdraftError as exc:
                self._try_drop(key)
                if corrupt is not None:
                    raise SpecdraftError(f"sample {sid!r} arrived corrupt twice: first {corrupt}; then {exc}") from None
                corrupt = str(exc)
                self._count("refetches")
                log.warning("%s; requesting sample %r again", exc, sid)
                continue
            self._try_drop(key)
            break
        payload = HiddenStatePayload(manifest={**payload.manifest, "sample_id": sid}, hidden_states=payload.hidden_states,
                                     token_ids=payload.token_ids, last_hidden=payload.last_hidden)
        if self.cache is not None:
            self.cache.put(sid, payload)
        return self._item(sid, row, payload)

    def _request(self, body: dict, sid: str) -> tuple[str, str]:
        """Ask producers until one stores the sample; a failed attempt's key is abandoned (cleaned at close)."""
        tried: set[str] = set()
        while True:
            key = self._new_key(sid)
            try:
                self._count("requests")
                url, _ = self.client.extract({**body, "key": key}, avoid=tried)
                return key, url
            except ProducerUnavailable as exc:
                self._count("retries")
                tried.add(exc.url)
                log.warning("%s; sending sample %r to another producer", exc, sid)

    def _check(self, payload: Any, row: dict, *, where: str) -> None:
        problems = payload.mismatches(fingerprint=self._target_info["fingerprint"], slots=self.slots, dtype=self.dtype,
                                      token_ids=row["input_ids"])
        if problems:
            raise SpecdraftError(f"{where} is not the requested sample: {'; '.join(problems)}")

    @staticmethod
    def _item(sid: str, row: dict, payload: Any) -> dict:
        return {"sample_id": sid, "token_ids": payload.token_ids, "loss_mask": row["loss_mask"],
                "hidden_states": payload.hidden_states, "last_hidden": payload.last_hidden}

    # -- cache and cleanup ------------------------------------------------------------------------

    def _init_cache(self) -> None:
        """Make the local cache a valid store for later offline training (refuse one made for other settings)."""
        from specdraft.hidden_states.backends.base import (
            STORE_FORMAT_NAME, STORE_FORMAT_VERSION, check_store_dataset, check_store_manifest, dataset_record,
        )

        slots_json = [s.to_json() for s in self.slots]
        existing = self.cache.read_manifest()
        if existing is not None:
            check_store_manifest(existing, location=self.cache.location, target_info=self._target_info, slots=slots_json, dtype=self.dtype)
            check_store_dataset(existing, self.prepared, set(self.cache.keys()), location=self.cache.location,
                                choices="Give hybrid training a new --data cache directory, or delete this one")
            existing["dataset"] = dataset_record(self.prepared)  # the same rows, perhaps with more appended
            self.cache.write_manifest(existing)
            return
        self.cache.write_manifest({
            "format": STORE_FORMAT_NAME, "format_version": STORE_FORMAT_VERSION, "target": self._target_info,
            "slots": slots_json, "dtype": self.dtype, "count": 0, "complete": False,
            "dataset": dataset_record(self.prepared),
        })

    def sweep(self) -> int:
        """Delete keys that an earlier run of this ``owner`` left in the transport; returns how many.

        A consumer that is killed (a trainer rank's host lost) cannot delete the samples it had
        requested, and nobody else knows their keys; its restart, with the same owner, does.
        Needs a transport that can list keys (Mooncake: the ``admin`` option).
        """
        if self.owner is None:
            return 0
        mark, ours = f"#{self.owner}.", f"#{self.owner}.{self._nonce}-"
        try:
            stale = [k for k in self.transport.keys() if mark in k and ours not in k]
        except SpecdraftError as exc:
            log.warning("cannot look for samples an earlier run of this consumer left behind (%s)", exc)
            return 0
        for key in stale:
            try:
                self.transport.delete(key)
            except SpecdraftError as exc:
                log.warning("%s; it stays in %s", exc, self.transport.location)
        if stale:
            log.warning("deleted %d sample(s) that an earlier run of this consumer (%s) left in %s", len(stale), self.owner,
                        self.transport.location)
        return len(stale)

    def close(self) -> None:
        """Stop prefetching, then delete every key still in the transport (in flight or abandoned)."""
        if self._closed:
            return
        self._closed = True
        self._order = None
        for _, future in self._window:
            future.cancel()
        self._pool.shutdown(wait=True)
        self._window.clear()
        with self._lock:
            leftover = sorted(self._live_keys)
        deadline = time.monotonic() + self.cleanup_wait_s
        while leftover:
            failed = {}
            for key in leftover:
                try:
                    self._drop(key)
                except SpecdraftError as exc:
                    failed[key] = exc
            leftover = sorted(failed)
            if leftover and time.monotonic() >= deadline:
                log.warning("%d key(s) could not be deleted from %s within %g s, e.g. %s", len(leftover), self.transport.location,
                            self.cleanup_wait_s, failed[leftover[0]])
                break
            if leftover:
                time.sleep(1.0)
        self.sweep()  # a producer may have finished a dead predecessor's request meanwhile
        if self.cache is not None:
            from specdraft.hidden_states.backends.base import finish_manifest

            self.cache.write_manifest(finish_manifest(self.cache.read_manifest(), set(self.cache.keys()), list(self.sample_ids)))
        self.transport.close()
        if self._log_file is not None:
            self._log_file.close()

    def __enter__(self) -> "StreamingSource":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
