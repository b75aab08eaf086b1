"""The per-family table of pipeline stages passed, from a run of ``tests/test_families.py`` (the tests are the evidence).

Runs the family tests (tiny random models of each family's own config class) under pytest with a JUnit
report and tabulates each family's stages: passed, failed, or N/A with the reason the test gives
(a stage that cannot run on CPU skips with why). Writes JSON and a Markdown table.

  .venv/bin/python benchmarks/family_stages.py --out docs/results/family_stages
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: test function -> stage, in pipeline order
STAGES = {
    "test_prepare": "prepare",
    "test_extract_equals_hf_hidden_states": "extract == HF",
    "test_train": "train DFlash",
    "test_dspark_trains": "train DSpark",
    "test_eagle3_trains": "train EAGLE-3",
    "test_greedy_decoding_with_the_trained_drafter_is_exact": "greedy exact (trained drafter)",
    "test_greedy_is_exact_with_drafts_rejected_at_varied_positions": "greedy exact (forced rejections)",
    "test_sampled_decoding_is_exact": "sampled exact",
    "test_checkpoint_loads_in_speculators": "speculators 0.9.0 load",
    "test_checkpoint_loads_in_vllm": "vLLM 0.32 load (CPU)",
}


def run_tests(report: Path, extra: list[str]) -> int:
    tests = [f"tests/test_families.py::{name}" for name in STAGES]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *tests, *extra]
    return subprocess.run(command, cwd=ROOT).returncode


def stage_table(report: Path) -> dict[str, dict[str, dict]]:
    """family -> stage -> {"status": passed|failed|n/a, "why": ...} from a JUnit report."""
    table: dict[str, dict[str, dict]] = {}
    for case in ET.parse(report).iter("testcase"):
        match = re.fullmatch(r"(\w+)\[(\w+)\]", case.get("name", ""))
        if not match or match.group(1) not in STAGES:
            continue
        test, family = match.groups()
        skipped = case.find("skipped")
        failed = case.find("failure") if case.find("failure") is not None else case.find("error")
        if failed is not None:
            entry = {"status": "failed", "why": " ".join((failed.get("message") or "").split())[:300]}
        elif skipped is not None:
            entry = {"status": "n/a", "why": " ".join((skipped.get("message") or "").removeprefix("Skipped: ").split())[:300]}
        else:
            entry = {"status": "passed", "why": ""}
        table.setdefault(family, {})[STAGES[test]] = entry
    return table


def markdown(table: dict[str, dict[str, dict]]) -> str:
    stages = list(STAGES.values())
    lines = ["| family | " + " | ".join(stages) + " |", "|---|" + "---|" * len(stages)]
    notes = []
    for family, row in table.items():
        cells = []
        for stage in stages:
            entry = row.get(stage, {"status": "not run", "why": ""})
            if entry["status"] == "n/a":
                notes.append(f"{family}, {stage}: {entry['why']}")
                cells.append(f"N/A ({len(notes)})")
            else:
                cells.append(entry["status"])
        lines.append(f"| {family} | " + " | ".join(cells) + " |")
    return "\n".join(lines + [""] + [f"({i}) {note}" for i, note in enumerate(notes, 1)]) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="", help="write OUT.json and OUT.md")
    parser.add_argument("pytest_args", nargs="*", help="further pytest arguments (e.g. -k qwen3)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "families.xml"
        code = run_tests(report, args.pytest_args)
        table = stage_table(report)
    text = markdown(table)
    print(text)
    if args.out:
        Path(f"{args.out}.json").write_text(json.dumps({"pytest_exit": code, "stages": table}, indent=1) + "\n")
        Path(f"{args.out}.md").write_text(
            "# Pipeline stages per target family\n\nFrom `.venv/bin/python benchmarks/family_stages.py "
            "--out docs/results/family_stages` (tiny random models of each family's config "
            "class, `tests/test_families.py`).\n\n" + text
        )
    sys.exit(code)


if __name__ == "__main__":
    main()
