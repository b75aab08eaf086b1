"""Learning curves at equal training-time budget: decoded acceptance length against training time.

Every run trains one drafter on the same hidden-state store for the same training-time budget. At
every budget/--points of training time the trainer validates (``specdraft train``'s evaluation):
it decodes --decode-prompts held-out validation prompts greedily with the built-in runtime
(``tau_decoded``, the figure users get: anchors wherever the previous round stopped) and logs the
teacher-forced estimate beside it (``tau_teacher_forced``, uniform anchors). The curves, the
table and the ratios are drawn from the decoded tau; the teacher-forced one is kept for reference.
The validation split is ``train/split.py``'s (whole conversations, no prompt on both sides), the
same for every run. The LR schedule of each run is fitted to the budget: a short probe measures
the run's seconds per step and the run gets ``budget / step_time`` steps, so every method finishes
its warm-up + cosine inside the budget. Optionally (``--decode-suite``) the final checkpoints are
then decoded side by side with plain decoding (``specdraft eval``) on a held-out suite for tau per
domain and speed-up.

A run is ``LABEL|METHOD|EXTRA TRAIN ARGS``; the same script serves method comparisons and
recipe ablations (one piece switched off per run):

    .venv/bin/python benchmarks/learning_curves.py --data runs/r16/hidden_states --budget-min 6 \\
        --run 'dspark|dspark|' --run 'dflash|dflash|' --run 'eagle3|eagle3|' --decode-suite domains --out runs/curves

    .venv/bin/python benchmarks/learning_curves.py --data runs/r16/hidden_states --budget-min 4 \\
        --run 'recipe|dspark|' --run 'no-target-init|dspark|--no-init-from-target' --out runs/ablation

``--lock FILE`` holds an exclusive flock on FILE around each training run and the decode eval, so
other measurements sharing the machine queue instead of overlapping (and skewing) the step times.

Output under --out: curves.json (every point, every run's command), curves.png, table.md (final
decoded and teacher-forced tau per run and the ratios of the first run to the others), and one
train dir per run.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from _common import held

PROBE_STEPS = 5
SPECDRAFT = str(Path(sys.executable).with_name("specdraft"))  # the console script of this venv


def parse_run(text: str) -> tuple[str, str, list[str]]:
    parts = text.split("|")
    if len(parts) != 3 or not parts[0] or not parts[1]:
        raise SystemExit(f"--run {text!r}: expected 'LABEL|METHOD|EXTRA ARGS' (extra args may be empty)")
    return parts[0], parts[1], shlex.split(parts[2])


def train_command(method: str, data: str, out: Path, extra: list[str], args: argparse.Namespace, **flags: object) -> list[str]:
    cmd = [
        SPECDRAFT,
        "train",
        "--config",
        method,
        "--data",
        data,
        "--out",
        str(out),
        "--num-threads",
        str(args.threads),
        "--checkpoint-interval",
        "0",
        "--seed",
        str(args.seed),
        "--val-max-batches",
        str(args.val_batches),
        "--decode-prompts",
        str(args.decode_prompts),
        "--decode-tokens",
        str(args.decode_prompt_tokens),
    ]
    for name, value in flags.items():
        cmd += [f"--{name.replace('_', '-')}", str(value)]
    return cmd + extra


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def probe_seconds_per_step(method: str, data: str, work: Path, extra: list[str], args: argparse.Namespace) -> float:
    """Step time of this exact run configuration, from a short run (see specdraft.train.budget)."""
    from specdraft.tuning.budget_probes import seconds_per_step

    out = work / "probe"
    shutil.rmtree(str(out), ignore_errors=True)
    cmd = train_command(method, data, out, extra, args, max_steps=PROBE_STEPS, eval_interval=0, decode_prompts=0)
    with held(args.lock):
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    per_step = seconds_per_step(out / "metrics.jsonl")
    shutil.rmtree(str(out), ignore_errors=True)
    return per_step


def curve(run_dir: Path) -> list[dict]:
    """Decoded and teacher-forced tau at each validation; training time = sum of step times."""
    elapsed, points = 0.0, []
    for r in records(run_dir):
        if r.get("split") == "train":
            elapsed += r["seconds"]
        elif r.get("split") == "val":
            decoded = r.get("decoded") or {}
            points.append(
                {
                    "step": r["step"],
                    "minutes": elapsed / 60,
                    "tau_decoded": r.get("tau_decoded"),
                    "decoded_rounds": decoded.get("rounds"),
                    "tau_teacher_forced": r["accept_len"],
                    "acc_pos1": (r.get("position_acc") or [None])[0],
                }
            )
    return points


def plot(runs: list[dict], path: Path, budget_min: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        pts = [p for p in run["curve"] if p["tau_decoded"] is not None]
        (line,) = ax.plot([p["minutes"] for p in pts], [p["tau_decoded"] for p in pts], marker="o", label=f"{run['label']} (decoded)")
        ax.plot(
            [p["minutes"] for p in run["curve"]],
            [p["tau_teacher_forced"] for p in run["curve"]],
            linestyle="--",
            color=line.get_color(),
            alpha=0.5,
            label=f"{run['label']} (teacher-forced)",
        )
    ax.set_xlabel("training time (min, sum of step times)")
    ax.set_ylabel("tau on held-out validation prompts")
    ax.set_xlim(0, max([budget_min] + [p["minutes"] for run in runs for p in run["curve"]]) * 1.05)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("Learning curves (solid: decoded tau, dashed: teacher-forced)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(runs: list[dict], decode: dict | None, equal_steps: bool = False) -> str:
    lines = [
        "| run | method | steps done / planned | s/step (mean) | tau decoded (val prompts, rounds) | tau teacher-forced (val) | acc pos 1 "
        "| suite tau | speed-up |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for run in runs:
        last = run["curve"][-1] if run["curve"] else {}
        d = (decode or {}).get(run["label"], {})
        fmt = lambda v, spec=".3f": "-" if v is None else format(v, spec)  # noqa: E731
        train = [r for r in records(Path(run["dir"])) if r.get("split") == "train"]
        done = max((r["step"] for r in train), default=0)
        per_step = sum(r["seconds"] for r in train) / len(train) if train else None
        decoded = "-" if last.get("tau_decoded") is None else f"{last['tau_decoded']:.3f} ({last['decoded_rounds']})"
        lines.append(
            f"| {run['label']} | {run['method']} | {done} / {run['steps']} | {fmt(per_step, '.2f')} | "
            f"{decoded} | {fmt(last.get('tau_teacher_forced'))} | {fmt(last.get('acc_pos1'))} | {fmt(d.get('tau'))} | "
            f"{fmt(d.get('speedup'), '.2f')} |"
        )
    if decode and any(d.get("domains") for d in decode.values()):
        domains = sorted({name for d in decode.values() for name in d.get("domains", {})})
        lines += ["", "| run | " + " | ".join(f"{name} tau" for name in domains) + " |", "| --- |" + " ---: |" * len(domains)]
        for run in runs:
            per = (decode.get(run["label"]) or {}).get("domains", {})
            lines.append(f"| {run['label']} | " + " | ".join(fmt(per.get(name)) for name in domains) + " |")
    if len(runs) > 1 and all(any(p["tau_decoded"] is not None for p in r["curve"]) for r in runs):
        first = runs[0]
        lines.append("")
        for other in runs[1:]:
            # runs end at slightly different training times (step times drift with machine load): compare
            # both at the earlier end, interpolating the other curve linearly
            axis = "step" if equal_steps else "minutes"
            at = min(first["curve"][-1][axis], other["curve"][-1][axis])
            ratio = tau_at(first["curve"], at, axis=axis) / tau_at(other["curve"], at, axis=axis)
            tf_ratio = tau_at(first["curve"], at, "tau_teacher_forced", axis=axis) / tau_at(
                other["curve"], at, "tau_teacher_forced", axis=axis
            )
            where = f"step {at}" if equal_steps else f"{at:.1f} min of training"
            line = f"- {first['label']} / {other['label']}: decoded tau ratio {ratio:.3f} at {where} (teacher-forced {tf_ratio:.3f})"
            if decode and first["label"] in decode and other["label"] in decode:
                line += f", suite tau ratio {decode[first['label']]['tau'] / decode[other['label']]['tau']:.3f}"
            lines.append(line)
    return "\n".join(lines) + "\n"


def tau_at(points: list[dict], at: float, key: str = "tau_decoded", axis: str = "minutes") -> float:
    """A curve's tau (``key``) at ``at`` on ``axis`` (minutes of training or step; linear between points, flat outside)."""
    points = [p for p in points if p[key] is not None]
    xs, ys = [p[axis] for p in points], [p[key] for p in points]
    if at <= xs[0]:
        return ys[0]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if at <= x1:
            return y0 + (y1 - y0) * (at - x0) / (x1 - x0) if x1 > x0 else y1
    return ys[-1]


def decode_eval(runs: list[dict], args: argparse.Namespace) -> dict:
    """Real tau and speed-up of every final checkpoint, side by side with plain decoding."""
    out = Path(args.out) / "decode"
    policy = f"@{args.decode_policy}" if args.decode_policy else ""
    drafters = ",".join(f"{r['dir']}/final{policy}" for r in runs)
    cmd = [
        SPECDRAFT,
        "eval",
        "--drafters",
        drafters,
        "--suite",
        args.decode_suite,
        "--limit-per-domain",
        str(args.decode_limit),
        "--max-new-tokens",
        str(args.decode_tokens),
        "--threads",
        str(args.threads),
        "--out",
        str(out),
        "--no-plots",
    ]
    with held(args.lock):
        subprocess.run(cmd, check=True)
    report = json.loads((out / "report.json").read_text())
    by_dir = {r["dir"] + "/final": r["label"] for r in runs}
    result = {}
    for run in report["runs"]:
        name = run["drafter"].split("@")[0]
        if name in by_dir:
            result[by_dir[name]] = {
                "tau": run["overall"]["tau"],
                "speedup": run["speedup"],
                "tok_per_s": run["overall"]["tokens_per_s"],
                "domains": {d: m["tau"] for d, m in run["per_domain"].items()},
            }
    return {"command": " ".join(shlex.quote(c) for c in cmd), "runs": result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", help="hidden-state store holding every method's layer slots")
    parser.add_argument("--run", action="append", default=[], help="'LABEL|METHOD|EXTRA TRAIN ARGS' (repeatable)")
    parser.add_argument("--budget-min", type=float, default=10.0, help="training-time budget per run, minutes")
    parser.add_argument(
        "--steps",
        type=int,
        default=0,
        help="give every run this many steps instead of fitting them to --budget-min "
        "(ratios are then taken at the last point, equal steps and data)",
    )
    parser.add_argument("--points", type=int, default=6, help="validations per run (evenly spaced in steps)")
    parser.add_argument("--val-batches", type=int, default=4, help="validation batches per point (teacher-forced estimate)")
    parser.add_argument("--decode-prompts", type=int, default=6, help="validation prompts decoded at every point (decoded tau)")
    parser.add_argument("--decode-prompt-tokens", type=int, default=48, help="tokens generated per validation prompt")
    parser.add_argument("--lock", help="hold an exclusive flock on this file around each training run and the decode eval")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--decode-suite", default="", help="after training, decode this suite with every final checkpoint")
    parser.add_argument("--decode-limit", type=int, default=2, help="prompts per domain of the decode suite")
    parser.add_argument("--decode-tokens", type=int, default=96)
    parser.add_argument("--decode-policy", default="", help="verify policy for the decode eval (default: the eval's)")
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="re-render table.md and curves.png from OUT/curves.json (with --decode-suite: decode the saved runs' final checkpoints first)",
    )
    args = parser.parse_args()

    out = Path(args.out)
    if args.report_only:
        saved = json.loads((out / "curves.json").read_text())
        for run in saved["runs"]:
            run["curve"] = curve(Path(run["dir"]))  # also picks up points logged after the JSON was written
        if args.decode_suite:  # decode the saved runs' final checkpoints now
            saved["decode"] = decode_eval(saved["runs"], args)
            (out / "curves.json").write_text(json.dumps(saved, indent=1))
        write_outputs(out, saved["runs"], (saved.get("decode") or {}).get("runs"), saved["budget_min"], bool(saved.get("steps")))
        return
    if not args.data or not args.run:
        parser.error("--data and at least one --run are needed (or --report-only)")
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for text in args.run:
        label, method, extra = parse_run(text)
        run_dir = out / label
        if args.steps:  # equal steps: runs of one architecture cost the same per step, whatever the load
            step_s, steps, limit = None, args.steps, {}
        else:
            step_s = probe_seconds_per_step(method, args.data, out, extra, args)
            steps = max(args.points, int(args.budget_min * 60 / step_s))
            limit = {"max_time": int(args.budget_min * 60 * 2)}  # a safety stop: load can slow steps past the probe
        cmd = train_command(method, args.data, run_dir, extra, args, max_steps=steps, eval_interval=max(1, steps // args.points), **limit)
        print(f"[{label}] {steps} steps: {' '.join(shlex.quote(c) for c in cmd)}", flush=True)
        shutil.rmtree(str(run_dir), ignore_errors=True)
        with held(args.lock):
            started = time.time()
            subprocess.run(cmd, check=True)
        runs.append(
            {
                "label": label,
                "method": method,
                "extra": extra,
                "dir": str(run_dir),
                "seconds_per_step": step_s,
                "steps": steps,
                "wall_s": time.time() - started,
                "command": " ".join(shlex.quote(c) for c in cmd),
                "curve": curve(run_dir),
            }
        )
        (out / "curves.json").write_text(json.dumps({"budget_min": args.budget_min, "steps": args.steps, "runs": runs}, indent=1))

    decode = decode_eval(runs, args) if args.decode_suite else None
    result = {"budget_min": args.budget_min, "steps": args.steps, "argv": sys.argv, "runs": runs, "decode": decode}
    (out / "curves.json").write_text(json.dumps(result, indent=1))
    write_outputs(out, runs, decode["runs"] if decode else None, args.budget_min, bool(args.steps))


def write_outputs(out: Path, runs: list[dict], decode: dict | None, budget_min: float, equal_steps: bool = False) -> None:
    text = table(runs, decode, equal_steps)
    (out / "table.md").write_text(text)
    plot(runs, out / "curves.png", budget_min)
    print(text)
    print(f"wrote {out / 'curves.json'}, {out / 'curves.png'}, {out / 'table.md'}")


if __name__ == "__main__":
    main()
