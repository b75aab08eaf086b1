"""A sample source whose hidden states are requested from producers while training runs (online and hybrid data).

``StreamingSource`` has the item interface of ``HiddenStateDataset`` (``sample_id``, ``token_ids``, ``loss_mask``,
``hidden_states``, ``last_hidden``). Each sample is requested from a producer (``client.ProducerClient``), read back
through the transport backend (Mooncake or a shared directory), verified, and deleted from the transport once it is
in memory; with a local ``cache`` (hybrid mode) a sample already there is read from it and a requested one is written
to it. ``data_modes.py`` opens it from the training options.

Prefetching: ``start(order)`` hands it the indices the consumer will ask for, in order; it keeps ``prefetch`` of them
in flight on a thread pool, so ``source[i]`` returns at once when producers keep up. An index asked for out of that
order (validation) is fetched synchronously. ``stats()`` reports the fetch-time fraction: seconds the consumer spent
waiting inside ``__getitem__`` / seconds since ``start``.

Faults: a producer that refuses the connection, times out or answers 5xx is marked down and the request goes to
another producer under a fresh key (a late write of the abandoned key is deleted at ``close``). A payload that fails
verification is deleted and requested once more, then reported. ``close`` deletes whatever is still in flight or
abandoned, so the transport is left empty (retrying for up to ``cleanup_wait_s`` deletes the store refuses, e.g.
objects a killed producer left half-written). Each delivered sample id is appended to ``delivery_log`` (JSON lines
``{"sample_id", "wait_s", "at"}``: seconds the consumer waited for it, wall-clock time of the delivery) when one is
given, so a run can prove every sample was delivered exactly once and show how long each rank waited.

Sequence groups (``train --sequence-parallel N``, ``start(order, share=GroupShare(...))``): the N ranks of a group
read the same samples in the same order, and each needs only its rows of each. The group's first rank (place 0)
requests every sample once and publishes where it landed (the transport key, or "in the cache") under the fetch's
ticket in the process group's key-value store (``torch.distributed``'s c10d store: thread-safe through ``clone``,
so prefetch threads use it without ordering collectives); tickets count fetches in the order ``__getitem__`` and
``start`` issue them, which every rank of a group follows alike, so ticket t is the same sample on every rank. Every
rank then reads the sample "windowed" (``backend.get_rows``: verified whole, loaded only by the rows ``collate``
slices; a whole read where the transport hands over whole objects, as Mooncake does) and adds one to the ticket's
read count; the first rank deletes the sample from the transport only once the count reaches N (checked at each of
its deliveries, and ``close`` deletes what is left), so no rank reads a deleted sample. (A file read windowed stays
mapped, so its rows are collated after the deletion: POSIX unlink.) An error of the requesting rank is published
too, so the others fail with it instead of waiting.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdraft.errors import SpecdraftError, setting
from specdraft.hidden_states.client import ProducerClient, ProducerUnavailable
from specdraft.hidden_states.layers import LayerSlot
from specdraft.hidden_states.source import SampleSource

if TYPE_CHECKING:
    from specdraft.data.dataset import PreparedDataset

log = logging.getLogger(__name__)


#: How long ``close`` keeps retrying deletes the store refuses. A producer killed mid-write leaves
#: objects Mooncake will not remove (-703 REPLICA_IS_NOT_READY) until its master releases the
#: unfinished put (``mooncake_master --put_start_release_timeout_sec``, 600 s by default).
CLEANUP_WAIT_S = 60.0

#: How often a rank of a sequence group looks for the ticket of a sample its group's first rank requests. Bounds
#: only the delay between the publication and a prefetch thread's read (a producer's request takes far longer), and
#: lets a waiting thread notice ``close``; a blocking ``Store.wait`` could do neither without logging each timeout.
SHARE_POLL_S = 0.005


@dataclass(frozen=True)
class GroupShare:
    """How the ranks of one sequence group share each streamed sample (see the module docstring). ``store``: a
    ``torch.distributed.Store`` every rank of the group reaches; ``namespace``: unique to the group and the run
    (the first rank's choice, sent to the others), so tickets of another group or an earlier launch never match."""

    place: int  # this rank's place in its group; place 0 requests every sample
    size: int  # ranks in the group, the reads a sample waits for before it is deleted
    store: Any
    namespace: str
    _local: threading.local = field(default_factory=threading.local, init=False, repr=False, compare=False)

    def _store(self) -> Any:
        """This thread's clone of the store (one store object is not safe to use from several threads)."""
        if not hasattr(self._local, "store"):
            self._local.store = self.store.clone()
        return self._local.store

    def _name(self, ticket: int, what: str) -> str:
        return f"{self.namespace}/{ticket}/{what}"

    def publish(self, ticket: int, note: dict) -> None:
        """Tell the group where ticket ``ticket``'s sample is (``{"key"}`` or ``{"cache": true}``), or ``{"error"}``."""
        self._store().set(self._name(ticket, "where"), json.dumps(note))

    def wait(self, ticket: int, closed: Callable[[], bool]) -> dict | None:
        """The note ``publish`` left for ``ticket``; None once ``closed()`` says the source closed meanwhile."""
        store, name = self._store(), self._name(ticket, "where")
        while not store.check([name]):
            if closed():
                return None
            time.sleep(SHARE_POLL_S)
        return json.loads(store.get(name))

    def read(self, ticket: int) -> int:
        """Count one more rank's read of ``ticket``'s sample; returns the count."""
        return int(self._store().add(self._name(ticket, "read"), 1))

    def readers(self, ticket: int) -> int:
        return int(self._store().add(self._name(ticket, "read"), 0))

    def forget(self, ticket: int) -> None:
        store = self._store()
        for what in ("where", "read"):
            store.delete_key(self._name(ticket, what))


class StreamingSource(SampleSource):
    """Online/hybrid sample source; see the module docstring. Close it (or use ``with``) to clean up."""

    prepared: PreparedDataset
    slots: list[LayerSlot]

    def __init__(
        self,
        *,
        prepared: PreparedDataset,
        client: ProducerClient,
        transport: Any,
        target_info: dict,
        slots: list[LayerSlot],
        dtype: str = "bfloat16",
        prefetch: int = 8,
        cache: Any = None,
        delivery_log: str | None = None,
        owner: str | None = None,
    ):
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
        self.counters: collections.Counter[str] = collections.Counter()  # requests, retries, refetches, cache_hits
        self._nonce = uuid.uuid4().hex[:8]
        self.owner = owner
        self._keys = itertools.count()
        self._lock = threading.Lock()
        self._live_keys: set[str] = set()  # issued, not yet deleted
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=prefetch, thread_name_prefix="specdraft-prefetch")
        self._order: Iterator[int] | None = None
        self._window: collections.deque[tuple[int, concurrent.futures.Future]] = collections.deque()
        self._share: GroupShare | None = None
        self._tickets = itertools.count()  # fetches in issue order: the same sample on every rank of a group
        self._pending: dict[int, str] = {}  # a group's first rank: ticket -> transport key not yet read by every rank
        self._started: float | None = None
        self._wait_s = 0.0
        self._delivery_log = Path(delivery_log) if delivery_log else None
        self._log_file: Any = None  # opened on the first delivery (the run directory may not exist before)
        self._closed = False
        self.cleanup_wait_s = CLEANUP_WAIT_S
        if cache is not None:
            self._init_cache()

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
            item = self._fetch(index, next(self._tickets))
        self._release()
        waited = time.perf_counter() - started
        self._wait_s += waited
        if self._started is None:
            self._started = started
        self.delivered.append(item["sample_id"])
        if self._delivery_log is not None:
            if self._log_file is None:
                self._delivery_log.parent.mkdir(parents=True, exist_ok=True)
                self._log_file = open(self._delivery_log, "a")  # noqa: SIM115 - appended to on every delivery, closed with the stream
            record = {"sample_id": item["sample_id"], "wait_s": round(waited, 6), "at": round(time.time(), 6)}
            self._log_file.write(json.dumps(record) + "\n")
            self._log_file.flush()
        return item

    # -- prefetching ------------------------------------------------------------------------------

    def start(self, order: Iterable[int], share: GroupShare | None = None) -> None:
        """Prefetch ``order`` (the indices the consumer will read next, in that order). ``share``: this rank's sequence
        group, every rank of which calls ``start`` and reads items alike (see the module docstring)."""
        if share is not None and share.size > 1:
            # A store that deletes on read would lose the sample for every rank after the first that reads it.
            if self.transport.deletes_on_read:
                raise SpecdraftError(
                    f"{self.transport.location}: delete_after_read=true deletes a sample at its first read, but the {share.size} "
                    "ranks of a sequence group each read it; drop delete_after_read from the store URL (the group's first rank "
                    "deletes each sample once every rank has read it)"
                )
            self._share = share
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
            self._window.append((index, self._pool.submit(self._fetch, index, next(self._tickets))))

    def stats(self) -> dict:
        elapsed = time.perf_counter() - self._started if self._started is not None else 0.0
        return {
            "delivered": len(self.delivered),
            "wait_s": self._wait_s,
            "elapsed_s": elapsed,
            "fetch_fraction": self._wait_s / elapsed if elapsed > 0 else 0.0,
            **dict(self.counters),
        }

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

    def _fetch(self, index: int, ticket: int) -> dict:
        sid = self.sample_ids[index]
        row = self.prepared[self.prepared.index_of(sid)]
        share = self._share
        if share is not None and share.place:
            return self._follow(share, ticket, sid, row)
        try:
            item, key = self._obtain(sid, row)
        except Exception as exc:
            if share is not None:
                share.publish(ticket, {"error": str(exc)})
            raise
        if share is not None:
            share.publish(ticket, {"key": key} if key is not None else {"cache": True})
            if key is not None:
                with self._lock:
                    self._pending[ticket] = key
                share.read(ticket)
        return item

    def _obtain(self, sid: str, row: dict) -> tuple[dict, str | None]:
        """Sample ``sid`` from the cache or a producer -> (its item, the transport key still holding it: None when
        it is deleted already, or came from the cache). Alone, the key is deleted once read; in a sequence group
        it stays for the group's other ranks (``_release`` deletes it)."""
        from specdraft.hidden_states.payload import HiddenStatePayload

        if self.cache is not None and self.cache.exists(sid):
            try:
                cached = self._cache_read(sid)
                self._check(cached, row, where=f"{self.cache.location} sample {sid!r}")
                self._count("cache_hits")
                return self._item(sid, row, cached), None
            except SpecdraftError as exc:
                log.warning("%s; requesting it from a producer instead", exc)
        body = {
            "token_ids": row["input_ids"].tolist(),
            "slots": [s.to_json() for s in self.slots],
            "dtype": self.dtype,
            "target_fingerprint": self._target_info["fingerprint"],
        }
        # the cache stores whole payloads; a sequence-group rank otherwise loads only the rows it collates
        read = self.transport.get_rows if self._share is not None and self.cache is None else self.transport.get
        corrupt: str | None = None
        while True:
            key, url = self._request(body, sid)
            try:
                payload = read(key)  # verifies checksums, shapes and dtypes
                self._check(payload, row, where=f"{self.transport.location} key {key!r} from {url}")
            except SpecdraftError as exc:
                self._try_drop(key)
                if corrupt is not None:
                    raise SpecdraftError(f"sample {sid!r} arrived corrupt twice: first {corrupt}; then {exc}") from None
                corrupt = str(exc)
                self._count("refetches")
                log.warning("%s; requesting sample %r again", exc, sid)
                continue
            break
        kept: str | None = key
        if self._share is None:
            self._try_drop(key)
            kept = None
        if self.cache is not None:
            self.cache.put(
                sid,
                HiddenStatePayload(
                    manifest={**payload.manifest, "sample_id": sid},
                    hidden_states=payload.hidden_states,
                    token_ids=payload.token_ids,
                    last_hidden=payload.last_hidden,
                ),
            )
        return self._item(sid, row, payload), kept

    def _cache_read(self, sid: str) -> Any:
        return self.cache.get_rows(sid) if self._share is not None else self.cache.get(sid)

    def _follow(self, share: GroupShare, ticket: int, sid: str, row: dict) -> dict:
        """A sequence-group rank past the first: read ticket ``ticket``'s sample where the first rank says it is."""
        note = share.wait(ticket, lambda: self._closed)
        if note is None:
            raise SpecdraftError("the streaming data source is closed")
        if "error" in note:
            raise SpecdraftError(f"sample {sid!r} could not be fetched by the first rank of this sequence group: {note['error']}")
        if note.get("cache"):
            payload = self._cache_read(sid)
            self._check(payload, row, where=f"{self.cache.location} sample {sid!r}")
            self._count("cache_hits")
            return self._item(sid, row, payload)
        key = note["key"]
        try:
            payload = self.transport.get_rows(key)
            self._check(payload, row, where=f"{self.transport.location} key {key!r} (requested by this sequence group's first rank)")
        finally:
            share.read(ticket)  # counted even when it failed: the run stops, and the first rank may delete it
        return self._item(sid, row, payload)

    def _release(self) -> None:
        """A sequence group's first rank: delete the samples every rank of the group has read."""
        share = self._share
        if share is None or share.place:
            return
        with self._lock:
            pending = list(self._pending.items())
        for ticket, key in pending:
            if share.readers(ticket) >= share.size:
                self._try_drop(key)
                share.forget(ticket)
                with self._lock:
                    del self._pending[ticket]

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
        problems = payload.mismatches(
            fingerprint=self._target_info["fingerprint"], slots=self.slots, dtype=self.dtype, token_ids=row["input_ids"]
        )
        if problems:
            raise SpecdraftError(f"{where} is not the requested sample: {'; '.join(problems)}")

    @staticmethod
    def _item(sid: str, row: dict, payload: Any) -> dict:
        return {
            "sample_id": sid,
            "token_ids": payload.token_ids,
            "loss_mask": row["loss_mask"],
            "hidden_states": payload.hidden_states,
            "last_hidden": payload.last_hidden,
        }

    # -- cache and cleanup ------------------------------------------------------------------------

    def _init_cache(self) -> None:
        """Make the local cache a valid store for later offline training (refuse one made for other settings)."""
        from specdraft.hidden_states.backends.base import (
            STORE_FORMAT_NAME,
            STORE_FORMAT_VERSION,
            check_store_dataset,
            check_store_manifest,
            dataset_record,
        )

        slots_json = [s.to_json() for s in self.slots]
        existing = self.cache.read_manifest()
        if existing is not None:
            check_store_manifest(existing, location=self.cache.location, target_info=self._target_info, slots=slots_json, dtype=self.dtype)
            check_store_dataset(
                existing,
                self.prepared,
                set(self.cache.keys()),
                location=self.cache.location,
                choices=f"Give hybrid training a new {setting('data')} cache directory, or delete this one",
            )
            existing["dataset"] = dataset_record(self.prepared)  # the same rows, perhaps with more appended
            self.cache.write_manifest(existing)
            return
        self.cache.write_manifest(
            {
                "format": STORE_FORMAT_NAME,
                "format_version": STORE_FORMAT_VERSION,
                "target": self._target_info,
                "slots": slots_json,
                "dtype": self.dtype,
                "count": 0,
                "complete": False,
                "dataset": dataset_record(self.prepared),
            }
        )

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
            stale = [k for k in self.transport.keys() if mark in k and ours not in k]  # noqa: SIM118 - a transport, not a dict
        except SpecdraftError as exc:
            log.warning("cannot look for samples an earlier run of this consumer left behind (%s)", exc)
            return 0
        for key in stale:
            try:
                self.transport.delete(key)
            except SpecdraftError as exc:
                log.warning("%s; it stays in %s", exc, self.transport.location)
        if stale:
            log.warning(
                "deleted %d sample(s) that an earlier run of this consumer (%s) left in %s", len(stale), self.owner, self.transport.location
            )
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
        self._release()
        with self._lock:
            leftover = sorted(self._live_keys)
            if self._share is not None:  # the run is over: no rank of the group reads these any more
                for ticket in self._pending:
                    self._share.forget(ticket)
                self._pending.clear()
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
                log.warning(
                    "%d key(s) could not be deleted from %s within %g s, e.g. %s",
                    len(leftover),
                    self.transport.location,
                    self.cleanup_wait_s,
                    failed[leftover[0]],
                )
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

    def __enter__(self) -> StreamingSource:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
