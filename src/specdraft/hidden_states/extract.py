"""``specdraft extract``: run the target over a prepared dataset and store the requested hidden states.

Steps:
  1. Open the prepared dataset and the target (the one recorded in the dataset unless given) and
     check they belong together.
  2. Open the store; refuse it if its manifest names another target, other slots or dtype, or it
     was started from another dataset (``check_store_dataset``; ``--restart`` empties it instead);
     delete debris of interrupted writes.
  3. Resume: every sample already stored whose payload verifies (checksums, shapes, dtype, same
     token ids) is skipped; missing, corrupt or stale ones are (re)extracted.
  4. Capture the pending samples in length-sorted batches while an :class:`AsyncWriter` writes
     the payloads of earlier batches; then record the final count in the store manifest.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specdraft.errors import SpecdraftError, setting
from specdraft.hidden_states.backends.base import (
    STORE_FORMAT_NAME,
    STORE_FORMAT_VERSION,
    HiddenStateBackend,
    check_store_dataset,
    check_store_manifest,
    dataset_record,
    finish_manifest,
    open_backend,
)
from specdraft.hidden_states.backends.file import STORE_DIR
from specdraft.hidden_states.capture import HiddenStateCapture
from specdraft.hidden_states.config import ExtractConfig
from specdraft.hidden_states.layers import LayerSlot
from specdraft.hidden_states.payload import HiddenStatePayload
from specdraft.hidden_states.writer import AsyncWriter
from specdraft.registry import Registry
from specdraft.targets.base import Target
from specdraft.utils.lock import claims_output

if TYPE_CHECKING:
    from specdraft.data.dataset import PreparedDataset

log = logging.getLogger(__name__)


@dataclass
class ExtractSummary:
    """What one run did; ``bytes_per_token`` is over the samples written in this run."""

    store: str
    samples_selected: int
    samples_skipped: int
    samples_extracted: int
    tokens_extracted: int
    seconds: float
    bytes_written: int

    @property
    def samples_per_second(self) -> float:
        return self.samples_extracted / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_extracted / self.seconds if self.seconds else 0.0

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_written / self.tokens_extracted if self.tokens_extracted else 0.0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {
            "samples_per_second": round(self.samples_per_second, 3),
            "tokens_per_second": round(self.tokens_per_second, 1),
            "bytes_per_token": round(self.bytes_per_token, 1),
        }


@claims_output(STORE_DIR, out=lambda config: config.out if config.backend == "file" else None, inputs=lambda config: [config.dataset])
def extract_hidden_states(config: ExtractConfig, *, target: Target | None = None, progress: bool = True) -> ExtractSummary:
    """Run steps 1-4 above; ``target`` may be passed pre-loaded (tests, notebooks)."""
    from tqdm import tqdm

    from specdraft.data.dataset import PreparedDataset

    dataset = PreparedDataset(config.dataset)
    if target is None:
        from specdraft.targets import load_target

        name = config.target or dataset.target_info.get("name")
        if not name:
            raise SpecdraftError(f"{dataset.directory}/manifest.json records no target name; pass {setting('target')}")
        target = load_target(name, dtype=config.target_dtype, device=config.device)
    dataset.check_target(target)
    slots = config.resolve_slots(target.num_layers)
    target_info = target.describe()

    backend = open_backend(config.backend, config.out)
    with backend:
        manifest = _open_store_manifest(backend, config, dataset, target_info, slots)
        removed = backend.recover()
        if removed:
            log.warning("%s: removed %d partial file(s) left by an interrupted run", backend.location, removed)

        selected = range(min(len(dataset), config.max_samples or len(dataset)))
        stored_keys = set(backend.keys())
        checking = tqdm(selected, desc="verify stored", unit="sample", disable=not progress or not stored_keys)
        pending = [
            i
            for i in checking
            if dataset.sample_ids[i] not in stored_keys or not _is_intact(backend, dataset[i], target_info, slots, config.dtype)
        ]
        skipped = len(selected) - len(pending)
        if skipped:
            log.info("resuming: %d of %d samples are already stored and verified", skipped, len(selected))

        start = time.perf_counter()
        engine = EXTRACT_ENGINES.get(config.engine)
        tokens, written = engine(ExtractJob(backend, config, dataset, pending, target, target_info, slots, progress))
        seconds = time.perf_counter() - start

        backend.write_manifest(finish_manifest(manifest, set(backend.keys()), [dataset.sample_ids[i] for i in selected]))

    return ExtractSummary(
        store=backend.location,
        samples_selected=len(selected),
        samples_skipped=skipped,
        samples_extracted=len(pending),
        tokens_extracted=tokens,
        seconds=round(seconds, 3),
        bytes_written=written,
    )


@dataclass(frozen=True)
class ExtractJob:
    """What an extraction engine is given: the open store, the run's settings and the rows still to extract."""

    backend: HiddenStateBackend
    config: ExtractConfig
    dataset: PreparedDataset
    pending: list[int]  # dataset row indices
    target: Target
    target_info: dict  # ``target.describe()``, recorded in every payload
    slots: list[LayerSlot]
    progress: bool


#: ``--engine`` name -> fn(job) -> (tokens, bytes written). Every engine fills the store with the same payloads;
#: ``vllm`` is registered by ``integrations/vllm/extract.py``.
EXTRACT_ENGINES: Registry[Callable[[ExtractJob], tuple[int, int]]] = Registry("extraction engine")


@EXTRACT_ENGINES.register("hf")
def _extract(job: ExtractJob) -> tuple[int, int]:
    """Capture ``pending`` rows (longest first, so padding is small and OOM shows up at once)."""
    from tqdm import tqdm

    from specdraft.tuning.settings import Choice, MachineSettings
    from specdraft.tuning.threads import resolve_forward_threads, threads_facts

    config, dataset, target = job.config, job.dataset, job.target

    capture = HiddenStateCapture(target.model, job.slots)
    lengths = dataset.lengths()
    order = sorted(job.pending, key=lambda i: -int(lengths[i]))
    if order:  # the probe's batch: as many rows as a batch, of the median length
        measured = resolve_forward_threads(
            config.threads,
            target.model,
            fingerprint=target.fingerprint,
            rows=min(config.batch_size, len(order)),
            tokens=int(lengths[order[len(order) // 2]]),
        )
        MachineSettings("extract", threads=Choice.from_facts(threads_facts(config.threads, measured), "threads")).log()
    tokens = 0
    start = time.perf_counter()
    with (
        AsyncWriter(job.backend, max_pending=config.queue_size, num_threads=config.writer_threads) as writer,
        tqdm(total=len(order), unit="sample", desc="extract", disable=not job.progress) as bar,
    ):
        for lo in range(0, len(order), config.batch_size):
            rows = [dataset[i] for i in order[lo : lo + config.batch_size]]
            for row, (hidden, last) in zip(rows, capture([r["input_ids"] for r in rows])):
                payload = HiddenStatePayload.create(
                    sample_id=row["sample_id"],
                    target_info=job.target_info,
                    slots=job.slots,
                    token_ids=row["input_ids"],
                    hidden_states=hidden,
                    last_hidden=last,
                    dtype=config.dtype,
                )
                writer.submit(row["sample_id"], payload)
                tokens += payload.num_tokens
            bar.update(len(rows))
            bar.set_postfix(tok_s=f"{tokens / max(time.perf_counter() - start, 1e-9):.0f}")
    return tokens, writer.bytes_written


def _open_store_manifest(
    backend: HiddenStateBackend, config: ExtractConfig, dataset: PreparedDataset, target_info: dict, slots: list[LayerSlot]
) -> dict:
    """Check an existing store against this run, or start a new one; returns the manifest to update."""
    slots_json = [s.to_json() for s in slots]
    existing = backend.read_manifest()
    if existing is None and backend.keys():
        raise SpecdraftError(f"{backend.location} holds hidden-state files but no manifest; choose an empty {setting('out')} directory")
    if existing is not None and config.restart:
        if existing.get("format") != STORE_FORMAT_NAME:  # only a store's own samples are deleted
            raise SpecdraftError(
                f"{backend.location}: manifest format {existing.get('format')!r} is not "
                f"{STORE_FORMAT_NAME!r}; choose another {setting('out')}"
            )
        stale = backend.keys()
        for key in stale:
            backend.delete(key)
        log.warning("%s: --restart deleted the %d sample(s) stored there", backend.location, len(stale))
    elif existing is not None:  # a resume: every setting that determines the stored values must be the store's
        choices = (
            f"Rerun with the store's settings, extract into a new {setting('out')}, or add {setting('restart')} to delete "
            "the stored samples and start over"
        )
        check_store_manifest(
            existing,
            location=backend.location,
            target_info=target_info,
            slots=slots_json,
            dtype=config.dtype,
            target_dtype=config.target_dtype,
            choices=choices,
        )
        check_store_dataset(existing, dataset, set(backend.keys()), location=backend.location, choices=choices)
    manifest = {
        "format": STORE_FORMAT_NAME,
        "format_version": STORE_FORMAT_VERSION,
        "target": target_info,
        "slots": slots_json,
        "dtype": config.dtype,
        "dataset": dataset_record(dataset),
        "count": len(backend.keys()),
        "complete": False,
        "config": {k: v for k, v in dataclasses.asdict(config).items() if k != "restart"},  # rerunning these options resumes
    }
    backend.write_manifest(manifest)
    return manifest


def _is_intact(backend: HiddenStateBackend, row: dict, target_info: dict, slots: list[LayerSlot], dtype: str) -> bool:
    """True when the stored payload of ``row`` verifies and is up to date; a bad one is logged and redone."""
    sid = row["sample_id"]
    try:
        payload = backend.get(sid)
    except SpecdraftError as exc:
        log.warning("%s; extracting it again", exc)
        return False
    stale = payload.mismatches(fingerprint=target_info["fingerprint"], slots=slots, dtype=dtype, token_ids=row["input_ids"])
    if stale:
        log.warning("%s: stored sample %r is stale (%s); extracting it again", backend.location, sid, "; ".join(stale))
        return False
    return True
