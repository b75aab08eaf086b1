"""One exception type for every user-facing failure.

The CLI prints a ``SpecdraftError`` as a one-line message (no traceback), so each message must
name the offending file/field/value and say what to do about it.
"""

import contextlib
import errno
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field


class SpecdraftError(Exception):
    """A problem with the user's input or environment, explained in the message."""


@dataclass(frozen=True)
class CommandSettings:
    """How the command running spells settings: library code that raises an error names a config field, and the
    advice must name what the user can type on the command they ran (quickstart feeds prepare's ``regen_budget``
    from its own ``--data-budget``; calibrate has no ``--regen-budget`` at all)."""

    command: str  # "quickstart", "store start"
    flags: Mapping[str, str]  # config field -> this command's flag (or positional): "--data-budget", "DRAFTER"
    owners: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # config field -> the commands with a flag for it


_active: CommandSettings | None = None  # a process runs one command; a module global, so worker threads see it too


@contextlib.contextmanager
def command_settings(settings: CommandSettings) -> Iterator[None]:
    """Spell settings as ``settings.command``'s flags while it runs (the CLI wraps each command in this)."""
    global _active
    previous, _active = _active, settings
    try:
        yield
    finally:
        _active = previous


def setting(name: str, *aliases: str, of: str | None = None) -> str:
    """How an error names the config field ``name`` so that the user can act on it: the running command's flag for it
    (``--val-fraction``, or quickstart's ``--data-budget`` for ``regen_budget``); where that command has none, the field
    and the commands that do ("val_fraction (a setting of `specdraft train`)"), since a flag the user cannot pass is
    no advice. ``of``: the command whose field it is, where the running one has a flag of that name for something else
    (calibrate's ``--val-fraction`` is not the one its training run split with). ``aliases``: the same setting's
    field in other commands' configs (``threads``, ``num_threads``); the running command's is named. Outside the CLI:
    ``--val-fraction``, the flag of every command that has the field under its own name."""
    if _active is None:
        return "--" + name.replace("_", "-")
    name = next((n for n in (name, *aliases) if n in _active.flags), name)
    if name in _active.flags and of in (None, _active.command):
        return _active.flags[name]
    owners = (of,) if of else _active.owners.get(name, ())
    return f"{name} (a setting of {', '.join(f'`specdraft {c}`' for c in owners)})" if owners else name


#: errno -> what to do, for the OS errors that come from the machine rather than from a bug: the CLI turns
#: them into a one-line error (``os_error_message``) however deep in a command they arise.
OS_ERROR_FIXES = {
    errno.ENOSPC: "the disk is full: free space there or write to another filesystem, then rerun the same command",
    errno.EDQUOT: "the disk quota is used up: free space there or write to another filesystem, then rerun the same command",
    errno.EROFS: "the filesystem is read-only: choose a path on a writable one (or remount it read-write)",
    errno.EACCES: "permission denied: change its permissions or owner, or choose another path",
    errno.EPERM: "operation not permitted: change its permissions or owner, or choose another path",
    errno.EMFILE: "too many open files in this process: raise the limit (ulimit -n) or use fewer threads/workers",
    errno.ENFILE: "too many open files on this machine: close other programs' files or raise the system limit (fs.file-max)",
    # a directory or a file where specdraft expects the other (moved or made there by hand): no write of ours leaves one
    errno.EISDIR: "a directory is where a file is expected: move it aside, or choose another path",
    errno.ENOTDIR: "a file is where a directory is expected on that path: move it aside, or choose another path",
}


def os_error_message(exc: BaseException) -> str | None:
    """One line for the first boundary ``OSError`` (see ``OS_ERROR_FIXES``) in ``exc``'s cause/context chain,
    naming its path(s) and the fix; ``None`` if there is none (a bug keeps its traceback)."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if isinstance(link, OSError) and link.errno in OS_ERROR_FIXES:
            where = " -> ".join(str(f) for f in (link.filename, link.filename2) if f is not None) or "(no path given)"
            return f"{where}: {link.strerror or os.strerror(link.errno)}; {OS_ERROR_FIXES[link.errno]}"
        link = link.__cause__ or link.__context__
    return None
