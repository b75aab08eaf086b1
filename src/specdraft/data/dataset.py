"""The prepared-dataset directory: the hand-off between ``specdraft prepare`` and every later stage.

Layout (``FORMAT_VERSION`` 1)::

    <dir>/data.parquet             one row per sample: sample_id (string, unique), source (string),
                                   input_ids (list<int32>), loss_mask (list<int8>, 1 = assistant token)
    <dir>/token_counts.safetensors counts: int64[V], how often each token id occurs among loss-masked
                                   (response) tokens -- drives draft-vocabulary selection
    <dir>/manifest.json            format/version, target identity (``Target.describe()``), the prepare
                                   config, counts (read/kept/skipped by reason), creation time, and the
                                   sha256 of token_counts.safetensors (``checksums``), checked when the
                                   counts are read, as are their values (non-negative integers, one per
                                   vocabulary id): damaged counts would choose a wrong draft vocabulary

The directory is written whole into a temporary sibling and renamed into place, so a reader sees
either the previous dataset or the complete new one, never a mixture. An existing directory is
replaced only when it is a prepared dataset (``PREPARED_DIR``); anything else there is refused.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specdraft.errors import SpecdraftError, os_error_message
from specdraft.targets.base import Target
from specdraft.utils.io import DirKind, atomic_dir, json_field_is, naming_path, save_safetensors, sha256_file

FORMAT_NAME = "specdraft.prepared"
FORMAT_VERSION = 1
DATA_FILE = "data.parquet"
COUNTS_FILE = "token_counts.safetensors"
MANIFEST_FILE = "manifest.json"
WORK_DIR = ".work"  # regeneration work kept by `specdraft prepare` until the dataset replaces the directory
PREPARED_DIR = DirKind(
    "prepared dataset",
    MANIFEST_FILE,
    json_field_is("format", FORMAT_NAME),
    frozenset({DATA_FILE, COUNTS_FILE, MANIFEST_FILE, WORK_DIR}),
    scratch=frozenset({WORK_DIR}),
)
# The JSON type of each manifest field ``write_prepared`` writes; checked once where the manifest is read, so a
# damaged field is one clear error there instead of a traceback wherever it is first used. Absent fields pass
# (datasets written before a field existed lack it).
MANIFEST_TYPES: dict[str, type] = {
    "format": str,
    "format_version": int,
    "target": dict,
    "config": dict,
    "stats": dict,
    "num_samples": int,
    "num_tokens": int,
    "num_loss_tokens": int,
    "vocab_size": int,
    "created": str,
    "checksums": dict,
}
_JSON_NAMES = {dict: "object", list: "array", str: "string", int: "integer", float: "number", bool: "boolean"}


def manifest_problem(manifest: object) -> str | None:
    """Why ``manifest`` is not what ``write_prepared`` writes (a JSON object whose fields have ``MANIFEST_TYPES``), or None."""
    if not isinstance(manifest, dict):
        return f"it holds a JSON {_JSON_NAMES.get(type(manifest), 'null')}, not an object"
    for name, kind in MANIFEST_TYPES.items():
        value = manifest.get(name)
        if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
            return f"its {name!r} is a JSON {_JSON_NAMES[type(value)]} ({json.dumps(value)[:60]}), not a JSON {_JSON_NAMES[kind]}"
    if isinstance(manifest.get("vocab_size"), int) and manifest["vocab_size"] <= 0:
        return f"its 'vocab_size' is {manifest['vocab_size']}, not a positive number"
    return None


def _schema():
    import pyarrow as pa

    return pa.schema(
        [
            ("sample_id", pa.string()),
            ("source", pa.string()),
            ("input_ids", pa.list_(pa.int32())),
            ("loss_mask", pa.list_(pa.int8())),
        ]
    )


def _checked_table(rows: Iterable[Mapping[str, Any]], directory: Path, vocab_size: int) -> tuple[Any, np.ndarray, int]:
    """The rows as a table of the prepared schema, the loss-token counts per token id and the number of tokens; an
    error names the sample that is a duplicate, ragged or out of the vocabulary."""
    import pyarrow as pa

    columns: dict[str, list] = {"sample_id": [], "source": [], "input_ids": [], "loss_mask": []}
    counts = np.zeros(int(vocab_size), dtype=np.int64)
    seen: set[str] = set()
    for row in rows:
        sid = str(row["sample_id"])
        if sid in seen:
            raise SpecdraftError(f"duplicate sample_id {sid!r} while writing {directory}")
        seen.add(sid)
        ids = np.asarray(row["input_ids"], dtype=np.int64)
        mask = np.asarray(row["loss_mask"], dtype=np.int64)
        if ids.ndim != 1 or ids.shape != mask.shape:
            raise SpecdraftError(f"sample {sid!r}: input_ids and loss_mask must be 1-D and equally long")
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise SpecdraftError(f"sample {sid!r}: token id out of range for a vocabulary of {vocab_size}")
        np.add.at(counts, ids[mask != 0], 1)
        columns["sample_id"].append(sid)
        columns["source"].append(str(row.get("source", "")))
        columns["input_ids"].append(ids.astype(np.int32))
        columns["loss_mask"].append((mask != 0).astype(np.int8))
    table = pa.table(
        {
            "sample_id": pa.array(columns["sample_id"], pa.string()),
            "source": pa.array(columns["source"], pa.string()),
            "input_ids": pa.array(columns["input_ids"], pa.list_(pa.int32())),
            "loss_mask": pa.array(columns["loss_mask"], pa.list_(pa.int8())),
        },
        schema=_schema(),
    )
    return table, counts, int(sum(len(x) for x in columns["input_ids"]))


def write_prepared(
    directory: str | os.PathLike,
    rows: Iterable[Mapping[str, Any]],
    *,
    target_info: dict,
    config: dict,
    stats: dict,
    vocab_size: int,
    inputs: Iterable[str | os.PathLike] = (),
) -> Path:
    """Write a prepared dataset atomically (replacing any previous one at ``directory``).

    ``rows`` yield ``sample_id``, ``source``, ``input_ids`` and ``loss_mask`` (sequences of ints,
    same length). Raises ``SpecdraftError`` for duplicate ids, ragged rows or out-of-vocab ids, and
    when ``directory`` holds anything but a prepared dataset or contains one of ``inputs``.
    """
    import pyarrow.parquet as pq

    directory = Path(directory)
    table, counts, num_tokens = _checked_table(rows, directory, vocab_size)
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "target": target_info,
        "config": config,
        "stats": stats,
        "num_samples": table.num_rows,
        "num_tokens": num_tokens,
        "num_loss_tokens": int(counts.sum()),
        "vocab_size": int(vocab_size),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    with atomic_dir(directory, PREPARED_DIR, inputs=inputs) as tmp:
        with naming_path(tmp / DATA_FILE):
            pq.write_table(table, tmp / DATA_FILE)
        save_safetensors({"counts": torch.from_numpy(counts)}, tmp / COUNTS_FILE)
        manifest["checksums"] = {COUNTS_FILE: sha256_file(tmp / COUNTS_FILE)}
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        for name in (DATA_FILE, COUNTS_FILE, MANIFEST_FILE):
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
    return directory


class PreparedDataset:
    """Random access to a prepared dataset (the whole table is held in memory as flat arrays)."""

    def __init__(self, directory: str | os.PathLike):
        import pyarrow.parquet as pq

        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise SpecdraftError(f"prepared dataset {self.directory} does not exist; run `specdraft prepare --out {self.directory}`")
        manifest_path = self.directory / MANIFEST_FILE
        try:
            manifest = json.loads(manifest_path.read_text())
        except FileNotFoundError:
            raise SpecdraftError(
                f"{manifest_path} is missing: {self.directory} is not a prepared dataset (rerun `specdraft prepare`)"
            ) from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise SpecdraftError(f"{manifest_path} is corrupt ({exc}); rerun `specdraft prepare`") from None
        problem = manifest_problem(manifest)
        if problem:
            raise SpecdraftError(f"{manifest_path} is damaged ({problem}); rerun `specdraft prepare`")
        self.manifest: dict = manifest
        if self.manifest.get("format") != FORMAT_NAME or self.manifest.get("format_version") != FORMAT_VERSION:
            raise SpecdraftError(
                f"{manifest_path}: format {self.manifest.get('format')!r} version {self.manifest.get('format_version')!r} "
                f"is not {FORMAT_NAME!r} version {FORMAT_VERSION}; rerun `specdraft prepare`"
            )
        data_path = self.directory / DATA_FILE
        try:
            with naming_path(data_path):
                table = pq.read_table(data_path)
        except FileNotFoundError:
            raise SpecdraftError(f"{data_path} is missing; rerun `specdraft prepare`") from None
        except Exception as exc:  # pyarrow raises several types for damaged files
            if os_error_message(exc):
                raise  # not damage (a denied read, too many open files): the CLI says what it is
            raise SpecdraftError(f"{data_path} is corrupt ({exc}); rerun `specdraft prepare`") from None
        missing = [f.name for f in _schema() if f.name not in table.column_names]
        if missing:
            raise SpecdraftError(f"{data_path} lacks column(s) {', '.join(missing)}; rerun `specdraft prepare`")
        self.sample_ids: list[str] = table.column("sample_id").to_pylist()
        self.sources: list[str] = table.column("source").to_pylist()
        self._ids, self._offsets = _flatten(table.column("input_ids"), np.int64)
        self._mask, self._mask_offsets = _flatten(table.column("loss_mask"), np.bool_)
        if not np.array_equal(np.diff(self._offsets), np.diff(self._mask_offsets)):
            raise SpecdraftError(f"{data_path}: input_ids and loss_mask lengths differ; rerun `specdraft prepare`")
        self._check_token_ids(data_path)
        self._index = {sid: i for i, sid in enumerate(self.sample_ids)}

    def _check_token_ids(self, data_path: Path) -> None:
        """Refuse ids outside the vocabulary the manifest records (one vectorised pass): every later stage indexes
        embeddings and counts with them, and would fail far from the cause (an IndexError in the target's embedding)."""
        vocab = self.manifest.get("vocab_size")
        ids = self._ids[self._offsets[0] : self._offsets[-1]]
        if vocab is None or not ids.size or (ids.min() >= 0 and ids.max() < vocab):
            return
        at = int(np.flatnonzero((ids < 0) | (ids >= vocab))[0])
        row = int(np.searchsorted(self._offsets, self._offsets[0] + at, side="right")) - 1
        position = int(self._offsets[0] + at - self._offsets[row])
        raise SpecdraftError(
            f"{data_path}: row {row} (sample_id {self.sample_ids[row]!r}) holds token id {int(ids[at])} at position "
            f"{position}, outside the vocabulary of {vocab} ({MANIFEST_FILE} vocab_size); rerun `specdraft prepare`"
        )

    def __len__(self) -> int:
        return len(self.sample_ids)

    def __getitem__(self, i: int) -> dict:
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        lo, hi = int(self._offsets[i]), int(self._offsets[i + 1])
        mlo = int(self._mask_offsets[i])
        return {
            "sample_id": self.sample_ids[i],
            "source": self.sources[i],
            "input_ids": torch.from_numpy(self._ids[lo:hi].copy()),
            "loss_mask": torch.from_numpy(self._mask[mlo : mlo + hi - lo].copy()),
        }

    def index_of(self, sample_id: str) -> int:
        try:
            return self._index[sample_id]
        except KeyError:
            raise SpecdraftError(f"sample_id {sample_id!r} is not in {self.directory}") from None

    def lengths(self) -> np.ndarray:
        """Tokens per sample (int64[N]), e.g. for length-bucketed batching."""
        return np.diff(self._offsets)

    @property
    def target_info(self) -> dict:
        return dict(self.manifest.get("target") or {})

    def rows_sha256(self, n: int | None = None) -> str:
        """Hash of the first ``n`` rows' sample ids and token ids: what hidden states depend on, so a store
        can tell a re-prepared dataset from the one it was extracted from (or one with rows appended to it)."""
        import hashlib

        n = len(self) if n is None else n
        h = hashlib.sha256("\0".join(self.sample_ids[:n]).encode())
        h.update(np.ascontiguousarray(self._offsets[: n + 1] - self._offsets[0]).tobytes())
        h.update(np.ascontiguousarray(self._ids[self._offsets[0] : self._offsets[n]]).tobytes())
        return h.hexdigest()

    def token_counts(self) -> torch.Tensor:
        """Response-token frequencies, LongTensor[V], checked against the manifest's sha256 (datasets written before
        it recorded one: unchecked) and refused unless every count is a non-negative integer."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        path = self.directory / COUNTS_FILE
        if not path.is_file():
            raise SpecdraftError(f"{path} is missing; rerun `specdraft prepare`")
        recorded = (self.manifest.get("checksums") or {}).get(COUNTS_FILE)
        if recorded is not None and sha256_file(path) != recorded:
            raise SpecdraftError(
                f"{path} is corrupt: its sha256 is not the {str(recorded)[:16]}... {MANIFEST_FILE} records; rerun `specdraft prepare`"
            )
        try:
            counts = load_file(str(path))["counts"]
        except (SafetensorError, KeyError, OSError) as exc:
            raise SpecdraftError(f"{path} is corrupt ({exc}); rerun `specdraft prepare`") from None
        vocab = self.manifest.get("vocab_size")
        if counts.dim() != 1 or (vocab is not None and counts.numel() != vocab):
            raise SpecdraftError(
                f"{path} holds counts of shape {list(counts.shape)}, not one per id of the vocabulary of "
                f"{vocab} ({MANIFEST_FILE}); rerun `specdraft prepare`"
            )
        bad = counts < 0
        if counts.is_floating_point():
            bad |= ~torch.isfinite(counts) | (counts != counts.round())
        if bad.any():
            first = int(bad.nonzero()[0, 0])
            raise SpecdraftError(
                f"{path} holds {int(bad.sum())} count(s) that are not non-negative integers (token id {first}: "
                f"{counts[first].item()}); rerun `specdraft prepare`"
            )
        return counts.to(torch.int64)

    def check_target(self, target: Target) -> None:
        """Refuse a target other than the one this data was prepared for (tokens would mean other words)."""
        recorded = self.target_info
        problems = [
            f"{key} {recorded.get(key)} then, {getattr(target, key)} now"
            for key in ("fingerprint", "tokenizer_hash")
            if recorded.get(key) != getattr(target, key)
        ]
        if not problems:
            return
        if (recorded.get("name"), str(recorded.get("path"))) == (target.name, str(target.path)):
            what = f"target {target.name!r} ({target.path}) has changed since {self.directory} was prepared for it"
        else:
            what = (
                f"{self.directory} was prepared for target {recorded.get('name')!r} ({recorded.get('path')}), "
                f"not {target.name!r} ({target.path})"
            )
        raise SpecdraftError(
            f"{what}: {'; '.join(problems)}. Rerun `specdraft prepare --target {target.name}`, or use the original target."
        )


def _flatten(column: Any, dtype: type[np.generic]) -> tuple[np.ndarray, np.ndarray]:
    """A list<...> column as (flat values, offsets[N+1]) numpy arrays, without per-row Python objects.

    ``offsets`` index straight into ``values`` (a sliced list array keeps its parent's child array).
    """
    arr = column.combine_chunks()
    offsets = arr.offsets.to_numpy().astype(np.int64)
    values = arr.values.to_numpy(zero_copy_only=False).astype(dtype)
    return values, offsets
