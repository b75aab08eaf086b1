"""What the trainer reads: ``SampleSource``, the interface every source of training samples implements
(``HiddenStateDataset`` and ``streaming.StreamingSource`` inherit it; the tests' in-memory store spells it out).

It is declared here, beside the sources, so they can inherit it (the trainer sits a layer above). What
the trainer needs besides the items -- lengths, token rows, split labels, token frequencies -- are
methods with defaults: read from the store's prepared dataset when the source has one (no hidden
states read, nothing requested from producers), else from the items.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from specdraft.hidden_states.layers import LayerSlot

if TYPE_CHECKING:
    from specdraft.data.dataset import PreparedDataset


class SampleSource:
    """Random access to per-sample dicts ``{sample_id, token_ids [T], loss_mask [T], hidden_states [T, S, D],
    last_hidden [T, D]}`` in ``sample_ids`` order; a subclass sets the three attributes and ``__getitem__``."""

    sample_ids: list[str]
    prepared: PreparedDataset | None = None  # the store's prepared dataset, when it has one

    if TYPE_CHECKING:  # read-only to readers: a subclass sets them as attributes or derives them as properties

        @property
        def slots(self) -> list[LayerSlot]:
            """What ``hidden_states`` holds, in order."""

        @property
        def target_info(self) -> dict:
            """The target the hidden states came from (name, fingerprint, num_layers, ...)."""

    def __len__(self) -> int:
        return len(self.sample_ids)

    def __getitem__(self, index: int) -> dict:
        raise NotImplementedError

    @property
    def made_with(self) -> dict:
        """The settings, beyond the target and slots, that made the hidden states' values (a store's dtypes): a
        training run resumes only on samples made alike (``train.checkpoint_files.IDENTITY_KEYS``). {} where unrecorded."""
        return {}

    def lengths(self) -> list[int]:
        """Tokens per sample, in item order (packing needs every length up front)."""
        if self.prepared is not None:
            all_lengths = self.prepared.lengths()
            return [int(all_lengths[self.prepared.index_of(sid)]) for sid in self.sample_ids]
        return [len(self[i]["token_ids"]) for i in range(len(self))]

    def token_row(self, index: int) -> tuple[Any, Any]:
        """(token ids, loss mask) of sample ``index`` as numpy arrays (the split's keys, warm starts, decode prompts)."""
        if self.prepared is not None:
            item = self.prepared[self.prepared.index_of(self.sample_ids[index])]
            return item["input_ids"].numpy(), item["loss_mask"].numpy()
        item = self[index]
        return torch.as_tensor(item["token_ids"]).numpy(), torch.as_tensor(item["loss_mask"]).bool().numpy()

    def source_label(self, index: int) -> str:
        """The prepared row's ``source`` (the split groups a conversation's turns by it); "" without one."""
        return self.prepared.sources[self.prepared.index_of(self.sample_ids[index])] if self.prepared is not None else ""

    def token_counts(self) -> torch.Tensor | None:
        """Response-token frequencies (EAGLE-3 picks its draft vocabulary from them); None when unknown."""
        return self.prepared.token_counts() if self.prepared is not None else None


class PreparedRows(SampleSource):
    """A prepared dataset's rows without hidden states: what its split and lengths need (no items)."""

    slots: list[LayerSlot]
    target_info: dict

    def __init__(self, prepared: PreparedDataset):
        self.prepared, self.sample_ids, self.slots, self.target_info = prepared, list(prepared.sample_ids), [], prepared.target_info
