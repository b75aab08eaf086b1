"""Resume across a code change, bit for bit: a run started by one checkout and resumed by another ends
with the same weights as an uninterrupted run of the first.

The tests' random 8-layer Llama target (vocab 128, seeded, rebuilt identically in every process) and
16-sample DSpark hidden-state store (``tests/test_train_methods.build_stores``) are made once; then,
each in a subprocess with its own ``PYTHONPATH``:

1. BASE trains DSpark ``--steps`` steps uninterrupted;
2. BASE trains the same run and is stopped by SIGTERM mid-run (it checkpoints after the current step);
3. NEW resumes that run to the end;
4. NEW trains the same run uninterrupted (a fresh run is unchanged too).

Every ``final/model.safetensors`` and last ``trainer_state.safetensors`` must equal run 1's tensor for
tensor. Usage (a few minutes on 2 cores)::

    python scripts/resume_across.py --base /work/main/src --new src --work /tmp/resume-across
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"


def run_training(store: str, out: str, steps: int, stop_after_reads: int) -> None:
    """One training invocation with the code on ``sys.path`` (a subprocess of ``main``)."""
    from specdraft.hidden_states.dataset import HiddenStateDataset
    from specdraft.train.config import TrainConfig
    from specdraft.train.trainer import train
    from test_train_methods import OVERRIDES, tiny_target
    from test_train_toy import SignalAfterReads

    cfg = TrainConfig(
        method="dspark",
        data=store,
        out=out,
        model=OVERRIDES["dspark"],
        max_steps=steps,
        pack_tokens=64,
        batch_rows=1,
        val_fraction=0.2,
        eval_interval=3,
        checkpoint_interval=0,
        keep_checkpoints=0,
        dtype="fp32",
        num_threads=1,
        seed=11,
        decode_prompts=0,
    )
    dataset = HiddenStateDataset(store)
    result = train(cfg, target=tiny_target(), dataset=SignalAfterReads(dataset, stop_after_reads) if stop_after_reads else dataset)
    import specdraft

    print(
        json.dumps(
            {
                "out": out,
                "step": result.step,
                "stopped_by": result.stopped_by,
                "completed": result.completed,
                "code": str(Path(specdraft.__file__).parent.parent),
            }
        ),
        flush=True,
    )


def invoke(src: str, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(src).resolve()), str(TESTS)])}
    done = subprocess.run([sys.executable, __file__, "--_run", *args], env=env, capture_output=True, text=True)
    if done.returncode not in (0, 128 + 15):
        raise SystemExit(f"training with {src} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def tensors_equal(a: Path, b: Path) -> list[str]:
    """Names of the tensors that differ between two safetensors files (a missing or extra name differs)."""
    import torch
    from safetensors.torch import load_file

    ta, tb = load_file(str(a)), load_file(str(b))
    return sorted(set(ta) ^ set(tb)) + [k for k in sorted(set(ta) & set(tb)) if not torch.equal(ta[k], tb[k])]


def main() -> int:
    if sys.argv[1:2] == ["--_run"]:
        store, out, steps, stop = sys.argv[2:6]
        run_training(store, out, int(steps), int(stop))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="src/ of the checkout that starts the run (e.g. /work/main/src)")
    parser.add_argument("--new", required=True, help="src/ of the checkout that resumes it")
    parser.add_argument("--work", required=True, help="a new directory for the store and the runs")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True)
    sys.path[:0] = [str(Path(args.new).resolve()), str(TESTS)]
    from test_train_methods import build_stores

    store = str(build_stores(work, ("dspark",))[1]["dspark"])
    runs = {
        "base uninterrupted": [invoke(args.base, store, str(work / "ref"), str(args.steps), "0")],
        # about half the steps' reads (batch_rows=1, a few samples per packed row), then SIGTERM: a checkpoint mid-run
        "base stopped, new resumed": [
            invoke(args.base, store, str(work / "resumed"), str(args.steps), str(args.steps)),
            invoke(args.new, store, str(work / "resumed"), str(args.steps), "0"),
        ],
        "new uninterrupted": [invoke(args.new, store, str(work / "fresh-new"), str(args.steps), "0")],
    }
    failed = False
    last = f"checkpoints/step-{args.steps}/trainer_state.safetensors"
    for name, results in runs.items():
        out = Path(results[-1]["out"])
        differ = tensors_equal(work / "ref/final/model.safetensors", out / "final/model.safetensors") + tensors_equal(
            work / "ref" / last, out / last
        )
        failed |= bool(differ) or not results[-1]["completed"]
        steps = " -> ".join(f"{r['step']}{' (' + r['stopped_by'] + ')' if r['stopped_by'] else ''} [{r['code']}]" for r in results)
        print(f"{name:26s} {'identical' if not differ else 'DIFFERENT: ' + ', '.join(differ[:5]):10s}  steps {steps}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
