"""What the benchmarks share: the command line they start from, and loading the target they measure.

Imported as ``from _common import ...``: a benchmark runs as ``python benchmarks/NAME.py``, so this
folder is on ``sys.path``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DEFAULT_TARGET = "smollm2-135m"


def benchmark_parser(doc: str, *, target: bool = True, threads: int = 0) -> argparse.ArgumentParser:
    """A parser described by ``doc``'s first line, with ``--threads`` (default ``threads``) and, if ``target``, ``--target``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    if target:
        parser.add_argument("--target", default=DEFAULT_TARGET, help="embedded target name or HF directory")
    parser.add_argument("--threads", type=int, default=threads, help="torch CPU threads (0 = torch's default)")
    return parser


def labelled(items: list[str]) -> dict[str, str]:
    """``{label: value}`` of command-line items written ``LABEL=VALUE`` or just ``VALUE`` (then its own label)."""
    return dict(item.partition("=")[::2] if "=" in item else (item, item) for item in items)


def load_benchmark_target(args: argparse.Namespace, name: str | None = None) -> Any:
    """Apply ``--threads``, then load the target ``name`` (default: ``--target``)."""
    import torch

    from specdraft.targets import load_target

    if args.threads:
        torch.set_num_threads(args.threads)
    return load_target(name or args.target)


def quickstart_drafter(target: Any) -> Any:
    """A fresh drafter of the quickstart's configuration (what `specdraft quickstart` trains); untrained
    weights cost what trained ones do."""
    from specdraft.quickstart import QuickstartConfig, fresh_drafter
    from specdraft.train.config import resolve_config

    qs = QuickstartConfig()
    return fresh_drafter(resolve_config(qs.recipe, {"model": {"max_anchors": qs.max_anchors}}), target)


@contextlib.contextmanager
def held(lock: str | None) -> Iterator[None]:
    """An exclusive flock on ``lock`` for the duration (nothing without one): timed runs of benchmarks that
    share the machine queue instead of overlapping."""
    if not lock:
        yield
        return
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def reading_section(path: Path | None) -> list[str]:
    """The lines of a page's "Reading" section, from the Markdown file ``path`` (``--reading``): a benchmark rewrites
    its page whole, so what a person wrote about the figures lives in a file the rerun reads back."""
    return ["## Reading", "", path.read_text().strip(), ""] if path else []
