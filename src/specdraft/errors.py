"""One exception type for every user-facing failure.

The CLI prints a ``SpecdraftError`` as a one-line message (no traceback), so each message must
name the offending file/field/value and say what to do about it.
"""

import errno
import os


class SpecdraftError(Exception):
    """A problem with the user's input or environment, explained in the message."""


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
}


def os_error_message(exc: BaseException) -> str | None:
    """One line for the first boundary ``OSError`` (see ``OS_ERROR_FIXES``) in ``exc``'s cause/context chain,
    naming its path(s) and the fix; ``None`` if there is none (a bug keeps its traceback)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in OS_ERROR_FIXES:
            where = " -> ".join(str(f) for f in (exc.filename, exc.filename2) if f is not None) or "(no path given)"
            return f"{where}: {exc.strerror or os.strerror(exc.errno)}; {OS_ERROR_FIXES[exc.errno]}"
        exc = exc.__cause__ or exc.__context__
    return None
