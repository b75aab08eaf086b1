"""How much the old validation split leaked, and what the new one moves, on a prepared dataset.

The old rule held a sample out when sha256(sample id) fell below ``val_fraction`` (each chunk of a
ShareGPT conversation on its own side); the new one is ``train/split.py``'s (whole conversations, no
prompt on both sides); the counting is ``train/split_audit.py``'s. For both the script counts validation rows that share a conversation or a
prompt with a training row, and how many rows changed side. Prints one JSON object, then a table.

  .venv/bin/python benchmarks/split_leak.py --data runs/ref/data
  .venv/bin/python benchmarks/split_leak.py --reference

``--reference`` rebuilds the rows of the shipped reference drafter's data without regenerating
(its build directories are gone): sample ids, sources and prompts do not depend on the replies, so
``data.prepare.select_samples`` with the build's settings gives them (``REFERENCE_SHARDS``; each shard
must end at the row the card says it read), and the prompt-token total is printed beside the card's.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

from specdraft.train.split_audit import analyse


@dataclass(frozen=True)
class Shard:
    """One ``prepare --regenerate`` of the reference build: ``max_samples`` prompts from the ``read`` rows
    after ``skip_rows``, ``kept`` of them regenerated before ``--regen-budget`` ran out. Which ones is not
    recorded anywhere left; taken to be the shortest (regeneration runs prompts shortest first,
    ``data/regenerate.py``), and ``prompt_tokens`` against ``card_prompt_tokens`` shows how far off that is."""

    skip_rows: int
    read: int
    max_samples: int
    kept: int
    engine: str


#: The reference drafter's data (src/specdraft/reference/smollm2-135m-dspark/MODEL_CARD.md): ShareGPT wheel rows
#: 0-714 (`--samples 640`, hf, no budget) joined with rows 715-2405 (`--samples 1500 --engine vllm --regen-budget 32`),
#: 1887 samples, first reply regenerated greedily with at most 256 new tokens, in regeneration batches of 32, samples
#: of at most 768 tokens (the build script's --max-length then).
REFERENCE_SHARDS = (Shard(0, 715, 640, 640, "hf"), Shard(715, 1691, 1500, 1887 - 640, "vllm"))
REFERENCE_PROMPT_TOKENS = 503552 - 360988  # the card's tokens minus its response tokens
REFERENCE_SETTINGS = {"max_new_tokens": 256, "batch_size": 32, "max_length": 768, "val_fraction": 0.05}


@dataclass(frozen=True)
class RebuiltSample:
    sample_id: str
    source: str
    prompt_ids: tuple[int, ...]
    engine: str  # what regenerated its reply in the reference build


def reference_samples(target: Any) -> list[RebuiltSample]:
    """The reference build's samples in dataset order, with their prompts (no reply generated).

    ``prepare`` then (before 1e81171) skipped rows without an assistant turn; it now regenerates them, so
    they are dropped here, and each shard must then end exactly at the last row the card says it read."""
    import itertools

    from specdraft.data.prepare import PrepareConfig, select_samples
    from specdraft.data.sources import conversation, first_reply_index, iter_rows

    out = []
    for shard in REFERENCE_SHARDS:
        rows = list(itertools.islice(iter_rows("sharegpt"), shard.skip_rows, shard.skip_rows + shard.read))
        replied = {r.sample_id for r in rows if first_reply_index(conversation(r.messages)) is not None}
        config = PrepareConfig(
            out="-",
            regenerate=True,
            skip_rows=shard.skip_rows,
            max_samples=2 * shard.max_samples,
            max_length=REFERENCE_SETTINGS["max_length"],
        )
        picked = [s for s in select_samples(config, target).samples if s.sample_id in replied][: shard.max_samples]
        if len(picked) != shard.max_samples or picked[-1].sample_id != rows[-1].sample_id:
            raise SystemExit(
                f"the rebuild of rows {shard.skip_rows}-{shard.skip_rows + shard.read - 1} does not end where the "
                f"reference build's did ({len(picked)} prompts, last {picked[-1].sample_id if picked else None})"
            )
        kept = {id(s) for s in sorted(picked, key=lambda s: len(s.input_ids))[: shard.kept]}  # the sort regenerate() uses
        out += [RebuiltSample(s.sample_id, s.source, tuple(s.input_ids), shard.engine) for s in picked if id(s) in kept]
    return out


def markdown(result: dict) -> str:
    lines = [
        "| split | validation rows | sharing a conversation with training | sharing a prompt | sharing either |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name in ("old", "new"):
        r = result[name]
        lines.append(
            f"| {name} | {r['validation_rows']} | {r['sharing_a_conversation_with_training']} | "
            f"{r['sharing_a_prompt_with_training']} | {r['sharing_either']} |"
        )
    lines.append(
        f"\n{result['rows']} rows, {result['conversations']} conversations; moved validation -> training "
        f"{result['moved_validation_to_training']}, training -> validation {result['moved_training_to_validation']}."
    )
    return "\n".join(lines)


def reference_keys(target: Any) -> tuple[list[RebuiltSample], list]:
    from specdraft.train.split import sample_key

    samples = reference_samples(target)
    return samples, [sample_key(s.sample_id, s.source, list(s.prompt_ids), [0] * len(s.prompt_ids)) for s in samples]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", help="prepared dataset directory (`specdraft prepare`)")
    source.add_argument("--reference", action="store_true", help="the reference drafter's data, rebuilt without regenerating")
    parser.add_argument("--val-fraction", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0, help="the new split's seed")
    args = parser.parse_args()

    if args.reference:
        from specdraft.targets import load_target

        samples, keys = reference_keys(load_target("smollm2-135m"))
        ids = [s.sample_id for s in samples]
        head = {
            "data": "reference build, rebuilt (benchmarks/split_leak.py REFERENCE_SHARDS)",
            "prompt_tokens": sum(len(s.prompt_ids) for s in samples),
            "card_prompt_tokens": REFERENCE_PROMPT_TOKENS,
        }
    else:
        from specdraft.data.dataset import PreparedDataset
        from specdraft.hidden_states.source import PreparedRows
        from specdraft.train.split import sample_keys

        prepared = PreparedDataset(args.data)
        ids = list(prepared.sample_ids)
        keys = sample_keys(PreparedRows(prepared))
        head = {"data": args.data}
    result = analyse(ids, keys, val_fraction=args.val_fraction, seed=args.seed)
    del result["old_validation"], result["old_clean"]
    print(json.dumps({**head, **result}, indent=1))
    print(markdown(result))


if __name__ == "__main__":
    main()
