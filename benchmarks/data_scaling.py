"""How much data do I need? Decoded tau of the default recipe against training tokens and epochs (issue 41, item 3).

Protocol, all on one hidden-state store:

1. One held-out set, chosen once: the validation side of ``train/split.py``'s split of the whole store
   (``--val-fraction``, ``--split-seed``: whole conversations, no prompt on both sides). No training subset holds
   any of it.
2. The training side's conversations in one seeded order (``--subset-seed``); the subset for T tokens is the
   shortest prefix of that order holding at least T tokens, so the subsets are nested (whole conversations:
   a point's actual tokens, in the table, end a conversation past T). Each subset is a store of its own under
   ``OUT/subsets`` (the manifest listing its samples, the payloads linked to the full store's).
3. Every point ``specdraft train --config RECIPE`` (same ``--seed``; ``--epochs`` as the point says) on its subset
   with ``--val-fraction 0`` (the whole subset trains; the held-out set is scored here, from the full store).
4. Every final checkpoint is scored on the held-out set as ``benchmarks/split_tau.py`` scores one (``score``):
   **decoded** tau (specdraft's runtime, greedy, full verification: the first ``--decode-prompts`` held-out prompts x
   ``--decode-tokens`` tokens, what ``specdraft train`` logs as ``tau_decoded``) and, labelled as such, the
   **teacher-forced** estimate over every held-out row.
5. Fit over the 1-epoch points: decoded tau(T) = tau_inf - a * T^(-b) (scipy's ``curve_fit``), "flattens at" = the
   T beyond which doubling the data adds < ``--flat-gain`` tau; and for the epoch points (``--epoch-tokens``) the
   tokens of fresh data an epoch count is worth (the fit inverted), as a multiplier of the data.

A point already finished under ``--out`` is reused (its checkpoint and its score), so a cut-short run resumes and
a rerun with more points adds only those. ``--package-fit`` writes the fit where ``specdraft train`` reads its
predicted tau (``src/specdraft/reference/scaling/data_scaling.json``, ``train/predicted_tau.py``). Writes
``RESULTS.json``, ``.md`` and ``.png`` (``--results``, default ``OUT/data_scaling``).

  PYTHONPATH=$PWD/src nice -n 10 .venv/bin/python benchmarks/data_scaling.py --store runs/scale/hidden_states \\
      --out runs/scale --tokens 10000,30000,100000,300000 --epoch-tokens 30000 --epochs 1,2,3 \\
      --results docs/results/data_scaling --package-fit
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_compare import train_ours
from split_tau import score

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_FIT = ROOT / "src/specdraft/reference/scaling/data_scaling.json"


def conversation_order(dataset, indices: list[int], seed: int) -> list[list[int]]:
    """The samples of ``indices`` grouped by conversation (``split.sample_keys``), groups in a seeded order."""
    from specdraft.train.split import sample_keys

    keys = sample_keys(dataset)
    groups: dict[str, list[int]] = {}
    for i in indices:
        groups.setdefault(keys[i].group, []).append(i)
    names = sorted(groups)
    random.Random(seed).shuffle(names)
    return [groups[name] for name in names]


def nested_subset(order: list[list[int]], lengths: list[int], tokens: int) -> list[int]:
    """The shortest prefix of conversations ``order`` holding at least ``tokens`` tokens (sample indices)."""
    chosen, total = [], 0
    for members in order:
        if total >= tokens:
            break
        chosen += members
        total += sum(lengths[i] for i in members)
    if total < tokens:
        raise SystemExit(f"--tokens {tokens}: the store's training side holds only {total} tokens; prepare more data or drop the point")
    return sorted(chosen)


def subset_store(store: Path, sample_ids: list[str], out: Path) -> Path:
    """A store of ``sample_ids`` only: the full store's manifest listing them, payloads linked (no copies)."""
    from specdraft.hidden_states.backends.file import MANIFEST_FILE, FileBackend

    full, sub = FileBackend(store, create=False), FileBackend(out)
    manifest = json.loads((store / MANIFEST_FILE).read_text())
    for sid in sample_ids:
        link = sub.path(sid)
        if not link.exists():
            link.symlink_to(full.path(sid).resolve())
    sub.write_manifest({**manifest, "samples": list(sample_ids), "count": len(sample_ids)})
    return out


def run_point(args: argparse.Namespace, held_out: dict, order: list[list[int]], dataset, tokens: int, epochs: int) -> dict:
    """Train (unless finished) and score (unless scored) one point; its record, cached in ``OUT/runs/NAME.json``."""
    name = f"T{tokens}-e{epochs}"
    cached = Path(args.out) / "runs" / f"{name}.json"
    if cached.is_file():
        return json.loads(cached.read_text())
    indices = nested_subset(order, dataset.lengths(), tokens)
    ids = [str(dataset.sample_ids[i]) for i in indices]
    sub = subset_store(Path(args.store), ids, Path(args.out) / "subsets" / f"T{tokens}")
    run_args = argparse.Namespace(
        store=str(sub),
        epochs=epochs,
        val_fraction=0.0,
        split_seed=args.split_seed,
        threads=args.threads,
        ours_flags=f"--seed {args.seed} --eval-interval 0 --checkpoint-interval 0 --decode-prompts 0 {args.train_flags}",
        retrain=False,
        lock=args.lock,
    )
    train = train_ours(args.recipe, run_args, Path(args.out) / "runs" / name)
    record = {
        "name": name,
        "target_tokens": tokens,
        "epochs": epochs,
        "samples": len(ids),
        "conversations": sum(1 for members in order if set(members) <= set(indices)),
        "unique_tokens": sum(dataset.lengths()[i] for i in indices),
        "train": train,
        **scored(args, held_out, Path(train["checkpoint"])),
    }
    cached.write_text(json.dumps(record, indent=1))
    return record


def scored(args: argparse.Namespace, held_out: dict, checkpoint: Path) -> dict:
    """Decoded and teacher-forced tau of ``checkpoint`` on the held-out set (``split_tau.score``)."""
    from specdraft.models import load_drafter
    from specdraft.train.batches import select_slots

    dataset, target = held_out["dataset"], held_out["target"]
    drafter = load_drafter(checkpoint, target=target).eval()
    slot_index = select_slots(dataset.slots, drafter.config.slots(), where=args.store)
    result = score(
        dataset, held_out["indices"], drafter, target, slot_index, decode_prompts=args.decode_prompts, decode_tokens=args.decode_tokens
    )
    return {
        "tau_decoded": result["decoded"]["tau"],
        "decoded": result["decoded"],
        "tau_teacher_forced": result["teacher_forced_all"]["tau"],
        "teacher_forced_rows": result["teacher_forced_all"]["packed_rows"],
    }


def power_law(tokens, tau_inf, a, b):
    return tau_inf - a * tokens ** (-b)


def fit_curve(points: list[dict], epoch_points: list[dict], flat_gain: float) -> dict | None:
    """tau(T) = tau_inf - a T^-b over the 1-epoch points (T = unique training tokens), where it flattens, and the
    fresh-data multiplier of each epoch count at the epoch points' size (the fit inverted)."""
    import numpy as np
    from scipy.optimize import curve_fit

    if len(points) < 3:
        return None
    xs = np.array([p["unique_tokens"] for p in points], dtype=float)
    ys = np.array([p["tau_decoded"] for p in points], dtype=float)
    start = (ys.max() + 0.05, (ys.max() - ys.min() + 0.05) * np.sqrt(np.median(xs)), 0.5)  # b = 0.5 spans the measured rise
    (tau_inf, a, b), cov = curve_fit(power_law, xs, ys, p0=start, bounds=([1.0, 0.0, 0.01], [10.0, np.inf, 3.0]), maxfev=20000)
    residuals = ys - power_law(xs, tau_inf, a, b)
    # doubling T adds a T^-b (1 - 2^-b): below flat_gain past this T
    flattens = (a * (1 - 2 ** (-b)) / flat_gain) ** (1 / b) if a > 0 else None
    multipliers = {}
    base = next((p for p in epoch_points if p["epochs"] == 1), None)
    for p in epoch_points:
        if base is not None and p["tau_decoded"] < tau_inf and base["tau_decoded"] < tau_inf:
            effective = (a / (tau_inf - p["tau_decoded"])) ** (1 / b)
            effective_one = (a / (tau_inf - base["tau_decoded"])) ** (1 / b)
            multipliers[str(p["epochs"])] = round(float(effective / effective_one), 3)
    return {
        "form": "tau_decoded(T) = tau_inf - a * T^(-b), T = unique training tokens, 1 epoch",
        "tau_inf": round(float(tau_inf), 4),
        "a": float(a),
        "b": round(float(b), 4),
        "parameter_sd": [float(s) if math.isfinite(s) else None for s in np.sqrt(np.diag(cov))],
        "points": len(points),
        "degrees_of_freedom": len(points) - 3,
        "residuals": [round(float(r), 4) for r in residuals],
        "tokens_range": [int(xs.min()), int(xs.max())],
        "flat_gain": flat_gain,
        "flattens_at_tokens": round(float(flattens)) if flattens else None,
        "epoch_token_multiplier": multipliers,
        "epoch_multiplier_at_tokens": base["unique_tokens"] if base else None,
    }


def monotone(multipliers: dict[str, float]) -> dict[str, float]:
    """Epoch multipliers as the prediction uses them: at least 1 and never falling with more epochs (another pass
    over the same data does not unlearn; a measured dip is decode noise, and the results keep it as measured)."""
    out, best = {}, 1.0
    for epochs in sorted(multipliers, key=float):
        best = max(best, multipliers[epochs])
        out[epochs] = best
    return out


def package_fit(result: dict, path: Path) -> None:
    """Write (or replace) this target + method + recipe's entry of the packaged fits ``train/predicted_tau.py`` reads."""
    fit, p = result["fit"], result["protocol"]
    entry = {
        "target": p["target"],
        "target_fingerprint": p["target_fingerprint"],
        "method": p["method"],
        "recipe": p["recipe"],
        "tau_inf": fit["tau_inf"],
        "a": fit["a"],
        "b": fit["b"],
        "tokens_range": fit["tokens_range"],
        "epoch_token_multiplier": monotone(fit["epoch_token_multiplier"]),
        "flattens_at_tokens": fit["flattens_at_tokens"],
        "measure": f"decoded tau, greedy, full verification, {p['decode_prompts']} held-out prompts x {p['decode_tokens']} tokens",
        "measured": f"benchmarks/data_scaling.py ({p['command']}); docs/results/data_scaling.md",
    }
    doc = json.loads(path.read_text()) if path.is_file() else {"format": "specdraft.data_scaling", "version": 1, "fits": []}
    key = lambda e: (e["target"], e["method"], e["recipe"])  # noqa: E731
    doc["fits"] = [e for e in doc["fits"] if key(e) != key(entry)] + [entry]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")


def markdown(result: dict) -> str:
    p, fit = result["protocol"], result.get("fit")
    lines = [
        f"Store `{p['store']}` ({p['target']}): held-out set = {p['held_out_samples']} samples of {p['held_out_conversations']} "
        f"whole conversations (the store's split, val_fraction {p['val_fraction']}, split seed {p['split_seed']}), in no training "
        f"subset; training subsets nested by conversation (subset seed {p['subset_seed']}) from {p['train_side_tokens']} tokens. "
        f"Recipe `{p['recipe']}` (seed {p['seed']}, flags `{p['train_flags']}`), {p['threads']} torch thread(s). "
        f"**Decoded** tau: specdraft's runtime, greedy, full verification, the first {p['decode_prompts']} held-out prompts x "
        f"{p['decode_tokens']} tokens; **teacher-forced**: the trainer's validation pass over every held-out row "
        "(an estimate, not a decode).",
        "",
        f"    {p['command']}",
        "",
        "| point | epochs | target tokens | unique tokens | conversations | tokens trained | steps | tau (decoded) | rounds "
        "| tau (teacher-forced) | train s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["points"]:
        t = r["train"]
        lines.append(
            f"| {r['name']} | {r['epochs']} | {r['target_tokens']:,} | {r['unique_tokens']:,} | {r['conversations']} "
            f"| {int(t['tokens']):,} | {t['steps']} | {r['tau_decoded']:.3f} | {r['decoded']['rounds']} "
            f"| {r['tau_teacher_forced']:.3f} | {t['step_seconds']:.0f} |"
        )
    if fit:
        lines += [
            "",
            f"Fit ({fit['points']} one-epoch points, {fit['degrees_of_freedom']} degree(s) of freedom): decoded tau(T) = "
            f"{fit['tau_inf']:.3f} - {fit['a']:.4g} * T^(-{fit['b']:.3f}); residuals {fit['residuals']}; "
            f"parameter sd {['-' if s is None else f'{s:.3g}' for s in fit['parameter_sd']]}. "
            f"Doubling the data adds < {fit['flat_gain']} tau beyond **{fit['flattens_at_tokens'] or 0:,} tokens** "
            f"(measured range {fit['tokens_range'][0]:,}-{fit['tokens_range'][1]:,}).",
        ]
        if fit["epoch_token_multiplier"]:
            worth = ", ".join(f"{e} epochs = x{m} the data" for e, m in fit["epoch_token_multiplier"].items())
            lines[-1] += f" Epochs at {fit['epoch_multiplier_at_tokens']:,} tokens, as fresh data (the fit inverted): {worth}."
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4.2))
    ones = [r for r in result["points"] if r["epochs"] == 1]
    xs = [r["unique_tokens"] for r in ones]
    ax.plot(xs, [r["tau_decoded"] for r in ones], "o", color="C0", label="decoded, 1 epoch")
    ax.plot(xs, [r["tau_teacher_forced"] for r in ones], "x", color="C0", alpha=0.5, label="teacher-forced, 1 epoch")
    for r in result["points"]:
        if r["epochs"] > 1:
            ax.plot([r["unique_tokens"]], [r["tau_decoded"]], "s", color=f"C{r['epochs']}", label=f"decoded, {r['epochs']} epochs")
    fit = result.get("fit")
    if fit:
        grid = np.geomspace(min(xs) / 2, max(xs) * 16, 100)
        ax.plot(grid, power_law(grid, fit["tau_inf"], fit["a"], fit["b"]), "-", color="C0", alpha=0.6, label="fit (decoded)")
        if fit["flattens_at_tokens"] and fit["flattens_at_tokens"] < grid[-1]:
            flat = f"flattens (< {fit['flat_gain']} per doubling)"
            ax.axvline(fit["flattens_at_tokens"], color="C3", linestyle="--", alpha=0.6, label=flat)
        ax.axhline(fit["tau_inf"], color="gray", linestyle=":", label=f"tau_inf {fit['tau_inf']:.3f}")
    ax.set_xscale("log")
    ax.set_xlabel("unique training tokens (log)")
    ax.set_ylabel("tau on held-out conversations")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{result['protocol']['method']} on {result['protocol']['target']}: data scaling")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="hidden-state store of the whole prepared dataset")
    parser.add_argument("--out", required=True, help="work directory: subsets/, runs/ (one train dir and one record per point)")
    parser.add_argument("--results", default=None, help="path stem of the JSON/Markdown/PNG results (default OUT/data_scaling)")
    parser.add_argument("--recipe", default="dspark", help="`specdraft train --config` of every point (default: the default recipe)")
    parser.add_argument("--tokens", default="10000,30000,100000,300000", help="training-token points, 1 epoch each")
    parser.add_argument("--epoch-tokens", type=int, default=30000, help="the size of the epoch points")
    parser.add_argument("--epochs", default="1,2,3", help="epoch counts trained at --epoch-tokens")
    parser.add_argument("--seed", type=int, default=0, help="training seed of every point")
    parser.add_argument("--val-fraction", type=float, default=0.05)
    parser.add_argument("--split-seed", type=int, default=0)
    parser.add_argument("--subset-seed", type=int, default=0, help="seed of the conversations' order the nested subsets take")
    parser.add_argument("--decode-prompts", type=int, default=16)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--flat-gain", type=float, default=0.01, help="'flattens at': doubling the data adds less than this tau")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of training and scoring")
    parser.add_argument("--train-flags", default="--dtype fp32", help="further `specdraft train` flags of every point (one dtype for all)")
    parser.add_argument("--lock", default=None, help="flock file held during each training run")
    parser.add_argument("--package-fit", action="store_true", help=f"write the fit into {PACKAGE_FIT.relative_to(ROOT)}")
    args = parser.parse_args()

    import torch

    from specdraft.hidden_states.dataset import HiddenStateDataset
    from specdraft.targets import load_target
    from specdraft.train.split import dataset_split

    torch.set_num_threads(args.threads)
    dataset = HiddenStateDataset(args.store)
    split = dataset_split(dataset, val_fraction=args.val_fraction, seed=args.split_seed)
    target = load_target(dataset.target_info["path"])
    order = conversation_order(dataset, split.train, args.subset_seed)
    held_out = {"dataset": dataset, "target": target, "indices": split.val}
    tokens = [int(t) for t in args.tokens.split(",") if t]
    plan = {(t, 1) for t in tokens} | {(args.epoch_tokens, int(e)) for e in args.epochs.split(",") if e}
    results = Path(args.results) if args.results else Path(args.out) / "data_scaling"
    protocol = {
        "store": args.store,
        "target": dataset.target_info.get("name"),
        "target_fingerprint": dataset.target_info.get("fingerprint"),
        "method": args.recipe,
        "recipe": args.recipe,
        "seed": args.seed,
        "subset_seed": args.subset_seed,
        "val_fraction": args.val_fraction,
        "split_seed": args.split_seed,
        "held_out_samples": len(split.val),
        "held_out_conversations": len(conversation_order(dataset, split.val, 0)),
        "train_side_tokens": sum(dataset.lengths()[i] for i in split.train),
        "decode_prompts": args.decode_prompts,
        "decode_tokens": args.decode_tokens,
        "threads": args.threads,
        "train_flags": args.train_flags,
        "command": " ".join(["benchmarks/data_scaling.py", *sys.argv[1:]]),
    }
    points: list[dict] = []
    for size, epochs in sorted(plan, key=lambda p: (p[0] * p[1], p[1])):  # cheapest first: a cut-short run has the small points
        points.append(run_point(args, held_out, order, dataset, size, epochs))
        print(json.dumps({k: points[-1][k] for k in ("name", "unique_tokens", "tau_decoded", "tau_teacher_forced")}), flush=True)
        write_results(results, protocol, points, args)
    if args.package_fit and write_results(results, protocol, points, args).get("fit"):
        package_fit(json.loads(results.with_suffix(".json").read_text()), PACKAGE_FIT)


def write_results(results: Path, protocol: dict, points: list[dict], args: argparse.Namespace) -> dict:
    """JSON, Markdown and PNG of the points so far (after every point, so a cut-short run leaves what it finished)."""
    points = sorted(points, key=lambda r: (r["epochs"], r["unique_tokens"]))
    ones = [r for r in points if r["epochs"] == 1]
    at_size = [r for r in points if r["target_tokens"] == args.epoch_tokens]
    result = {"protocol": protocol, "points": points, "fit": fit_curve(ones, at_size, args.flat_gain)}
    results.parent.mkdir(parents=True, exist_ok=True)
    results.with_suffix(".json").write_text(json.dumps(result, indent=1))
    results.with_suffix(".md").write_text(markdown(result))
    plot(result, results.with_suffix(".png"))
    return result


if __name__ == "__main__":
    main()
