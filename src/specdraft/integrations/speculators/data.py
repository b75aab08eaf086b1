"""``specdraft export-speculators``: a hidden-state store as the training data speculators' trainer reads.

Why: to train speculators' own drafter (``python -m speculators.train``) on exactly the tokens, hidden states,
validation split and draft vocabulary ``specdraft train`` uses, so the two trainers can be compared
(``benchmarks/peer_compare.py``).

What the peer's ``--data-path`` holds: a Hugging Face ``datasets`` directory (``save_to_disk``) with columns
``input_ids``, ``loss_mask`` and ``seq_len``, and ``hidden_states/hs_<row>.safetensors`` per row holding
``token_ids`` [T] and ``hidden_states`` [T, L + 1, D] -- the drafter's L target layers (in ``--target-layer-ids``
order) followed by the target's last hidden state (before its final norm). Our store holds exactly these tensors
(``hidden_states`` [T, S, D] + ``last_hidden`` [T, D]); only the method's slots are written, mapped to
speculators' layer ids as in ``models/common/checkpoint.py`` (``output:i`` -> ``i + 1``). The peer validates on
the last ``1 - --train-data-ratio`` rows, so our validation side (``train/split.py``) is written last. With
``draft_vocab_size`` also ``d2t-N.npy``/``t2d-N.npy`` (the peer's cached mapping names), built from the counts our
trainer selects its draft vocabulary from; they are part of the export (its reuse key holds N), so another N exports
again whole rather than leaving the old mapping beside the new. Needs the ``datasets`` package (in ``.venv-interop``,
with speculators).

``--out`` is claimed like every output (``utils/lock.claim_output``): only an export (``EXPORT_DIR``) is replaced, never
the store it reads, and under a lock covering its tree. It is written into a fresh directory and swapped in whole, so no
row of an earlier export survives. ``converted.json`` records what it was made from, keyed by the store's *content*
(``store_digest``: a store re-extracted at the same path is other data), and the sha256 of every file written: a
later run reuses the export only when the key matches and every file verifies, and otherwise (an unreadable
``converted.json`` included) exports again, saying why.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdraft.errors import SpecdraftError
from specdraft.utils.config import config_field, require_finite
from specdraft.utils.io import DirKind, atomic_dir, atomic_write_bytes, atomic_write_json, save_safetensors, sha256_file
from specdraft.utils.lock import claims_output

if TYPE_CHECKING:
    import numpy as np

    from specdraft.hidden_states.dataset import HiddenStateDataset

log = logging.getLogger(__name__)

DONE_FILE = "converted.json"


def _is_export(marker: Path) -> bool:
    """``EXPORT_DIR``'s marker test: ``converted.json`` with a reuse key, or unreadable (an export cut short while an older
    specdraft wrote it in place; the directory holds nothing but an export's entries, and is exported again)."""
    try:
        obj = json.loads(marker.read_text())
    except ValueError:
        return True
    except OSError:
        return False
    return isinstance(obj, dict) and "key" in obj


#: What ``export-speculators`` writes: ``datasets``' ``save_to_disk`` files, the rows' hidden states, the d2t/t2d mappings.
EXPORT_DIR = DirKind(
    "speculators training-data export",
    DONE_FILE,
    _is_export,
    frozenset({DONE_FILE, "state.json", "dataset_info.json", "hidden_states"}),
    patterns=("data-*.arrow", "cache-*.arrow", "d2t-*.npy", "t2d-*.npy"),
)

#: Our model config field -> the speculators trainer flag that sets the same quantity (absent fields are skipped).
#: Keys are the method configs' own field names, so a method's recipe selects its flags (DSpark's Markov rank, DFlash2's
#: convolution and selector) without naming the method.
SHAPE_FLAGS = {
    "num_layers": "--num-layers",
    "block_size": "--block-size",
    "draft_vocab_size": "--draft-vocab-size",
    "markov_rank": "--markov-rank",
    "conv_kernel_size": "--conv-kernel-size",
    "conv_group_size": "--conv-group-size",
    "selector_rank": "--selector-rank",
    "selector_top_k": "--selector-top-k",
    "selector_weight": "--selector-loss-alpha",
    "ttt_steps": "--ttt-steps",
    "ttt_decay": "--ttt-step-loss-decay",
}

#: Our boolean model config fields -> the peer's switch of the same drafter part: ``--x`` on, ``--no-x`` off (its eagle3
#: turns Eagle 3.1's norm_before_fc and norm_output on unless told), except ``ON_ONLY`` switches, off unless given.
SWITCH_FLAGS = {
    "norm_before_residual": "norm-before-residual",
    "norm_before_fc": "norm-before-fc",
    "fc_norm": "fc-norm",
    "norm_output": "norm-output",
}
ON_ONLY = {"fc-norm"}


#: Loss terms of our method configs (field names of the resolved recipe's ``model``; a method has the ones its config
#: defines, DFlash none of them: hard-label CE) -> the peer's flattened config key weighting the same term, or None.
LOSS_TERMS = {
    "unary_loss": None,
    "ce_weight": None,
    "l1_weight": None,
    "bce_weight": "confidence_head_alpha",
    "selector_weight": "selector_loss_alpha",
}


def peer_methods() -> list[str]:
    """The registered methods compared with speculators' trainer (``benchmarks/peer_compare.py``): every decodable
    family (the block drafters and EAGLE-3), which speculators 0.9.0 trains as the ``--speculator-type`` of the same
    name from the data ``export_speculators_data`` writes. Read from the method registry, so a family is compared once
    its ``MethodSpec`` is registered, without being named here."""
    from specdraft.models import METHODS

    return [name for name in METHODS if METHODS.get(name).proposer is not None]


def loss_summary(model: dict, peer: dict | None = None) -> str:
    """Our resolved ``model`` config's loss terms, e.g. 'unary_loss kl, selector_weight 1.0'; with ``peer`` (the peer's
    flattened config) its keys for the same terms instead."""
    if peer is None:
        return ", ".join(f"{key} {model[key]}" for key in LOSS_TERMS if key in model) or "CE (hard target argmax)"
    return ", ".join(f"{peer_key} {peer[peer_key]}" for key, peer_key in LOSS_TERMS.items() if key in model and peer_key)


def trainer_flags(model: dict, *, anchors_per_step: int | None = None) -> list[str]:
    """The speculators trainer flags that give its drafter the shape of our resolved ``model`` config (a field left
    None, e.g. DFlash2's full vocabulary, leaves the peer's default) and, when given, ``anchors_per_step`` blocks per step
    (it counts ``--max-anchors`` per packed row, ours per sample)."""
    flags = [x for key, flag in SHAPE_FLAGS.items() if model.get(key) is not None for x in (flag, str(model[key]))]
    if anchors_per_step is not None:
        flags += ["--max-anchors", str(anchors_per_step)]
    for key, switch in SWITCH_FLAGS.items():
        if key in model and (model[key] or switch not in ON_ONLY):
            flags.append(f"--{'' if model[key] else 'no-'}{switch}")
    return flags


@dataclass
class ExportSpeculatorsConfig:
    store: str = config_field(help="hidden-state store (written by `specdraft extract`) holding the method's layer slots")
    out: str = config_field(
        help="directory to write (the peer's --data-path); one exported from a store of the same content, slots and split is reused"
    )
    method: str = config_field("dspark", help="drafter method whose layer slots are exported (the peer's --speculator-type)")
    val_fraction: float = config_field(0.05, help="specdraft train's --val-fraction: its validation rows are written last")
    split_seed: int = config_field(0, help="specdraft train's --split-seed")
    draft_vocab_size: int | None = config_field(
        None,
        help="also write the peer's d2t/t2d mapping of this size, built from the store's token counts as specdraft train builds its own",
    )

    def __post_init__(self) -> None:
        require_finite(self)
        if not 0 < self.val_fraction < 1:
            raise SpecdraftError(f"--val-fraction must be in (0, 1): the peer needs validation rows, got {self.val_fraction}")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise SpecdraftError(f"--draft-vocab-size must be >= 1, got {self.draft_vocab_size}")


def store_digest(dataset: HiddenStateDataset) -> str:
    """sha256 of everything an export is made of: the store's manifest, each stored sample's payload manifest (which
    records its tensors' sha256; read from the file's header, not its data) and the prepared rows (tokens, loss masks)."""
    from safetensors import safe_open

    from specdraft.data.dataset import DATA_FILE
    from specdraft.hidden_states.backends.file import FileBackend

    backend = dataset.backend
    if not isinstance(backend, FileBackend):
        raise SpecdraftError(f"export-speculators reads a store directory; {backend.location} is a {type(backend).__name__}")
    digest = hashlib.sha256(json.dumps(dataset.manifest, sort_keys=True).encode())
    for sample_id in dataset.sample_ids:
        with safe_open(str(backend.path(sample_id)), "pt") as f:
            digest.update(f"\0{sample_id}\0{(f.metadata() or {}).get('specdraft', '')}".encode())
    digest.update(sha256_file(Path(dataset.prepared.directory) / DATA_FILE).encode())
    return digest.hexdigest()


def _reusable(out: Path, key: dict) -> dict | None:
    """The facts of the export in ``out`` when it was made with ``key`` and every file it recorded verifies; else
    ``None``, with the reason logged (a WARNING for damage, INFO for an export of other data)."""
    done = out / DONE_FILE
    if not done.exists():
        return None
    try:
        recorded, why = json.loads(done.read_text()), "not a JSON object"
    except (OSError, ValueError) as exc:
        recorded, why = None, str(exc) or type(exc).__name__
    if not isinstance(recorded, dict):
        log.warning("%s is unreadable (%s); exporting again", done, why)
        return None
    if recorded.get("key") != key:
        log.info("%s was exported from other data or settings; exporting again", out)
        return None
    files, facts = recorded.get("files"), recorded.get("facts")
    if not isinstance(files, dict) or not files or not isinstance(facts, dict):
        log.warning("%s records no checksums of its files (written by an older specdraft); exporting again", done)
        return None
    for name, recorded_sha in files.items():
        path = out / name
        if not path.is_file() or sha256_file(path) != recorded_sha:
            log.warning("%s is %s; exporting again", path, "missing" if not path.is_file() else f"not the file {DONE_FILE} records")
            return None
    return facts


def _write_npy(path: Path, array: np.ndarray) -> None:
    import numpy as np

    buffer = io.BytesIO()
    np.save(buffer, array)
    atomic_write_bytes(path, buffer.getvalue())


@claims_output(EXPORT_DIR, inputs=lambda config: [config.store])  # before any work: a foreign, locked or read-only --out costs nothing
def export_speculators_data(config: ExportSpeculatorsConfig) -> dict:
    """Write ``config.out``; returns the peer's ``--target-layer-ids`` (``layer_ids``), the row counts of each side,
    the ``--train-data-ratio`` that splits them as ours and the token counts."""
    from specdraft.hidden_states.dataset import HiddenStateDataset
    from specdraft.models import METHODS
    from specdraft.models.common.checkpoint import slot_to_aux_id
    from specdraft.train.batches import select_slots
    from specdraft.train.split import dataset_split

    try:
        from datasets import Dataset
    except ImportError:
        raise SpecdraftError(
            "export-speculators needs the `datasets` package (installed with speculators in .venv-interop: "
            "run `.venv-interop/bin/python -m specdraft.cli.main export-speculators ...`)"
        ) from None
    out = Path(config.out)
    dataset = HiddenStateDataset(config.store)
    slots = METHODS.get(config.method).layer_slots(int(dataset.target_info["num_layers"]))
    key = {
        "store": store_digest(dataset),
        "slots": [str(s) for s in slots],
        "val_fraction": config.val_fraction,
        "split_seed": config.split_seed,
        "draft_vocab_size": config.draft_vocab_size,
    }
    facts = _reusable(out, key)
    if facts is None:
        slot_index = select_slots(dataset.slots, slots, where=config.store)
        split = dataset_split(dataset, val_fraction=config.val_fraction, seed=config.split_seed)
        if not split.val:
            raise SpecdraftError(
                f"{config.store}: no sample falls in the validation split (--val-fraction {config.val_fraction}); the peer needs one"
            )
        order = split.train + split.val  # the peer holds out the last rows
        with atomic_dir(out, EXPORT_DIR, inputs=[config.store]) as tmp:
            columns = _write_rows(dataset, order, slot_index, tmp)
            Dataset.from_dict(columns).with_format("torch").save_to_disk(str(tmp))
            train_tokens = sum(columns["seq_len"][: len(split.train)])
            facts = {
                "layer_ids": [slot_to_aux_id(slot) for slot in slots],
                "train_rows": len(split.train),
                "val_rows": len(split.val),
                # the peer cuts at int(rows * ratio): half a row more keeps float rounding on the right side
                "train_data_ratio": (len(split.train) + 0.5) / len(order),
                "tokens": sum(columns["seq_len"]),
                "train_tokens": train_tokens,
            }
            if config.draft_vocab_size:  # part of the export, so that a rerun with another size leaves no mapping of this one
                _write_draft_vocab(dataset, config.draft_vocab_size, config.store, tmp)
            files = {p.relative_to(tmp).as_posix(): sha256_file(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
            atomic_write_json(tmp / DONE_FILE, {"key": key, "files": files, "facts": facts})
    return facts


def _write_rows(dataset: Any, order: list[int], slot_index: list[int], tmp: Path) -> dict[str, list]:
    """One ``hidden_states/hs_ROW.safetensors`` per row in ``order`` (the chosen slots' hidden states, then the last
    layer's, stacked as the peer reads them); returns the Arrow dataset's columns (token ids, loss mask, length)."""
    import torch

    (tmp / "hidden_states").mkdir()
    columns: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    for row, index in enumerate(order):
        item = dataset[index]
        tokens = torch.as_tensor(item["token_ids"], dtype=torch.long)
        stacked = torch.cat([item["hidden_states"][:, slot_index], item["last_hidden"].unsqueeze(1)], dim=1).contiguous()
        save_safetensors({"token_ids": tokens, "hidden_states": stacked}, tmp / "hidden_states" / f"hs_{row}.safetensors")
        columns["input_ids"].append(tokens.tolist())
        columns["loss_mask"].append([int(m) for m in torch.as_tensor(item["loss_mask"]).tolist()])
        columns["seq_len"].append(len(tokens))
    return columns


def _write_draft_vocab(dataset: Any, size: int, store: str, tmp: Path) -> None:
    """The peer's draft-vocabulary mappings (``d2t``/``t2d``) of ``--draft-vocab-size``, from the store's token counts."""
    from specdraft.models.common.vocab import build_draft_vocab

    counts = dataset.token_counts()
    if counts is None:
        raise SpecdraftError(
            f"draft_vocab_size {size} needs token counts (the prepared dataset's "
            f"token_counts.safetensors), which the store {store} does not reach"
        )
    d2t, t2d = build_draft_vocab(counts, size)
    _write_npy(tmp / f"d2t-{size}.npy", d2t.numpy())
    _write_npy(tmp / f"t2d-{size}.npy", t2d.numpy())
