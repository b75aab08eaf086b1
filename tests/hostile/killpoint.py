"""Run the specdraft CLI and SIGKILL it at a chosen moment: ``python killpoint.py WHERE [WHERE...] -- ARGS...``.

``WHERE`` is ``module:qualname[#N][@after][?FILTER][!stop]``: on the Nth call (default the first) of that function
the process sends itself SIGKILL, as ``kill -9`` would, before the call runs or, with ``@after``, once it has
returned; with ``!stop`` it sends itself SIGSTOP instead (frozen where it is, holding what it holds, until the sweep
continues it with SIGCONT or kills it). ``?dir`` counts only calls whose first argument is an existing directory
(``os:replace?dir``: the swaps of ``atomic_dir``); ``?match=REGEX`` only those whose positional arguments, joined
by `` -> ``, match (``os:replace?match=/final -> ``: the rename that moves ``final/`` aside). The
function is replaced where the code under test looks it up (a module that did ``from x import f`` holds its own
``f``). Why: a sweep kills "while the checkpoint is written" or "between the two renames of a swap" on every run,
not when a sleep happens to land there; the process gets no chance to clean up, exactly as with kill -9.
"""

from __future__ import annotations

import importlib
import os
import re
import signal
import sys
import threading


def arm(where: str) -> None:
    spec, _, action = where.partition("!")
    spec, _, only = spec.partition("?")
    spec, _, when = spec.partition("@")
    sig = signal.SIGSTOP if action == "stop" else signal.SIGKILL
    target, _, nth = spec.partition("#")
    module_name, _, qualname = target.partition(":")
    owner = importlib.import_module(module_name)
    *path, attr = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    original = getattr(owner, attr)
    wanted, calls, guard = int(nth or 1), [0], threading.Lock()

    def wrapper(*args, **kwargs):
        first = args[0] if args else None
        if only == "dir":
            counted = first is not None and os.path.isdir(first)
        elif only.startswith("match="):
            counted = re.search(only[len("match=") :], " -> ".join(map(str, args))) is not None
        else:
            counted = True
        with guard:
            calls[0] += counted
            hit = counted and calls[0] == wanted
        if hit and when != "after":
            os.kill(os.getpid(), sig)
        result = original(*args, **kwargs)
        if hit and when == "after":
            os.kill(os.getpid(), sig)
        return result

    setattr(owner, attr, wrapper)


def main(argv: list[str]) -> int:
    split = argv.index("--")
    for where in argv[:split]:
        arm(where)
    from specdraft.cli.main import main as cli

    sys.argv = [sys.argv[0], *argv[split + 1 :]]  # what a lock records of its holder: the command, as the CLI's own
    return cli(argv[split + 1 :])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
