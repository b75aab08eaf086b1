"""How much a validation split leaks into training: validation rows sharing a conversation or a prompt with a
training row, for the rule before ``train/split.py`` (a hash of the sample id alone) and for the split itself.

Why in the package: the figures behind the split's design (``benchmarks/split_leak.py``, ``split_tau.py``) are
tested here, and a test must not import a benchmark.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence

from specdraft.train.split import SplitKey, compute_split


def old_rule(sample_id: str, val_fraction: float) -> bool:
    """The split before train/split.py: a stable hash of the sample id alone."""
    return int.from_bytes(hashlib.sha256(sample_id.encode()).digest()[:8], "big") / 2.0**64 < val_fraction


def _training_side(keys: Sequence[SplitKey], val: set[int]) -> tuple[set[str], set[str]]:
    train = [k for i, k in enumerate(keys) if i not in val]
    return {k.group for k in train}, {k.prompt for k in train}


def leaks(keys: Sequence[SplitKey], val: set[int]) -> dict:
    groups, prompts = _training_side(keys, val)
    return {
        "validation_rows": len(val),
        "sharing_a_conversation_with_training": sum(1 for i in val if keys[i].group in groups),
        "sharing_a_prompt_with_training": sum(1 for i in val if keys[i].prompt in prompts),
        "sharing_either": len(val) - len(clean(keys, val)),
    }


def clean(keys: Sequence[SplitKey], val: set[int]) -> list[int]:
    """The validation rows that share neither a conversation nor a prompt with a training row."""
    groups, prompts = _training_side(keys, val)
    return sorted(i for i in val if keys[i].group not in groups and keys[i].prompt not in prompts)


def analyse(sample_ids: Sequence[str], keys: Sequence[SplitKey], *, val_fraction: float, seed: int) -> dict:
    """Old rule against the new split on one dataset's keys; ``old_validation``/``old_clean`` are indices."""
    sizes, prompts = Counter(k.group for k in keys), Counter(k.prompt for k in keys)
    old = {i for i, sid in enumerate(sample_ids) if old_rule(sid, val_fraction)}
    new_split = compute_split(list(sample_ids), keys, val_fraction=val_fraction, seed=seed)
    new = set(new_split.val)
    return {
        "rows": len(keys),
        "conversations": len(sizes),
        "rows_in_multi_row_conversations": sum(1 for k in keys if sizes[k.group] > 1),
        "rows_whose_prompt_opens_another_row": sum(1 for k in keys if prompts[k.prompt] > 1),
        "old": leaks(keys, old),
        "new": leaks(keys, new),
        "moved_validation_to_training": len(old - new),
        "moved_training_to_validation": len(new - old),
        "drawn_groups_kept_in_training": new_split.record["drawn_groups_kept_in_training"],
        "old_validation": sorted(old),
        "old_clean": clean(keys, old),
    }
