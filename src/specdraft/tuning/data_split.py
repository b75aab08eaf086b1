"""How much of a quickstart's budget goes to regenerating data: a split made from rates measured in the run itself.

Each sample regenerated costs three times before the comparison: its regeneration, its extraction and ``epochs``
passes of training. A fixed data budget is right on one machine only: where training is fast next to regeneration
it leaves minutes unused at the end (issue #41: 320 samples in 5 minutes, then every capped epoch in under 3, and the
run done at 14.7 of its 20 minutes), where training is slow it leaves too few for the epochs. So the quickstart times
all three on a pilot (its first regenerated batches, extracted and trained on for a few steps) and regenerates as many
more samples as the rest of the budget carries through every later stage. The epoch cap stays: more passes over a few
hundred samples only overfit, so a budget that has time over buys samples, not passes.

:func:`plan_data_split` decides from a :class:`SplitInputs` and nothing else, so it is tested with injected rates;
:func:`engine_candidates` makes one per regeneration engine (a vLLM server's start against its speed) and
:func:`choose_data_split` keeps the engine whose split holds the most samples.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

from specdraft.errors import SpecdraftError
from specdraft.tuning.engines import ENGINES

#: Share of the budget left after the pilot that the split keeps unplanned: its rates are averages over a few batches,
#: and a busy machine runs the later stages slower than the pilot did. Not a speed: a slower machine gets the same share.
DRIFT_SHARE = 0.05


@dataclass(frozen=True)
class SplitInputs:
    """What the split is made from: seconds are this machine's, measured in this run (the pilot), never fixed in code.

    Per-sample figures are the pilot's averages: regeneration seconds per regenerated sample (its generate time, no
    engine start), extraction seconds per sample, training seconds per sample and epoch (a probe's median step times the
    pilot's steps per epoch, over its samples)."""

    seconds_left: float  # the budget left when the split is made (after the pilot and the comparison's sizing)
    engine: str  # what regenerates after the pilot (its rate is the pilot's, or the engine probe's scaled to it)
    regen_s_per_sample: float
    engine_start_s: float  # the regeneration engine's start (a vLLM server's minutes; nothing for HF), inside its deadline
    extract_s_per_sample: float
    train_s_per_sample_epoch: float
    epochs: int  # the epoch cap (``--epochs``): training's time is this many passes over the data
    pilot_samples: int  # already regenerated; extracted again and trained on with the rest
    max_new_samples: int  # what ``--samples`` leaves after the pilot
    batch_samples: int  # samples regenerated together: the batch running when regeneration's time is up still finishes
    reserve_s: float  # the comparison's reserve (measured: eval/budget.py; calibration runs within it)
    overhead_s: float  # per-stage costs that do not grow with the data (model loads, the training probe), as measured
    train_headroom: float  # the share of its time that training plans steps in (train/budget.py)

    def check(self) -> None:
        """A rate that is not a finite number of seconds >= 0 (or a regeneration that took none) cannot be planned
        with: an error naming it and the flag that fixes the split by hand, rather than a split of nonsense."""
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and not math.isfinite(value):
                raise _unusable(f.name, value, "is not finite")
        for name in ("regen_s_per_sample", "train_headroom"):
            if getattr(self, name) <= 0:
                raise _unusable(name, getattr(self, name), "must be > 0")
        for name in (
            "engine_start_s",
            "extract_s_per_sample",
            "train_s_per_sample_epoch",
            "reserve_s",
            "overhead_s",
            "pilot_samples",
            "max_new_samples",
        ):
            if getattr(self, name) < 0:
                raise _unusable(name, getattr(self, name), "must be >= 0")
        if self.epochs < 1 or self.batch_samples < 1:
            raise _unusable("epochs" if self.epochs < 1 else "batch_samples", min(self.epochs, self.batch_samples), "must be >= 1")


def _unusable(name: str, value: float, why: str) -> SpecdraftError:
    return SpecdraftError(
        f"the data split cannot be planned: the pilot's {name.replace('_', ' ')} ({value:g}) {why}; "
        "pass --data-budget MINUTES to give regeneration a fixed share of --budget"
    )


@dataclass(frozen=True)
class DataSplit:
    """The split: ``new_samples`` regenerated after the pilot, batches started within ``regen_s`` (regeneration's deadline),
    the projected seconds of each later stage, and what bound it (``budget`` or ``samples``: --samples ran out first)."""

    inputs: SplitInputs
    new_samples: int
    regen_s: float
    projected_s: dict[str, float]
    bound_by: str

    @property
    def total_s(self) -> float:
        return sum(self.projected_s.values())

    def facts(self) -> dict:
        """What the journal records: the rates, the split and its projection."""
        return {
            "engine": self.inputs.engine,
            "rates": {f.name: round(v, 4) for f in fields(self.inputs) if isinstance(v := getattr(self.inputs, f.name), (int, float))},
            "new_samples": self.new_samples,
            "regen_s": round(self.regen_s, 1),
            "projected_s": {k: round(v, 1) for k, v in self.projected_s.items()},
            "bound_by": self.bound_by,
        }

    def describe(self) -> str:
        """The split's one log block: the measured rates, then the seconds each stage is given."""
        i = self.inputs
        samples = i.pilot_samples + self.new_samples
        return "\n".join(
            [
                "quickstart data split (rates measured now, on the pilot):",
                f"  regenerate ({i.engine}): {i.regen_s_per_sample:.2f} s/sample after a {i.engine_start_s:.0f} s engine start; "
                f"extract: {i.extract_s_per_sample:.3f} s/sample; "
                f"train: {i.train_s_per_sample_epoch:.3f} s/sample/epoch x {i.epochs} epochs (cap)",
                f"  {self.new_samples} samples more than the pilot's {i.pilot_samples} ({samples} in all, bound by "
                f"{self.bound_by}): regeneration {self.regen_s / 60:.1f} min of the {i.seconds_left / 60:.1f} min left",
                "  projected: "
                + ", ".join(f"{k} {v / 60:.1f} min" for k, v in self.projected_s.items())
                + f" = {self.total_s / 60:.1f} min",
            ]
        )


def plan_data_split(inputs: SplitInputs) -> DataSplit:
    """The most samples whose regeneration, extraction and capped epochs of training fit, with the comparison's reserve,
    the stages' fixed costs and a drift share, in what is left of the budget; the pilot's samples are extracted and
    trained on too. None more where even the pilot's data fills it (training then gets what is left, as before)."""
    inputs.check()
    i = inputs
    train_s = i.epochs * i.train_s_per_sample_epoch / i.train_headroom  # per sample, as training's plan counts it
    later_s = i.extract_s_per_sample + train_s  # what a sample costs after it is regenerated
    fixed_s = i.reserve_s + i.overhead_s + DRIFT_SHARE * i.seconds_left + i.pilot_samples * later_s
    fitting = max(0, math.floor((i.seconds_left - fixed_s - i.engine_start_s) / (i.regen_s_per_sample + later_s)))
    # Regeneration runs whole batches and stops starting them at its deadline (the batch it is running then finishes):
    # the plan is whole batches, and the deadline falls half a batch after the last one starts, so that neither one
    # batch more nor one fewer runs when batch times jitter.
    new = min(fitting // i.batch_samples * i.batch_samples, i.max_new_samples)
    batches_s = (math.ceil(new / i.batch_samples) - 0.5) * i.batch_samples * i.regen_s_per_sample
    regen_s = i.engine_start_s + batches_s if new else 0.0
    samples = i.pilot_samples + new
    projected = {
        "regenerate": i.engine_start_s + new * i.regen_s_per_sample if new else 0.0,
        "extract": samples * i.extract_s_per_sample,
        "train": samples * train_s,
        "comparison": i.reserve_s,
        "fixed costs": i.overhead_s,
    }
    return DataSplit(i, new, regen_s, projected, "samples" if fitting >= i.max_new_samples else "budget")


def choose_data_split(candidates: Sequence[SplitInputs]) -> DataSplit:
    """The split of the engine that regenerates the most samples in its share (the first, the pilot's own engine, on a
    tie): a vLLM server's minutes of start-up pay off only where the budget leaves it minutes to generate."""
    if not candidates:
        raise SpecdraftError("the data split needs at least one regeneration engine to plan with")
    splits = [plan_data_split(c) for c in candidates]
    return max(splits, key=lambda split: split.new_samples)  # max keeps the first of equals


def engine_candidates(measured: SplitInputs, figures: Mapping[str, float], *, auto: bool) -> list[SplitInputs]:
    """The split's inputs for each engine that may regenerate after the pilot (``measured``: those of the pilot's own
    engine). A server's start is paid again (the pilot's stops when its prepare ends): the engine probe's start-up figure
    where it has one (``figures``: ``tuning/engines.py``'s ``NAME_tokens_per_s`` and ``NAME_start_s``). With
    ``--engine auto`` and both engines' figures, the other engine too: the pilot's seconds per sample scaled by the two
    engines' predicted tokens/s."""

    def start(engine: str) -> float:
        return float(figures.get(f"{engine}_start_s", 0.0))

    own = dataclasses.replace(measured, engine_start_s=max(measured.engine_start_s, start(measured.engine)))
    rates = {name: figures.get(f"{name}_tokens_per_s") for name in ENGINES}
    if not auto or measured.engine not in rates or not all(rates.values()):
        return [own]
    return [own] + [
        dataclasses.replace(
            measured,
            engine=other,
            regen_s_per_sample=measured.regen_s_per_sample * float(rates[measured.engine] or 0.0) / float(rate or 1.0),
            engine_start_s=start(other),
        )
        for other, rate in rates.items()
        if other != measured.engine
    ]
