"""What a training run will do, worked out before anything is written, wrapped or distributed.

``plan_run`` is side-effect free (it reads the store's lengths, ``OUT/split.json`` and the latest
checkpoint's state, and writes nothing), so it can be tested without ``torch.distributed``: the layer
slots the drafter reads (worked out once, here) and where they sit in the store, the validation split,
the data plan of this rank, the step counts, the run identity, and whether and from where it resumes --
refused, naming the checkpoint, when the identity changed.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from specdraft.errors import SpecdraftError, setting
from specdraft.hidden_states.layers import LayerSlot
from specdraft.models.base import DrafterModel, MethodSpec, WarmStart
from specdraft.targets.base import Target
from specdraft.train import checkpoint_files as ckpt
from specdraft.train.batches import DataPlan, SampleSource, select_slots, token_rows
from specdraft.train.config import TrainConfig
from specdraft.train.decoded_tau import DecodeProbe, unavailable_reason
from specdraft.train.split import SPLIT_FILE, Split, resolve_split

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resume:
    directory: Path  # the latest complete checkpoint
    state: dict  # its trainer_state.json, checksums verified (``checkpoint.read_state``)

    @property
    def step(self) -> int:
        return int(self.state["step"])


@dataclass(frozen=True)
class RunPlan:
    method: str
    out: Path
    where: str  # the data, as messages and the model card name it
    slots: list[LayerSlot]  # what the drafter reads
    slot_index: list[int] | None  # their positions in the store (None: all, in order)
    split: Split
    data: DataPlan  # this rank's batches
    total_steps: int
    warmup_steps: int
    identity: dict  # must match to resume (``checkpoint.IDENTITY_KEYS``)
    resolved: dict  # config.resolved.yaml: every value the run uses
    resume: Resume | None
    probe: DecodeProbe | None  # decoded tau at each validation
    probe_skipped: str | None  # why there is no probe, when the method/target cannot decode
    warm_starts: Mapping[str, WarmStart]  # the switched-on pieces (``warm_start.check_warm_start``), for a fresh run


def plan_run(
    cfg: TrainConfig,
    *,
    spec: MethodSpec,
    model_cfg: Any,
    drafter: DrafterModel,
    target: Target,
    dataset: SampleSource,
    rank: int,
    world: int,
    warm_starts: Mapping[str, WarmStart] = MappingProxyType({}),
) -> RunPlan:
    """The plan of rank ``rank`` of ``world`` for training the built ``drafter``, to be warm-started with ``warm_starts``."""
    out, where = Path(cfg.required("out")), str(cfg.data or "(in-memory dataset)")
    check_block_fits(cfg.pack_tokens, drafter, spec.name)
    slots = spec.run_slots(cfg.model, target.num_layers)
    slot_index: list[int] | None = select_slots(dataset.slots, slots, where=where)
    slot_index = None if slot_index == list(range(len(dataset.slots))) else slot_index
    split = resolve_split(dataset, val_fraction=cfg.val_fraction, seed=cfg.split_seed, recorded=out / SPLIT_FILE)
    data = DataPlan.for_run(dataset, split, cfg, world_size=world, rank=rank)
    require_labels(dataset, data.train_indices, sample_tokens=cfg.sample_tokens, where=where)
    probe, probe_skipped = None, None
    if cfg.decode_prompts and data.val_indices:
        probe_skipped = unavailable_reason(spec.name, target)
        if probe_skipped is None:
            probe = DecodeProbe.from_split(
                token_rows(dataset, data.val_indices),
                [dataset.sample_ids[i] for i in data.val_indices],
                count=cfg.decode_prompts,
                tokens=cfg.decode_tokens,
            )
        else:
            log.warning("decoded tau is not measured: %s", probe_skipped)
    total_steps = cfg.max_steps or data.total_steps(cfg.epochs)
    identity = {
        "method": spec.name,
        "model_config": ckpt._jsonable(config_dict(getattr(drafter, "config", model_cfg))),
        "target_fingerprint": target.fingerprint,
        "slots": [str(s) for s in slots],
        "hidden_states": dataset.made_with,
    }
    return RunPlan(
        method=spec.name,
        out=out,
        where=where,
        slots=slots,
        slot_index=slot_index,
        split=split,
        data=data,
        total_steps=total_steps,
        warmup_steps=max(1, round(cfg.warmup_ratio * total_steps)) if cfg.warmup_ratio > 0 else 0,
        identity=identity,
        resolved={**cfg.to_dict(), "model": identity["model_config"], "target": cfg.target or target.name, "data": cfg.data},
        resume=check_resume(cfg, identity, data_fingerprint=data.fingerprint(), world=world),
        probe=probe,
        probe_skipped=probe_skipped,
        warm_starts=warm_starts,
    )


#: Settings that choose the layout of part of a checkpoint's state, which then loads under no other value (AdamW's moment
#: estimates are no Muon momentum): a resume that changes one is refused before any step, naming it, where other settings
#: are only warned about.
STATE_SETTINGS: Mapping[str, str] = MappingProxyType({"optimizer": "its optimizer state"})


def check_resume(cfg: TrainConfig, identity: dict, *, data_fingerprint: str, world: int) -> Resume | None:
    """The latest checkpoint of ``cfg.out`` to resume from (None: a fresh run); refused when the run identity or a
    ``STATE_SETTINGS`` setting changed, and warned about when the split, other settings or process count did."""
    directory = ckpt.latest_checkpoint(cfg.required("out"))
    if directory is None:
        return None
    saved = ckpt.read_state(directory)
    ckpt.check_identity(saved["identity"], identity, where=directory)
    for name, part in STATE_SETTINGS.items():
        was, now = saved["config"].get(name), getattr(cfg, name)
        if was is not None and was != now:
            raise SpecdraftError(
                f"cannot resume from {directory}: {part} was written under {setting(name)} {was}, and cannot be loaded under "
                f"{setting(name)} {now}; resume with {setting(name)} {was}, or train with {now} into a new {setting('out')}"
            )
    if saved.get("data_fingerprint") != data_fingerprint:
        log.warning("the training split differs from the one %s was trained on; resuming anyway", directory)
    changed = sorted(
        k
        for k, v in ckpt._jsonable(cfg.to_dict()).items()
        if k not in ("out", "dry_run", "target", "model") and saved["config"].get(k) != v
    )
    if changed:
        log.warning(
            "resuming with changed settings: %s", ", ".join(f"{k} {saved['config'].get(k)!r} -> {getattr(cfg, k)!r}" for k in changed)
        )
    saved_world = saved.get("world_size", 1) // saved.get("sequence_parallel", 1)  # data-parallel processes (groups)
    if saved_world != world:
        log.warning(
            "resuming a run of %s data-parallel process(es) with %d: the data order after step %d differs",
            saved_world,
            world,
            saved["step"],
        )
    return Resume(directory, saved)


def check_block_fits(pack_tokens: int, drafter: DrafterModel, method: str) -> None:
    """Refuse rows shorter than one draft block: the anchor and the K tokens it drafts (``speculative_tokens``;
    K = 1 for a drafter without it: a token and the next). Draft position k is supervised only where k tokens of
    the same sample follow the anchor, so rows of ``pack_tokens`` leave positions ``pack_tokens``..K unlearned:
    at ``--pack-tokens 1`` every one, a run at loss 0.0 that learned nothing."""
    speculative_tokens = getattr(drafter, "speculative_tokens", None)
    drafts = speculative_tokens() if callable(speculative_tokens) else 1
    if pack_tokens < drafts + 1:
        positions = f"{pack_tokens}-{drafts}" if pack_tokens < drafts else str(drafts)
        raise SpecdraftError(
            f"{setting('pack_tokens')} {pack_tokens} is below the {drafts + 1} tokens one {method} block spans (its anchor and the "
            f"{drafts} token(s) it drafts, each labelled by the sample's next token): rows that short never supervise draft "
            f"position(s) {positions}; use {setting('pack_tokens')} {drafts + 1} or more"
        )


def require_labels(dataset: SampleSource, indices: list[int], *, sample_tokens: int, where: str) -> None:
    """Refuse a training split with nothing to learn: no sample with a response token past its first within the
    ``sample_tokens`` a row reads of it (prompts longer than that fill the rows; a label needs a token before it).
    Stops at the first sample that has one, so real data pays one ``token_row``."""
    for i in indices:
        _, mask = dataset.token_row(i)
        if mask[1:sample_tokens].any():
            return
    raise SpecdraftError(
        f"{where}: none of the {len(indices)} training samples has a response token within the first {sample_tokens} tokens a "
        f"row reads of it ({setting('pack_tokens')}, {setting('max_sample_tokens')}): their prompts fill the rows, so the run "
        f"would learn nothing; raise {setting('pack_tokens')} past the prompts' length"
    )


def build_method_config(spec: MethodSpec, overrides: dict) -> Any:
    """The method's config from ``--model`` overrides, refused with the valid keys when one is unknown."""
    try:
        return spec.config_cls(**overrides)
    except TypeError as exc:
        fields = ", ".join(f.name for f in dataclasses.fields(spec.config_cls)) if dataclasses.is_dataclass(spec.config_cls) else "?"
        raise SpecdraftError(f"invalid {setting('model')} override for method {spec.name!r} ({exc}); valid keys: {fields}") from None


def config_dict(model_cfg: Any) -> dict:
    if dataclasses.is_dataclass(model_cfg) and not isinstance(model_cfg, type):
        return dataclasses.asdict(model_cfg)
    return dict(vars(model_cfg))
