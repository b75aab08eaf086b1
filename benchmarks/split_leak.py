"""How much the old validation split leaked, and what the new one moves, on a prepared dataset.

The old rule held a sample out when sha256(sample id) fell below ``val_fraction`` (each chunk of a
ShareGPT conversation on its own side); the new one is ``train/split.py``'s (whole conversations, no
prompt on both sides). For both the script counts validation rows that share a conversation or a
prompt with a training row, and how many rows changed side. Prints one JSON object.

  .venv/bin/python benchmarks/split_leak.py --data runs/ref/data
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections import Counter
from types import SimpleNamespace


def old_rule(sample_id: str, val_fraction: float) -> bool:
    """The split before train/split.py: a stable hash of the sample id alone."""
    return int.from_bytes(hashlib.sha256(sample_id.encode()).digest()[:8], "big") / 2.0**64 < val_fraction


def leaks(keys, val: set[int]) -> dict:
    train_groups = {k.group for i, k in enumerate(keys) if i not in val}
    train_prompts = {k.prompt for i, k in enumerate(keys) if i not in val}
    return {"validation_rows": len(val),
            "sharing_a_conversation_with_training": sum(1 for i in val if keys[i].group in train_groups),
            "sharing_a_prompt_with_training": sum(1 for i in val if keys[i].prompt in train_prompts)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="prepared dataset directory (`specdraft prepare`)")
    parser.add_argument("--val-fraction", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0, help="the new split's seed")
    args = parser.parse_args()

    from specdraft.data.dataset import PreparedDataset
    from specdraft.train.split import dataset_split, sample_keys

    prepared = PreparedDataset(args.data)
    dataset = SimpleNamespace(prepared=prepared, sample_ids=list(prepared.sample_ids))
    keys = sample_keys(dataset)
    sizes, prompts = Counter(k.group for k in keys), Counter(k.prompt for k in keys)
    old = {i for i, sid in enumerate(dataset.sample_ids) if old_rule(sid, args.val_fraction)}
    new_split = dataset_split(dataset, val_fraction=args.val_fraction, seed=args.seed)
    new = set(new_split.val)
    print(json.dumps({
        "data": args.data, "rows": len(keys), "conversations": len({k.group for k in keys}),
        "rows_in_multi_row_conversations": sum(1 for k in keys if sizes[k.group] > 1),
        "rows_whose_prompt_opens_another_row": sum(1 for k in keys if prompts[k.prompt] > 1),
        "old": leaks(keys, old), "new": leaks(keys, new),
        "moved_validation_to_training": len(old - new), "moved_training_to_validation": len(new - old),
        "drawn_groups_kept_in_training": new_split.record["drawn_groups_kept_in_training"],
    }, indent=1))


if __name__ == "__main__":
    main()
