"""From stored samples to ``DrafterBatch``es: per-epoch shuffle, packing, collation (the validation
split they start from is ``train/split.py``'s).

Everything here is a pure function of (split, lengths, seed, epoch), so a resumed run can
recompute exactly which batch comes next from the step number alone -- no loader state is saved.

Packing ("next fit" in shuffled order): samples are laid end to end in a row of at most
``pack_tokens`` tokens; when the next sample does not fit a new row starts. Samples are never
split across rows: a longer one gets a row of its own of up to ``max_sample_tokens`` (long samples,
not long packs: the short ones around it pack as before) and is truncated to that; with
``max_sample_tokens`` at most ``pack_tokens`` it is truncated to ``pack_tokens``. Example with ``pack_tokens=8``
and shuffled lengths 3, 4, 5, 2::

    row 0: a a a b b b b -        segment_ids 0 0 0 1 1 1 1 -1   position_ids 0 1 2 0 1 2 3 0
    row 1: c c c c c d d -        segment_ids 0 0 0 0 0 1 1 -1   position_ids 0 1 2 3 4 0 1 0

Rows are grouped ``batch_rows`` at a time and padded to the longest row of their batch (with long samples,
rounded up to one of a few widths: ``padded_width``). With W
processes, global batch ``i * W + r`` of an epoch goes to rank ``r`` at step ``i`` (the tail that
does not fill every rank is dropped), so ranks see disjoint data. With sequence parallelism W and r are the
data-parallel ones (``Dist.data_world``, ``Dist.data_rank``): every rank of a sequence group reads the same batch and
collates its own shard of each row (``RowWindow``).
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from specdraft.errors import SpecdraftError, setting
from specdraft.hidden_states.layers import LayerSlot
from specdraft.hidden_states.source import SampleSource
from specdraft.models.base import DrafterBatch
from specdraft.train.split import Split

if TYPE_CHECKING:
    from specdraft.hidden_states.streaming import GroupShare
    from specdraft.train.config import TrainConfig

log = logging.getLogger(__name__)


@runtime_checkable
class PrefetchingSource(Protocol):
    """A source that reads ahead (``hidden_states.streaming.StreamingSource``): the trainer tells it the
    order of the indices it will read (``training_order``) and its sequence group (``group_share``), and closes it
    at the end."""

    def start(self, order: Iterable[int], share: GroupShare | None = None) -> None: ...

    def close(self) -> None: ...


def open_sample_source(cfg: TrainConfig, *, rank: int | None = None, world: int | None = None) -> SampleSource:
    """The source ``cfg.data_mode`` names (``hidden_states.data_modes.DATA_MODES``); online/hybrid modes request
    the layer slots of ``cfg.method`` (``MethodSpec.run_slots``, as the trainer's plan) and log delivered ids in ``OUT``
    (one log per rank under torchrun: ranks may run on different hosts, and appends from several hosts to
    one file on a network file system interleave or get lost). Each rank's source is owned by (OUT, rank),
    so a rank restarted after its host was lost deletes what its predecessor left in the store. ``rank`` and
    ``world`` default to torchrun's environment (``distributed.Dist.from_env``). A sequence-parallel rank reads each
    sample "windowed" (``hidden_states.dataset.SAMPLE_READS``): ``collate`` then loads only its shard's rows of it."""
    from pathlib import Path

    import specdraft.models  # noqa: F401  (registers the built-in methods)
    from specdraft.hidden_states.data_modes import DATA_MODES, SourceOptions
    from specdraft.models.base import METHODS

    if rank is None or world is None:
        from specdraft.train.distributed import Dist

        env = Dist.from_env()
        rank, world = env.rank, env.world
    options = SourceOptions(
        data=cfg.data,
        dataset=cfg.dataset,
        producers=list(cfg.producers),
        store=cfg.store,
        slots=functools.partial(METHODS.get(cfg.required("method")).run_slots, cfg.model or {}),
        dtype=cfg.stream_dtype,
        prefetch=cfg.prefetch,
        token=cfg.producer_token,
        timeout_s=cfg.request_timeout,
        delivery_log=str(Path(cfg.out) / delivery_log_name(rank, world)) if cfg.out else None,
        verify=cfg.verify,
        reads="windowed" if cfg.sequence_parallel > 1 else "whole",
        owner=f"{hashlib.sha256(str(Path(cfg.out).resolve()).encode()).hexdigest()[:8]}r{rank}" if cfg.out else None,
    )
    return DATA_MODES.get(cfg.data_mode)(options)


def group_share(window: RowWindow, group: Any) -> GroupShare | None:
    """How the ranks of this sequence group (``group``; this rank's place and the group's size: ``window``) share each
    streamed sample: one request per group, each rank reading its rows (``hidden_states.streaming.GroupShare``);
    None for one process per sample. A collective of the group: its first rank picks the tickets' namespace."""
    if window.size == 1:
        return None
    import uuid

    import torch.distributed as dist

    from specdraft.hidden_states.streaming import GroupShare

    namespace = [f"specdraft/samples/{uuid.uuid4().hex}"]
    dist.broadcast_object_list(namespace, src=dist.get_global_rank(group, 0), group=group)
    # the key-value store the process group was made with (torchrun's): every rank reaches it; no public accessor
    return GroupShare(window.rank, window.size, dist.distributed_c10d._get_default_store(), namespace[0])


#: Run-directory file where streaming sources append each delivered sample id (JSON lines).
DELIVERY_LOG = "delivered.jsonl"


def delivery_log_name(rank: int, world_size: int) -> str:
    """``delivered.jsonl`` for a single process, ``delivered-rank{R}.jsonl`` for each rank of a multi-process run."""
    return DELIVERY_LOG if world_size == 1 else f"delivered-rank{rank}.jsonl"


def training_order(plan: DataPlan, start_step: int, total_steps: int) -> Iterator[int]:
    """Sample indices in the order training steps ``start_step..total_steps-1`` read them (for prefetching)."""
    for step in range(start_step, total_steps):
        for row in plan.train_rows(step):
            yield from row


def epoch_order(indices: Sequence[int], *, seed: int, epoch: int) -> list[int]:
    """``indices`` shuffled by a generator seeded from (seed, epoch)."""
    g = torch.Generator().manual_seed(_mix(seed, epoch, 0x5EED))
    perm = torch.randperm(len(indices), generator=g).tolist()
    return [indices[p] for p in perm]


def pack_rows(order: Sequence[int], lengths: Sequence[int], pack_tokens: int, max_sample_tokens: int = 0) -> list[list[int]]:
    """Next-fit packing of sample indices (in ``order``) into rows of at most ``pack_tokens`` tokens; a sample
    longer than that gets a row of its own (of at most ``max(pack_tokens, max_sample_tokens)`` tokens)."""
    rows: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i in order:
        n = int(lengths[i])
        if n <= 0:
            continue
        if n > pack_tokens and max_sample_tokens > pack_tokens:  # a long sample: a row of its own
            rows.append([i])
            continue
        n = min(n, pack_tokens)
        if current and used + n > pack_tokens:
            rows.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        rows.append(current)
    return rows


def _mix(*values: int) -> int:
    """Combine integers into one 63-bit seed (stable across processes and Python versions)."""
    h = hashlib.sha256(",".join(str(int(v)) for v in values).encode()).digest()
    return int.from_bytes(h[:8], "big") & ((1 << 63) - 1)


def step_seed(seed: int, rank: int, step: int, kind: int = 0) -> int:
    """The seed every random draw of (rank, step) uses: what makes resume bit-exact without saving RNG state."""
    return _mix(seed, rank, step, kind)


@dataclass
class DataPlan:
    """Which samples form which batch at every step, for one process of ``world_size``."""

    sample_ids: list[str]
    lengths: list[int]
    train_indices: list[int]
    val_indices: list[int]
    pack_tokens: int
    batch_rows: int
    seed: int
    world_size: int = 1
    rank: int = 0
    max_sample_tokens: int = 0  # a sample longer than pack_tokens gets a row of its own of up to this many tokens
    _epochs: dict[int, list[list[list[int]]]] = field(default_factory=dict, repr=False)  # only the latest epoch
    _counts: dict[int, int] = field(default_factory=dict, repr=False)  # batches per epoch, all seen epochs

    @classmethod
    def build(
        cls,
        sample_ids: Sequence[str],
        lengths: Sequence[int],
        *,
        split: Split,
        pack_tokens: int,
        batch_rows: int,
        seed: int,
        world_size: int = 1,
        rank: int = 0,
        max_sample_tokens: int = 0,
    ) -> DataPlan:
        """``split``: the validation split (``train.split``) of exactly these samples."""
        if len(sample_ids) != len(lengths):
            raise ValueError("sample_ids and lengths differ in length")
        if len(set(sample_ids)) != len(sample_ids):
            raise SpecdraftError("the hidden-state store lists a sample id twice; re-run `specdraft extract`")
        train, val = list(split.train), list(split.val)
        if sorted(train + val) != list(range(len(sample_ids))):
            raise ValueError("the split does not cover these samples exactly once")
        plan = cls(
            list(map(str, sample_ids)),
            [int(n) for n in lengths],
            train,
            val,
            pack_tokens,
            batch_rows,
            seed,
            world_size,
            rank,
            max_sample_tokens,
        )
        if plan.steps_in_epoch(0) == 0:
            raise SpecdraftError(
                f"the training split ({len(train)} samples, {sum(plan.lengths[i] for i in train)} tokens) does not fill one step "
                f"of {batch_rows} row(s) x {world_size} process(es); add data, lower {setting('batch_rows')}, or lower "
                f"{setting('val_fraction', of='train')}"
            )
        truncated = sum(1 for n in plan.lengths if n > plan.sample_tokens)
        if truncated:
            log.warning(
                "%d sample(s) are longer than %d tokens and will be truncated (their replies, at the end, lost): raise "
                "--max-sample-tokens to train on them whole",
                truncated,
                plan.sample_tokens,
            )
        own_rows = sum(1 for n in plan.lengths if n > pack_tokens) if max_sample_tokens > pack_tokens else 0
        if own_rows:
            log.info(
                "%d sample(s) longer than pack_tokens=%d get rows of their own (up to %d tokens)", own_rows, pack_tokens, plan.sample_tokens
            )
        return plan

    @classmethod
    def for_run(cls, dataset: SampleSource, split: Split, cfg: TrainConfig, *, world_size: int = 1, rank: int = 0) -> DataPlan:
        """The plan a training run of ``cfg`` follows over ``dataset`` (the trainer's, and the budget probes' count of it)."""
        return cls.build(
            list(dataset.sample_ids),
            dataset.lengths(),
            split=split,
            pack_tokens=cfg.pack_tokens,
            batch_rows=cfg.batch_rows,
            seed=cfg.seed,
            world_size=world_size,
            rank=rank,
            max_sample_tokens=cfg.max_sample_tokens,
        )

    @property
    def sample_tokens(self) -> int:
        """The most tokens of one sample a row holds (longer ones are truncated to it)."""
        return max(self.pack_tokens, self.max_sample_tokens)

    def fingerprint(self) -> str:
        """Identifies the training split and its lengths (a resumed run must see the same data)."""
        h = hashlib.sha256()
        for i in self.train_indices:
            h.update(f"{self.sample_ids[i]}:{self.lengths[i]}\n".encode())
        return h.hexdigest()[:16]

    def global_batches(self, epoch: int) -> list[list[list[int]]]:
        """All batches of one epoch (before splitting across ranks), each a list of rows of sample indices."""
        if epoch not in self._epochs:
            order = epoch_order(self.train_indices, seed=self.seed, epoch=epoch)
            rows = pack_rows(order, self.lengths, self.pack_tokens, self.max_sample_tokens)
            self._epochs = {epoch: [rows[i : i + self.batch_rows] for i in range(0, len(rows) - self.batch_rows + 1, self.batch_rows)]}
            self._counts[epoch] = len(self._epochs[epoch])
        return self._epochs[epoch]

    def steps_in_epoch(self, epoch: int) -> int:
        if epoch not in self._counts:
            self.global_batches(epoch)
        return self._counts[epoch] // self.world_size

    def total_steps(self, epochs: int) -> int:
        return sum(self.steps_in_epoch(e) for e in range(epochs))

    def locate(self, step: int) -> tuple[int, int]:
        """(epoch, step within the epoch) of a global step number."""
        epoch = 0
        while step >= (n := self.steps_in_epoch(epoch)):
            step -= n
            epoch += 1
        return epoch, step

    def train_rows(self, step: int) -> list[list[int]]:
        epoch, i = self.locate(step)
        return self.global_batches(epoch)[i * self.world_size + self.rank]

    def val_batches(self, max_batches: int = 0) -> list[list[list[int]]]:
        """This rank's validation batches (fixed order, no shuffle; every rank gets as many, since
        each forward may be a collective under DDP/FSDP -- the remainder is dropped)."""
        rows = pack_rows(self.val_indices, self.lengths, self.pack_tokens, self.max_sample_tokens)
        batches = [rows[i : i + self.batch_rows] for i in range(0, len(rows), self.batch_rows)]
        if max_batches:
            batches = batches[: max_batches * self.world_size]
        batches = batches[: len(batches) // self.world_size * self.world_size]
        return batches[self.rank :: self.world_size]


def token_rows(dataset: SampleSource, indices: Sequence[int]) -> list[tuple[Any, Any]]:
    """(token ids, loss mask) of samples ``indices`` (``SampleSource.token_row``)."""
    return [dataset.token_row(i) for i in indices]


def select_slots(store_slots: Sequence[LayerSlot], wanted: Sequence[LayerSlot], *, where: str) -> list[int]:
    """Positions of ``wanted`` in the store's slot list; a clear error naming what is missing."""
    store_slots = list(store_slots)
    missing = [s for s in wanted if s not in store_slots]
    if missing:
        have = ", ".join(map(str, store_slots)) or "none"
        need = ", ".join(map(str, wanted))
        raise SpecdraftError(
            f"hidden-state store {where} holds layers [{have}] but this method reads [{need}] (missing {', '.join(map(str, missing))}); "
            f"re-run `specdraft extract --method` with this method"
        )
    return [store_slots.index(s) for s in wanted]


def padded_width(tokens: int) -> int:
    """``tokens`` rounded up to one of 8 widths per power of two (at most 1/8 more): rows of long samples then come
    in a few shapes whose buffers the allocator reuses, where every new length fragmented the heap further
    (docs/results/long_train: a 7k-token run's peak RSS 4.3 GB with exact widths)."""
    step = 1 << max(int(tokens).bit_length() - 4, 0)
    return -(-int(tokens) // step) * step


@dataclass(frozen=True)
class RowWindow:
    """The rows of every batch row one process collates. Sequence parallelism (``train/sequence_parallel.py``) splits
    each row into ``size`` equal shards and rank ``rank`` of its group keeps shard ``rank`` only, so no process ever
    holds a whole long sample's float32 hidden states. The row is padded (segment -1, as ``sequence_parallel.pad_rows``)
    to a multiple of ``size`` and to at least ``min_rows`` per shard: the halo a block reads past its shard's end."""

    rank: int = 0
    size: int = 1
    min_rows: int = 0

    def bounds(self, width: int) -> tuple[int, int]:
        """[start, end) of this shard in a row of ``width`` tokens; the whole row (padding none) for one shard."""
        step = max(-(-width // self.size), self.min_rows)
        return self.rank * step, (self.rank + 1) * step


WHOLE = RowWindow()


def row_lengths(rows: Sequence[Sequence[dict[str, Any]]], sample_tokens: int) -> list[int]:
    """Real tokens of each packed row (samples truncated to ``sample_tokens``): the whole rows', whatever window is collated."""
    return [sum(min(len(item["token_ids"]), sample_tokens) for item in row) for row in rows]


def collate(
    rows: Sequence[Sequence[dict[str, Any]]],
    *,
    sample_tokens: int,
    round_width: bool = False,
    slot_index: Sequence[int] | None = None,
    where: str = "the hidden-state store",
    agree: Callable[[bool], bool] | None = None,
    window: RowWindow = WHOLE,
) -> DrafterBatch:
    """Pack per-sample dicts into one padded ``DrafterBatch`` (see the module docstring for the layout), each
    sample truncated to ``sample_tokens`` (the plan's ``sample_tokens``). ``round_width`` pads the batch to
    ``padded_width``: for runs with long samples (``TrainConfig.round_row_widths``), whose row lengths range widely;
    other runs keep exact widths, so they train (and resume, ``scripts/resume_across.py``) bit for bit as before.
    ``window``: only these rows of every row (a sequence-parallel rank's shard; default the whole row). An item's
    ``hidden_states``/``last_hidden`` are read only by the rows of the window, ``item[...][a:b]``: loaded tensors or
    ``payload.StoredRows`` (a windowed read, ``SAMPLE_READS``), which then load only those rows from the store.

    Hidden states are cast to float32 (autocast lowers them again where it pays off). NaN or inf among them is
    refused, naming ``where`` (the store), the sample and the tensor (``check_finite_hidden``); ``agree``: with
    several processes, ``Dist.any``, so that every one refuses when any batch holds them.
    """
    first = rows[0][0]
    S = len(slot_index) if slot_index is not None else first["hidden_states"].shape[1]
    D = first["last_hidden"].shape[-1]
    lengths = row_lengths(rows, sample_tokens)
    lo, hi = window.bounds(padded_width(max(lengths)) if round_width else max(lengths))
    B, T = len(rows), hi - lo
    token_ids = torch.zeros(B, T, dtype=torch.long)
    loss_mask = torch.zeros(B, T, dtype=torch.bool)
    segment_ids = torch.full((B, T), -1, dtype=torch.int32)
    position_ids = torch.zeros(B, T, dtype=torch.long)
    aux_hidden = torch.zeros(B, T, S, D, dtype=torch.float32)
    last_hidden = torch.zeros(B, T, D, dtype=torch.float32)
    for b, row in enumerate(rows):
        start = 0
        for seg, item in enumerate(row):
            n = min(len(item["token_ids"]), sample_tokens)
            a, z = max(start, lo), min(start + n, hi)  # the sample's tokens inside the window
            if a < z:
                src, dst = slice(a - start, z - start), slice(a - lo, z - lo)
                token_ids[b, dst] = torch.as_tensor(item["token_ids"][src], dtype=torch.long)
                loss_mask[b, dst] = torch.as_tensor(item["loss_mask"][src]).bool()
                segment_ids[b, dst] = seg
                position_ids[b, dst] = torch.arange(src.start, src.stop)
                hs = item["hidden_states"][src]
                aux_hidden[b, dst] = (hs[:, list(slot_index)] if slot_index is not None else hs).float()
                last_hidden[b, dst] = item["last_hidden"][src].float()
            start += n
    check_finite_hidden(
        rows, {"hidden_states": aux_hidden, "last_hidden": last_hidden}, segment_ids, where=where, agree=agree, position_ids=position_ids
    )
    return DrafterBatch(token_ids, loss_mask, segment_ids, position_ids, aux_hidden, last_hidden)


def check_finite_hidden(
    rows: Sequence[Sequence[dict[str, Any]]],
    tensors: dict[str, torch.Tensor],
    segment_ids: torch.Tensor,
    *,
    where: str,
    position_ids: torch.Tensor,
    agree: Callable[[bool], bool] | None = None,
) -> None:
    """Refuse a batch whose hidden states hold NaN or inf, naming the store, the sample, the tensor and the token.
    A store's checksums prove only that it holds what was written: a target that overflowed while extracting
    writes non-finite states that verify, and they would train a NaN loss or, in validation, report a tau that
    means nothing. One pass over the collated batch, a fraction of a step's cost; the culprit is looked up only
    when there is one. ``agree`` (``Dist.any``, called by every process for every batch) makes every process refuse
    when any one's batch holds them: a process that refused alone would leave the others waiting in the step's
    collectives for ever."""
    problem = None
    for name, tensor in tensors.items():
        finite = torch.isfinite(tensor).flatten(2).all(-1)  # [B, T]
        if bool(finite.all()):
            continue
        b, t = (int(x) for x in (~finite).nonzero()[0])
        segment = int(segment_ids[b, t])
        token = int(position_ids[b, t])
        sample = rows[b][segment].get("sample_id", f"row {b}, segment {segment}")
        problem = f"sample {sample!r} holds non-finite values (NaN or inf) in its {name} at token {token}"
        break
    if agree is not None and agree(problem is not None) and problem is None:
        problem = "another process's batch holds non-finite values (NaN or inf; its error names the sample)"
    if problem is not None:
        raise SpecdraftError(
            f"{where}: {problem}; the store verifies, so they were written so: extract the store again "
            "(`specdraft extract` into a new --out) or leave that sample out"
        )
