"""This process's place in a ``torchrun`` launch, read from the environment torchrun sets in this one
place: the trainer's ``train.distributed.Dist`` and the output lock's one writer per job
(``utils/lock.py``, a layer below the trainer) both ask here."""

from __future__ import annotations

import os


def torchrun_place() -> tuple[int, int, int]:
    """(rank, world size, local rank); (0, 1, 0) outside a ``torchrun`` launch."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_RANK", "0"))
