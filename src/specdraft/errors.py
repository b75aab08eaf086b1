"""One exception type for every user-facing failure.

The CLI prints a ``SpecdraftError`` as a one-line message (no traceback), so each message must
name the offending file/field/value and say what to do about it.
"""


class SpecdraftError(Exception):
    """A problem with the user's input or environment, explained in the message."""
