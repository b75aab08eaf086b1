"""The validation split: held-out samples that share neither a conversation nor a prompt with training.

Splitting by sample id leaked (issue 16): ShareGPT rows ``X_0``, ``X_1``, ... are pieces of one
conversation, and identical prompts ("continue", "more") get identical greedy replies, so a
"held-out" sample was often a copy of a training one and its tau read high. Here each sample has
two keys:

* its *group*, the conversation it was cut from (``data.sources.conversation_group``: one rule per
  row format, registered with the format);
* its *prompt*, what precedes its first reply: for a prepared sample the tokens before its first
  response token, for a raw row the messages ``prepare`` would render.

Samples sharing either key are linked, and a linked component stays on one side. A group is drawn
for validation when a hash of (``seed``, group) falls below ``val_fraction``; a component is held
out only if *every* group in it was drawn. So a prompt that also opens a training conversation keeps
all its conversations in training, and a group's draw never depends on the rest of the data: adding
rows can move a component from validation to training (a new link), never the other way. That is
what lets the ``sharegpt`` eval suite (``eval/suites.py``), computed over the whole ShareGPT file,
hold only prompts that are on the validation side of any run prepared from part of that file.

On a small dataset a nonzero ``val_fraction`` may draw no component at all: asking for validation and getting none
unsaid would leave the run unmeasured, so the component a slightly larger fraction would draw first is held out, with
a warning counting it (``split.json``: ``held_out_closest``); when every sample is linked into one component that is
refused instead.

``OUT/split.json`` records the split of a run (fraction, seed, the validation groups and ids, a
hash of both sides); a resumed run reuses it (see ``resolve_split``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdraft.errors import SpecdraftError, os_error_message, setting

if TYPE_CHECKING:
    from specdraft.hidden_states.source import SampleSource

log = logging.getLogger(__name__)

SPLIT_FILE = "split.json"
DEFAULT_VAL_FRACTION = 0.05  # TrainConfig's defaults; the ``sharegpt`` eval suite splits with them
DEFAULT_SPLIT_SEED = 0
SPLIT_FORMAT = "specdraft.split"
RULE = "conversation groups and prompts linked; a component is held out when all its groups hash below val_fraction"


@dataclass(frozen=True)
class SplitKey:
    group: str
    prompt: str  # a digest of the prompt (tokens or messages)


def draw(group: str, seed: int) -> float:
    """A stable pseudo-random number in [0, 1) per (seed, group), independent of order and data."""
    digest = hashlib.sha256(f"{int(seed)}\0{group}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def prompt_digest(value: Any) -> str:
    """Digest of a prompt: a token-id sequence or JSON-able messages."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    return hashlib.sha256(json.dumps(value, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:24]


def components(keys: Sequence[SplitKey]) -> list[int]:
    """Per sample: the root of its linked component (samples sharing a group or a prompt, transitively)."""
    parent = list(range(len(keys)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: dict[tuple[str, str], int] = {}
    for i, key in enumerate(keys):
        for link in (("g", key.group), ("p", key.prompt)):
            j = first.setdefault(link, i)
            if j != i:
                parent[find(i)] = find(j)
    return [find(i) for i in range(len(keys))]


def component_draws(keys: Sequence[SplitKey], seed: int) -> tuple[list[int], dict[int, float]]:
    """Each sample's component and each component's draw: the largest draw of its groups, so a component is held
    out exactly when its draw is below ``val_fraction`` (every group drawn)."""
    roots = components(keys)
    draws: dict[int, float] = {}
    for root, key in zip(roots, keys):
        draws[root] = max(draws.get(root, 0.0), draw(key.group, seed))
    return roots, draws


def held_out(keys: Sequence[SplitKey], val_fraction: float, seed: int) -> list[bool]:
    """Per sample: is it on the validation side? (the rule of the module docstring)."""
    roots, draws = component_draws(keys, seed)
    return [draws[root] < val_fraction for root in roots]


def prompt_length(mask: Any) -> int:
    """Tokens before the first response token (all of them when there is none)."""
    import torch

    hits = torch.as_tensor(mask).bool().nonzero()
    return int(hits[0]) if len(hits) else len(mask)


def sample_keys(dataset: SampleSource) -> list[SplitKey]:
    """The keys of every sample of a source, from its ``source_label(i)`` and ``token_row(i)``."""
    return [sample_key(str(sid), dataset.source_label(i), *dataset.token_row(i)) for i, sid in enumerate(dataset.sample_ids)]


def sample_key(sample_id: str, source: str, tokens: Any, mask: Any) -> SplitKey:
    """The key of one prepared sample: ``source`` its row's label, ``tokens``/``mask`` its ids and loss mask."""
    from specdraft.data.sources import conversation_group

    return SplitKey(conversation_group(sample_id, source), prompt_digest(tokens[: prompt_length(mask)]))


@dataclass
class Split:
    """Indices (into the source's ``sample_ids``) of the training and validation sides, and its record."""

    train: list[int]
    val: list[int]
    record: dict

    @property
    def hash(self) -> str:
        return self.record["hash"]


def _record(sample_ids: Sequence[str], keys: Sequence[SplitKey], val: list[int], val_fraction: float, seed: int) -> dict:
    val_set = set(val)
    h = hashlib.sha256()
    for i, sid in enumerate(sample_ids):
        h.update(f"{'V' if i in val_set else 'T'}:{sid}\n".encode())
    groups = {k.group for k in keys}
    val_groups = sorted({keys[i].group for i in val})
    linked_out = len({g for g in groups if draw(g, seed) < val_fraction} - set(val_groups))
    return {
        "format": SPLIT_FORMAT,
        "version": 1,
        "rule": RULE,
        "val_fraction": val_fraction,
        "seed": seed,
        "samples": len(sample_ids),
        "train_samples": len(sample_ids) - len(val),
        "validation_samples": len(val),
        "groups": len(groups),
        "validation_groups_count": len(val_groups),
        "drawn_groups_kept_in_training": linked_out,  # drawn, but linked by a prompt to a training group
        "hash": h.hexdigest()[:16],
        "validation_groups": val_groups,
        "validation_ids": sorted(str(sample_ids[i]) for i in val),
    }


def compute_split(sample_ids: Sequence[str], keys: Sequence[SplitKey], *, val_fraction: float, seed: int) -> Split:
    """The split of the module docstring; a nonzero ``val_fraction`` that draws nothing holds out one component
    (``_closest_component``): asking for validation and silently getting none would leave the run unmeasured."""
    flags = held_out(keys, val_fraction, seed) if val_fraction > 0 else [False] * len(keys)
    forced = val_fraction > 0 and not any(flags)
    if forced:
        flags = _closest_component(keys, val_fraction, seed)
    val = [i for i, f in enumerate(flags) if f]
    train = [i for i, f in enumerate(flags) if not f]
    record = _record(sample_ids, keys, val, val_fraction, seed)
    if forced:
        record["held_out_closest"] = True  # none drawn: the component nearest the draw holds out (the card says so)
    return Split(train, val, record)


def _closest_component(keys: Sequence[SplitKey], val_fraction: float, seed: int) -> list[bool]:
    """With ``val_fraction`` drawing no component (a small dataset): hold out the one a slightly larger fraction
    would draw first (the smallest draw) among those no larger than what stays in training, with a warning
    that counts it. Deterministic, so a resume recomputes it; it only adds validation samples, so a prompt the
    hash rule holds out anywhere is never moved into training. Refused when no such component exists (all
    samples linked into one), naming the numbers."""
    roots, draws = component_draws(keys, seed)
    sizes = Counter(roots)
    candidates = [root for root in draws if sizes[root] <= len(keys) - sizes[root]]
    groups = len({k.group for k in keys})
    if not candidates:
        raise SpecdraftError(
            f"{setting('val_fraction')} {val_fraction} holds out none of the {len(keys)} samples ({groups} conversation(s) linked by "
            f"shared prompts into {len(draws)} component(s), none of which leaves as many samples to train on): add samples, "
            f"or set {setting('val_fraction')} 0 to train on all of them without validation"
        )
    chosen = min(candidates, key=lambda root: (draws[root], root))
    log.warning(
        "%s %s drew none of the %d conversation(s) (%d samples) for validation; holding out the %d sample(s) a larger "
        "fraction would draw first (1 of %d linked components), so the run is measured; set it to 0 for no validation",
        setting("val_fraction"),
        val_fraction,
        groups,
        len(keys),
        sizes[chosen],
        len(draws),
    )
    return [root == chosen for root in roots]


def dataset_split(dataset: SampleSource, *, val_fraction: float, seed: int) -> Split:
    """The split of a ``SampleSource`` (what ``train``, ``calibrate`` and the benchmarks share)."""
    return compute_split(list(map(str, dataset.sample_ids)), sample_keys(dataset), val_fraction=val_fraction, seed=seed)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


#: The fields of split.json a resume reads (``resolve_split``): what each must be, whether records may lack it (written
#: before it was recorded), and its check. Checked once where the record is read, so a damaged one is one clear error.
_RECORD_FIELDS: dict[str, tuple[str, bool, Any]] = {
    "val_fraction": ("a number in [0, 1)", True, lambda v: _number(v) and 0 <= v < 1),
    "seed": ("an integer", True, lambda v: _number(v) and isinstance(v, int)),
    "validation_ids": ("a list of sample ids", True, _strings),
    "validation_groups": ("a list of conversation groups", False, _strings),
    "hash": ("a string", False, lambda v: isinstance(v, str)),
}


def read_split(path: Path) -> dict:
    """A run's split.json, refused (naming the file and field) unless every field a resume reads is what it must be."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        if os_error_message(exc):
            raise  # a denied read is no reason to delete the split: the CLI says what it is
        raise SpecdraftError(f"{path} is unreadable ({exc}); delete it to recompute the split (validation may then change)") from None
    redo = "delete it to recompute the split (validation may then change)"
    if not isinstance(record, dict) or record.get("format") != SPLIT_FORMAT:
        raise SpecdraftError(f"{path} is not a {SPLIT_FORMAT} record; {redo}")
    for name, (what, required, fits) in _RECORD_FIELDS.items():
        value = record.get(name)
        if value is None and required:
            raise SpecdraftError(f"{path} has no {name!r}; {redo}")
        if value is not None and not fits(value):
            raise SpecdraftError(f"{path} has {name!r} {json.dumps(value)[:60]}, not {what}; {redo}")
    return record


def resolve_split(dataset: SampleSource, *, val_fraction: float, seed: int, recorded: Path | None) -> Split:
    """The run's split: computed, or -- when ``recorded`` (a run's split.json) exists -- the recorded one.

    A resume on the same data recomputes the same split (same hash). If the data or settings changed,
    the recorded validation side is kept: recorded validation ids still in the store stay held out,
    new samples of a recorded validation group join them, every other sample trains (with a warning).
    """
    sample_ids = list(map(str, dataset.sample_ids))
    keys = sample_keys(dataset)
    if recorded is None or not Path(recorded).is_file():
        return compute_split(sample_ids, keys, val_fraction=val_fraction, seed=seed)
    record = read_split(recorded)
    fresh = compute_split(sample_ids, keys, val_fraction=record["val_fraction"], seed=record["seed"])
    if fresh.hash == record.get("hash"):
        if (record["val_fraction"], record["seed"]) != (val_fraction, seed):
            log.warning(
                "%s: keeping the recorded split (val_fraction %s, seed %s), not val_fraction %s, seed %s",
                recorded,
                record["val_fraction"],
                record["seed"],
                val_fraction,
                seed,
            )
        return fresh
    ids, groups = set(record["validation_ids"]), set(record.get("validation_groups") or ())
    val = [i for i, sid in enumerate(sample_ids) if sid in ids or keys[i].group in groups]
    log.warning(
        "%s: the data differ from the recorded split's (hash %s, now %s); keeping its validation side "
        "(%d of %d recorded ids present, %d samples held out)",
        recorded,
        record.get("hash"),
        fresh.hash,
        len(ids & set(sample_ids)),
        len(ids),
        len(val),
    )
    val_set = set(val)
    train = [i for i in range(len(sample_ids)) if i not in val_set]
    return Split(train, val, _record(sample_ids, keys, val, record["val_fraction"], record["seed"]))


def write_split(path: Path, split: Split, **extra: Any) -> None:
    from specdraft.utils.io import atomic_write_json

    atomic_write_json(Path(path), {**split.record, **extra})
