"""The peers' recipe advances as flags, each against the current recipe at equal training tokens and seeds (issue 41,
item 2).

Every candidate is ``specdraft train --config METHOD`` (the packaged recipe) plus the one flag in ``CANDIDATES``;
``default`` adds none. All runs read one hidden-state store and split (``train/split.py``), train the same ``--epochs``
(or ``--max-steps``), and are decoded greedily by specdraft's runtime on the first ``--val-prompts`` validation prompts
(``peer_trainer.decode_validation``, what ``method_compare.py`` reports as ``tau val``). Training and decoding go through
``method_compare.py``'s harness (``train_ours``, ``decode_validation``, ``summarize``); runs and decodes finished under
``--out`` are reused, so seeds can run as separate processes and a last run merges them.

A candidate is marked **adopt** only where every seed's decoded tau is above every seed of ``default`` (its mean gain
exceeds the two seed spreads, half-ranges, together); the per-seed paired gain (same seed: same initialisation and data
order) is listed beside it. Writes ``RESULTS.json`` and ``.md`` (``--results``, default ``OUT/recipe_ablation``), e.g.::

  PYTHONPATH=$PWD/src nice -n 15 .venv/bin/python benchmarks/recipe_ablation.py --store STORE --out runs/ra \\
      --seeds 0,1 --epochs 1 --results docs/results/recipe_ablation
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import reading_section
from method_compare import summarize, teacher_forced
from peer_compare import train_ours
from peer_trainer import decode_validation

#: candidate -> the `specdraft train` flags it adds to the method's packaged recipe (speculators 0.9.0 and SpecForge's
#: recipe advances; models/common/distill_losses.py, train/optimizers.py)
CANDIDATES = {
    "default": "",
    "tv": "--distill-loss tv",
    "lk": "--distill-loss lk",
    "lk_hybrid": "--distill-loss lk_hybrid",
    "reverse_kl": "--distill-loss reverse_kl",
    "jsd": "--distill-loss jsd",
    "kl": "--distill-loss kl",
    "muon": "--optimizer muon",
    # EAGLE-3 only: Eagle 3.1's normalisations (models/eagle3/config.py), as its paper has them and as speculators'
    # eagle3 trains by default, and the fed-back output norm alone
    "eagle3.1": "--model fc_norm=true,norm_output=true",
    "norm_before_fc": "--model norm_before_fc=true,norm_output=true",
    "norm_output": "--model norm_output=true",
}


def verdicts(rows: list[dict], runs: list[dict]) -> list[dict]:
    """Each candidate's gain over ``default``: mean, per seed (paired), and adopt or keep."""
    base = next((r for r in rows if r["trainer"] == "default"), None)
    by_seed = {(r["trainer"], r["seed"]): r["val_tau"]["tau"] for r in runs}
    out = []
    for row in rows:
        if base is None or row["trainer"] == "default" or "tau_val" not in row:
            continue
        c, d = row["tau_val"], base["tau_val"]
        paired = {s: by_seed[(row["trainer"], s)] - by_seed[("default", s)] for s in row["seeds"] if ("default", s) in by_seed}
        adopt = len(c["values"]) > 1 and len(d["values"]) > 1 and min(c["values"]) > max(d["values"])
        out.append({"candidate": row["trainer"], "gain": c["mean"] - d["mean"], "paired": paired, "adopt": adopt})
    return out


def markdown(result: dict) -> str:
    p = result["protocol"]
    budget = f"{p['max_steps']} optimizer steps" if p["max_steps"] else f"{p['epochs']} epoch(s)"
    lines = [
        f"# Recipe ablation: {p['method']}, candidates against the packaged recipe (seeds {', '.join(map(str, p['seeds']))})",
        "",
        f"Store `{p['store']}`: {p['train_samples']} training / {p['val_samples']} validation samples (split by conversation), "
        f"{p['train_tokens_per_epoch']} training tokens per epoch; every run {budget} (train tokens in the table). Decoded "
        f"greedily by specdraft's runtime, full-block verification, on the first {p['val_prompts']} validation prompts "
        f"(all of them when fewer) x {p['val_tokens']} tokens. {p['threads']} torch thread(s) per process.",
        "",
        f"    {p['command']}",
        "",
        "| candidate | flags | seed | steps | train tokens | tokens/s | tau val (decoded) | rounds | tau val (teacher-forced) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["runs"]:
        t, tf = r["train"], r.get("teacher_forced", {})
        lines.append(
            f"| {r['trainer']} | `{CANDIDATES[r['trainer']] or '(none)'}` | {r['seed']} | {t['steps']} | {int(t['tokens'])} | "
            f"{t['tokens_per_s']:.0f} | {r['val_tau']['tau']:.3f} | {r['val_tau'].get('rounds', '-')} | "
            + (f"{tf['tau_teacher_forced']:.3f}" if "tau_teacher_forced" in tf else "-")
            + " |"
        )
    lines += ["", "Mean over seeds (+- half the range), and the gain over `default`:", ""]
    lines += ["| candidate | tau val (decoded) | gain | gain per seed (paired) | verdict |", "| --- | ---: | ---: | --- | --- |"]
    gains = {v["candidate"]: v for v in result["verdicts"]}
    for row in result["summary"]:
        if "tau_val" not in row:
            continue
        v = gains.get(row["trainer"])
        paired = ", ".join(f"s{s}: {g:+.3f}" for s, g in v["paired"].items()) if v else "-"
        verdict = "-" if v is None else ("adopt" if v["adopt"] else "keep default")
        gain = f"{v['gain']:+.3f}" if v else "-"
        lines.append(
            f"| {row['trainer']} | {row['tau_val']['mean']:.3f} +- {row['tau_val']['spread']:.3f} | {gain} | {paired} | {verdict} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="specdraft hidden-state store holding the method's slots")
    parser.add_argument("--target", default=None, help="the target's Hugging Face directory (default: the one the store recorded)")
    parser.add_argument("--out", required=True, help="work directory: seedS/CANDIDATE, seedS/val-CANDIDATE.json")
    parser.add_argument("--results", default=None, help="path stem of the JSON/Markdown results (default OUT/recipe_ablation)")
    parser.add_argument("--method", default="dspark", help="the packaged recipe every candidate starts from")
    parser.add_argument("--candidates", default=",".join(CANDIDATES), help=f"comma list of {', '.join(CANDIDATES)}")
    parser.add_argument("--seeds", default="0,1", help="training seeds (--seed)")
    parser.add_argument("--epochs", type=int, default=1, help="passes over the training split, every run")
    parser.add_argument("--max-steps", type=int, default=0, help="instead of --epochs: this many optimizer steps, every run")
    parser.add_argument("--val-fraction", type=float, default=0.05)
    parser.add_argument("--split-seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every training and decoding process")
    parser.add_argument("--lock", default=None, help="flock file held during each training run")
    parser.add_argument("--val-prompts", type=int, default=16)
    parser.add_argument("--val-tokens", type=int, default=64)
    parser.add_argument("--ours-flags", default="--dtype fp32", help="further `specdraft train` flags of every run")
    parser.add_argument("--retrain", action="store_true", help="redo runs already finished under --out")
    parser.add_argument("--reading", type=Path, help="a Markdown file of what the table says, written under it as 'Reading'")
    args = parser.parse_args()

    from specdraft.errors import SpecdraftError
    from specdraft.hidden_states.dataset import HiddenStateDataset
    from specdraft.train.split import dataset_split

    candidates = args.candidates.split(",")
    unknown = [c for c in candidates if c not in CANDIDATES]
    if unknown:
        raise SpecdraftError(f"--candidates: unknown {unknown}; choose from {', '.join(CANDIDATES)}")
    dataset = HiddenStateDataset(args.store)
    args.target = args.target or dataset.target_info["path"]
    split = dataset_split(dataset, val_fraction=args.val_fraction, seed=args.split_seed)
    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.out)
    results = Path(args.results) if args.results else out / "recipe_ablation"
    protocol = {
        "store": args.store,
        "method": args.method,
        "candidates": {c: CANDIDATES[c] for c in candidates},
        "seeds": seeds,
        "epochs": args.epochs,
        "max_steps": args.max_steps,
        "train_samples": len(split.train),
        "val_samples": len(split.val),
        "train_tokens_per_epoch": sum(dataset.lengths()[i] for i in split.train),
        "val_prompts": args.val_prompts,
        "val_tokens": args.val_tokens,
        "threads": args.threads,
        "ours_flags": args.ours_flags,
        "decode": "greedy, full-block verification, specdraft runtime",
        "command": shlex.join(["benchmarks/recipe_ablation.py", *sys.argv[1:]]),
    }
    steps = f"--max-steps {args.max_steps}" if args.max_steps else ""
    runs: list[dict] = []
    for candidate in candidates:  # candidates outer: a cut-short run leaves whole candidates, every seed
        for seed in seeds:
            run_dir = out / f"seed{seed}" / candidate
            flags = f"--seed {seed} --decode-prompts 0 --eval-interval 0 {steps} {CANDIDATES[candidate]} {args.ours_flags}"
            trained = train_ours(args.method, argparse.Namespace(**{**vars(args), "ours_flags": flags}), run_dir)
            cached = out / f"seed{seed}" / f"val-{candidate}.json"
            if args.retrain or not cached.is_file():
                decoded = decode_validation(
                    args.store,
                    args.target,
                    Path(trained["checkpoint"]),
                    val_fraction=args.val_fraction,
                    split_seed=args.split_seed,
                    prompts=args.val_prompts,
                    tokens=args.val_tokens,
                )
                cached.write_text(json.dumps(decoded))
            runs.append(
                {
                    "seed": seed,
                    "method": args.method,
                    "trainer": candidate,  # summarize() groups by (trainer, method): here the candidate
                    "train": trained,
                    "teacher_forced": teacher_forced(run_dir),
                    "val_tau": json.loads(cached.read_text()),
                    "suite_tau": {},
                }
            )
            print(candidate, seed, "tau val", runs[-1]["val_tau"]["tau"], flush=True)
            summary = summarize(runs)
            result = {"protocol": protocol, "runs": runs, "summary": summary, "verdicts": verdicts(summary, runs)}
            results.parent.mkdir(parents=True, exist_ok=True)
            results.with_suffix(".json").write_text(json.dumps(result, indent=1))
            results.with_suffix(".md").write_text(
                "\n".join([markdown(result).rstrip(), "", *reading_section(args.reading)]).rstrip() + "\n"
            )
    print(markdown(result), flush=True)


if __name__ == "__main__":
    main()
