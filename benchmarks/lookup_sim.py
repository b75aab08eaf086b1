"""Lookup drafting (prompt lookup, suffix drafting from the target's answers) simulated exactly on held-out greedy answers.

Under greedy verification a lookup proposal's fate needs no target forward (``eval/lookup_replay.py``): the committed
text is the target's own greedy continuation, so a round accepts the longest common prefix of the proposal and that
continuation, plus the bonus token. The answers ``specdraft prepare`` regenerated are such continuations (greedy, the target itself), so
replaying them round by round gives the exact tau of every lookup setting in seconds, where a decoded eval takes
minutes per setting. (Exact up to where the regeneration's batched fp32 forward and the runtime's forward pick
different argmaxes: rare, and the same for every setting.) Time per round comes from a measured forward table
(``benchmarks/forward_path.py``'s JSON: a verify of k proposed tokens costs the k+1-token forward); the lookup's own
cost (hash lookups, microseconds) is left out.

The corpus is built from the training side of the conversation split (``train/split.py``) and the replay runs on the
validation side, so no answer is looked up in itself. With ``--suite`` the replay runs instead on the target's greedy
continuations of an eval suite's prompts (generated here, HF ``generate``: what ``specdraft eval`` compares on), and
the corpus holds every answer in ``--data``, as ``--lookup-corpus`` does. Prints and writes a table per setting: tau, the share of rounds
that verified a proposal, and the estimated speed-up over autoregressive decoding; ``--out`` writes JSON and Markdown.

  PYTHONPATH=src .venv/bin/python benchmarks/lookup_sim.py --data runs/qs4/data --val-fraction 0.3 \\
      --costs docs/results/forward_path.json --path prepacked+gqa --out docs/results/lookup_sim
  ... --suite quick --limit-per-domain 2 --max-new-tokens 64 --threads 2   (the eval suite instead of validation rows)
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import benchmark_parser, load_benchmark_target


@dataclass(frozen=True)
class Setting:
    """One lookup configuration: prompt lookup's n-gram range and draft length, and the corpus (None: ngram alone)."""

    name: str
    max_tokens: int
    corpus: dict | None  # AnswerCorpus keyword arguments
    max_ngram: int = 3
    min_ngram: int = 2


def suite_rows(args: argparse.Namespace) -> list[tuple[np.ndarray, np.ndarray]]:
    """(prompt + greedy continuation, mask of the continuation) per prompt of ``--suite``."""
    import torch

    from specdraft.eval.suites import load_prompts

    target = load_benchmark_target(args)
    rows = []
    for prompt in load_prompts(args.suite, limit_per_domain=args.limit_per_domain):
        ids = prompt.token_ids(target.tokenizer)
        with torch.inference_mode():
            out = target.model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False,
                max_new_tokens=args.max_new_tokens,
                pad_token_id=target.tokenizer.eos_token_id,
            )[0].numpy()
        rows.append((out, np.r_[np.zeros(len(ids), bool), np.ones(len(out) - len(ids), bool)]))
    return rows


def simulate(
    setting: Setting, rows: list[tuple[np.ndarray, np.ndarray]], corpus_answers: list[np.ndarray], cost_ms: dict[int, float]
) -> dict:
    from specdraft.decode.proposers.corpus import AnswerCorpus, answer_runs
    from specdraft.decode.proposers.ngram import Lookup
    from specdraft.eval.lookup_replay import replay, summarize

    corpus = AnswerCorpus(corpus_answers, **setting.corpus) if setting.corpus is not None else None
    lookup = Lookup(setting.max_ngram, setting.min_ngram, corpus)
    rounds = [r for ids, mask in rows for lo, hi in answer_runs(mask) for r in replay(lookup, ids, lo, hi, setting.max_tokens)]
    return {"setting": setting.name, "max_tokens": setting.max_tokens, "corpus": setting.corpus, **asdict(summarize(rounds, cost_ms))}


def settings(draft_lengths: list[int], shares: list[float], occurrences: list[int], contexts: list[tuple[int, ...]]) -> list[Setting]:
    out = [Setting(f"ngram k={k}", k, None) for k in draft_lengths]
    for k, share, occ, ctx in itertools.product(draft_lengths, shares, occurrences, contexts):
        out.append(
            Setting(
                f"suffix k={k} share>={share:g} seen>={occ} ctx={'/'.join(map(str, ctx))}",
                k,
                {"min_share": share, "min_occurrences": occ, "context_lengths": ctx},
            )
        )
    return out


def markdown(result: dict) -> str:
    p = result["protocol"]
    lines = [
        f"# Lookup drafting replayed on the target's greedy text: {p['replay']} (corpus from {p['data']})",
        "",
        f"Corpus: {p['corpus_answers']} answers, {p['corpus_tokens']:,} tokens; replay: {p['val_rows']} {p['replay']}, "
        f"{p['val_tokens']:,} answer tokens (validation rows: split by conversation, val fraction {p['val_fraction']}, the corpus "
        f"from the training side; a suite: the target's greedy continuations, the corpus from all answers). Exact greedy tau; speed-up "
        f"estimated from `{p['costs']}` path `{p['path']}` (k+1-token forward per round of k proposed).",
        "",
        f"    {p['command']}",
        "",
        "| setting | tau | rounds drafted | mean proposed | accepted / proposed | est. speed-up |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in sorted(result["runs"], key=lambda r: -r["speedup_est"]):
        lines.append(
            f"| {r['setting']} | {r['tau']:.3f} | {r['drafted_share']:.0%} | {r['mean_proposed']:.2f} | {r['accepted_per_proposed']:.2f} | "
            f"{r['speedup_est']:.3f}x |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--data", required=True, help="a `specdraft prepare` output with the target's regenerated answers")
    parser.add_argument("--val-fraction", type=float, default=0.3)
    parser.add_argument("--split-seed", type=int, default=0)
    parser.add_argument(
        "--costs", default="docs/results/forward_path.json", help="benchmarks/forward_path.py JSON (forward_ms per path and k)"
    )
    parser.add_argument("--path", default="prepacked+gqa", help="the forward path whose k-token costs price a round")
    parser.add_argument("--draft-lengths", default="4,7", help="proposed tokens per round at most (the runtime's --num-draft-tokens)")
    parser.add_argument("--min-shares", default="0,0.1,0.2,0.3")
    parser.add_argument("--min-occurrences", default="1,2,3")
    parser.add_argument("--contexts", default="4/3/2,6/5/4/3/2,3/2", help="context lengths tried, longest first; sets separated by commas")
    parser.add_argument(
        "--suite", default=None, help="replay the target's greedy continuations of this eval suite instead of validation rows"
    )
    parser.add_argument("--limit-per-domain", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", default=None, help="path stem of the JSON and Markdown results")
    args = parser.parse_args()

    from specdraft.data.dataset import PreparedDataset
    from specdraft.decode.proposers.corpus import answer_runs, prepared_answers
    from specdraft.hidden_states.source import PreparedRows
    from specdraft.train.split import dataset_split

    prepared = PreparedDataset(args.data)
    split = dataset_split(PreparedRows(prepared), val_fraction=args.val_fraction, seed=args.split_seed)
    corpus_answers = prepared_answers(prepared, range(len(prepared)) if args.suite else split.train)
    val_rows = suite_rows(args) if args.suite else [(prepared[i]["input_ids"].numpy(), prepared[i]["loss_mask"].numpy()) for i in split.val]
    table = json.loads(Path(args.costs).read_text())["forward_ms"]
    if args.path not in table:
        raise SystemExit(f"--path {args.path}: {args.costs} has forward costs for {', '.join(table)}")
    cost_ms = {int(k): float(v) for k, v in table[args.path].items()}
    grid = settings(
        [int(k) for k in args.draft_lengths.split(",")],
        [float(s) for s in args.min_shares.split(",")],
        [int(o) for o in args.min_occurrences.split(",")],
        [tuple(int(n) for n in c.split("/")) for c in args.contexts.split(",")],
    )
    runs = []
    for setting in grid:
        runs.append(simulate(setting, val_rows, corpus_answers, cost_ms))
        print(f"{setting.name}: tau {runs[-1]['tau']:.3f}, est. {runs[-1]['speedup_est']:.3f}x", flush=True)
    protocol = {
        "data": args.data,
        "replay": f"suite {args.suite}" if args.suite else "validation rows",
        "val_fraction": args.val_fraction,
        "split_seed": args.split_seed,
        "costs": args.costs,
        "path": args.path,
        "cost_ms": cost_ms,
        "corpus_answers": len(corpus_answers),
        "corpus_tokens": int(sum(len(a) for a in corpus_answers)),
        "val_rows": len(val_rows),
        "val_tokens": int(sum(hi - lo for _, mask in val_rows for lo, hi in answer_runs(mask))),
        "command": " ".join(["benchmarks/lookup_sim.py", *sys.argv[1:]]),
    }
    result = {"protocol": protocol, "runs": runs}
    print(markdown(result))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(result, indent=1))
        out.with_suffix(".md").write_text(markdown(result))


if __name__ == "__main__":
    main()
