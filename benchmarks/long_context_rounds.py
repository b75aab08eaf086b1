"""benchmarks/long_context.py, also recording each decode's rounds and committed tokens (OUT/rounds.json).

The benchmark reports tau only (committed / rounds); at 32 new tokens a prompt is ~25-30 rounds, so two drafters'
tau are only comparable next to how many rounds stand behind them. This wraps ``decoder_for_target`` so that every
``generate`` of a decoder records its label, prompt length, rounds and committed tokens; the benchmark itself runs
unchanged (same arguments):

  PYTHONPATH=$PWD/src .venv/bin/python benchmarks/long_context_rounds.py ARGS_OF_long_context.py
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import specdraft.decode.runtime as runtime  # noqa: E402

records: list[dict] = []
made = runtime.decoder_for_target


def decoder_for_target(*args, **kwargs):
    """The benchmark builds one decoder per --drafters entry, in order: the n-th one is the n-th label."""
    decoder = made(*args, **kwargs)
    index, generate = sum(1 for _ in decoders), decoder.generate
    decoders.append(decoder)

    def recording(prompts, *a, **kw):
        result = generate(prompts, *a, **kw)
        m = result.metrics
        records.append({"decoder": index, "prompt_tokens": len(prompts[0]), "rounds": m.rounds, "committed": m.committed})
        return result

    decoder.generate = recording
    return decoder


decoders: list = []
runtime.decoder_for_target = decoder_for_target
argv = sys.argv[1:]
sys.argv = [str(ROOT / "benchmarks/long_context.py"), *argv]
runpy.run_path(sys.argv[0], run_name="__main__")
out = argv[argv.index("--out") + 1] if "--out" in argv else ""
if out:
    from _common import labelled

    drafters = argv[argv.index("--drafters") + 1].split(",") if "--drafters" in argv else ["none", "ngram", "reference"]
    names = list(labelled(drafters))
    rows = [dict(r, drafter=names[r.pop("decoder")]) for r in records if r["prompt_tokens"] > 64]  # not the warm-ups
    (Path(out) / "rounds.json").write_text(json.dumps(rows, indent=1) + "\n")
