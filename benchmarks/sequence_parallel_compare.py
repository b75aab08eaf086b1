"""N = 1 against N = 2: final weights, the logged losses, and decoded tau with the rounds behind it (markdown).

  .venv/bin/python benchmarks/sequence_parallel_compare.py runs/sp/N1 runs/sp/N2 docs/results/long_train_sp [N1 N2]

The decode part reads DIR/long_context.json and DIR/rounds.json (``long_context_rounds.py``) for the two labels.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file


def weights(one: Path, two: Path) -> list[str]:
    a, b = load_file(str(one / "final/model.safetensors")), load_file(str(two / "final/model.safetensors"))
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    diffs = {k: (a[k].double() - b[k].double()).abs().max().item() for k in a}
    worst = max(diffs, key=diffs.__getitem__)
    scale = a[worst].double().abs().max().item()
    same = sum(torch.equal(a[k], b[k]) for k in a)
    total = sum(v.numel() for v in a.values())
    return [
        f"- final weights: {len(a)} tensors, {total:,} values; {same} tensors bit-identical; largest |N1 - N2| "
        f"{diffs[worst]:.3g} in `{worst}` (its largest |w| {scale:.3g}); median over tensors of the per-tensor max "
        f"{sorted(diffs.values())[len(diffs) // 2]:.3g}",
    ]


def losses(one: Path, two: Path) -> list[str]:
    lines = []
    recs = [[json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (one, two)]
    for split in ("train", "val"):
        a, b = ([r for r in rs if r.get("split") == split and "loss" in r] for rs in recs)
        if not a:
            continue
        assert [r["step"] for r in a] == [r["step"] for r in b], f"{split}: the runs logged different steps"
        d = [abs(x["loss"] - y["loss"]) for x, y in zip(a, b)]
        rel = [abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in zip(a, b)]
        counted = all(x.get(k) == y.get(k) for x, y in zip(a, b) for k in ("tokens", "labels", "anchors"))
        lines.append(
            f"- {split} loss: {len(a)} records (steps {a[0]['step']}-{a[-1]['step']}); largest |N1 - N2| {max(d):.3g} "
            f"(relative {max(rel):.2g}); last {a[-1]['loss']:.6f} vs {b[-1]['loss']:.6f}; tokens/labels/anchors per "
            f"record {'equal' if counted else 'DIFFER'}"
        )
    return lines


def taus(out: Path, labels: list[str]) -> list[str]:
    report = json.loads((out / "long_context.json").read_text())
    rounds = json.loads((out / "rounds.json").read_text())
    bucket_of = {r["prompt_tokens"]: r["bucket"] for r in report["rows"]}
    head = "| bucket | prompts | " + " | ".join(f"{n} tau (committed / rounds)" for n in labels) + " | difference |"
    lines = [head, "|" + " --- |" * 2 + " ---: |" * (len(labels) + 1)]
    for entry in report["buckets"]:
        cells, values = [], []
        for name in labels:
            rs = [r for r in rounds if r["drafter"] == name and bucket_of[r["prompt_tokens"]] == entry["bucket"]]
            c, n = sum(r["committed"] for r in rs), sum(r["rounds"] for r in rs)
            assert abs(c / n - entry[name]["tau"]) < 1e-9, (entry["bucket"], name)
            cells.append(f"{c / n:.3f} ({c} / {n})")
            values.append(c / n)
        lines.append(f"| {entry['bucket']} | {entry['prompts']} | " + " | ".join(cells) + f" | {values[1] - values[0]:+.3f} |")
    lines += [
        "",
        "| prompt | tokens | " + " | ".join(f"{n} tau (rounds)" for n in labels) + " |",
        "| --- |" + " ---: |" * (len(labels) + 1),
    ]
    for row in report["rows"]:
        cells = []
        for name in labels:
            (r,) = [r for r in rounds if r["drafter"] == name and r["prompt_tokens"] == row["prompt_tokens"]]
            cells.append(f"{r['committed'] / r['rounds']:.2f} ({r['rounds']})")
        lines.append(f"| {row['prompt']} | {row['prompt_tokens']} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    one, two, out = map(Path, sys.argv[1:4])
    labels = sys.argv[4:6] or ["N1", "N2"]
    print("\n".join(weights(one, two) + losses(one, two)))
    if (out / "rounds.json").exists():
        print()
        print("\n".join(taus(out, labels)))


if __name__ == "__main__":
    main()
