"""The decoded tau a run's data predicts, from a measured data-scaling fit, logged once as a prediction.

``benchmarks/data_scaling.py`` trains the default recipe on nested subsets of one dataset and fits decoded tau on
held-out conversations against training tokens, tau(T) = tau_inf - a * T^(-b), and what 2 or 3 epochs over the
same data are worth in fresh data (``epoch_token_multiplier``). Its ``--package-fit`` writes the fit here
(``reference/scaling/data_scaling.json``, keyed by target + method + recipe). At the start of a run ``specdraft
train`` logs what that fit says for the run's training tokens and epochs, so a user can tell before the first
step whether more data or more epochs are worth having. It is a prediction, labelled so and naming where it was
measured: the run's measured tau comes from its validation.

Where no fit exists for the run's target and method nothing is logged at INFO (a DEBUG line says so): a line on
every run of every other target and method would carry no information.
"""

from __future__ import annotations

import bisect
import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from specdraft.errors import SpecdraftError

if TYPE_CHECKING:
    from specdraft.targets.base import Target
    from specdraft.train.plan import RunPlan

log = logging.getLogger(__name__)

FIT_FILE = Path(__file__).resolve().parent.parent / "reference" / "scaling" / "data_scaling.json"
FIT_FORMAT = "specdraft.data_scaling"
RESULTS_PAGE = "docs/results/data_scaling.md"


@dataclass(frozen=True)
class ScalingFit:
    """One measured fit: decoded tau(T) = tau_inf - a * T^(-b) over unique training tokens T at 1 epoch, and the
    fresh-data multiplier of each measured epoch count."""

    target: str
    target_fingerprint: str | None
    method: str
    recipe: str
    tau_inf: float
    a: float
    b: float
    tokens_range: tuple[int, int]
    epoch_token_multiplier: dict[float, float]
    measured: str

    @classmethod
    def from_json(cls, entry: dict, where: Path) -> ScalingFit:
        try:
            return cls(
                target=str(entry["target"]),
                target_fingerprint=entry.get("target_fingerprint"),
                method=str(entry["method"]),
                recipe=str(entry["recipe"]),
                tau_inf=float(entry["tau_inf"]),
                a=float(entry["a"]),
                b=float(entry["b"]),
                tokens_range=(int(entry["tokens_range"][0]), int(entry["tokens_range"][1])),
                epoch_token_multiplier={float(k): float(v) for k, v in (entry.get("epoch_token_multiplier") or {}).items()},
                measured=str(entry.get("measured", "")),
            )
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise SpecdraftError(f"{where}: a data-scaling fit entry is malformed ({exc!r}); reinstall specdraft") from None

    def tau(self, tokens: float) -> float:
        """The fitted decoded tau at ``tokens`` unique training tokens, 1 epoch."""
        return self.tau_inf - self.a * max(tokens, 1.0) ** (-self.b)

    def multiplier(self, epochs: float) -> float:
        """Fresh-data tokens that ``epochs`` passes are worth, as a multiple of the data: the fraction seen below one
        epoch, linear between measured epoch counts, and the largest measured one's beyond them (not extrapolated)."""
        if epochs <= 1:
            return max(epochs, 0.0)
        known = sorted({1.0: 1.0, **self.epoch_token_multiplier}.items())
        counts = [e for e, _ in known]
        if epochs >= counts[-1]:
            return known[-1][1]
        i = bisect.bisect_right(counts, epochs)
        (e0, m0), (e1, m1) = known[i - 1], known[i]
        return m0 + (m1 - m0) * (epochs - e0) / (e1 - e0)

    def predict(self, tokens: float, epochs: float) -> float:
        return self.tau(tokens * self.multiplier(epochs))

    def matches(self, target: str, fingerprint: str | None, method: str) -> bool:
        return method == self.method and (target == self.target or (fingerprint is not None and fingerprint == self.target_fingerprint))


@functools.cache
def load_fits(path: Path = FIT_FILE) -> tuple[ScalingFit, ...]:
    """The packaged fits (none when the file is absent)."""
    if not path.is_file():
        return ()
    doc = json.loads(path.read_text())
    if not isinstance(doc, dict) or doc.get("format") != FIT_FORMAT:
        raise SpecdraftError(f"{path} is not a {FIT_FORMAT} file; reinstall specdraft")
    return tuple(ScalingFit.from_json(entry, path) for entry in doc.get("fits") or ())


def find_fit(fits: tuple[ScalingFit, ...], *, target: str, fingerprint: str | None, method: str) -> ScalingFit | None:
    return next((fit for fit in fits if fit.matches(target, fingerprint, method)), None)


def prediction_line(fit: ScalingFit, tokens: int, epochs: float) -> str:
    """The log line. Below the fit's smallest measured data there is no number: the power law falls without bound there
    (to a tau under 1, which no drafter has), so it would be a made-up figure; above its largest it is extrapolated,
    towards ``tau_inf``, and says so."""
    low, high = fit.tokens_range
    seen = tokens * fit.multiplier(epochs)
    source = f"the {fit.target} {fit.method} data-scaling fit of the {fit.recipe} recipe, {RESULTS_PAGE}"
    data = f"{tokens:,} training tokens x {epochs:.3g} epochs"
    if seen < low:
        return (
            f"no predicted decoded tau for {data}: {seen:,.0f} fresh-data tokens lie below the smallest measured point "
            f"({low:,} tokens) of {source}; more data is the first thing to get"
        )
    reach = "" if seen <= high else f", extrapolated: the fit measured {low:,}-{high:,} tokens"
    return (
        f"predicted decoded tau for {data}: {fit.predict(tokens, epochs):.2f} "
        f"(a prediction from {source}{reach}; measured tau comes from validation)"
    )


def log_predicted_tau(run: RunPlan, target: Target, fits: tuple[ScalingFit, ...] | None = None) -> str | None:
    """Log the prediction for ``run``'s training tokens and epochs when a fit exists for its target and method."""
    try:
        fits = load_fits() if fits is None else fits
    except SpecdraftError as exc:  # a prediction never stops a run
        log.warning("no predicted tau: %s", exc)
        return None
    fit = find_fit(fits, target=target.name, fingerprint=target.fingerprint, method=run.method)
    if fit is None:
        log.debug("no data-scaling fit for target %s, method %s: no predicted tau", target.name, run.method)
        return None
    data = run.data
    tokens = sum(min(data.lengths[i], data.sample_tokens) for i in data.train_indices)
    per_epoch = data.steps_in_epoch(0)
    line = prediction_line(fit, tokens, run.total_steps / per_epoch if per_epoch else 0.0)
    log.info("%s", line)
    return line
