"""One writer per output: ``claim_output`` checks ownership and writability and holds an exclusive lock.

Every command that writes (prepare, extract, train, calibrate, eval, export-speculators, quickstart, the
Mooncake master's ``store start``, and ``generate --metrics-out``, a file) enters ``claim_output(OUT, KIND)``
before any work, so none can forget one of the three checks (``tests/hostile/test_ownership.py`` runs every
output flag of the CLI against them):

1. **ownership**: ``check_replaceable(OUT, KIND)`` (``utils/io.py``): an existing ``OUT`` is
   replaced or extended only when it is that command's kind (a ``DirKind``, or a ``FileKind`` for a
   file output); an input inside ``OUT`` (or equal to it,
   unless the command rewrites in place) is refused. ``KIND`` is ``None`` where the command checks
   its directory itself (train's run) or only adds named entries beside others' (the quickstart, whose
   stages claim their own directories with their kinds; a master's ``--dir``).
2. **writability**: a probe file is written in ``OUT``'s parent (and in ``OUT`` when it exists), so
   a read-only, forbidden or full file system is one clear error before the work, not a traceback
   after an hour of decoding.
3. **one writer per tree**: an exclusive lock, held until the command ends; a second writer is refused at
   once with the holder's pid, host, command and start time. A lock covers ``OUT``'s whole tree: a writer
   is also refused while another holds a lock on an ancestor of its ``OUT`` (``calibrate --drafter R/final``
   while ``train --out R`` runs would swap the run's final drafter under it) or on a descendant (the
   reverse). Each writer takes its own lock *first* and then looks for the others' (``tree_conflict``), so of
   two writers on nested paths the later to look always sees the earlier: at least one is refused, never both
   let through. A process's own locks (its pid in the lock file) never block it: the quickstart holds its
   run directory while its stages claim theirs inside.

The lock file is ``PARENT/.NAME.lock`` of ``OUT``'s resolved path, a sibling of ``OUT`` rather than a file
inside it: it survives ``atomic_dir`` swapping ``OUT`` for a new directory, is no entry of ``OUT`` for the
ownership check, and can be taken before ``OUT`` exists (so the parent must be writable, as an atomic swap
needs anyway).
It is locked with ``fcntl.flock`` on an open descriptor, which the kernel releases if the process dies,
and holds JSON ``{pid, host, pidns, command, argv, started, heartbeat}``; a clean release deletes it.

Stale locks: a lock file found unlocked but with content was left by a holder that died (SIGKILL, a
crash) and is taken over with a WARNING. A lock found locked is stale when its holder ran on this
host (same host name and pid namespace: containers with host networking share the name) and its pid
is gone (an orphaned forked child kept the descriptor), or ran on another host and
its heartbeat, refreshed every ``HEARTBEAT_S`` by a daemon thread, is older than ``STALE_AFTER_S``
(the holder's machine died, or the file system's flock does not reach across hosts: a lock this host
*could* take is still refused while another host's heartbeat is fresh). A stale lock file is unlinked
and a new one taken, with a WARNING.

One lock per job: the ranks of one ``torchrun`` job are one writer, so only rank 0 (``RANK`` unset or
0) takes the lock; the others check ownership and writability only. Within one process the lock is
re-entrant (a nested claim of the same output shares it). Readers (training streaming from a store
being extracted, online training reading a store) never take it.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import json
import logging
import os
import re
import shlex
import socket
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from specdraft.errors import OS_ERROR_FIXES, SpecdraftError, setting
from specdraft.utils.io import LOCK_GLOB
from specdraft.utils.launch import torchrun_place

log = logging.getLogger(__name__)

HEARTBEAT_S = 30.0
STALE_AFTER_S = 300.0  # ten missed heartbeats
# A lock file found locked but empty is a writer between its flock and its first write (or a probe's brief shared
# lock): looked at again this many times, this long apart, before it counts as held by someone unknown.
EMPTY_RETRIES = 25
EMPTY_WAIT_S = 0.02
COMMAND_CHARS = 300  # of a holder's command line in a refusal: enough for its subcommand, paths and --out


def lock_path(out: str | os.PathLike) -> Path:
    """Where the lock of output ``out`` lives: ``.NAME.lock`` beside it (see the module docstring), found through its
    resolved path so that two spellings of one directory (a symbolic link, ``..``) share one lock."""
    out = Path(out).expanduser().resolve()
    return out.parent / f".{out.name}.lock"


def _output_of(lock: Path) -> Path:
    """The output a lock file ``PARENT/.NAME.lock`` guards: ``PARENT/NAME``."""
    return lock.parent / lock.name[1 : -len(".lock")]


def unwritable(path: Path, exc: OSError, what: str) -> SpecdraftError:
    """The one-line error for an output that cannot be written, naming the path and the fix."""
    fix = OS_ERROR_FIXES.get(exc.errno or 0, f"{exc.strerror or exc}: choose another {what}")
    return SpecdraftError(f"cannot write {what} {path}: {fix}; nothing was done")


def probe_writable(directory: str | os.PathLike, what: str = "", *, output: str | os.PathLike | None = None) -> None:
    """Create ``directory`` if needed and write, sync and delete a small file in it, or raise ``SpecdraftError``
    naming ``output`` (default: ``directory``), the path the user gave.

    A real write (4 KiB, fsynced) rather than ``os.access``: root passes every permission check yet
    cannot write a read-only mount, and a full disk accepts an empty file.
    """
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".specdraft-probe.", dir=directory)
        try:
            os.write(fd, b"\0" * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        raise unwritable(Path(output) if output is not None else directory, exc, what or setting("out")) from None


def _now_text(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def pid_alive(pid: int) -> bool:
    """True if a process ``pid`` exists on this host (whoever owns it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by another user
    return True


def _pid_namespace() -> str:
    """This process's pid namespace: two containers may share a host name (host networking) but not their pids."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def same_machine(holder: dict, host: str) -> bool:
    """Whether the holder's pid means a process here: same host name and same pid namespace."""
    return holder.get("host") == host and holder.get("pidns", _pid_namespace()) == _pid_namespace()


def stale_reason(holder: dict, *, host: str, now: float, stale_after: float = STALE_AFTER_S) -> str | None:
    """Why the lock ``holder`` recorded is stale, or ``None`` while it may still be writing.

    Same host (and pid namespace): stale when its pid is gone. Another host (pids mean nothing
    here): stale when its heartbeat is older than ``stale_after`` seconds.
    """
    if same_machine(holder, host):
        pid = holder.get("pid")
        return None if isinstance(pid, int) and pid_alive(pid) else f"pid {pid} is no longer running on {host}"
    beat = holder.get("heartbeat")
    if not isinstance(beat, (int, float)):
        return None
    age = now - beat
    return f"its heartbeat is {age:.0f} s old (stale after {stale_after:.0f} s)" if age > stale_after else None


def describe_holder(holder: dict) -> str:
    started = holder.get("started")
    since = _now_text(started) if isinstance(started, (int, float)) else "an unknown time"
    return f"pid {holder.get('pid', '?')} on {holder.get('host', '?')} ({holder_command(holder)}), since {since}"


_CLI_WORD = re.compile(r"[a-z][a-z-]*")  # how the CLI's subcommands are spelled (``train``, ``export-speculators``)


def holder_command(holder: dict, limit: int = COMMAND_CHARS) -> str:
    """What the holder runs, as a quoted command: `specdraft train --out R ...` when it is the CLI (its ``argv`` goes on
    with a subcommand), else its command and program. Quoted, so that the flags in it read as the holder's, not as
    advice to the refused command (``tests/hostile/test_advice.py``); cut after ``limit`` characters at an argument,
    inside the quote, which stays closed (a long path is cut within, a flag never: a cut one would name no flag)."""
    command = str(holder.get("command") or "a specdraft command")
    argv = holder.get("argv")
    argv = [str(a) for a in argv] if isinstance(argv, list) else []
    if len(argv) < 2 or not _CLI_WORD.fullmatch(argv[1]):
        return f"{command}, run by `{Path(argv[0]).name}`" if argv else command
    shown = "specdraft"
    for i, word in enumerate(map(shlex.quote, argv[1:]), 1):
        if len(shown) + 1 + len(word) > limit:
            room = limit - len(shown) - 1
            cut = f" {word[:room]}..." if room > 0 and not word.startswith("-") else " ..."
            return f"`{shown}{cut}` ({len(argv) - i} argument(s) cut)"
        shown += " " + word
    return f"`{shown}`"


def _read_holder(fd: int) -> dict | None:
    """A lock file's holder JSON, ``{}`` when the file is half-written or not ours, ``None`` when it never had content."""
    data = os.pread(fd, 1 << 16, 0)
    if not data:
        return None
    try:
        obj = json.loads(data)
    except ValueError:
        return {}
    return obj if isinstance(obj, dict) else {}


def held_by_other(path: Path, *, host: str, now: float, stale_after: float = STALE_AFTER_S) -> dict | None:
    """The holder recorded in lock file ``path`` while another live writer holds it; ``None`` when nobody does (no such
    file, released, left by a dead holder, this process's own lock, or a locked file that never gets content: another
    program's ``.lock``, not ours).

    Probed with a shared non-blocking ``flock``, released at once: a holder's exclusive lock refuses it, two probes do
    not refuse each other, and a writer taking the lock at that instant finds it locked and empty, and looks again.
    """
    import fcntl

    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return None
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None  # gone, or unreadable to us: nothing known holds it
    try:
        for _ in range(EMPTY_RETRIES):
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
                locked = False
            except BlockingIOError:
                locked = True
            holder = _read_holder(fd)
            if holder and holder.get("pid") == os.getpid() and same_machine(holder, host):
                return None  # this process's own: a nested claim
            if not locked:  # only another host's fresh heartbeat still holds it (flock may not reach across hosts)
                fresh = (
                    holder
                    and not same_machine(holder, host)
                    and isinstance(holder.get("heartbeat"), (int, float))
                    and stale_reason(holder, host=host, now=now, stale_after=stale_after) is None
                )
                return holder if fresh else None
            if holder:
                return None if stale_reason(holder, host=host, now=now, stale_after=stale_after) else holder
            time.sleep(EMPTY_WAIT_S)
        return None
    finally:
        os.close(fd)


def tree_conflict(out: str | os.PathLike, *, host: str, now: float, stale_after: float = STALE_AFTER_S) -> tuple[Path, dict] | None:
    """The first lock another live writer holds on an ancestor or a descendant of ``out`` (its lock file and holder),
    or ``None``: the tree rule of the module docstring. Descendants are found by walking ``out`` (links not followed)."""
    root = Path(out).expanduser().resolve()
    ancestors = (parent.parent / f".{parent.name}.lock" for parent in root.parents if parent.name)
    descendants = (
        Path(directory) / name for directory, _, names in os.walk(root) for name in names if fnmatch.fnmatchcase(name, LOCK_GLOB)
    )
    for lock in (*ancestors, *descendants):
        holder = held_by_other(lock, host=host, now=now, stale_after=stale_after)
        if holder is not None:
            return lock, holder
    return None


class OutputLock:
    """The exclusive lock on one output directory (``acquire``/``release``, or a context manager).

    ``host`` and ``clock`` default to this machine's name and ``time.time``; tests inject others.
    """

    def __init__(
        self,
        out: str | os.PathLike,
        *,
        command: str = "",
        what: str = "",
        host: str | None = None,
        clock: Callable[[], float] = time.time,
        heartbeat_s: float = HEARTBEAT_S,
        stale_after: float = STALE_AFTER_S,
    ):
        self.out = Path(out)
        self.path = lock_path(self.out)
        self.command = command or "specdraft"
        self.what = what or setting("out")
        self.host = host or socket.gethostname()
        self.clock = clock
        self.heartbeat_s = heartbeat_s
        self.stale_after = stale_after
        self._fd: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._info: dict = {}

    # -- the lock file ------------------------------------------------------------------------------

    def _write(self) -> None:
        assert self._fd is not None  # called only while the lock is held
        data = json.dumps(self._info, sort_keys=True).encode()
        os.pwrite(self._fd, data, 0)
        os.ftruncate(self._fd, len(data))

    def _same_file(self, fd: int) -> bool:
        try:
            return os.stat(self.path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False

    def _refuse(self, holder: dict) -> SpecdraftError:
        who = describe_holder(holder) if holder else "another process (its lock file is being written)"
        return SpecdraftError(
            f"{self.out} is being written by {who}; lock {self.path}. Wait for it to finish, stop it, or choose another "
            f"{self.what}; nothing was done"
        )

    def _refuse_nested(self, lock: Path, holder: dict) -> SpecdraftError:
        other = _output_of(lock)
        where = f"{self.out} lies inside {other}" if other in self.out.expanduser().resolve().parents else f"{self.out} holds {other}"
        return SpecdraftError(
            f"{where}, which is being written by {describe_holder(holder)}; lock {lock}. A writer's lock covers its whole "
            f"directory tree: wait for it to finish, stop it, or choose another {self.what}; nothing was done"
        )

    def _not_a_lock_file(self) -> SpecdraftError | None:
        """The error for a lock path that is not a regular file (``mkdir .D.lock``): it names that path, not the output."""
        try:
            mode = os.stat(self.path).st_mode
        except OSError:
            return None
        if stat.S_ISREG(mode):
            return None
        found = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        return SpecdraftError(
            f"cannot lock {self.what} {self.out}: its lock file {self.path} is {found}, not a lock specdraft wrote; move it away, "
            "or remove it if it is not yours, then rerun; nothing was done"
        )

    def _open(self) -> int:
        """The lock file, opened (made where absent) for reading and writing; an error names the path and the fix."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise self._not_a_lock_file() or unwritable(self.out, exc, self.what) from None

    def _hold(self, fd: int, holder: dict | None, now: float) -> None:
        """With the ``flock`` of ``fd`` taken: take over from a holder that ended without releasing (refusing one on
        another host whose heartbeat is fresh), write ours, refuse a writer on a nested path, and start the heartbeat."""
        if holder is not None:
            reason = stale_reason(holder, host=self.host, now=now, stale_after=self.stale_after) if holder else "it is unreadable"
            if holder and not same_machine(holder, self.host) and reason is None:
                os.close(fd)  # flock does not reach across hosts on this file system; the heartbeat does
                raise self._refuse(holder)
            log.warning(
                "%s: took over the lock of %s, which ended without releasing it (%s)",
                self.out,
                describe_holder(holder) if holder else "an unknown process",
                reason or "it has ended",
            )
        self._fd = fd
        self._info = {
            "pid": os.getpid(),
            "host": self.host,
            "command": self.command,
            "argv": sys.argv,
            "pidns": _pid_namespace(),
            "started": now,
            "heartbeat": now,
        }
        try:
            self._write()
        except OSError as exc:
            self.release()
            raise unwritable(self.path, exc, self.what) from None
        # ours first, then the others': of two writers on nested paths, the later to look sees the earlier
        conflict = tree_conflict(self.out, host=self.host, now=self.clock(), stale_after=self.stale_after)
        if conflict is not None:
            self.release()
            raise self._refuse_nested(*conflict)
        self._start_heartbeat()

    def acquire(self) -> None:
        import fcntl

        contended = waited = 0
        while contended < 20:  # each retry follows a release or a removed stale lock: it makes progress
            if (error := self._not_a_lock_file()) is not None:
                raise error
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
            except BlockingIOError:
                locked = False
            holder = _read_holder(fd)
            now = self.clock()
            if locked and not self._same_file(fd):
                os.close(fd)  # its holder released (and deleted) it between our open and our flock
                contended += 1
                continue
            if locked:
                self._hold(fd, holder, now)
                return
            if not holder and waited < EMPTY_RETRIES:  # locked, nothing written yet: a writer about to write, or a probe
                os.close(fd)
                waited += 1
                time.sleep(EMPTY_WAIT_S)
                continue
            reason = stale_reason(holder, host=self.host, now=now, stale_after=self.stale_after) if holder else None
            if reason is None:
                os.close(fd)
                raise self._refuse(holder or {})
            if self._same_file(fd):  # still the stale file, not one a contender created after removing it
                log.warning("%s: removing the stale lock of %s (%s)", self.out, describe_holder(holder or {}), reason)
                self.path.unlink(missing_ok=True)
            os.close(fd)
            contended += 1
        raise SpecdraftError(f"could not take the lock {self.path} after 20 tries (writers keep contending for {self.out}); retry")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._fd is None:
            return
        if self._same_file(self._fd):
            self.path.unlink(missing_ok=True)  # while still locked: a waiter then finds it gone and retries
        os.close(self._fd)
        self._fd = None

    def refresh(self) -> bool:
        """Write a new heartbeat; ``False`` when the lock file is no longer ours (removed as stale by another)."""
        if self._fd is None or not self._same_file(self._fd):
            return False
        self._info["heartbeat"] = self.clock()
        self._write()
        return True

    def _start_heartbeat(self) -> None:
        def beat() -> None:
            while not self._stop.wait(self.heartbeat_s):
                try:
                    if not self.refresh():
                        log.error(
                            "%s: the lock %s was removed by another process; two writers may now share this output", self.out, self.path
                        )
                        return
                except OSError as exc:
                    log.warning("%s: cannot refresh the lock heartbeat (%s)", self.path, exc)

        self._stop.clear()
        self._thread = threading.Thread(target=beat, name=f"specdraft-lock-{self.out.name}", daemon=True)
        self._thread.start()

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


_held: dict[Path, tuple[int, int]] = {}  # lock path -> (pid, depth): re-entrancy within one process
_held_guard = threading.Lock()


@contextlib.contextmanager
def _process_lock(out: Path, command: str, what: str) -> Iterator[None]:
    key = lock_path(out)
    with _held_guard:
        pid, depth = _held.get(key, (0, 0))
        nested = pid == os.getpid() and depth > 0  # a forked child inherits the dict, not the lock
        if nested:
            _held[key] = (pid, depth + 1)
    if nested:
        try:
            yield
        finally:
            with _held_guard:
                _held[key] = (pid, _held[key][1] - 1)
        return
    with OutputLock(out, command=command, what=what):
        with _held_guard:
            _held[key] = (os.getpid(), 1)
        try:
            yield
        finally:
            with _held_guard:
                _held.pop(key, None)


def _is_extra_rank() -> bool:
    """A rank other than 0 of a ``torchrun`` job: its rank 0 holds the job's lock."""
    try:
        return torchrun_place()[0] > 0
    except ValueError:
        return False


@contextlib.contextmanager
def claim_output(
    out: str | os.PathLike,
    kind: Any,
    *,
    inputs: Iterable[str | os.PathLike] = (),
    in_place_ok: bool = False,
    command: str = "",
    what: str = "",
) -> Iterator[Path]:
    """Ownership check, writability probe and exclusive lock on ``out`` for the block (module docstring).

    ``kind`` is the ``DirKind`` (a ``FileKind`` for a file) the command writes (or a function returning it, for kinds defined
    beside heavy imports), or ``None`` when the command checks its directory itself (the trainer's
    run directory). ``what`` names the flag in messages (default: the running command's for ``out``).
    """
    from specdraft.utils.io import check_replaceable, recover_swap

    what = what or setting("out")
    if callable(kind):
        kind = kind()
    if not str(out):
        raise SpecdraftError(f"{what} is required")
    out = Path(out).expanduser()
    if kind is not None:
        check_replaceable(out, kind, inputs=inputs, in_place_ok=in_place_ok)
    elif out.exists() and not out.is_dir():
        raise SpecdraftError(f"{what} {out} exists and is not a directory; choose another {what}")
    probe_writable(out.parent, what, output=out)
    if out.is_dir():
        probe_writable(out, what)
    if _is_extra_rank():
        yield out
        return
    with _process_lock(out, command, what):
        recover_swap(out)  # before anything reads OUT: a writer killed mid-swap may have left no OUT at all
        if kind is not None:
            check_replaceable(out, kind, inputs=inputs, in_place_ok=in_place_ok)  # again: it may have changed before we held it
        yield out


def claims_output(
    kind: Any,
    *,
    out: Callable[[Any], str | None] = lambda config: config.out,
    inputs: Callable[[Any], Iterable[str]] = lambda config: (),
    in_place_ok: bool = False,
    command: str = "",
    what: str | Callable[[Any], str] = "",
) -> Callable:
    """Decorate a command's library entry ``fn(config, ...)`` to run inside ``claim_output(out(config), kind, ...)``:
    one line per command, and the claim cannot be skipped by a caller that bypasses the CLI (the quickstart)."""

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(config: Any, *args: Any, **kwargs: Any) -> Any:
            path = out(config)
            if path is None:  # not a directory here (a Mooncake URL): nothing to claim
                return fn(config, *args, **kwargs)
            with claim_output(
                path,
                kind,
                inputs=inputs(config),
                in_place_ok=in_place_ok,
                command=command or f"specdraft {fn.__name__}",
                what=what(config) if callable(what) else what,
            ):
                return fn(config, *args, **kwargs)

        return wrapper

    return decorate
