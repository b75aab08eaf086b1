"""Training-side reader: stored hidden states joined with their prepared-dataset rows.

Every item is verified before it is returned: the payload's checksums/shapes/dtypes, that it was
made for the store's target, slots and dtype, and that its token ids equal the dataset row's, so
a drafter can never be trained on hidden states of other tokens. Storage is reached only through
a :class:`HiddenStateBackend`, so the same reader serves files today and Mooncake later.

The store is also checked when it is opened (``verify``), so a bad sample stops a run before its
first step instead of when training reaches it: ``quick`` (the default) requires every sample the
manifest lists (or, in a store written before manifests listed them, counts) to be present and each
stored object whole (sizes); ``full`` also reads every sample and checks it against the sha256 its
payload records. One error names every kind of problem found.

How an item's hidden states are read is named by ``reads`` (``SAMPLE_READS``): ``whole`` loads the sample's
tensors; ``windowed`` (a sequence-parallel rank, ``train --sequence-parallel N``) verifies the sample just as
whole but returns ``hidden_states``/``last_hidden`` as ``payload.StoredRows``, read from the store only where
``collate`` slices them: the rank's shard of each row, 1/N of the sample.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from specdraft.errors import SpecdraftError, setting
from specdraft.hidden_states.backends.base import STORE_FORMAT_NAME, HiddenStateBackend
from specdraft.hidden_states.config import VERIFY_LEVELS
from specdraft.hidden_states.layers import LayerSlot
from specdraft.hidden_states.payload import HiddenStatePayload, PayloadRows
from specdraft.hidden_states.source import SampleSource

if TYPE_CHECKING:
    from specdraft.data.dataset import PreparedDataset

log = logging.getLogger(__name__)

#: How a sample's hidden states are read, by name (``HiddenStateDataset(..., reads=NAME)``): whole, or verified whole
#: and loaded only by the rows sliced (``HiddenStateBackend.get_rows``; backends that cannot skip bytes read whole).
SAMPLE_READS: dict[str, Callable[[HiddenStateBackend, str], HiddenStatePayload | PayloadRows]] = {
    "whole": lambda backend, key: backend.get(key),
    "windowed": lambda backend, key: backend.get_rows(key),
}


class HiddenStateDataset(torch.utils.data.Dataset, SampleSource):
    """Items: ``sample_id`` (str), ``token_ids`` [T] int64, ``loss_mask`` [T] bool,
    ``hidden_states`` [T, S, D], ``last_hidden`` [T, D] (the store's dtype).

    ``store`` is a store directory (file backend) or an open backend; ``prepared_dataset`` a
    ``PreparedDataset`` or its directory, by default the one recorded in the store manifest.
    Samples are the stored ones, in dataset order. ``reads``: a ``SAMPLE_READS`` name (see the module docstring).
    """

    prepared: PreparedDataset

    def __init__(
        self, store: str | os.PathLike | HiddenStateBackend, prepared_dataset: Any = None, *, verify: str = "quick", reads: str = "whole"
    ):
        from specdraft.data.dataset import PreparedDataset
        from specdraft.hidden_states.backends.file import FileBackend

        if reads not in SAMPLE_READS:
            raise SpecdraftError(f"unknown hidden-state read {reads!r}; choose one of: {', '.join(SAMPLE_READS)}")
        self._read = SAMPLE_READS[reads]
        self.backend = store if isinstance(store, HiddenStateBackend) else FileBackend(store, create=False)
        where = self.backend.location
        manifest = self.backend.read_manifest()
        if manifest is None or manifest.get("format") != STORE_FORMAT_NAME:
            raise SpecdraftError(f"{where} is not a hidden-state store (no valid manifest); run `specdraft extract --out {where}`")
        self.manifest = manifest
        if prepared_dataset is None:
            prepared_dataset = (manifest.get("dataset") or {}).get("path")
            if not prepared_dataset:
                raise SpecdraftError(f"{where}: manifest records no dataset; pass the prepared dataset explicitly ({setting('dataset')})")
            if not os.path.isdir(prepared_dataset):
                raise SpecdraftError(
                    f"{where} was extracted from the prepared dataset {prepared_dataset}, which no longer exists (was it moved?); "
                    f"pass its new location with {setting('dataset')} DIR"
                )
        self.prepared = prepared_dataset if isinstance(prepared_dataset, PreparedDataset) else PreparedDataset(prepared_dataset)

        recorded = self.prepared.target_info
        for key in ("fingerprint", "tokenizer_hash"):
            if recorded.get(key) != self.target_info.get(key):
                raise SpecdraftError(
                    f"{where} was extracted with target {self.target_info.get('name')!r} but dataset {self.prepared.directory} "
                    f"was prepared for {recorded.get('name')!r} ({key} {self.target_info.get(key)!r} != {recorded.get(key)!r})"
                )
        stored = set(self.backend.keys())
        foreign = stored.difference(self.prepared.sample_ids)
        if foreign:
            example = sorted(foreign)[0]
            raise SpecdraftError(
                f"{where} holds {len(foreign)} sample(s) not in dataset {self.prepared.directory} (e.g. {example!r}); "
                "pass the dataset the store was extracted from"
            )
        self.sample_ids = [sid for sid in self.prepared.sample_ids if sid in stored]
        if not self.sample_ids:
            raise SpecdraftError(f"{where} holds no samples; run `specdraft extract --out {where}`")
        if not manifest.get("complete"):
            log.warning("%s: extraction did not finish; reading the %d samples stored so far", where, len(self.sample_ids))
        self.verify(verify)

    def verify(self, level: str) -> None:
        """Check the store before use (see the module docstring); one error lists what is wrong."""
        if level not in VERIFY_LEVELS:
            raise SpecdraftError(f"verify level must be one of {', '.join(VERIFY_LEVELS)}, got {level!r}")
        problems = self._missing()
        problems.update(self.backend.stored_problems(self.sample_ids))
        if level == "full":
            from tqdm import tqdm

            for i in tqdm(range(len(self)), desc="verify store", unit="sample", disable=len(self) < 100):
                if self.sample_ids[i] not in problems:
                    try:
                        self[i]
                    except SpecdraftError as exc:
                        problems[self.sample_ids[i]] = str(exc)
        if problems:
            shown = "; ".join(problems[k] for k in sorted(problems)[:3])
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            where = self.backend.location
            raise SpecdraftError(
                f"{where}: {len(problems)} bad sample(s): {shown}{more}; rerun `specdraft extract --dataset {self.prepared.directory} "
                f'--out {where}` with the options in the manifest\'s "config" to redo them (intact samples are kept)'
            )

    def _missing(self) -> dict[str, str]:
        """Samples the manifest says extraction stored that are gone (key -> why).

        Those it lists; a store written before manifests listed their samples has only its count, and a
        complete one's stored samples are the first ``count`` of the dataset (extract selects a prefix).
        """
        present = set(self.sample_ids)
        listed = self.manifest.get("samples")
        if listed is not None:
            return {key: f"sample {key!r} is listed in the store manifest but missing" for key in listed if key not in present}
        count = int(self.manifest.get("count") or 0) if self.manifest.get("complete") else 0
        why = f"the store manifest records {count} complete samples but {len(present)} are stored"
        return {key: f"sample {key!r} is missing ({why})" for key in self.prepared.sample_ids[:count] if key not in present}

    @property
    def slots(self) -> list[LayerSlot]:
        return [LayerSlot.from_json(s) for s in self.manifest["slots"]]

    @property
    def target_info(self) -> dict:
        return dict(self.manifest.get("target") or {})

    @property
    def dtype(self) -> str:
        return self.manifest["dtype"]

    @property
    def made_with(self) -> dict:
        """The storage dtype and, where ``specdraft extract`` recorded it, the dtype the target ran in (``SampleSource.made_with``)."""
        ran_in = (self.manifest.get("config") or {}).get("target_dtype")
        return {"dtype": self.dtype, **({"target_dtype": ran_in} if ran_in else {})}

    def __len__(self) -> int:
        return len(self.sample_ids)

    def __getitem__(self, i: int) -> dict:
        sid = self.sample_ids[i]
        payload = self._read(self.backend, sid)  # verifies checksums, shapes and dtypes
        row = self.prepared[self.prepared.index_of(sid)]
        problems = payload.mismatches(
            fingerprint=self.target_info.get("fingerprint"), slots=self.slots, dtype=self.dtype, token_ids=row["input_ids"]
        )
        if problems:
            raise SpecdraftError(
                f"{self.backend.location}: sample {sid!r} does not match the store/dataset ({'; '.join(problems)}); "
                "rerun `specdraft extract` to redo it"
            )
        return {
            "sample_id": sid,
            "token_ids": payload.token_ids,
            "loss_mask": row["loss_mask"],
            "hidden_states": payload.hidden_states,
            "last_hidden": payload.last_hidden,
        }
