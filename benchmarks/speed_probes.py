"""What the ``auto`` thread counts and ``prepare --engine auto`` measure and choose on this machine.

Runs the library's own probes into a fresh scratch cache (so it always measures) on the embedded
target and the quickstart's drafter, and prints the figures and choices as JSON:

* threads of a training step (the quickstart's recipe at ``--pack-tokens``, in the dtype its probe picks),
  of plain decoding (eval / generate), of an extraction forward (8 x 256 tokens) and of HF regeneration;
* with ``--engine``: the regeneration engine probe on the quickstart's ShareGPT prompts (batch 16,
  HF and a vLLM server from .venv-vllm, its start timed), and the engine each budget would then get
  for the quickstart's work (512 prompts x 128 tokens), the server start still to pay.

  .venv/bin/python benchmarks/speed_probes.py --engine
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m", help="embedded target name")
    parser.add_argument("--pack-tokens", type=int, default=512, help="tokens per training step (the quickstart's 512)")
    parser.add_argument("--engine", action="store_true", help="also probe the regeneration engines (starts a vLLM server)")
    args = parser.parse_args()

    import torch
    from _common import quickstart_drafter

    from specdraft.data.regenerate import EngineRequest, GenerationSettings, resolve_engine
    from specdraft.data.sources import conversation, iter_rows
    from specdraft.decode.runtime import resolve_decode_threads
    from specdraft.quickstart import QuickstartConfig
    from specdraft.targets import load_target
    from specdraft.train.step import StepModule, measure_train_dtype, synthetic_batch, train_step
    from specdraft.tuning.engines import choose_engine
    from specdraft.tuning.measured import machine_identity
    from specdraft.tuning.threads import resolve_forward_threads, resolve_threads

    target = load_target(args.target)
    cpu = torch.device("cpu")
    report: dict = {"machine": machine_identity(threads=False)}
    with tempfile.TemporaryDirectory() as scratch:
        os.environ["SPECDRAFT_CACHE"] = scratch  # after the target is loaded (its conversion stays cached): every probe measures

        def record(name, m):
            report[name] = {"seconds": m.seconds, "choice": m.choice}

        module = StepModule(quickstart_drafter(target))
        batch = synthetic_batch(
            rows=1, tokens=args.pack_tokens, slots=len(module.drafter.config.slots()), hidden=target.hidden_size, vocab=target.vocab_size
        )
        dtype = measure_train_dtype(module, batch, device=cpu, context={"pack_tokens": args.pack_tokens})
        record("train_dtype", dtype)
        record("train_threads", resolve_threads(0, "train-threads", {}, lambda: train_step(module, batch, dtype=dtype.choice, device=cpu)))
        decode_threads = resolve_decode_threads(target, 0)  # a Choice (tuning/settings.py)
        report["decode_threads"] = {"seconds": decode_threads.seconds, "choice": str(decode_threads.value)}
        record("forward_threads", resolve_forward_threads(0, target.model, fingerprint=target.fingerprint, rows=8, tokens=256))

        qs = QuickstartConfig()
        prompts = []
        for row in iter_rows("sharegpt"):
            user = [m for m in conversation(row.messages or []) if m["role"] == "user"][:1]
            if user:
                prompts.append(target.tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=True, return_dict=False))
            if len(prompts) == 64:
                break
        prompts = [p for p in prompts if len(p) < qs.max_length - qs.max_new_tokens]
        eos = frozenset(target.end_of_turn_ids)
        request = EngineRequest(target, min(eos), eos, GenerationSettings(qs.max_new_tokens, 0.0, qs.regen_batch_size, 0, "hf"))
        choice = resolve_engine(request, prompts, requested="auto" if args.engine else "hf", threads=0, deadline=None)
        if choice.server is not None:
            choice.server.stop()
        report["regenerate"] = choice.facts
        figures = choice.facts.get("engine_figures")
        if figures:
            work = qs.samples * qs.max_new_tokens
            report["engine_for_budget"] = {
                f"{budget} min" if budget else "no limit": choose_engine(
                    figures, work_tokens=work, budget_s=budget * 60 if budget else None, server_running=False
                )
                for budget in (1, 2, 5, 10, 20, 0)  # minutes of regeneration: the quickstart's share is split from measured rates
            }
    print(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
