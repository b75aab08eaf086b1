"""The table a run ends with: what training used and did, read from the journal's stage facts."""

from __future__ import annotations


def training_table(stages: dict, *, served_skipped: str = "") -> str:
    """What training used and did, from the journal: compute dtype (and the probe's figures), anchors/s,
    steps planned vs done (and why fewer, what to change), epochs and data volume; the served rows' reserve and drafter
    (or why they were skipped: ``served_skipped``)."""
    data, plan, done = stages.get("prepare", {}), stages.get("size-training", {}), stages.get("train", {})
    probe = (plan.get("dtype_probe") or {}).get("seconds") or {}
    dtype = done.get("dtype") or plan.get("dtype") or "?"
    if probe:
        dtype += " (step probe: " + ", ".join(f"{k} {v:.3f} s" for k, v in probe.items()) + ")"
    planned, steps = plan.get("steps"), done.get("steps")
    per_epoch = plan.get("steps_per_epoch")
    anchors = done.get("anchors_per_s") or plan.get("anchors_per_s")
    rows = [
        ("compute dtype", dtype),
        ("CPU threads", _measured_fact(done, "threads")),
        ("forward path", _measured_fact(done, "forward_path")),
        ("anchors/s", f"{anchors:.1f}" if anchors else "n/a"),
        ("steps", f"{steps} done of {planned} planned ({plan.get('seconds_per_step', 0):.2f} s/step in the probe)"),
        ("epochs", f"{steps / per_epoch:.2f} ({per_epoch} steps each)" if steps and per_epoch else "n/a"),
        ("data", f"{data.get('kept', '?')} samples, {data.get('tokens', 0):,} tokens ({data.get('loss_tokens', 0):,} response tokens)"),
        ("regeneration", _regeneration(data)),
    ]
    split = stages.get("size-data")
    if split:
        rows.append(
            (
                "data split",
                f"{split['new_samples']} samples planned after a pilot of {split['rates']['pilot_samples']:.0f} (bound by "
                f"{split['bound_by']}), regeneration {split['regen_s'] / 60:.1f} min; projected "
                f"{sum(split['projected_s'].values()) / 60:.1f} of the {split['rates']['seconds_left'] / 60:.1f} min left "
                f"(rates measured on the pilot: tuning/data_split.py)",
            )
        )
    if "reserve_s" in stages.get("size-eval", {}):
        sized = stages["size-eval"]
        rows.append(
            (
                "comparison reserve",
                f"{sized['reserve_s'] / 60:.1f} min (measured worst case of {sized['prompts']} prompts; "
                f"plain round {sized['round_ms']['autoregressive']:.0f} ms here)",
            )
        )
    rows += _served_facts(stages, served_skipped)
    if plan.get("budget_short"):
        rows.append(
            (
                "note",
                f"the budget left {plan.get('train_seconds', 0):.0f} s for training, less than one "
                f"{plan.get('seconds_per_step', 0):.1f} s step: raise --budget or lower --pack-tokens",
            )
        )
    if done.get("stopped_by_time_budget"):
        rows.append(
            (
                "note",
                f"steps ran slower than the probe measured, so the time budget stopped training at step {steps} of "
                f"{planned}; raise --budget or lower --samples / --pack-tokens",
            )
        )
    return "\n".join(["| training | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows])


def _served_facts(stages: dict, skipped: str) -> list[tuple[str, str]]:
    """The served rows' measured reserve and the served drafter's steps, or why the rows were skipped."""
    if skipped:
        return [("served rows", f"skipped: {skipped}")]
    sized, plan, done = stages.get("size-served"), stages.get("size-served-training", {}), stages.get("train-served", {})
    if not sized:
        return []
    figures = sized["figures"]
    return [
        (
            "served reserve",
            f"{sized['bench_s'] / 60:.1f} min: {sized['servers']} servers x (start {figures['start_s']:.0f} s + {sized['prompts']} "
            f"prompts x {figures['request_s']:.1f} s per {sized['tokens']}-token request; a plain vLLM server measured here: "
            "quickstart/served.py)",
        ),
        ("served drafter", f"dflash, {done.get('steps', '?')} steps done of {plan.get('steps', '?')} planned ({done.get('dtype', '?')})"),
    ]


def served_table(rows: list[dict]) -> str:
    """The served rows (``served.served_rows``): server, concurrency, tokens/s per user, speed-up over plain serving,
    served tau (vLLM's counters) and the replies identical to plain serving's."""

    def shown(value: float | str | None, spec: str = "", unit: str = "") -> str:
        return "-" if value is None else format(value, spec) + unit

    lines = [
        "| served (vLLM) | concurrency | tokens/s per user | speed-up | served tau | identical to plain |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['server']} | {r['concurrency']} | {r['per_user_tok_s']:.1f} | {shown(r['speedup'], '.2f', 'x')} | {shown(r['tau'], '.2f')} "
        f"| {shown(r['identical'])} |"
        for r in rows
    ]
    return "\n".join(lines)


def _measured_fact(facts: dict, name: str) -> str:
    """``2 (measured: 1 12 ms, 2 9 ms)``: a stage's ``name`` setting (threads, forward_path) and why, from the
    ``NAME``, ``NAME_source`` and ``NAME_seconds`` facts its probe recorded."""
    if name not in facts:
        return "n/a"
    figures = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in (facts.get(f"{name}_seconds") or {}).items())
    return f"{facts[name]} ({facts.get(f'{name}_source', '?')}{': ' + figures if figures else ''})"


def _regeneration(data: dict) -> str:
    """The engine that regenerated the answers, why, and its speed."""
    if "engine" not in data:
        return "n/a"
    figures = data.get("engine_figures") or {}
    why = data.get("engine_source", "?")
    if figures:
        why += (
            f": hf {figures['hf_tokens_per_s']:.1f}, vllm {figures['vllm_tokens_per_s']:.1f} tokens/s predicted + "
            f"{figures['vllm_start_s']:.0f} s start"
        )
    threads = f", {data['threads']} CPU threads ({data.get('threads_source', '?')})" if data["engine"] == "hf" and "threads" in data else ""
    return (
        f"{data['engine']} ({why}); {data.get('generated_tokens', 0):,} tokens at {data.get('generated_tokens_per_second', 0):.1f} "
        f"tokens/s{threads}"
    )
