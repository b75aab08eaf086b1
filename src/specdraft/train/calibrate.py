"""``specdraft calibrate``: fit a DSpark drafter's confidence temperatures on held-out hidden states.

The held-out samples are the trainer's validation split (``train/split.py``): the run's recorded
``split.json`` when the drafter is a run's ``final/`` (or ``--split`` names one), else the split the
trainer computes from ``--val-fraction`` and ``--split-seed``; so calibration never sees data the
drafter was trained on. The temperatures are stored in the
checkpoint's config (``specdraft.config.confidence_temperatures``) and the fit statistics in
``calibration.json`` beside it; the checkpoint directory is replaced atomically, and only when it
holds a drafter checkpoint and nothing else (a training checkpoint, with its trainer state, is refused).
The drafter's ``MODEL_CARD.md`` is carried into the new directory with a section on the calibration.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdraft.errors import SpecdraftError, setting
from specdraft.targets.base import Target
from specdraft.utils.config import config_field, require_finite
from specdraft.utils.io import DirKind
from specdraft.utils.lock import claims_output

ACCEPT_MODES = {"greedy": "greedy_accept", "sampling": "soft_accept"}


@dataclass(frozen=True)
class CalibrateConfig:
    drafter: str = config_field(help="DSpark checkpoint directory to calibrate (rewritten in place unless --out is given)")
    data: str = config_field(help="hidden-state store written by `specdraft extract` (its validation split is used)")
    out: str = config_field(
        "", help="write the calibrated checkpoint here instead of overwriting --drafter (an existing one must hold a drafter checkpoint)"
    )
    target: str = config_field("", help="target model (default: the one recorded in the hidden-state store)")
    mode: str = config_field(
        "greedy",
        help="acceptance to calibrate for: greedy (argmax match) or sampling (1 - 0.5*L1 at T=1)",
        metadata={"choices": sorted(ACCEPT_MODES)},
    )
    val_fraction: float = config_field(
        0.05, help="share of conversations held out, as `specdraft train --val-fraction` (when no split.json is found)"
    )
    split_seed: int = config_field(0, help="seed of the validation split, as `specdraft train --split-seed` (when no split.json is found)")
    split: str = config_field("", help="a training run's split.json (default: the one beside --drafter when it is a run's final/)")
    max_samples: int = config_field(256, help="use at most this many held-out samples")
    pack_tokens: int = config_field(2048, help="tokens per packed row while scoring")
    seed: int = config_field(0, help="seed of the anchor sampling")

    def __post_init__(self) -> None:
        require_finite(self)
        if self.mode not in ACCEPT_MODES:
            raise SpecdraftError(f"{setting('mode')} must be one of {sorted(ACCEPT_MODES)}, got {self.mode!r}")
        if not 0 < self.val_fraction <= 1:
            raise SpecdraftError(f"{setting('val_fraction', of='calibrate')} must be in (0, 1], got {self.val_fraction}")
        if self.max_samples < 1 or self.pack_tokens < 2:
            raise SpecdraftError(f"{setting('max_samples', of='calibrate')} must be >= 1 and {setting('pack_tokens', of='calibrate')} >= 2")


def _drafter_dir() -> DirKind:
    from specdraft.models.common.checkpoint import DRAFTER_DIR  # beside torch: imported only when calibrating

    return DRAFTER_DIR


def _held_out(config: CalibrateConfig, dataset: Any) -> list[int]:
    """The samples to calibrate on: the validation side of the drafter's training split (its recorded ``split.json``,
    else the split ``--val-fraction`` and ``--split-seed`` give), at most ``--max-samples``; an error where it is empty,
    since temperatures fitted on training samples would be too confident."""
    from specdraft.train.split import SPLIT_FILE, resolve_split

    recorded = Path(config.split) if config.split else Path(config.drafter).resolve().parent / SPLIT_FILE
    if config.split and not recorded.is_file():
        raise SpecdraftError(f"{setting('split')} {config.split} does not exist")
    split = resolve_split(dataset, val_fraction=config.val_fraction, seed=config.split_seed, recorded=recorded)
    held_out = split.val
    if not held_out:
        used = f"val_fraction {split.record['val_fraction']:g}, seed {split.record['seed']}"
        if recorded.is_file():  # the run's split wins over --val-fraction: the drafter trained on everything else
            raise SpecdraftError(
                f"{config.data}: the recorded split ({recorded}: {used}) holds out none of the {len(dataset.sample_ids)} "
                f"samples, and calibrating on samples it was trained on would fit the temperatures to its training data; train "
                f"it again, into a new output directory, with a larger {setting('val_fraction', of='train')} or on more samples"
            )
        raise SpecdraftError(
            f"{config.data}: the split computed with {used} holds out none of the {len(dataset.sample_ids)} samples; raise "
            f"{setting('val_fraction')} (to the drafter's training run's), or give that run's split.json as {setting('split')}"
        )
    return held_out[: config.max_samples]


# --out defaults to --drafter itself: the documented in-place rewrite (the new checkpoint replaces the old whole, once complete)
@claims_output(
    _drafter_dir,
    out=lambda config: config.out or config.drafter,
    inputs=lambda config: [config.drafter, config.data],
    in_place_ok=True,
    what=lambda config: setting("out") if config.out else setting("drafter"),
)
def calibrate(config: CalibrateConfig, *, target: Target | None = None, progress: bool = True) -> dict:
    """Fit and store the temperatures; returns the statistics written to ``calibration.json``."""
    import dataclasses

    import torch
    from tqdm import tqdm

    from specdraft.hidden_states.dataset import HiddenStateDataset
    from specdraft.models.common.checkpoint import CALIBRATION_FILE, DRAFTER_DIR, MODEL_CARD_FILE
    from specdraft.models.common.drafter import load_drafter
    from specdraft.models.dspark.model import DSparkDrafter
    from specdraft.models.dspark.temperature_scaling import sequential_temperature_scaling
    from specdraft.targets import load_target
    from specdraft.train.batches import collate, pack_rows, select_slots
    from specdraft.train.model_card import calibrated_card
    from specdraft.utils.io import atomic_dir, atomic_write_bytes, atomic_write_json

    out = Path(config.out or config.drafter)
    dataset = HiddenStateDataset(config.data)
    if target is None:
        target = load_target(config.target or dataset.target_info["name"])
    drafter = load_drafter(config.drafter, target=target).eval()
    if not isinstance(drafter, DSparkDrafter):  # the one family with a confidence head
        raise SpecdraftError(f"{config.drafter}: a {drafter.method} drafter has no confidence head; only dspark drafters are calibrated")
    slot_index = select_slots(dataset.slots, drafter.config.slots(), where=config.data)
    held_out = _held_out(config, dataset)
    lengths = dataset.lengths()  # indexed by sample index
    rows = pack_rows(held_out, lengths, config.pack_tokens)
    generator = torch.Generator().manual_seed(config.seed)
    parts: dict[str, list[torch.Tensor]] = {}
    for row in tqdm(rows, desc="calibrate", unit="row", disable=not progress):
        batch = collate([[dataset[i] for i in row]], sample_tokens=config.pack_tokens, slot_index=slot_index, where=config.data)
        for key, value in drafter.confidence_records(batch, generator=generator).items():
            parts.setdefault(key, []).append(value.cpu())
    records = {k: torch.cat(v) for k, v in parts.items()}
    if records["valid"].numel() == 0 or not records["valid"][:, 0].any():
        raise SpecdraftError(f"{config.data}: the held-out samples contain no response tokens to calibrate on")
    result = sequential_temperature_scaling(
        logits=records["logits"], accept=records[ACCEPT_MODES[config.mode]], valid=records["valid"].bool()
    )
    drafter.config = dataclasses.replace(drafter.config, confidence_temperatures=result.temperatures)
    stats = {"mode": config.mode, "samples": len(held_out), "blocks": int(records["valid"][:, 0].sum()), **result.to_json()}
    card = Path(config.drafter) / MODEL_CARD_FILE  # read before the swap: in place, it is the directory being replaced
    card_text = card.read_text() if card.is_file() else None
    # one swap for the weights, the statistics and the card: the whole drafter directory is replaced, so what it held
    # beside the weights (the training run's MODEL_CARD.md) is carried over, not dropped
    with atomic_dir(out, DRAFTER_DIR, inputs=[config.drafter, config.data], in_place_ok=True) as tmp:
        drafter.save_pretrained(tmp)
        atomic_write_json(tmp / CALIBRATION_FILE, stats)
        if card_text is not None:
            atomic_write_bytes(tmp / MODEL_CARD_FILE, calibrated_card(card_text, stats, data=config.data).encode())
    return stats
