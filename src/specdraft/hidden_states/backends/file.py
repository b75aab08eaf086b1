"""Directory store: one ``<key>.safetensors`` payload per sample plus ``manifest.json``.

Layout::

    <dir>/manifest.json              store manifest (target, slots, dtype, count, dataset)
    <dir>/<quoted key>.safetensors   one HiddenStatePayload per sample

Keys are percent-quoted into file names (``a/b`` -> ``a%2Fb``; a leading dot is quoted too, so
no key can collide with the hidden ``.<name>.*.tmp`` files of in-flight atomic writes).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar
from urllib.parse import quote, unquote

from specdraft.errors import OS_ERROR_FIXES, SpecdraftError
from specdraft.hidden_states.backends.base import BACKENDS, STORE_FORMAT_NAME, HiddenStateBackend
from specdraft.hidden_states.payload import HiddenStatePayload, PayloadRows
from specdraft.utils.io import DirKind, atomic_write_bytes, json_field_is

_Payload = TypeVar("_Payload", HiddenStatePayload, PayloadRows)

SUFFIX = ".safetensors"
MANIFEST_FILE = "manifest.json"
#: What `specdraft extract` writes into (and resumes): a store's manifest, payloads and in-flight temporaries.
STORE_DIR = DirKind(
    "hidden-state store",
    MANIFEST_FILE,
    json_field_is("format", STORE_FORMAT_NAME),
    frozenset({MANIFEST_FILE}),
    patterns=("*" + SUFFIX, ".*.tmp"),
    replaced=False,
)


#: The manifest fields readers index, and the JSON type each must have where present (older stores lack some).
MANIFEST_TYPES = {
    "format": str,
    "format_version": int,
    "target": dict,
    "slots": list,
    "dtype": str,
    "dataset": dict,
    "samples": list,
    "count": int,
    "complete": bool,
    "config": dict,
}


def manifest_problem(manifest: object) -> str | None:
    """Why ``manifest`` is not what ``extract`` writes (a JSON object whose fields have ``MANIFEST_TYPES``), or None."""
    if not isinstance(manifest, dict):
        return f"it holds a JSON {type(manifest).__name__}, not an object"
    for name, kind in MANIFEST_TYPES.items():
        value = manifest.get(name)
        if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
            return f"its {name!r} is a {type(value).__name__}, not a {kind.__name__}"
    if not all(isinstance(s, dict) for s in manifest.get("slots") or ()):
        return "its 'slots' are not all objects"
    if not all(isinstance(k, str) for k in manifest.get("samples") or ()):
        return "its 'samples' are not all sample ids"
    return None


def key_to_filename(key: str) -> str:
    name = quote(key, safe="")
    if name.startswith("."):
        name = "%2E" + name[1:]
    return name + SUFFIX


def filename_to_key(name: str) -> str:
    return unquote(name[: -len(SUFFIX)])


@BACKENDS.register("file")
class FileBackend(HiddenStateBackend):
    def __init__(self, location: str | os.PathLike, *, create: bool = True):
        self.root = Path(location)
        self.location = str(self.root)
        if self.root.exists() and not self.root.is_dir():
            raise SpecdraftError(f"hidden-state store {self.root} exists but is not a directory")
        if create:
            self.root.mkdir(parents=True, exist_ok=True)
        elif not self.root.is_dir():
            raise SpecdraftError(f"hidden-state store {self.root} does not exist; run `specdraft extract --out {self.root}` first")

    def producer_location(self) -> str:
        return str(self.root.resolve())  # the producer may run in another working directory

    def path(self, key: str) -> Path:
        return self.root / key_to_filename(key)

    def put(self, key: str, payload: HiddenStatePayload) -> int:
        if payload.sample_id != key:
            raise SpecdraftError(f"payload of sample {payload.sample_id!r} cannot be stored under key {key!r}")
        data = payload.to_bytes()
        _write(self.path(key), data)
        return len(data)

    def get(self, key: str) -> HiddenStatePayload:
        return self._read(key, lambda path: HiddenStatePayload.from_bytes(path.read_bytes(), source=str(path)))

    def get_rows(self, key: str) -> PayloadRows:
        """Verified whole (every tensor's sha256, hashed from the file in chunks), loaded by rows: only the rows a
        reader slices of ``hidden_states``/``last_hidden`` are read (``payload.PayloadRows``)."""
        return self._read(key, lambda path: PayloadRows.open(path, source=str(path)))

    def _read(self, key: str, read: Callable[[Path], _Payload]) -> _Payload:
        """``read`` the file of ``key``, naming the sample where it is absent or not the one stored under ``key``."""
        path = self.path(key)
        try:
            payload = read(path)
        except FileNotFoundError:
            raise SpecdraftError(
                f"{path}: no hidden states stored for sample {key!r}; run `specdraft extract` to (re)create them"
            ) from None
        except IsADirectoryError:
            raise SpecdraftError(
                f"{path} is a directory, not the stored sample {key!r}; move it away and rerun `specdraft extract` to redo the sample"
            ) from None
        if payload.sample_id != key:
            raise SpecdraftError(f"{path}: holds sample {payload.sample_id!r}, expected {key!r}; re-extract it")
        return payload

    def exists(self, key: str) -> bool:
        return self.path(key).is_file()

    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def keys(self) -> list[str]:
        return sorted(filename_to_key(p.name) for p in self.root.iterdir() if p.name.endswith(SUFFIX) and not p.name.startswith("."))

    def stored_problems(self, keys: list[str]) -> dict[str, str]:
        """Missing files, and files whose size is not the one their safetensors header describes (truncated/extended)."""
        problems = {}
        for key in keys:
            path = self.path(key)
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                problems[key] = f"{path} is missing (sample {key!r})"
                continue
            declared = _declared_size(path)
            if declared != size:
                described = f"its header describes {declared}" if declared is not None else "its header is unreadable"
                problems[key] = f"{path} is truncated or damaged ({size} bytes, {described})"
        return problems

    def read_manifest(self) -> dict | None:
        """The manifest, or None where there is none; a damaged one is refused here, once for every reader (a field of
        the wrong type would otherwise fail later, with a traceback, wherever it is first used)."""
        path = self.root / MANIFEST_FILE
        problem: str | None
        try:
            manifest = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            problem = f"it is not JSON: {exc}"
        else:
            problem = manifest_problem(manifest)
            if problem is None:
                return manifest
        raise SpecdraftError(
            f"{path} is damaged ({problem}), so the samples of {self.root} cannot be checked against it; "
            "extract into a new directory (`specdraft extract --out NEW_DIR`)"
        )

    def write_manifest(self, manifest: dict) -> None:
        _write(self.root / MANIFEST_FILE, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())

    def recover(self) -> int:
        """Delete temporary files left by a writer that was killed mid-write."""
        removed = 0
        for p in self.root.glob(".*.tmp"):
            p.unlink(missing_ok=True)
            removed += 1
        return removed


def _declared_size(path: Path) -> int | None:
    """The file size a safetensors header implies (8-byte length + header + tensor data), or None if unreadable."""
    try:
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            if not 0 < header_len <= 100_000_000:
                return None
            header = json.loads(f.read(header_len))
        ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
        return 8 + header_len + max(ends, default=0)
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None


def _write(path: Path, data: bytes) -> None:
    """Atomic write whose OS errors (full disk, permissions) become one clear ``SpecdraftError``."""
    try:
        atomic_write_bytes(path, data)
    except OSError as exc:
        fix = OS_ERROR_FIXES.get(exc.errno) if exc.errno is not None else None
        raise SpecdraftError(f"cannot write {path}: {exc.strerror or exc}{f'; {fix}' if fix else ''}; no partial file was left") from exc
