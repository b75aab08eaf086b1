"""The transport-agnostic hidden-state store interface and its registry.

A backend maps a key (the sample id) to a :class:`HiddenStatePayload` and keeps one store-level
manifest (which target, which slots, which dtype, from which dataset). Extraction, the reader and
the trainer only talk to this interface, so the file store, Mooncake and a vLLM connector are
interchangeable as long as they store the same payload bytes.

Contract every backend keeps:
  * ``put`` is all-or-nothing: after a crash a key is either absent or holds a complete payload.
  * ``get`` returns a verified payload (checksums, dtypes, shapes) or raises ``SpecdraftError``
    naming the key/location and the problem.

Store manifest (written by ``specdraft extract``)::

  {"format": "specdraft.hidden_state_store", "format_version": 1,
   "target": Target.describe(), "slots": [{"layer": 1, "side": "output"}, ...], "dtype": "bfloat16",
   "dataset": {"path": abs path, "num_samples": N, "created": ..., "rows_sha256": its identity (``dataset_record``)},
   "count": payloads stored, "complete": every selected sample is stored, "config": ExtractConfig,
   "samples": the stored keys when the writer finished (``finish_manifest``)}

Readers check the store up front (``HiddenStateDataset``): every key in ``samples`` present and
each stored object whole (``stored_problems``), before a training step reads any of them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from specdraft.errors import SpecdraftError, setting
from specdraft.hidden_states.payload import HiddenStatePayload, PayloadRows
from specdraft.registry import Registry

STORE_FORMAT_NAME = "specdraft.hidden_state_store"
STORE_FORMAT_VERSION = 1


class HiddenStateBackend(ABC):
    """Key -> payload storage. ``location`` describes where the data lives (used in messages)."""

    location: str

    @abstractmethod
    def put(self, key: str, payload: HiddenStatePayload) -> int:
        """Store ``payload`` under ``key`` atomically (replacing any old value); returns bytes stored."""

    @abstractmethod
    def get(self, key: str) -> HiddenStatePayload:
        """The verified payload under ``key``; ``SpecdraftError`` if it is missing or corrupt."""

    def get_rows(self, key: str) -> HiddenStatePayload | PayloadRows:
        """The verified payload under ``key``, for a reader that slices ``hidden_states``/``last_hidden`` by rows and
        uses only some (a sequence-parallel rank: ``HiddenStateDataset(..., reads="windowed")``). The default reads it
        whole (``get``: its tensors slice alike): a transport that hands over one object's bytes at once (Mooncake)
        has no part of it to skip. The file backend overrides it to load only the rows sliced."""
        return self.get(key)

    @property
    def deletes_on_read(self) -> bool:
        """Whether ``get`` deletes what it read (a streaming store for one reader); then no second reader of a key can
        share it. Stores that keep keys until ``delete`` say False."""
        return False

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key`` (no error if it is absent)."""

    @abstractmethod
    def keys(self) -> list[str]:
        """All stored keys, sorted."""

    @abstractmethod
    def read_manifest(self) -> dict | None:
        """The store-level manifest, or ``None`` for an empty/new store."""

    @abstractmethod
    def write_manifest(self, manifest: dict) -> None:
        """Replace the store-level manifest atomically."""

    def stored_problems(self, keys: list[str]) -> dict[str, str]:
        """Key -> what is wrong, for keys that are absent or not stored whole; cheap (no payload is read).

        The default checks presence only; a backend that can see object sizes checks those too.
        """
        return {key: f"{self.location}: sample {key!r} is missing" for key in keys if not self.exists(key)}

    def stored_size(self, payload: HiddenStatePayload) -> int:
        """Bytes ``put`` reports for ``payload``, for a payload another process put (vLLM extraction)."""
        return len(payload.to_bytes())

    def producer_location(self) -> str:
        """The location another process (e.g. a vLLM engine's connector) opens to write into this store.

        A producer process may exit before the data is read, so it must not hold data itself
        (Mooncake: no memory segment); backends where that matters override this.
        """
        return self.location

    def recover(self) -> int:
        """Discard debris of interrupted writes (e.g. temporary files); returns how many were removed.

        Backends whose ``put`` leaves nothing behind on failure need not override this.
        """
        return 0

    def close(self) -> None:
        """Release connections/handles; the default holds none."""

    def __enter__(self) -> HiddenStateBackend:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


BACKENDS: Registry[Callable[..., HiddenStateBackend]] = Registry("hidden-state backend")


def open_backend(name: str, location: str, **options: Any) -> HiddenStateBackend:
    """Instantiate the backend registered as ``name`` for ``location`` (a directory, a URL...); importing this
    module ran the package's ``__init__``, which registers the built-in backends."""
    return BACKENDS.get(name)(location, **options)


def finish_manifest(manifest: dict, stored: set[str], expected: list[str]) -> dict:
    """Record what a writer leaves behind: the stored keys, their count, and whether ``expected`` are all there."""
    manifest["samples"] = sorted(stored)
    manifest["count"] = len(stored)
    manifest["complete"] = all(key in stored for key in expected)
    return manifest


def dataset_record(dataset: Any) -> dict:
    """The store manifest's ``dataset`` block for a ``PreparedDataset``: where it was, and its identity
    (``rows_sha256`` over every row's sample id and token ids), checked when the store is resumed."""
    from pathlib import Path

    return {
        "path": str(Path(dataset.directory).resolve()),
        "num_samples": len(dataset),
        "created": dataset.manifest.get("created"),
        "rows_sha256": dataset.rows_sha256(),
    }


def check_store_dataset(manifest: dict, dataset: Any, stored: set[str], *, location: str, choices: str) -> None:
    """Refuse to add to a store whose samples came from another dataset (a re-prepared one with other rows).

    The dataset must be the one the store was started from, or that one with rows appended (``prepare
    --data OLD,NEW`` keeps the old rows first, unchanged), and every stored sample must be one of its
    rows; else resuming would keep the old samples beside the new and call the store complete.
    ``choices`` says what the user can do instead (the caller's flags).
    """
    if not stored:
        return  # nothing stored yet: nothing to mix
    recorded = manifest.get("dataset") or {}
    problems = []
    n, digest = recorded.get("num_samples"), recorded.get("rows_sha256")
    if digest is not None:  # stores written before the identity was recorded have only their keys to go by
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= len(dataset):
            problems.append(f"it had {n!r} rows, this one has {len(dataset)}")
        elif dataset.rows_sha256(n) != digest:
            problems.append(f"its first {n} rows (sample ids or token ids) differ")
    foreign = sorted(stored.difference(dataset.sample_ids))
    if foreign:
        problems.append(f"{len(foreign)} stored sample(s) are not in it, e.g. {foreign[0]!r}")
    if problems:
        was = f"{recorded.get('path')} ({n} rows, created {recorded.get('created')}, rows sha256 {str(digest)[:12]})"
        now = (
            f"{dataset.directory} ({len(dataset)} rows, created {dataset.manifest.get('created')}, "
            f"rows sha256 {dataset.rows_sha256()[:12]})"
        )
        raise SpecdraftError(
            f"{location} was started from dataset {was}, not {now}: {'; '.join(problems)}; resuming would mix their samples. {choices}"
        )


def check_store_manifest(
    manifest: dict,
    *,
    location: str,
    target_info: dict,
    slots: list[dict],
    dtype: str,
    target_dtype: str | None = None,
    choices: str | None = None,
) -> None:
    """Refuse to mix data: the store must have been made for this target, these slots and storage dtype, and (where
    the writer records it: ``specdraft extract``'s ``config``) with the target run in ``target_dtype``, since its
    hidden states differ by far more than storage rounding from the other dtype's. ``choices`` says what the user
    can do instead (the caller's flags; default: a new ``out``)."""
    if manifest.get("format") != STORE_FORMAT_NAME:
        raise SpecdraftError(
            f"{location}: manifest format {manifest.get('format')!r} is not {STORE_FORMAT_NAME!r}; choose another {setting('out')}"
        )
    recorded = manifest.get("target") or {}
    problems = []
    for key in ("fingerprint", "tokenizer_hash"):
        if recorded.get(key) != target_info.get(key):
            problems.append(f"target {key} {recorded.get(key)!r} != {target_info.get(key)!r}")
    if manifest.get("slots") != slots:
        problems.append(f"layers {_slots_text(manifest.get('slots'))} != {_slots_text(slots)}")
    if manifest.get("dtype") != dtype:
        problems.append(f"storage dtype {manifest.get('dtype')!r} != {dtype!r}")
    ran_in = (manifest.get("config") or {}).get("target_dtype")
    if target_dtype is not None and ran_in is not None and ran_in != target_dtype:
        problems.append(f"target dtype {ran_in!r} != {target_dtype!r}")
    if problems:
        raise SpecdraftError(
            f"{location} holds hidden states of target {recorded.get('name')!r} made with other settings "
            f"({'; '.join(problems)}), the store's first: resuming would mix samples of both. "
            + (choices or f"Use a new {setting('out')} directory or the original settings.")
        )


def _slots_text(slots: Any) -> str:
    try:
        return ",".join(f"{s['side']}:{s['layer']}" for s in slots)
    except (TypeError, KeyError):
        return repr(slots)
