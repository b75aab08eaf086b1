"""DSpark, DFlash, DFlash2 and EAGLE-3, ours and speculators', at equal training tokens, several seeds, on decoded tau
(issues 29 and 41).

Protocol, all on one dataset's hidden states (``--store``; ``--stores`` gives a method whose layers it lacks, EAGLE-3's,
a store of the same samples, checked to split the same):

1. For every seed and every method (default: the registered decodable methods, ``peer_methods`` in
   ``integrations/speculators/data.py``, i.e. DFlash, DFlash2, DSpark, EAGLE-3) ``specdraft train --config METHOD --seed S``
   with the packaged recipe, ``--epochs`` passes over the same training split (``train/split.py``: whole
   conversations held out), so every run consumes the same training tokens (checked; the table states them).
2. For the methods in ``--peer-methods`` (default dflash2) speculators 0.9.0's own trainer too, on the same store,
   split and epochs, with ``--seed S`` and the shape our run trained (``peer_compare.train_peer``: the same harness as
   ``benchmarks/peer_compare.py``; EAGLE-3's unroll, loss decay and normalisation included).
3. Every checkpoint is decoded by specdraft's runtime, greedy, full-block verification:
   * ``tau val``: the store's first ``--val-prompts`` validation prompts x ``--val-tokens`` tokens (what
     ``specdraft train`` logs as ``tau_decoded``; ``peer_trainer.decode_validation``);
   * ``tau suite``: ``specdraft eval --suite SUITE --limit-per-domain N`` (one eval per seed holding every
     checkpoint, so all decode the same prompts), per domain.
   Beside them, labelled as such, the last *teacher-forced* validation figure our trainer logged (not a decode).

tau = committed tokens per verify round (bonus included). Training tokens/s is each trainer's step clock (see
``peer_compare.py``); absolute times are noisy on a shared machine, tau at equal tokens is the comparison.
Runs and decodes already finished under ``--out`` are reused (``--retrain`` redoes them), so seeds can run as separate
processes (``--seeds 0`` and ``--seeds 1``, same ``--out``; the peer's data is exported per method under
``OUT/peer-data``, reused by later seeds) and one ``--seeds 0,1`` run then merges them. Writes
``RESULTS.json``, ``.md`` and ``.png`` (``--results``, default ``OUT/method_compare``).

Run from the repository root in .venv (the peer trains in .venv-interop), e.g. (docs/results/method_compare.md)::

  PYTHONPATH=$PWD/src nice -n 15 .venv/bin/python benchmarks/method_compare.py --store STORE --out runs/mc \\
      --seeds 0,1 --epochs 1 --results docs/results/method_compare
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import reading_section
from peer_compare import INTEROP_PYTHON, defaults, suite_eval_runs, train_ours, train_peer
from peer_trainer import decode_validation

ROOT = Path(__file__).resolve().parent.parent


def split_of(dataset, split) -> tuple[list[str], list[str]]:
    """The training and validation sample ids of ``split`` of ``dataset``."""
    return [dataset.sample_ids[i] for i in split.train], [dataset.sample_ids[i] for i in split.val]


def method_stores(args: argparse.Namespace, methods: list[str], expected: tuple[list[str], list[str]]) -> dict[str, str]:
    """Each method's store (``--stores`` over ``--store``); every other store must split into ``expected``'s samples,
    so all methods train on the same tokens and are decoded on the same held-out conversations."""
    from specdraft.hidden_states.dataset import HiddenStateDataset
    from specdraft.train.split import dataset_split

    given = dict(item.split("=", 1) for item in args.stores.split(",") if item)
    unknown = sorted(set(given) - set(methods))
    if unknown:
        raise SystemExit(f"--stores names {unknown}, which --methods {','.join(methods)} does not train")
    for method, store in given.items():
        other = HiddenStateDataset(store)
        if split_of(other, dataset_split(other, val_fraction=args.val_fraction, seed=args.split_seed)) != expected:
            raise SystemExit(
                f"--stores {method}={store}: its samples or split differ from --store {args.store}'s; both must come from one dataset"
            )
    return {method: given.get(method, args.store) for method in methods}


def teacher_forced(run_dir: Path) -> dict:
    """The last validation record of our run's metrics.jsonl: teacher-forced figures (labelled so), not decoded."""
    from specdraft.train.model_card import last_validation

    record = last_validation(run_dir / "metrics.jsonl") or {}
    return {
        k: v
        for k, v in record.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and any(word in k for word in ("tau", "acc", "loss"))
    }


def suite_taus(args: argparse.Namespace, checkpoints: dict[str, str], out: Path) -> dict:
    """tau overall and per domain of every checkpoint (label -> directory) in one ``specdraft eval`` run (with
    ``--cached-only``, only an earlier run's: none for a seed whose suite eval did not finish)."""
    report = out / "report.json"
    if args.cached_only and not report.is_file():
        return {label: {} for label in checkpoints}
    runs = suite_eval_runs(args, list(checkpoints.values()), out)
    picked = {}
    for label, path in checkpoints.items():
        run = runs[f"{label.split('/')[-1]}:{Path(path).name}"]
        picked[label] = {
            "overall": run["overall"]["tau"],
            "rounds": run["overall"].get("rounds"),
            "per_domain": {d: m["tau"] for d, m in run["per_domain"].items() if m.get("rounds")},
        }
    return picked


def summarize(runs: list[dict]) -> list[dict]:
    """Mean and spread over seeds per (trainer, method)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for run in runs:
        groups.setdefault((run["trainer"], run["method"]), []).append(run)
    rows = []
    for (trainer, method), members in groups.items():
        row = {
            "trainer": trainer,
            "method": method,
            "seeds": [m["seed"] for m in members],
            "tokens": sorted({m["train"]["tokens"] for m in members}),
            "tokens_per_s": statistics.fmean(m["train"]["tokens_per_s"] for m in members),
        }
        for key, pick in (("tau_val", lambda m: m["val_tau"]["tau"]), ("tau_suite", lambda m: m["suite_tau"].get("overall"))):
            values = [v for v in map(pick, members) if v is not None]
            if values:
                row[key] = {
                    "mean": statistics.fmean(values),
                    "values": values,
                    "spread": (max(values) - min(values)) / 2 if len(values) > 1 else 0.0,
                }
        rows.append(row)
    return rows


def markdown(result: dict) -> str:
    p = result["protocol"]
    lines = [
        f"# {' vs '.join(p['methods'])} at equal training tokens (seeds {', '.join(map(str, p['seeds']))})",
        "",
        f"Store `{p['store']}`: {p['train_samples']} training / {p['val_samples']} validation samples (split by conversation), "
        f"{p['train_tokens_per_epoch']} training tokens per epoch; "
        + (
            f"every run {p['max_steps']} optimizer steps of one 2048-token packed row (train tokens per run in the table). "
            if p.get("max_steps")
            else f"{p['epochs']} epoch(s): every run trains on {p['train_tokens_per_epoch'] * p['epochs']} tokens. "
        )
        + f"Decoded greedily by specdraft's runtime, full-block verification: "
        f"tau val = the first {p['val_prompts']} validation prompts (all of them when fewer) x {p['val_tokens']} tokens; "
        + (
            f"tau suite = `--suite {p['suite']} --limit-per-domain {p['limit_per_domain']} --max-new-tokens {p['max_new_tokens']}`. "
            if p["suite"]
            else "no suite in this run. "
        )
        + f"Peer: speculators {p['peer_version']} trainer. {p['threads']} torch threads.",
        "",
        f"    {p['command']}",
        "",
    ]
    domains = sorted({d for r in result["runs"] for d in r["suite_tau"].get("per_domain", {})})
    lines += [
        "| method | trainer | seed | steps | train tokens | tokens/s | tau val (decoded) | rounds | tau suite (decoded) "
        "| tau val (teacher-forced) |" + "".join(f" {d} |" for d in domains),
        "| --- | --- | ---: |" + " ---: |" * (7 + len(domains)),
    ]
    for r in result["runs"]:
        t, s = r["train"], r["suite_tau"]
        tf = r.get("teacher_forced", {})
        tf_key = "tau_teacher_forced" if "tau_teacher_forced" in tf else None
        lines.append(
            f"| {r['method']} | {r['trainer']} | {r['seed']} | {t['steps']} | {int(t['tokens'])} | {t['tokens_per_s']:.0f} | "
            f"{r['val_tau']['tau']:.3f} | {r['val_tau'].get('rounds', '-')} | "
            + (f"{s['overall']:.3f}" if "overall" in s else "-")
            + " | "
            + (f"{tf[tf_key]:.3f}" if tf_key else "-")
            + " |"
            + "".join(f" {s['per_domain'][d]:.3f} |" if d in s.get("per_domain", {}) else " - |" for d in domains)
        )
    lines += [""] * bool(result.get("failures")) + [
        f"- {f['trainer']} {f['method']} seed {f['seed']} missing: {f['error']}" for f in result.get("failures", [])
    ]
    lines += [
        "",
        "Mean over seeds (+- half the range):",
        "",
        "| method | trainer | tau val (decoded) | tau suite (decoded) | tokens/s (mean) |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for row in result["summary"]:
        cell = lambda k: f"{row[k]['mean']:.3f} +- {row[k]['spread']:.3f}" if k in row else "-"  # noqa: E731
        lines.append(f"| {row['method']} | {row['trainer']} | {cell('tau_val')} | {cell('tau_suite')} | {row['tokens_per_s']:.0f} |")
    for method, rows in result.get("settings", {}).items():
        lines += ["", f"{method}: settings left at each trainer's own value (the shape is ours for both)", ""]
        lines += ["| setting | ours | peer |", "| --- | --- | --- |", *(f"| {k} | {a} | {b} |" for k, a, b in rows)]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = result["summary"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{r['method']}\n({r['trainer']})" for r in rows]
    for offset, key, name in ((-0.2, "tau_val", "validation prompts"), (0.2, "tau_suite", "domain suite")):
        xs = [i + offset for i in range(len(rows))]
        ax.bar(xs, [r.get(key, {}).get("mean", 0) for r in rows], 0.4, label=name)
        for x, r in zip(xs, rows):
            ax.scatter([x] * len(r.get(key, {}).get("values", [])), r.get(key, {}).get("values", []), color="k", s=8, zorder=3)
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylim(1.0, max([r.get(k, {}).get("mean", 1) for r in rows for k in ("tau_val", "tau_suite")] + [1.1]) * 1.05)
    ax.set_ylabel("decoded tau (greedy)")
    ax.set_title(f"equal training tokens ({', '.join(map(str, result['protocol']['tokens_seen']['ours']))}), seeds = dots")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def main() -> None:
    from specdraft.integrations.speculators.data import peer_methods

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="specdraft hidden-state store holding the methods' slots")
    parser.add_argument(
        "--stores",
        default="",
        help="METHOD=STORE,...: another store for these methods (EAGLE-3 reads other layers than the block drafters); "
        "each must hold the same samples, so every method trains and is decoded on the same split",
    )
    parser.add_argument("--target", default=None, help="the target's Hugging Face directory (default: the one the store recorded)")
    parser.add_argument("--out", required=True, help="work directory: seedS/ours-METHOD, seedS/peer-METHOD, eval-seedS")
    parser.add_argument("--results", default=None, help="path stem of the JSON/Markdown/PNG results (default OUT/method_compare)")
    parser.add_argument(
        "--methods", default=",".join(peer_methods()), help="methods trained by specdraft (default: every registered decodable method)"
    )
    parser.add_argument("--peer-methods", default="dflash2", help="methods also trained by speculators' trainer ('' for none)")
    parser.add_argument("--seeds", default="0,1", help="training seeds (ours: --seed; the peer: --seed)")
    parser.add_argument("--epochs", type=int, default=1, help="passes over the training split, every run")
    parser.add_argument(
        "--max-steps",
        type=int,
        default=0,
        help="instead of --epochs: this many optimizer steps of one 2048-token packed row, "
        "every run (ours: --max-steps, the peer: its --max-steps; the schedule spans them)",
    )
    parser.add_argument("--val-fraction", type=float, default=0.05)
    parser.add_argument("--split-seed", type=int, default=0)
    parser.add_argument(
        "--peer-anchors",
        choices=["matched", "default"],
        default="matched",
        help="the peer's --max-anchors: our run's mean blocks per step, or its default 512",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads of every training and decoding process")
    parser.add_argument("--lock", default=None, help="flock file held during each training run")
    parser.add_argument("--val-prompts", type=int, default=10)
    parser.add_argument("--val-tokens", type=int, default=64)
    parser.add_argument("--suite", default="domains", help="`specdraft eval --suite` prompts ('' to skip)")
    parser.add_argument("--limit-per-domain", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--ours-flags",
        default="--dtype fp32",
        help="further `specdraft train` flags of every run of ours (default: one compute dtype for all, not each run's own "
        "`auto` timing, which two runs measuring at once can settle differently)",
    )
    parser.add_argument("--retrain", action="store_true", help="redo runs already finished under --out")
    parser.add_argument(
        "--cached-only",
        action="store_true",
        help="report only the validation decodes and suite evals earlier runs finished (list the rest): what a cut-short run leaves",
    )
    parser.add_argument("--train-only", action="store_true", help="stop after training every run")
    parser.add_argument("--reading", type=Path, help="a Markdown file of what the table says, written under it as 'Reading'")
    args = parser.parse_args()

    from specdraft.hidden_states.dataset import HiddenStateDataset
    from specdraft.train.split import dataset_split

    dataset = HiddenStateDataset(args.store)
    args.target = args.target or dataset.target_info["path"]
    split = dataset_split(dataset, val_fraction=args.val_fraction, seed=args.split_seed)
    methods, peers = args.methods.split(","), [m for m in args.peer_methods.split(",") if m]
    stores = method_stores(args, methods, split_of(dataset, split))
    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.out)
    results = Path(args.results) if args.results else out / "method_compare"
    protocol = {
        "store": args.store,
        "stores": stores,
        "methods": methods,
        "peer_methods": peers,
        "seeds": seeds,
        "epochs": args.epochs,
        "train_samples": len(split.train),
        "val_samples": len(split.val),
        "train_tokens_per_epoch": sum(dataset.lengths()[i] for i in split.train),
        "max_steps": args.max_steps,
        "val_prompts": args.val_prompts,
        "val_tokens": args.val_tokens,
        "suite": args.suite,
        "limit_per_domain": args.limit_per_domain,
        "max_new_tokens": args.max_new_tokens,
        "threads": args.threads,
        "peer_anchors": args.peer_anchors,
        "ours_flags": args.ours_flags,
        "decode": "greedy, full-block verification, specdraft runtime",
        "command": " ".join(["benchmarks/method_compare.py", *sys.argv[1:]]),
        "peer_version": subprocess.run(
            [str(INTEROP_PYTHON), "-c", "import importlib.metadata as m; print(m.version('speculators'))"], capture_output=True, text=True
        ).stdout.strip(),
    }
    runs: list[dict] = []
    failures: list[dict] = []
    settings: dict[str, list] = {}  # method -> (setting, ours, peer) left at each trainer's own value (seed aside)
    steps = f"--max-steps {args.max_steps}" if args.max_steps else ""
    for seed in seeds:
        base = out / f"seed{seed}"
        trained: list[dict] = []
        for method in methods:
            ours_args = argparse.Namespace(
                **{
                    **vars(args),
                    "store": stores[method],
                    "ours_flags": f"--seed {seed} --decode-prompts 0 --eval-interval 0 {steps} {args.ours_flags}",
                }
            )  # decoded below
            ours = train_ours(method, ours_args, base / f"ours-{method}")
            trained.append(
                {
                    "seed": seed,
                    "method": method,
                    "trainer": "ours",
                    "train": ours,
                    "teacher_forced": teacher_forced(base / f"ours-{method}"),
                }
            )
            print(json.dumps(trained[-1]["train"]), flush=True)
            if method in peers:
                peer_args = argparse.Namespace(**{**vars(args), "store": stores[method]}, peer_flags=f"--seed {seed}")
                try:
                    trained.append(
                        {
                            "seed": seed,
                            "method": method,
                            "trainer": "peer",
                            "train": train_peer(method, peer_args, base / f"peer-{method}", ours),
                        }
                    )
                    if method not in settings:  # one seed's settings stand for all (each call runs the peer's resolver)
                        own = defaults(method, peer_args, base / f"ours-{method}", base / f"peer-{method}")
                        settings[method] = [row for row in own if row[0] != "seed"]
                except SystemExit as failed:  # the peer's failure is a result too (its log is named); ours go on
                    failures.append({"seed": seed, "method": method, "trainer": "peer", "error": str(failed)})
                    print(failures[-1], flush=True)
        if args.train_only:
            continue
        for run in list(trained):
            cached = base / f"val-{run['trainer']}-{run['method']}.json"  # one per checkpoint: a rerun (e.g. merging seeds) reuses it
            if args.cached_only and not cached.is_file():
                failures.append({"seed": seed, "method": run["method"], "trainer": run["trainer"], "error": "not decoded (--cached-only)"})
                trained.remove(run)
                continue
            if args.retrain or not cached.is_file():
                try:
                    decoded = decode_validation(
                        stores[run["method"]],
                        args.target,
                        Path(run["train"]["checkpoint"]),
                        val_fraction=args.val_fraction,
                        split_seed=args.split_seed,
                        prompts=args.val_prompts,
                        tokens=args.val_tokens,
                    )
                except Exception as failed:  # a peer checkpoint we cannot read is a result too; ours must decode
                    if run["trainer"] == "ours":
                        raise
                    failures.append({"seed": seed, "method": run["method"], "trainer": "peer", "error": f"decoding: {failed!r}"})
                    trained.remove(run)
                    continue
                cached.write_text(json.dumps(decoded))
            run["val_tau"] = json.loads(cached.read_text())
            print(run["trainer"], run["method"], seed, "tau val", run["val_tau"]["tau"], flush=True)
        suite_done = (out / f"eval-seed{seed}" / "report.json").is_file()
        if args.suite and args.cached_only and not suite_done:
            failures.append({"seed": seed, "method": "all", "trainer": "both", "error": "suite not evaluated (--cached-only)"})
        if args.suite and (suite_done or not args.cached_only):
            taus = suite_taus(args, {f"{r['trainer']}/{r['method']}": r["train"]["checkpoint"] for r in trained}, out / f"eval-seed{seed}")
            for run in trained:
                run["suite_tau"] = taus[f"{run['trainer']}/{run['method']}"]
        else:
            for run in trained:
                run["suite_tau"] = {}
        runs += trained
        result = {"protocol": protocol, "runs": runs, "summary": summarize(runs), "failures": failures, "settings": settings}
        write_results(results, result, args.reading)


def write_results(results: Path, result: dict, reading: Path | None = None) -> None:
    """JSON, Markdown and PNG of the runs so far (written after every seed, so a cut-short run leaves its finished seeds)."""
    seen = {trainer: sorted({r["train"]["tokens"] for r in result["runs"] if r["trainer"] == trainer}) for trainer in ("ours", "peer")}
    # ours count tokens exactly; the peer's are its step records' tokens/s x step time, rounded per step
    result["protocol"].update(equal_tokens=len(seen["ours"]) == 1, tokens_seen=seen)
    results.parent.mkdir(parents=True, exist_ok=True)
    results.with_suffix(".json").write_text(json.dumps(result, indent=1))
    results.with_suffix(".md").write_text("\n".join([markdown(result).rstrip(), "", *reading_section(reading)]).rstrip() + "\n")
    plot(result, results.with_suffix(".png"))
    print(markdown(result), flush=True)


if __name__ == "__main__":
    main()
