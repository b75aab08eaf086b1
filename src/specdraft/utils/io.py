"""Crash-safe file writes: readers never see a partial file, and a directory is replaced only when it is ours."""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def cache_root() -> Path:
    """specdraft's cache directory: ``$SPECDRAFT_CACHE`` or ``~/.cache/specdraft``."""
    return Path(os.environ.get("SPECDRAFT_CACHE") or Path.home() / ".cache" / "specdraft").expanduser()


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is fsynced and renamed over ``path``.

    On any exception the temporary file is removed and ``path`` is left untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


@dataclass(frozen=True)
class DirKind:
    """What one command writes into a directory: only a directory of its kind is replaced or extended.

    ``marker`` is the file that identifies the kind and ``recognise(marker_path)`` says whether it
    is this kind's; ``files`` are all the entries the kind may hold (marker included), ``patterns``
    globs for entries with open-ended names (a store's ``*.safetensors``). ``scratch`` entries may
    stand alone, before the marker exists (work kept by an interrupted run). ``replaced`` says
    whether the command replaces the directory whole or writes into it (only the message differs).
    """

    name: str
    marker: str
    recognise: Callable[[Path], bool]
    files: frozenset[str]
    scratch: frozenset[str] = frozenset()
    patterns: tuple[str, ...] = ()
    replaced: bool = True

    def holds(self, name: str) -> bool:
        """Whether an entry of this name belongs to the kind (lock files of outputs inside it always do)."""
        return name in self.files or any(fnmatch.fnmatchcase(name, p) for p in (*self.patterns, LOCK_GLOB))


#: Lock files of outputs (``utils/lock.py``): ``.NAME.lock`` beside the output they guard.
LOCK_GLOB = ".*.lock"


@dataclass(frozen=True)
class FileKind:
    """What one command writes as a single file (``generate --metrics-out``): an existing file is replaced only when
    ``recognise(path)`` says it is one; ``example`` is the name suggested inside a directory given instead of a file."""

    name: str
    recognise: Callable[[Path], bool]
    example: str


def json_field_is(key: str, value: Any) -> Callable[[Path], bool]:
    """A ``DirKind.recognise`` for a JSON marker whose ``key`` must exist (``value`` ``...``) or equal ``value``."""

    def recognise(path: Path) -> bool:
        try:
            obj = json.loads(path.read_text())
        except (OSError, ValueError):
            return False
        return isinstance(obj, dict) and key in obj and (value is ... or obj[key] == value)

    return recognise


def check_replaceable(
    path: str | os.PathLike, kind: DirKind | FileKind, *, inputs: Iterable[str | os.PathLike] = (), in_place_ok: bool = False
) -> None:
    """Refuse (``SpecdraftError``) to replace ``path`` unless it is absent, empty or holds only a ``kind`` (for a
    ``FileKind``: unless it is absent or such a file).

    ``inputs`` are paths the command reads: none may lie inside ``path``, and none may be ``path``
    itself unless ``in_place_ok`` (a documented in-place rewrite that reads everything first and
    swaps in the new content only when complete, as calibrate's): otherwise the command would
    replace its own input with something derived from it (``prepare --data D --out D``).
    """
    from specdraft.errors import SpecdraftError

    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return
    if isinstance(kind, FileKind):
        if path.is_dir():
            raise SpecdraftError(f"{path} is a directory; give a file path, e.g. {path / kind.example}")
        if not kind.recognise(path):
            raise SpecdraftError(
                f"{path} exists and is not a {kind.name}; it would be replaced, so nothing was done. Choose "
                "another path or move that file away"
            )
        return
    if path.is_symlink() or not path.is_dir():
        what = "a symbolic link (the link, not its target, would be replaced)" if path.is_symlink() else "not a directory"
        raise SpecdraftError(f"{path} exists and is {what}; choose another output path")
    fate = "replaced whole" if kind.replaced else "written into"
    entries = {p.name for p in path.iterdir()}
    foreign = sorted(name for name in entries if not kind.holds(name))
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise SpecdraftError(
            f"{path} already exists and holds entries a {kind.name} does not ({shown}); it would be {fate}, "
            "so nothing was written. Choose a new or empty output directory, or move those entries away"
        )
    entries -= {name for name in entries if fnmatch.fnmatchcase(name, LOCK_GLOB)}
    if entries and not entries <= kind.scratch and not kind.recognise(path / kind.marker):
        found = f"its {kind.marker} is not a {kind.name}'s" if (path / kind.marker).is_file() else f"it has no {kind.marker}"
        raise SpecdraftError(
            f"{path} already exists and is not a {kind.name} ({found}); it would be {fate}, so nothing "
            "was written. Choose a new or empty output directory"
        )
    root = path.resolve()
    for source in inputs:
        resolved = Path(source).expanduser().resolve()
        if root in resolved.parents:
            raise SpecdraftError(
                f"input {source} lies inside {path}, which this command {'replaces whole' if kind.replaced else 'writes into'} "
                f"as a {kind.name}; write the output to another directory"
            )
        if resolved == root and not in_place_ok:
            raise SpecdraftError(
                f"input {source} is also the output {path}: the {kind.name} written there would replace the data it "
                "is made from; write the output to another directory"
            )


def recover_swap(path: str | os.PathLike) -> None:
    """Clear what a writer of ``path`` killed inside ``atomic_dir`` left beside it: its ``.NAME.XXXXXXXX.tmp`` (a new
    content not yet swapped in) and ``.NAME.PID.old`` (the previous one, not yet removed) directories. Killed between
    the swap's two renames it left no ``path`` at all: the previous content is put back (old or new, never neither).

    Only for the writer of ``path``: its lock (``utils/lock.claim_output``, on ``path`` or a directory above it) is
    what makes these leftovers of a dead writer rather than the work of a live one. The names are matched exactly, so
    a sibling output's (``NAME.v2``) are never touched.
    """
    import logging

    path = Path(path)
    temporary = re.compile(rf"\.{re.escape(path.name)}\.(?:[a-z0-9_]{{8}}\.tmp|\d+\.old)")
    try:
        leftovers = sorted(p for p in path.parent.iterdir() if temporary.fullmatch(p.name) and p.is_dir() and not p.is_symlink())
    except FileNotFoundError:
        return
    log = logging.getLogger(__name__)
    previous = [p for p in leftovers if p.name.endswith(".old")]
    if previous and not path.exists() and not path.is_symlink():
        os.replace(previous[0], path)
        log.warning(
            "%s: put back its previous content from %s, left by a writer killed while swapping in a new one", path, previous[0].name
        )
        leftovers.remove(previous[0])
    for leftover in leftovers:
        shutil.rmtree(leftover, ignore_errors=True)
    if leftovers:
        log.info("%s: removed %s, left by a writer killed before it finished", path, ", ".join(p.name for p in leftovers))


@contextlib.contextmanager
def atomic_dir(
    path: str | os.PathLike, kind: DirKind, *, inputs: Iterable[str | os.PathLike] = (), in_place_ok: bool = False
) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success it replaces ``path`` whole (old content removed).

    ``path`` is replaced only when ``check_replaceable`` allows it, checked before the caller writes
    and again just before the swap. Readers see either the old directory or the complete new one.
    A hard kill can leave a hidden ``.NAME.*.tmp`` or ``.NAME.PID.old`` sibling behind, never a
    half-written ``path``; the next writer clears them first (``recover_swap``).
    """
    path = Path(path)
    recover_swap(path)
    check_replaceable(path, kind, inputs=inputs, in_place_ok=in_place_ok)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        check_replaceable(path, kind, inputs=inputs, in_place_ok=in_place_ok)
        old = None
        if path.exists():
            old = path.with_name(f".{path.name}.{os.getpid()}.old")
            os.replace(path, old)
        try:
            os.replace(tmp, path)
        except BaseException:
            if old is not None:  # put the previous content back rather than leave it as debris to be swept
                os.replace(old, path)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def naming_path(path: str | os.PathLike) -> Iterator[None]:
    """Make an OS error raised inside name ``path``, so the CLI's one-line message says where.

    Libraries that write files themselves drop the path (pyarrow: "Error writing bytes to file. Detail:
    [errno 28] ...") or wrap the error in their own type (safetensors: ``SafetensorError`` "... No space
    left on device (os error 28)"); both are re-raised as the ``OSError`` they were, naming ``path``.
    """
    from safetensors import SafetensorError

    try:
        yield
    except SafetensorError as exc:
        code = re.search(r"\(os error (\d+)\)", str(exc))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from exc
    except OSError as exc:
        if exc.filename is not None or not exc.errno:
            raise
        raise OSError(exc.errno, os.strerror(exc.errno), str(path)) from exc


def save_safetensors(tensors: dict, path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file``, the one place the project writes safetensors files (see ``naming_path``)."""
    from safetensors.torch import save_file

    with naming_path(path):
        save_file(tensors, str(path), metadata=metadata)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
