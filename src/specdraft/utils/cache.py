"""Per-machine caches: one way to read, verify and write them, and one bounded wait for a build another process runs.

specdraft caches what is slow to make and can always be made again: speed measurements (``tuning/measured.py``), SPS
profiles (``decode/sps.py``), file digests (``targets/identity.py``, which the converted target's check uses) and the
streamed kernel's build stamp (``tuning/streamed.py``). A damaged, foreign or stale entry must cost a rebuild, never a
traceback, a wrong figure or a failed command, so each goes through :func:`cached` (or :func:`read_entry` and
:func:`write_entry`):

- an entry is a flat JSON object: its ``format``, the fields of the ``key`` it was made for (machine, target, context),
  its value's fields, and ``entry_sha256``, a checksum of all the rest;
- a read returns the value only when the file is a JSON object of that format whose checksum holds, whose key fields
  equal the caller's and whose value the caller's ``parse`` accepts. Anything else is a miss the caller rebuilds: a
  missing file silently, an entry of another format or key (made by another version, for other inputs) with an INFO
  line, a damaged one (unreadable, a directory, not JSON, a checksum that fails, a value ``parse`` rejects) with a
  WARNING naming the file and why;
- a write is atomic (``utils/io.atomic_write_json``). Where it fails (a read-only cache, a directory in the way) the
  entry is kept in memory for the rest of the process, with a WARNING: a process makes each entry once and no command
  fails for its cache.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar, overload

from specdraft.errors import SpecdraftError
from specdraft.utils.io import atomic_write_json, sha256_bytes

log = logging.getLogger(__name__)

T = TypeVar("T")
CHECKSUM = "entry_sha256"
#: Entries this process could not write back, by path: used instead of the file until the process ends.
_memory: dict[str, dict[str, Any]] = {}


def _canonical(obj: Any) -> Any:
    """``obj`` as JSON reads it back (tuples become lists, other objects their ``str``), so a key compares equal to its stored form."""
    return json.loads(json.dumps(obj, sort_keys=True, default=str))


def _checksum(entry: dict[str, Any]) -> str:
    return sha256_bytes(json.dumps({k: v for k, v in entry.items() if k != CHECKSUM}, sort_keys=True).encode())


def _miss(path: Path, what: str, reason: str, level: int = logging.WARNING) -> None:
    log.log(level, "not using the cached %s %s: %s; making it again", what, path, reason)


@overload
def read_entry(path: str | os.PathLike, *, format: str, key: dict[str, Any], what: str) -> dict[str, Any] | None: ...
@overload
def read_entry(
    path: str | os.PathLike, *, format: str, key: dict[str, Any], what: str, parse: Callable[[dict[str, Any]], T]
) -> T | None: ...
def read_entry(
    path: str | os.PathLike, *, format: str, key: dict[str, Any], what: str, parse: Callable[[dict[str, Any]], Any] = lambda value: value
) -> Any:
    """The value cached at ``path`` for ``key``, passed through ``parse`` (which raises on a value it rejects and
    never returns None), or None where there is none that verifies (logged, see the module docstring)."""
    path = Path(path)
    entry = _memory.get(str(path))
    if entry is None:
        try:
            entry = json.loads(path.read_bytes())
        except FileNotFoundError:
            return None
        except OSError as exc:  # a directory in the way, a denied read
            _miss(path, what, f"it cannot be read ({exc.strerror or exc})")
            return None
        except ValueError as exc:
            _miss(path, what, f"it is not JSON ({exc})")
            return None
    if not isinstance(entry, dict):
        _miss(path, what, f"it holds a JSON {type(entry).__name__}, not an object")
        return None
    if entry.get("format") != format:
        _miss(path, what, f"its format is {entry.get('format')!r}, not {format!r} (another specdraft version)", logging.INFO)
        return None
    if entry.get(CHECKSUM) != _checksum(entry):
        _miss(path, what, f"its content does not match its {CHECKSUM} (edited or damaged)")
        return None
    key = _canonical(key)
    differs = sorted(name for name, value in key.items() if entry.get(name) != value)
    if differs:
        _miss(path, what, f"it was made for another {', '.join(differs)}", logging.INFO)
        return None
    value = {name: v for name, v in entry.items() if name not in key and name not in ("format", CHECKSUM)}
    try:
        return parse(value)
    except (KeyError, ValueError, TypeError, AttributeError, SpecdraftError) as exc:
        _miss(path, what, f"its value is invalid ({type(exc).__name__}: {exc})")
        return None


def write_entry(path: str | os.PathLike, value: dict[str, Any], *, format: str, key: dict[str, Any], what: str) -> bool:
    """Cache ``value`` (a dict whose field names differ from ``key``'s) at ``path`` atomically; False where the file
    cannot be written, the entry then being kept in memory for this process (logged)."""
    path = Path(path)
    entry = {"format": format, **_canonical(key), **_canonical(value)}
    entry[CHECKSUM] = _checksum(entry)
    try:
        atomic_write_json(path, entry)
    except OSError as exc:
        _memory[str(path)] = entry
        log.warning(
            "cannot write the cached %s %s (%s); it is kept in memory for this process only, and the next one makes it "
            "again: make %s writable (or remove what is in the way)",
            what,
            path,
            exc.strerror or exc,
            path.parent,
        )
        return False
    _memory.pop(str(path), None)
    return True


@overload
def cached(
    path: str | os.PathLike, build: Callable[[], dict[str, Any]], *, format: str, key: dict[str, Any], what: str
) -> tuple[dict[str, Any], bool]: ...
@overload
def cached(
    path: str | os.PathLike,
    build: Callable[[], dict[str, Any]],
    *,
    format: str,
    key: dict[str, Any],
    what: str,
    parse: Callable[[dict[str, Any]], T],
) -> tuple[T, bool]: ...
def cached(
    path: str | os.PathLike,
    build: Callable[[], dict[str, Any]],
    *,
    format: str,
    key: dict[str, Any],
    what: str,
    parse: Callable[[dict[str, Any]], Any] = lambda value: value,
) -> tuple[Any, bool]:
    """``(parse(value), was cached)``: the entry at ``path`` for ``key`` where one verifies, else ``build()``'s value,
    cached for the next caller."""
    hit = read_entry(path, format=format, key=key, what=what, parse=parse)
    if hit is not None:
        return hit, True
    value = build()
    write_entry(path, value, format=format, key=key, what=what)
    return parse(_canonical(value)), False


#: Seconds between two tries for a build lock another process holds.
LOCK_POLL_S = 0.2


@contextlib.contextmanager
def build_lock(path: str | os.PathLike, *, timeout: float, what: str) -> Iterator[bool]:
    """Hold an exclusive lock on ``path`` while building ``what``: yields True once held, or False where another
    process still holds it after ``timeout`` seconds (the caller falls back or refuses, naming it).

    A ``flock`` the kernel drops when its holder dies, so a killed builder never blocks a later one, and a build
    artifact found while the lock is held belongs to no live builder. The holder's pid is kept in the file for the
    one log line a waiter writes.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        deadline = time.monotonic() + timeout
        waited = False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not waited:
                    log.info("waiting up to %g s for %s: process %s is running it (it holds %s)", timeout, what, holder_of(path), path)
                    waited = True
                if time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(LOCK_POLL_S)
        try:
            f.seek(0)
            f.truncate()
            f.write(f"{os.getpid()}\n")
            f.flush()
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def holder_of(path: str | os.PathLike) -> str:
    """The pid :func:`build_lock` recorded in ``path`` (for a message), or ``unknown``."""
    try:
        return Path(path).read_text().strip() or "unknown"
    except OSError:
        return "unknown"
