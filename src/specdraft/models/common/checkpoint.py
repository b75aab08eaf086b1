"""The speculators/vLLM checkpoint directory: ``config.json`` + ``model.safetensors``.

Writing replaces the whole directory atomically (written into a hidden sibling, then renamed),
so a reader sees the old checkpoint or the new one, never a config from one and weights from the
other; an existing directory is replaced only when it is a drafter checkpoint (``DRAFTER_DIR``).
Reading refuses pickle formats and validates every tensor against what the model expects.

Checksum: ``config.json``'s ``specdraft`` block records ``checksums: {"model.safetensors":
sha256}``, verified on every read (speculators and vLLM ignore the block, so the layout stays
theirs). A checkpoint with a ``specdraft`` block but no checksum is refused, since reads are
strict and a flipped weight byte otherwise loads and decodes; one written by speculators itself
(no ``specdraft`` block) has nothing to verify against and loads as before.

Layer-id convention (``aux_hidden_state_layer_ids`` / ``eagle_aux_hidden_state_layer_ids``): we
write the id vLLM's hidden-state extraction and speculators use, which is the HF
``output_hidden_states`` index: ``input:i`` -> ``i`` and ``output:i`` -> ``i + 1`` (so the
EAGLE-3 preset inputs 2, L//2, L-3 are written as-is and the DFlash preset outputs 1, 8, ... of a
30-layer target are written 2, 9, ...). vLLM's DFlash/DSpark loaders subtract 1 again to get
z-lab's "output of layer i" ids. Reading applies the inverse per method (EAGLE-3 ids are layer
inputs, DFlash/DSpark ids are outputs of layer id-1), so a round trip keeps the ``LayerSlot``s.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from specdraft.errors import SpecdraftError
from specdraft.hidden_states.layers import LayerSlot
from specdraft.targets.loading import PICKLE_SUFFIXES
from specdraft.utils.io import DirKind, atomic_dir, atomic_write_json, json_field_is, save_safetensors, sha256_file

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
CALIBRATION_FILE = "calibration.json"  # written beside the weights by `specdraft calibrate`
MODEL_CARD_FILE = "MODEL_CARD.md"  # written beside the weights of a shipped reference drafter
DRAFTER_DIR = DirKind(
    "drafter checkpoint",
    CONFIG_FILE,
    json_field_is("speculators_model_type", ...),
    frozenset({CONFIG_FILE, WEIGHTS_FILE, CALIBRATION_FILE, MODEL_CARD_FILE}),
)
SPECULATORS_VERSION = "0.9.0"  # the speculators format version we write and test against


def slot_to_aux_id(slot: LayerSlot) -> int:
    return slot.layer if slot.side == "input" else slot.layer + 1


def aux_id_to_slot(aux_id: int, side: str) -> LayerSlot:
    """Inverse of ``slot_to_aux_id`` for a method whose slots are all on ``side``."""
    if side == "input":
        return LayerSlot(aux_id, "input")
    if aux_id < 1:
        raise SpecdraftError(f"aux hidden-state layer id {aux_id} cannot name a layer output (ids start at 1)")
    return LayerSlot(aux_id - 1, "output")


def write_checkpoint(directory: str | os.PathLike, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """Write ``config.json`` + ``model.safetensors`` into ``directory``, replacing it atomically."""
    directory = Path(directory)
    with atomic_dir(directory, DRAFTER_DIR) as tmp:
        save_safetensors({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp / WEIGHTS_FILE, metadata={"format": "pt"})
        if isinstance(config.get("specdraft"), dict):
            config = {**config, "specdraft": {**config["specdraft"], "checksums": {WEIGHTS_FILE: sha256_file(tmp / WEIGHTS_FILE)}}}
        atomic_write_json(tmp / CONFIG_FILE, config)
    return directory


def verify_weights(directory: Path, config: dict) -> None:
    """Check ``model.safetensors`` against the sha256 its ``specdraft`` block records (see the module docstring)."""
    ours = config.get("specdraft")
    if not isinstance(ours, dict):
        return
    path = directory / WEIGHTS_FILE
    digest = sha256_file(path)
    checksums = ours.get("checksums")
    recorded = checksums.get(WEIGHTS_FILE) if isinstance(checksums, dict) else None
    if recorded is None:
        raise SpecdraftError(
            f"{directory / CONFIG_FILE}: its specdraft block records no checksum of {WEIGHTS_FILE} (written before specdraft "
            f"recorded checksums, or edited), so {path} cannot be verified. If you trust that file, add "
            f'"checksums": {{"{WEIGHTS_FILE}": "{digest}"}} to the specdraft block, or re-save the drafter'
        )
    if digest != recorded:
        raise SpecdraftError(
            f"{path} is corrupt: its sha256 is {digest[:16]}..., but {CONFIG_FILE} records {str(recorded)[:16]}...; "
            "restore the file from a good copy or retrain"
        )


def read_checkpoint_config(directory: str | os.PathLike) -> dict:
    """``config.json`` of a drafter directory that holds safetensors weights (not read or verified here)."""
    import json

    directory = Path(directory)
    if not directory.is_dir():
        raise SpecdraftError(f"drafter checkpoint {directory} is not a directory")
    config_path = directory / CONFIG_FILE
    if not (directory / WEIGHTS_FILE).is_file():
        pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise SpecdraftError(
                f"{directory} holds pickle weights ({', '.join(pickles)}); specdraft only loads safetensors. "
                f"Convert them to {WEIGHTS_FILE} first (e.g. with safetensors.torch.save_file)"
            )
        raise SpecdraftError(f"{directory} has no {WEIGHTS_FILE}")
    if not config_path.is_file():
        raise SpecdraftError(f"{directory} has no {CONFIG_FILE}")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SpecdraftError(f"{config_path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise SpecdraftError(f"{config_path} is not a JSON object")
    return config


def read_checkpoint(directory: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read a drafter directory, weights verified; raise ``SpecdraftError`` for anything but config.json + safetensors."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config = read_checkpoint_config(directory)
    verify_weights(directory, config)
    weights_path = directory / WEIGHTS_FILE
    try:
        tensors = load_file(str(weights_path))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise SpecdraftError(f"cannot read {weights_path}: {exc}") from None
    return config, tensors


def check_tensors(tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], *, where: str, ignore: tuple[str, ...] = ()) -> None:
    """Every expected tensor present with the expected shape; no unknown tensors (``ignore`` aside)."""
    for name, ref in expected.items():
        if name not in tensors:
            raise SpecdraftError(f"{where}: tensor {name!r} is missing (expected shape {tuple(ref.shape)})")
        if tuple(tensors[name].shape) != tuple(ref.shape):
            raise SpecdraftError(
                f"{where}: tensor {name!r} has shape {tuple(tensors[name].shape)} but config.json implies {tuple(ref.shape)}"
            )
    unknown = sorted(set(tensors) - set(expected) - set(ignore))
    if unknown:
        raise SpecdraftError(
            f"{where}: unexpected tensors {unknown[:5]}{' ...' if len(unknown) > 5 else ''}; config.json and weights disagree"
        )
