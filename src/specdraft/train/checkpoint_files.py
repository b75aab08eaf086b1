"""A training run's files on disk: its directory layout and resumable checkpoints (safetensors + JSON, never pickle).

This is the format only: writing, verifying, reading, listing and pruning checkpoints, one process at a time.
Who writes them in a multi-process run, and from what state, is ``strategies.py``.

Layout of ``OUT``::

    config.resolved.yaml           every value the run used (written before training starts)
    metrics.jsonl                  one record per logged step / validation
    checkpoints/step-N/            config.json + model.safetensors   (the drafter, speculators format)
                                   trainer_state.safetensors          "model.<fqn>": trainable params and buffers
                                                                      (fp32, exactly as trained);
                                                                      "optim.<fqn>.<key>": AdamW state
                                   trainer_state.json                 step, data position, optimizer param
                                                                      groups, scheduler state, run identity
    final/                         the trained drafter (config.json + model.safetensors)

Every directory is built under a hidden temporary name and renamed into place, so a crash leaves
either the previous checkpoint or the complete new one; ``trainer_state.json`` is written last and
marks a checkpoint complete. It records the sha256 of every other file of its checkpoint
(``checksums``) and of its own content (``content_sha256``: the canonical JSON of all other keys),
all verified before a resume uses any of it; a state without them is refused. The trainer never
passes the frozen target tensors (embedding, LM head, final norm) here, so a resume keeps the
target's own. There is no RNG state to store: every random draw of a step is seeded from
(seed, rank, step) (``batches.step_seed``), so step N+1 after a resume draws exactly what it would
have drawn in an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from specdraft.errors import SpecdraftError, os_error_message
from specdraft.models.base import DrafterModel
from specdraft.models.common.checkpoint import CONFIG_FILE, WEIGHTS_FILE
from specdraft.utils.io import DirKind, atomic_dir, atomic_write_json, json_field_is, save_safetensors, sha256_bytes, sha256_file

STATE_FORMAT = "specdraft.trainer_state"
STATE_VERSION = 1
STATE_JSON = "trainer_state.json"
STATE_TENSORS = "trainer_state.safetensors"
CHECKPOINTS = "checkpoints"
FINAL = "final"
RESOLVED_CONFIG = "config.resolved.yaml"
METRICS = "metrics.jsonl"
_STEP_DIR = re.compile(r"^step-(\d+)$")
CHECKPOINT_DIR = DirKind(
    "training checkpoint",
    STATE_JSON,
    json_field_is("format", STATE_FORMAT),
    frozenset({CONFIG_FILE, WEIGHTS_FILE, STATE_JSON, STATE_TENSORS}),
)

#: Fields of the run identity that must match to resume: changing them would train a different model, or go on
#: training it on samples of another kind (``hidden_states``: the store's dtypes, ``SampleSource.made_with``).
IDENTITY_KEYS = ("method", "model_config", "target_fingerprint", "slots", "hidden_states")


def list_checkpoints(out: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``OUT/checkpoints`` as (step, dir), oldest first."""
    root = Path(out) / CHECKPOINTS
    found = []
    if root.is_dir():
        for child in root.iterdir():
            m = _STEP_DIR.match(child.name)
            if m and (child / STATE_JSON).is_file() and (child / STATE_TENSORS).is_file():
                found.append((int(m.group(1)), child))
    return sorted(found)


def latest_checkpoint(out: str | os.PathLike) -> Path | None:
    """The newest ``OUT/checkpoints/step-N``, complete or not: the one a resume starts from. An incomplete one (no
    write of ours leaves one: each is renamed into place whole) is not skipped for an older one, since the resumed
    run would reach step N again and could not replace it; ``read_state`` refuses it, naming it."""
    root = Path(out) / CHECKPOINTS
    if not root.is_dir():
        return None
    steps = sorted((int(m.group(1)), child) for child in root.iterdir() if (m := _STEP_DIR.match(child.name)))
    return steps[-1][1] if steps else None


_DELETE_HINT = "delete that checkpoint directory to resume from an older one"


def _content_sha256(state: dict) -> str:
    return sha256_bytes(json.dumps({k: v for k, v in state.items() if k != "content_sha256"}, sort_keys=True).encode())


def read_state(directory: str | os.PathLike) -> dict:
    """``trainer_state.json``, its own checksum and those of the checkpoint's other files verified."""
    directory = Path(directory)
    path = directory / STATE_JSON
    if not path.exists():
        raise SpecdraftError(f"{directory} is not a complete checkpoint: its {STATE_JSON}, written last, is missing; {_DELETE_HINT}")
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as exc:  # ValueError: bad JSON or bytes that are not UTF-8
        if os_error_message(exc):
            raise  # a denied read is no reason to delete the checkpoint: the CLI says what it is
        raise SpecdraftError(f"cannot read checkpoint state {path}: {exc}; {_DELETE_HINT}") from None
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT or state.get("version") != STATE_VERSION:
        found = (state.get("format"), state.get("version")) if isinstance(state, dict) else (type(state).__name__, None)
        raise SpecdraftError(f"{path} is not a {STATE_FORMAT} v{STATE_VERSION} file (found {found[0]!r} v{found[1]!r})")
    checksums = state.get("checksums")
    if not isinstance(checksums, dict) or not isinstance(state.get("content_sha256"), str):
        raise SpecdraftError(
            f"{path} records no checksums (written by a specdraft release before they were recorded, or edited), so the "
            "checkpoint cannot be verified; finish that run with the release that wrote it, or start a new --out"
        )
    if _content_sha256(state) != state["content_sha256"]:
        raise SpecdraftError(f"{path} is corrupt: its content does not match the content_sha256 it records; {_DELETE_HINT}")
    for name in (STATE_TENSORS, CONFIG_FILE, WEIGHTS_FILE):
        file = directory / name
        if name not in checksums:
            raise SpecdraftError(f"{path} records no checksum of {name}; {_DELETE_HINT}")
        if not file.is_file():
            raise SpecdraftError(f"{file} is missing; {_DELETE_HINT}")
        digest = sha256_file(file)
        if digest != checksums[name]:
            raise SpecdraftError(
                f"{file} is corrupt: its sha256 is {digest[:16]}..., but {STATE_JSON} records "
                f"{str(checksums[name])[:16]}...; {_DELETE_HINT}"
            )
    return state


def check_identity(saved: dict, current: dict, *, where: Path) -> None:
    """Refuse to resume a run whose method/model/target/layers/hidden states differ from the checkpoint's, naming each
    changed setting with both values (a mapping by its keys: ``model_config.block_size``). What one side does not
    record is not compared: a field saved before it was recorded, a key of a mapping only one side has (a store's
    dtypes where its writer recorded them: a hybrid run's cache resumed offline)."""
    keys, lines = [], []
    for key in (k for k in IDENTITY_KEYS if k in saved):
        was, now = _jsonable(saved[key]), _jsonable(current.get(key))
        pairs = (
            [(f"{key}.{k}", was[k], now[k]) for k in sorted(was.keys() & now.keys()) if was[k] != now[k]]
            if isinstance(was, dict) and isinstance(now, dict)
            else [(key, was, now)]
            if was != now
            else []
        )
        if pairs:
            keys.append(key)
            lines += [
                f"{name}: checkpoint has {json.dumps(a, sort_keys=True)}, now {json.dumps(b, sort_keys=True)}" for name, a, b in pairs
            ]
    if keys:
        raise SpecdraftError(
            f"cannot resume from {where}: the run's {', '.join(keys)} changed ({'; '.join(lines)}). "
            "Use a new --out directory, or restore the original settings to continue this run"
        )


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, sort_keys=True, default=str))


def save_checkpoint(
    directory: Path,
    *,
    drafter: DrafterModel,
    model_state: dict[str, torch.Tensor],
    optim_state: dict,
    scheduler_state: dict,
    meta: dict,
) -> None:
    """Write one complete checkpoint directory atomically (``trainer_state.json`` last)."""
    tensors: dict[str, torch.Tensor] = {f"model.{k}": v for k, v in model_state.items()}
    groups = []
    for group in optim_state["param_groups"]:
        groups.append({k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items()})
    for name, state in optim_state["state"].items():
        for key, value in state.items():
            tensors[f"optim.{name}.{key}"] = torch.as_tensor(value)
    tensors = {k: v.detach().cpu().clone().contiguous() for k, v in tensors.items()}
    with atomic_dir(directory, CHECKPOINT_DIR) as tmp:
        drafter.save_pretrained(tmp)
        save_safetensors(tensors, tmp / STATE_TENSORS)
        state = _jsonable(
            {
                "format": STATE_FORMAT,
                "version": STATE_VERSION,
                **meta,
                "optimizer": {"param_groups": groups},
                "scheduler": scheduler_state,
                "rng": {"scheme": "every random draw of step N on rank r is seeded from (seed, r, N)", "seed": meta["config"]["seed"]},
                "checksums": {name: sha256_file(tmp / name) for name in (STATE_TENSORS, CONFIG_FILE, WEIGHTS_FILE)},
            }
        )
        atomic_write_json(tmp / STATE_JSON, {**state, "content_sha256": _content_sha256(state)})


def load_tensors(directory: Path, state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """(model state, optimizer state in the FQN-keyed form of ``torch.distributed.checkpoint``);
    ``state`` is ``read_state(directory)``, which verified the checksums of the files read here."""
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(directory / STATE_TENSORS))
    except Exception as exc:  # noqa: BLE001  (safetensors raises its own error types, not OSError subclasses)
        raise SpecdraftError(f"cannot read {directory / STATE_TENSORS}: {exc}; {_DELETE_HINT}") from None
    model = {k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")}
    optim_state: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in tensors.items():
        if k.startswith("optim."):
            name, _, key = k[len("optim.") :].rpartition(".")
            optim_state.setdefault(name, {})[key] = v
    groups = [dict(g, betas=tuple(g["betas"])) if "betas" in g else dict(g) for g in state["optimizer"]["param_groups"]]
    return model, {"state": optim_state, "param_groups": groups}


def remove_debris(out: Path) -> int:
    """Delete temporary directories left by writes that a hard kill interrupted; returns how many."""
    removed = 0
    for parent in (out, out / CHECKPOINTS):
        if parent.is_dir():
            for child in parent.iterdir():
                name = child.name
                if not (name.startswith(".") and (name.endswith((".tmp", ".old")) or ".old-" in name)):
                    continue
                if child.is_dir():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    child.unlink(missing_ok=True)
                removed += 1
    return removed


def prune_checkpoints(out: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints (``keep == 0`` keeps all)."""
    if keep <= 0:
        return
    for _, path in list_checkpoints(out)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
