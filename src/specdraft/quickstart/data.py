"""``data/``: the target's own answers, reused when a finished data stage left them, or split from rates measured in
this run (``tuning/data_split.py``): a pilot is regenerated, extracted and trained on (``size_data``), and the
prompts after it are regenerated for what the plan gives and joined with it (``grow_data``)."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specdraft.errors import SpecdraftError
from specdraft.quickstart.config import METHOD, MIN_TRAIN_S, QuickstartConfig
from specdraft.targets.base import Target

log = logging.getLogger(__name__)


def prepared_earlier(data: Path, target: Target) -> dict | None:
    """The summary a finished data stage left in the manifest of ``data``, when that holds a complete prepared dataset
    for ``target`` (None otherwise): a journal that lost the stage is no reason to regenerate answers for minutes, and
    to get other rows than the later stages' outputs were made from."""
    from specdraft.data.dataset import PreparedDataset

    try:
        dataset = PreparedDataset(data)
        dataset.check_target(target)
    except SpecdraftError:
        return None
    stats = dataset.manifest.get("stats")
    if not isinstance(stats, dict):
        return None
    print(f"[quickstart] prepare: {data} holds a complete prepared dataset, reused", flush=True)
    return stats


#: Regeneration batches of the pilot the data split is measured on: the first pays the engine's one-off costs, so a
#: second keeps the rate near a steady one; together enough samples for a few training steps and a held-out one.
PILOT_BATCHES = 2


def size_data(
    config: QuickstartConfig,
    target: Target,
    parts: Path,
    *,
    regenerate: Callable[..., dict],
    train_config: Callable[..., Any],
    seconds_left: Callable[[], float],
    reserve_s: float,
    drafters: int = 1,
) -> dict:
    """The data split, from rates measured in this run (``tuning/data_split.py``): a pilot of ``PILOT_BATCHES`` batches is
    regenerated (``parts/pilot``), extracted (``parts/pilot-states``) and trained on for a few steps, timing each stage
    per sample here; the plan gives regeneration what the later stages leave of the budget. The pilot's samples are
    kept: ``grow_data`` joins them with the ones regenerated after them. ``drafters``: drafters trained on the data, each
    in at most the time of the one timed here (the served one's share: ``served.py``), so training counts that often."""
    from specdraft.hidden_states.config import ExtractConfig
    from specdraft.hidden_states.extract import extract_hidden_states
    from specdraft.train.budget import HEADROOM, epoch_steps, probe_training
    from specdraft.tuning.data_split import SplitInputs, choose_data_split, engine_candidates
    from specdraft.tuning.measured import measuring_seconds

    pilot_samples = min(config.samples, max(2, PILOT_BATCHES * config.regen_batch_size))
    # Each stage's first run on a machine measures its settings (the regeneration engines, threads, forward paths, dtype)
    # and caches them; the later runs read the cache. Those seconds are left out of each stage's time (clock[i+1] -
    # clock[i]): counted in, a prepare's one-off engine probe became two prepares' fixed cost and the extraction's thread
    # probe a per-sample rate four times the real one (issue #41: the run ended at 13.4 of its 20 minutes).
    clock = [measuring_seconds()]
    # The pilot may take what the comparison and the least training leave; a machine too slow for that is refused by prepare.
    pilot = regenerate(parts / "pilot", max(seconds_left() - reserve_s - MIN_TRAIN_S, 1.0) / 60, samples=pilot_samples)
    clock.append(measuring_seconds())
    states = parts / "pilot-states"
    extracted = extract_hidden_states(
        ExtractConfig(dataset=str(parts / "pilot"), out=str(states), method=METHOD, threads=config.threads), target=target
    )
    clock.append(measuring_seconds())
    probe = probe_training(train_config(data=str(states)), target=target)
    clock.append(measuring_seconds())
    measuring = [b - a for a, b in itertools.pairwise(clock)]  # seconds measuring in the prepare, extraction, probe (a clock only grows)
    steps_per_epoch = epoch_steps(train_config(data=str(states), epochs=1))
    kept, regenerated = pilot["kept"], pilot.get("regenerated", 0)
    # What the pilot's prepare spent besides starting its engine and generating (loading, rendering prompts, the engine's
    # probes, writing): each of the two prepares left (the further prompts, the join) pays it again; each of training's
    # two starts left (the step-count probe, the run) costs what the pilot's probe did.
    engine_start_s = pilot.get("engine_start_seconds", 0.0)
    prepare_fixed_s = max(0.0, pilot["seconds"] - pilot.get("generation_seconds", 0.0) - engine_start_s - measuring[0])
    extract_s = max(0.0, extracted.seconds - measuring[1])
    inputs = SplitInputs(
        seconds_left=seconds_left(),
        engine=pilot.get("engine", config.engine),
        regen_s_per_sample=pilot.get("generation_seconds", 0.0) / regenerated if regenerated else 0.0,
        engine_start_s=engine_start_s,
        extract_s_per_sample=extract_s / extracted.samples_extracted if extracted.samples_extracted else 0.0,
        train_s_per_sample_epoch=drafters * probe["seconds_per_step"] * steps_per_epoch / kept,
        epochs=config.epochs,
        pilot_samples=kept,
        max_new_samples=config.samples - pilot_samples,
        batch_samples=config.regen_batch_size,
        reserve_s=reserve_s,
        overhead_s=2 * prepare_fixed_s + 2 * max(0.0, probe["probe_seconds"] - measuring[2]),
        train_headroom=HEADROOM,
    )
    split = choose_data_split(engine_candidates(inputs, pilot.get("engine_figures") or {}, auto=config.engine == "auto"))
    log.info("%s", split.describe())
    print(f"[quickstart] {split.describe()}", flush=True)
    return {**split.facts(), "pilot_read": pilot["read"], "pilot_prompts": pilot_samples}


def grow_data(config: QuickstartConfig, split: dict, parts: Path, data: Path, *, regenerate: Callable[..., dict]) -> dict:
    """``data``: the pilot's samples and, where the split (``size_data``'s facts) planned more, the prompts after the
    pilot's rows regenerated for its seconds, joined into one prepared dataset. Its summary is the join's, with the
    regeneration facts of both parts (the engine of the later one)."""
    from specdraft.data.dataset import PreparedDataset
    from specdraft.data.prepare import PrepareConfig, prepare

    sources = [parts / "pilot"]
    if split["new_samples"]:
        sources.append(parts / "more")
        regenerate(
            sources[-1],
            split["regen_s"] / 60,
            samples=config.samples - split["pilot_prompts"],
            skip_rows=split["pilot_read"],
            engine=split["engine"],
        )
    joined = prepare(PrepareConfig(out=str(data), target=config.target, data=",".join(map(str, sources)), max_length=config.max_length))
    facts = {**joined, **_regeneration_facts([PreparedDataset(p).manifest["stats"] for p in sources])}
    if len(sources) > 1:
        facts["engine_source"] = "the data split's: the engine that regenerates the most in its share (tuning/data_split.py)"
    return facts


#: Regeneration facts of a prepare summary that add up over the parts of a joined dataset; the others (the engine and
#: why) are the last part's.
_SUMMED = ("regenerated", "generated_tokens", "engine_start_seconds", "generation_seconds", "reused_batches", "generated_batches")


def _regeneration_facts(parts: list[dict]) -> dict:
    """The regeneration facts of the parts' prepare summaries, as one regeneration's: counts and seconds summed, the
    rate over their sum, the engine of the last part."""
    last = parts[-1]
    engine = {k: v for k, v in last.items() if k.startswith(("engine", "forward_path", "threads")) and k not in _SUMMED}
    summed = {k: round(sum(p.get(k, 0) for p in parts), 3) for k in _SUMMED}
    rate = summed["generated_tokens"] / summed["generation_seconds"] if summed["generation_seconds"] else 0.0
    return {**engine, **summed, "generated_tokens_per_second": round(rate, 2)}
