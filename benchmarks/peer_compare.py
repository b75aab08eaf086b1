"""Head-to-head: specdraft's trainer against speculators 0.9.0's on one store (issue 16, item 4; DFlash2: issue 29).

For each method (by default every registered decodable method: DFlash, DFlash2, DSpark, EAGLE-3; ``peer_methods``):
``specdraft train --config METHOD`` and the peer's own entry point (``benchmarks/peer_trainer.py``: our store
exported to its data by ``specdraft export-speculators``, its losses, optimizer and schedule) train on the same
training samples for the same number of epochs, so both consume exactly the training split's tokens times
``--epochs`` (both pack whole samples into rows of at most 2048 tokens and drop none; the step counts can differ by a
row or two of packing). The draft shape
is matched where both expose it: the peer gets our run's layers, block size, draft vocabulary (its
d2t/t2d written from the counts ours uses), DSpark's Markov rank, DFlash2's convolution and selector shape, EAGLE-3's
unroll steps, loss decay and residual norm (``integrations/speculators/data.py`` ``SHAPE_FLAGS``/``SWITCH_FLAGS``, keyed
by our config fields) and its Eagle 3.1 norms as ours has them (the peer's eagle3 turns two of them on by default).
Anchors (block drafters only) are counted differently: ours draws up to ``max_anchors`` (64) per *sample*, the peer
``--max-anchors`` (512) per packed 2048-token *row*; on regenerated ShareGPT rows (~14 samples) ours drew 704-753 blocks a step,
so ``--peer-anchors matched`` (default) gives the peer our run's mean blocks per step, equal
draft work per token, and ``default`` leaves its 512. Every other default stays each trainer's own and
is listed in the output.

Both drafters are then decoded through specdraft's runtime: greedy, on the store's validation prompts
(``DecodeProbe``, as ``specdraft train`` logs ``tau_decoded``) and with ``specdraft eval --suite``.
Training tokens/s is each trainer's own step clock (fetch + forward + backward + optimizer; validation,
checkpoints and logging excluded): ``metrics.jsonl`` ``tokens / seconds`` for ours, the peer's
``profile`` records for it, with ``--threads`` torch threads each. Each training run takes
``--lock`` (flock) so timed runs do not overlap; decoding does not. Runs already finished under
``--out`` are reused (``--retrain`` redoes them). Writes ``OUT/peer_compare.json`` and ``.md``.

Run from the repository root in .venv (the peer trains in .venv-interop)::

  PYTHONPATH=src nice -n 5 .venv/bin/python benchmarks/peer_compare.py --store runs/r16/hidden_states \\
      --out runs/peer_compare --epochs 2 --lock /tmp/heavy.lock --train-only
  PYTHONPATH=src nice -n 15 .venv/bin/python benchmarks/peer_compare.py --store runs/r16/hidden_states \\
      --out runs/peer_compare --epochs 2
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import held
from peer_trainer import decode_validation, last_checkpoint

ROOT = Path(__file__).resolve().parent.parent
INTEROP_PYTHON = ROOT / ".venv-interop/bin/python"


def log_beside(out: Path) -> Path:
    """``OUT.log`` beside the run directory ``OUT``, whose name may hold a dot (a candidate such as ``eagle3.1``)."""
    return out.parent / f"{out.name}.log"


def run_logged(cmd: list[str], log: Path, threads: int, lock: str | None) -> float:
    """Run ``cmd`` with ``threads`` torch threads, output to ``log``; wall seconds. A failure names the log."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": str(threads)}
    log.parent.mkdir(parents=True, exist_ok=True)
    with held(lock), log.open("w") as out:
        started = time.perf_counter()
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode
        seconds = time.perf_counter() - started
    if code:
        raise SystemExit(f"{' '.join(cmd[:6])} ... failed (exit {code}); see {log}")
    return round(seconds, 1)


def train_ours(method: str, args: argparse.Namespace, out: Path) -> dict:
    final = out / "final"
    wall = None
    if args.retrain or not final.is_dir():
        cmd = [
            sys.executable,
            "-m",
            "specdraft.cli.main",
            "train",
            "--config",
            method,
            "--data",
            args.store,
            "--out",
            str(out),
            "--epochs",
            str(args.epochs),
            "--val-fraction",
            str(args.val_fraction),
            "--split-seed",
            str(args.split_seed),
            "--num-threads",
            str(args.threads),
            *shlex.split(args.ours_flags),
        ]
        wall = run_logged(cmd, log_beside(out), args.threads, args.lock)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in records if r.get("split") == "train"]
    tokens, seconds = sum(r["tokens"] for r in train), sum(r["seconds"] for r in train)
    return {
        "checkpoint": str(final),
        "steps": train[-1]["step"],
        "tokens": tokens,
        "step_seconds": round(seconds, 3),
        "tokens_per_s": tokens / seconds,
        "wall_s": wall,
        "dtype": train[-1].get("dtype"),
        "anchors_per_step": round(sum(r.get("anchors", 0) for r in train) / len(train)),
    }


def peer_flags(method: str, args: argparse.Namespace, ours: dict) -> list[str]:
    """The peer flags that give its drafter the shape our run trained (its ``config.resolved.yaml``; a field it predates
    has the method's default) and, per ``--peer-anchors``, our run's blocks per step (``ours`` is ``train_ours``' result)."""
    import dataclasses

    import yaml

    from specdraft.integrations.speculators.data import trainer_flags
    from specdraft.models import METHODS

    resolved = yaml.safe_load((Path(ours["checkpoint"]).parent / "config.resolved.yaml").read_text())["model"]
    model = {**dataclasses.asdict(METHODS.get(method).config_cls()), **resolved}
    matched = args.peer_anchors == "matched" and METHODS.get(method).proposer == "block"  # anchors: where blocks are drafted
    return trainer_flags(model, anchors_per_step=ours["anchors_per_step"] if matched else None)


def train_peer(method: str, args: argparse.Namespace, out: Path, ours: dict) -> dict:
    summary = out / "summary.json"
    wall = None
    if args.retrain or not summary.is_file():
        flags = peer_flags(method, args, ours) + shlex.split(getattr(args, "peer_flags", ""))
        vocab = []  # peer_trainer builds the peer's d2t/t2d from our counts (DFlash2 has none: the full vocabulary)
        if "--draft-vocab-size" in flags:
            at = flags.index("--draft-vocab-size")
            vocab = ["--draft-vocab-size", flags[at + 1]]
            del flags[at : at + 2]
        cmd = [
            str(INTEROP_PYTHON),
            str(ROOT / "benchmarks/peer_trainer.py"),
            "--store",
            args.store,
            "--target",
            args.target,
            "--method",
            method,
            "--epochs",
            str(args.epochs),
            *(["--steps", str(args.max_steps)] if getattr(args, "max_steps", 0) else []),
            "--out",
            str(out),
            "--data-dir",
            str(Path(args.out) / "peer-data" / method),  # one per method: methods may read other slots or stores
            "--val-fraction",
            str(args.val_fraction),
            "--split-seed",
            str(args.split_seed),
            *vocab,
            "--extra",
            " ".join(flags),
        ]
        wall = run_logged(cmd, log_beside(out), args.threads, args.lock)
    facts = json.loads(summary.read_text())
    return {
        "checkpoint": str(last_checkpoint(out / "run")),
        "steps": facts["steps"],
        "tokens": facts["tokens"],
        "step_seconds": facts["step_seconds"],
        "tokens_per_s": facts["tokens_per_s"],
        "wall_s": wall,
        "train_tokens_per_epoch": facts["train_tokens"],
        "argv": facts["argv"],
    }


def defaults(method: str, args: argparse.Namespace, ours_dir: Path, peer_dir: Path) -> list[tuple[str, str, str]]:
    """(setting, ours, peer) for the training choices left at each trainer's own value."""
    import yaml

    from specdraft.integrations.speculators.data import loss_summary

    ours = yaml.safe_load((ours_dir / "config.resolved.yaml").read_text())
    run_yaml = yaml.safe_load((peer_dir / "run" / "run.yaml").read_text())["train"]
    peer = _peer_resolved(run_yaml)
    model = ours["model"]
    if "ttt_steps" in model:  # a chain drafter unrolled in training (EAGLE-3): its loss is weighted per unroll step
        ours_loss = f"{model.get('distill_loss') or 'CE'} over {model['ttt_steps']} unroll steps, weight {model['ttt_decay']}^j"
        peer_loss = f"{peer['loss_fn']} over {peer['ttt_steps']} unroll steps, weight {peer['ttt_step_loss_decay']}^j"
    else:
        weighting = model.get("position_weighting", "exp")
        ours_loss = loss_summary(model) + (
            f", exp(-k/{model.get('loss_gamma') or 'gamma'}) position weights" if weighting == "exp" else f", {weighting} position weights"
        )
        peer_terms = "".join(f", {term}" for term in [loss_summary(model, peer)] if term)
        peer_loss = (
            f"{peer['loss_fn']}, {peer['per_position_loss_weight']} position weights (gamma {peer['dflash_decay_gamma']})" + peer_terms
        )
    anchors = []
    if "max_anchors" in model:  # block drafters only
        anchors.append(
            (
                "anchors",
                f"up to {model['max_anchors']} per sample ({model.get('anchor_sampling')})",
                f"{peer['max_anchors']} per packed row",
            )
        )
    return [
        (
            "optimizer",
            f"{ours.get('optimizer', 'adamw')} lr {ours['lr']}, wd {ours['weight_decay']}, betas {ours['betas']}",
            f"{peer['optimizer']} lr {peer['lr']} (muon_lr {peer['muon_lr']}), wd {peer['weight_decay']}, "
            f"muon wd {peer['muon_weight_decay']}",
        ),
        (
            "schedule",
            f"{ours['warmup_ratio']:.0%} warm-up, cosine",
            f"{peer['scheduler_type']}, warm-up {peer['scheduler_warmup_steps'] or peer['scheduler_warmup_ratio'] or '1% of steps'}",
        ),
        ("loss", ours_loss, peer_loss),
        *anchors,
        (
            "warm start",
            f"draft layers from target: {ours['init_from_target']}, fc {ours['fc_init']}"
            + (f", Markov {ours['markov_init']}" if "markov_rank" in model else ""),
            "random init (embeddings/lm_head from the verifier)",
        ),
        (
            "draft head",
            f"{'trained' if model.get('train_draft_head', True) else 'frozen'}, from the target head's rows",
            "frozen, the verifier head's rows",
        ),
        ("compute dtype", str(ours["dtype"]), f"autocast {peer['hidden_states_dtype']}"),
        ("grad clip", str(ours["grad_clip"]), "1.0"),
        ("seed", str(ours["seed"]), str(peer["seed"])),
    ]


def _peer_resolved(run_yaml: dict) -> dict:
    """The peer's flat config for a run.yaml (its defaults filled in by its own schema)."""
    code = (
        "import json, sys, yaml; from speculators.train.config import TrainConfig; "
        "print(json.dumps(TrainConfig(**yaml.safe_load(sys.stdin.read())).flatten(), default=str))"
    )
    import yaml

    done = subprocess.run([str(INTEROP_PYTHON), "-c", code], input=yaml.safe_dump(run_yaml), capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def suite_eval_runs(args: argparse.Namespace, drafters: list[str], out: Path) -> dict[str, dict]:
    """One ``specdraft eval`` of ``drafters`` on ``args.suite`` (verifying every draft) into ``out``, reused where
    ``out/report.json`` exists and ``--retrain`` is not given; its runs by label (a checkpoint's is METHOD:DIRNAME)."""
    report = out / "report.json"
    if args.retrain or not report.is_file():
        cmd = [
            sys.executable,
            "-m",
            "specdraft.cli.main",
            "eval",
            "--target",
            args.target,
            "--drafters",
            ",".join(drafters),
            "--suite",
            args.suite,
            "--limit-per-domain",
            str(args.limit_per_domain),
            "--max-new-tokens",
            str(args.max_new_tokens),
            "--verify-policy",
            "full",
            "--threads",
            str(args.threads),
            "--out",
            str(out),
            "--no-plots",
        ]
        run_logged(cmd, log_beside(out), args.threads, None)
    return {r["drafter"]: r for r in json.loads(report.read_text())["runs"]}


def suite_taus(method: str, args: argparse.Namespace, ours: str, peer: str, out: Path) -> dict:
    """tau per domain of both checkpoints with ``specdraft eval`` (same prompts, same runtime)."""
    runs = suite_eval_runs(args, [ours, peer], out)
    picked = {}
    for who, path in (("ours", ours), ("peer", peer)):
        run = runs[f"{method}:{Path(path).name}"]
        picked[who] = {"overall": run["overall"]["tau"], **{d: m["tau"] for d, m in run["per_domain"].items() if m.get("rounds")}}
    return picked


def markdown(result: dict) -> str:
    lines = [
        f"# specdraft vs speculators {result['peer_version']} trainer, same store and tokens",
        "",
        f"Store `{result['store']}` ({result['train_samples']} training / {result['val_samples']} validation samples), "
        f"{result['epochs']} epoch(s), {result['threads']} torch threads, peer anchors: {result['peer_anchors']}"
        + (f", our runs with `{result['ours_flags']}`" if result.get("ours_flags") else "")
        + ". "
        f"Command: `{result['command']}`",
        "",
    ]
    domains = sorted({d for m in result["methods"].values() for d in m["suite_tau"].get("ours", {}) if d != "overall"})
    head = "| method | trainer | steps | train tokens | tokens/s | tau val prompts | tau suite | " + " | ".join(domains) + " |"
    lines += [head, "|" + " --- |" * 2 + " ---: |" * (5 + len(domains))]
    for method, m in result["methods"].items():
        for who in ("ours", "peer"):
            t, s = m["train"][who], m["suite_tau"].get(who, {})
            overall = f"{s['overall']:.3f}" if "overall" in s else "-"  # no suite with --suite ''
            lines.append(
                f"| {method} | {who} | {t['steps']} | {t['tokens']} | {t['tokens_per_s']:.0f} | {m['val_tau'][who]['tau']:.3f} | "
                f"{overall} | " + " | ".join(f"{s[d]:.3f}" if d in s else "-" for d in domains) + " |"
            )
    for method, m in result["methods"].items():
        lines += [
            "",
            f"## {method}: matched shape `{' '.join(m['peer_shape_flags'])}`; defaults left to each trainer",
            "",
            "| setting | ours | peer |",
            "| --- | --- | --- |",
        ]
        lines += [f"| {name} | {ours} | {peer} |" for name, ours, peer in m["defaults"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    from specdraft.integrations.speculators.data import peer_methods

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="specdraft hidden-state store holding the methods' slots")
    parser.add_argument("--target", default=None, help="the target's Hugging Face directory (default: the one the store recorded)")
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--methods",
        default=",".join(peer_methods()),
        help="methods to compare (default: every registered decodable method, integrations/speculators/data.py peer_methods)",
    )
    parser.add_argument("--epochs", type=int, default=2, help="passes over the training split, both trainers (our recipes' 2)")
    parser.add_argument("--val-fraction", type=float, default=0.05)
    parser.add_argument("--split-seed", type=int, default=0)
    parser.add_argument(
        "--peer-anchors",
        choices=["matched", "default"],
        default="matched",
        help="the peer's --max-anchors (blocks per packed row): our run's mean blocks per step, or its default 512",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads of every training and decoding process")
    parser.add_argument("--lock", default=None, help="flock file held during each training run (e.g. /tmp/heavy.lock)")
    parser.add_argument("--val-prompts", type=int, default=10, help="validation prompts decoded per drafter")
    parser.add_argument("--val-tokens", type=int, default=64, help="tokens generated per validation prompt")
    parser.add_argument("--suite", default="domains", help="`specdraft eval --suite` prompts ('' to skip)")
    parser.add_argument("--limit-per-domain", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--ours-flags", default="", help="extra `specdraft train` flags for our runs (e.g. '--optimizer muon')")
    parser.add_argument(
        "--ours-label",
        default="",
        help="names our runs and the result files when --ours-flags is set "
        "(ours-METHOD-LABEL/, peer_compare-LABEL.json/.md; the peer's runs are shared)",
    )
    parser.add_argument("--retrain", action="store_true", help="redo runs already finished under --out")
    parser.add_argument(
        "--train-only",
        action="store_true",
        help="stop after training (run this stage at the lock's priority, the decoding stage at a lower one)",
    )
    args = parser.parse_args()
    if bool(args.ours_flags) != bool(args.ours_label):
        parser.error("--ours-flags and --ours-label go together")
    suffix = f"-{args.ours_label}" if args.ours_label else ""

    import torch

    from specdraft.hidden_states.dataset import HiddenStateDataset
    from specdraft.train.split import dataset_split

    torch.set_num_threads(args.threads)
    dataset = HiddenStateDataset(args.store)
    args.target = args.target or dataset.target_info["path"]
    split = dataset_split(dataset, val_fraction=args.val_fraction, seed=args.split_seed)
    out = Path(args.out)
    result = {
        "store": args.store,
        "epochs": args.epochs,
        "threads": args.threads,
        "peer_anchors": args.peer_anchors,
        "ours_flags": args.ours_flags,
        "train_samples": len(split.train),
        "val_samples": len(split.val),
        "command": " ".join(sys.argv),
        "train_tokens_per_epoch": sum(dataset.lengths()[i] for i in split.train),
        "peer_version": subprocess.run(
            [str(INTEROP_PYTHON), "-c", "import importlib.metadata as m; print(m.version('speculators'))"], capture_output=True, text=True
        ).stdout.strip(),
        "methods": {},
    }
    for method in args.methods.split(","):
        ours_dir, peer_dir = out / f"ours-{method}{suffix}", out / f"peer-{method}"
        ours = train_ours(method, args, ours_dir)
        train = {"ours": ours, "peer": train_peer(method, args, peer_dir, ours)}
        if args.train_only:
            print(json.dumps({method: train}, indent=1))
            continue
        val = {
            who: decode_validation(
                args.store,
                args.target,
                Path(t["checkpoint"]),
                val_fraction=args.val_fraction,
                split_seed=args.split_seed,
                prompts=args.val_prompts,
                tokens=args.val_tokens,
            )
            for who, t in train.items()
        }
        suite = (
            suite_taus(method, args, train["ours"]["checkpoint"], train["peer"]["checkpoint"], out / f"eval-{method}{suffix}")
            if args.suite
            else {}
        )
        result["methods"][method] = {
            "train": train,
            "val_tau": val,
            "suite_tau": suite,
            "peer_shape_flags": peer_flags(method, args, ours),
            "defaults": defaults(method, args, ours_dir, peer_dir),
        }
        (out / f"peer_compare{suffix}.json").write_text(json.dumps(result, indent=1))
    if not args.train_only:
        (out / f"peer_compare{suffix}.md").write_text(markdown(result))
        print(markdown(result))


if __name__ == "__main__":
    main()
