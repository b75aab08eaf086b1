"""The process group of a training run: who this process is (``Dist``: torchrun's place, ``utils/launch.py``),
its device, and the two collectives the trainer needs (a barrier, and "did any rank say so").

Multi-process runs use gloo on CPU and NCCL on GPU; a single process creates no group at all.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from specdraft.errors import SpecdraftError, setting
from specdraft.utils.compute import parse_device
from specdraft.utils.launch import torchrun_place

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Dist:
    """This process's place. With sequence parallelism (``sequence`` > 1) the processes form a data x sequence mesh:
    consecutive ranks make a sequence group that trains one batch together (``train/sequence_parallel.py``), so the
    data plan and the per-step seeds are keyed by ``data_rank`` of ``data_world``, never by the process rank."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    sequence: int = 1  # processes per sequence group (--sequence-parallel)

    @classmethod
    def from_env(cls, sequence: int = 1) -> Dist:
        """This process's place in a ``torchrun`` launch (rank 0 of 1 without one), in groups of ``sequence`` ranks."""
        rank, world, local_rank = torchrun_place()
        if world % sequence:
            raise SpecdraftError(
                f"{setting('sequence_parallel')} {sequence} splits each sample across {sequence} processes, and {world} "
                f"process(es) do not form groups of {sequence}: launch a multiple of {sequence} "
                f"(torchrun --nproc-per-node {sequence} ...; processes = data-parallel groups x {sequence})"
            )
        return cls(rank, world, local_rank, sequence)

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def data_rank(self) -> int:
        """Which data-parallel replica this process belongs to (its sequence group's index)."""
        return self.rank // self.sequence

    @property
    def data_world(self) -> int:
        """Data-parallel replicas: each reads its own batches."""
        return self.world // self.sequence

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    def any(self, flag: bool, device: torch.device) -> bool:
        """True on every rank if ``flag`` is true on any rank (so all ranks stop at the same step)."""
        if self.world == 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return bool(t.item())


def init_distributed(requested_device: str, dist_: Dist) -> torch.device:
    """The device of this rank (``auto``: its GPU, else the CPU), and the process group when there are several ranks."""
    if requested_device == "auto":
        device = torch.device(f"cuda:{dist_.local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    else:
        device = parse_device(requested_device)
        if device.type == "cuda" and device.index is None:
            device = torch.device(f"cuda:{dist_.local_rank}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist_.world > 1 and not torch.distributed.is_initialized():
        if device.type != "cuda":
            gloo_interface()
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def gloo_interface() -> None:
    """Point gloo at the interface that reaches ``MASTER_ADDR``, unless ``GLOO_SOCKET_IFNAME`` is set.

    Gloo otherwise binds and advertises the address the host name resolves to, often 127.0.0.1
    (``/etc/hosts``), and ranks on other hosts then fail with "Connection refused" connecting to it.
    """
    from specdraft.utils.net import interface_of, local_address_towards

    master = os.environ.get("MASTER_ADDR")
    if os.environ.get("GLOO_SOCKET_IFNAME") or not master:
        return
    name = interface_of(local_address_towards(master, int(os.environ.get("MASTER_PORT", "29500"))))
    if name:
        os.environ["GLOO_SOCKET_IFNAME"] = name
        log.info("gloo uses interface %s (the route to MASTER_ADDR %s); set GLOO_SOCKET_IFNAME to choose another", name, master)


@contextlib.contextmanager
def process_group_scope() -> Any:
    """Destroy a process group that ``train`` itself created (one the caller made is left alone).

    First the run's DDP wrapper goes: it sits in reference cycles, so it outlived ``train`` (found alive after
    it returned) and its reducer was freed whenever the collector ran, sometimes after the group it holds was
    destroyed; a rank then aborted at exit ("terminate called without an active exception", rank 1 of the
    2-rank gloo test, in CI and in a full local run). Then, after a run that ended normally, every rank meets at
    a barrier, so none tears gloo down while a peer is in its last collective. After an error no barrier: the
    others may never arrive."""
    existed = torch.distributed.is_available() and torch.distributed.is_initialized()
    ended_normally = False
    try:
        yield
        ended_normally = True
    finally:
        if not existed and torch.distributed.is_available() and torch.distributed.is_initialized():
            gc.collect()
            if ended_normally:
                torch.distributed.barrier()
            torch.distributed.destroy_process_group()
