"""Where training's hidden states come from: the data modes, dispatched by name through ``DATA_MODES``.

Each opener takes ``SourceOptions`` and returns a sample source with the item interface of ``HiddenStateDataset``:

  offline  the existing hidden-state store (``HiddenStateDataset``) -- nothing is requested.
  online   every sample is requested from a producer (``service.py``), read back through the
           transport backend (Mooncake or a shared directory), verified, and deleted from the
           transport once it is in memory (``streaming.StreamingSource``). Nothing is kept.
  hybrid   like online, but a sample already in the local file store (``data``) is read from
           there, and a requested one is written there, so a later epoch or run reads it locally.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from specdraft.errors import SpecdraftError, setting
from specdraft.hidden_states.client import ProducerClient
from specdraft.hidden_states.layers import LayerSlot
from specdraft.hidden_states.streaming import StreamingSource
from specdraft.registry import Registry


@dataclass
class SourceOptions:
    """Everything a data-mode opener may need (``TrainConfig`` is where the defaults live)."""

    data: str | None  # offline: the store to read; hybrid: the local file cache
    dataset: str | None  # prepared dataset: sample ids, tokens, loss masks (offline: default the one the store recorded)
    producers: list[str]
    store: str | None  # transport location: a directory (file backend) or mooncake://...
    slots: Callable[[int], list[LayerSlot]] | None  # target layer count -> slots to request
    dtype: str = "bfloat16"
    prefetch: int = 8
    token: str | None = None
    timeout_s: float = 120.0
    delivery_log: str | None = None
    owner: str | None = None  # stable across restarts of one consumer (a trainer rank): see streaming.StreamingSource.sweep
    verify: str = "quick"  # offline: how the store is checked before training (``HiddenStateDataset.verify``)
    reads: str = "whole"  # offline: how a sample's hidden states are read (``dataset.SAMPLE_READS``; "windowed": by rows)


DATA_MODES: Registry[Callable[[SourceOptions], Any]] = Registry("data mode")


@DATA_MODES.register("offline")
def open_offline(options: SourceOptions) -> Any:
    from specdraft.hidden_states.dataset import HiddenStateDataset

    if not options.data:
        raise SpecdraftError(f"{setting('data')} is required (or set `data:` in the {setting('config')} recipe)")
    path = Path(options.data)
    if not path.is_dir():
        raise SpecdraftError(f"{setting('data')} {path} does not exist; point it at a hidden-state store written by `specdraft extract`")
    # --dataset overrides the path the manifest recorded (a moved run)
    return HiddenStateDataset(path, options.dataset, verify=options.verify, reads=options.reads)


@DATA_MODES.register("online")
def open_online(options: SourceOptions) -> StreamingSource:
    return open_streaming(options, cache=None)


@DATA_MODES.register("hybrid")
def open_hybrid(options: SourceOptions) -> StreamingSource:
    from specdraft.hidden_states.backends.file import FileBackend

    if not options.data:
        raise SpecdraftError(f"hybrid mode needs {setting('data')}: the local hidden-state directory that caches requested samples")
    return open_streaming(options, cache=FileBackend(options.data))


def backend_name(location: str) -> str:
    """A location's URL scheme names its backend (``mooncake://...``); a plain path is the file backend."""
    from specdraft.hidden_states.backends import BACKENDS

    scheme = urlsplit(location).scheme
    return scheme if scheme in BACKENDS else "file"


def open_streaming(options: SourceOptions, *, cache: Any) -> StreamingSource:
    """A ``StreamingSource`` for ``options``: the dataset, producers and transport it names, checked to agree."""
    from specdraft.data.dataset import PreparedDataset
    from specdraft.hidden_states.backends import open_backend

    if not options.dataset:
        raise SpecdraftError(f"online/hybrid data needs {setting('dataset')}: the prepared dataset whose samples are requested")
    if not options.store:
        raise SpecdraftError(
            f"online/hybrid data needs {setting('store')}: where producers write (a shared directory or mooncake://HOST:PORT/NS)"
        )
    if options.slots is None:
        raise SpecdraftError("online/hybrid data needs the layer slots to request")
    prepared = PreparedDataset(options.dataset)
    listed = options.producers[0][1:] if len(options.producers) == 1 and options.producers[0].startswith("@") else None
    client = ProducerClient(options.producers, membership=listed, token=options.token, timeout_s=options.timeout_s)
    target_info = client.describe_target()
    recorded = prepared.target_info
    if recorded.get("fingerprint") != target_info.get("fingerprint"):
        raise SpecdraftError(
            f"dataset {prepared.directory} was prepared for target {recorded.get('name')!r} (fingerprint {recorded.get('fingerprint')}) "
            f"but the producers serve {target_info.get('name')!r} (fingerprint {target_info.get('fingerprint')})"
        )
    slots = options.slots(int(target_info["num_layers"]))
    transport = open_backend(backend_name(options.store), options.store)
    source = StreamingSource(
        prepared=prepared,
        client=client,
        transport=transport,
        target_info=target_info,
        slots=slots,
        dtype=options.dtype,
        prefetch=options.prefetch,
        cache=cache,
        delivery_log=options.delivery_log,
        owner=options.owner,
    )
    source.sweep()
    return source
