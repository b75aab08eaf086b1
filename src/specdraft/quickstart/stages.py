"""``run_quickstart``: one phase per stage, each taking the run's shared state (``_Run``) and recording its facts in
the journal, so that a rerun skips what an earlier one finished."""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdraft.errors import SpecdraftError
from specdraft.quickstart.comparison import eval_drafters, size_eval
from specdraft.quickstart.config import EVAL_MARGIN_S, METHOD, QuickstartConfig, check_budget
from specdraft.quickstart.data import grow_data, prepared_earlier, size_data
from specdraft.quickstart.journal import Journal
from specdraft.quickstart.report import training_table
from specdraft.targets.base import Target
from specdraft.utils.io import atomic_write_json
from specdraft.utils.lock import claims_output
from specdraft.utils.provenance import write_provenance

if TYPE_CHECKING:
    from specdraft.train.config import TrainConfig


@dataclass
class _Run:
    """One invocation's shared state (settings, journal, target, paths, clock), so that each phase takes it alone."""

    config: QuickstartConfig
    journal: Journal
    target: Target
    out: Path
    recipe: Path
    #: The recipe's method drafts blocks, so --max-anchors sizes its steps (EAGLE-3 drafts every position: no anchors).
    anchored: bool
    started: float
    deadline: float
    #: Seconds kept for the comparison: set by ``_size_comparison``, the first phase after ``_open_run``.
    reserve_s: float = 0.0

    @property
    def data(self) -> Path:
        return self.out / "data"

    @property
    def states(self) -> Path:
        return self.out / "hidden_states"

    @property
    def train_dir(self) -> Path:
        return self.out / "train"

    @property
    def final(self) -> Path:
        return self.train_dir / "final"

    def seconds_left(self) -> float:
        return self.deadline - time.perf_counter()

    def train_config(self, **overrides: Any) -> TrainConfig:
        """The recipe with quickstart's training flags over it, and ``overrides`` over those."""
        from specdraft.train.config import resolve_config

        config = self.config
        values = {
            "data": str(self.states),
            "out": str(self.train_dir),
            "num_threads": config.threads,
            "pack_tokens": config.pack_tokens,
            "epochs": config.epochs,
            "model": {"max_anchors": config.max_anchors} if self.anchored else {},
            **overrides,
        }
        return resolve_config(self.recipe, values)

    def regenerate(self, out: Path, minutes: float, *, samples: int, skip_rows: int = 0, engine: str | None = None) -> dict:
        """``samples`` ShareGPT prompts after the first ``skip_rows`` rows, answered by the target (with ``engine``;
        unset, ``--engine``) for at most ``minutes`` (a dataset prepared there earlier is reused)."""
        from specdraft.data.prepare import PrepareConfig, prepare

        config = self.config
        return prepared_earlier(out, self.target) or prepare(
            PrepareConfig(
                out=str(out),
                target=config.target,
                data="sharegpt",
                max_samples=samples,
                skip_rows=skip_rows,
                max_length=config.max_length,
                regenerate=True,
                max_new_tokens=config.max_new_tokens,
                batch_size=config.regen_batch_size,
                threads=config.threads,
                regen_budget=minutes,
                engine=engine or config.engine,
            )
        )


# One writer per run. No kind of its own: the run only adds its own entries (a log the user keeps there does not stop a
# resume), and each stage claims its own directory inside it with that stage's kind.
@claims_output(None)
def run_quickstart(config: QuickstartConfig) -> dict:
    """Run (or resume) every stage; returns the eval report."""
    run = _open_run(config)
    _size_comparison(run)
    _prepare_data(run)
    _extract_states(run)
    _train_drafter(run)
    _calibrate_drafter(run)
    report = _compare_decoders(run)
    _close_run(run)
    return report


def _open_run(config: QuickstartConfig) -> _Run:
    """The run directory, its journal (what earlier invocations finished), the target and the recipe, which every later
    phase reads; the budget's clock starts before the target loads, since loading it is part of the run."""
    from specdraft.models.base import METHODS
    from specdraft.targets import load_target
    from specdraft.train.config import load_recipe, recipe_path
    from specdraft.tuning.threads import set_threads

    started = time.perf_counter()
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    journal = Journal(out / "quickstart.json", config)
    if config.threads:
        set_threads(config.threads)
    target = load_target(config.target)
    recipe = recipe_path(config.recipe)
    anchored = "max_anchors" in {f.name for f in fields(METHODS.get(load_recipe(recipe)["method"]).config_cls)}
    return _Run(config, journal, target, out, recipe, anchored, started=started, deadline=started + config.budget * 60)


def _size_comparison(run: _Run) -> None:
    """The comparison's reserve (``--eval-reserve``, or measured by ``size_eval``), first: a budget it leaves no training
    in is refused before the data stages spend their minutes."""
    config = run.config
    run.reserve_s = (
        config.eval_reserve * 60
        or run.journal.run("size-eval", lambda: size_eval(config, run.target, run.train_config(), final=run.final))["reserve_s"]
    )
    check_budget(config, run.reserve_s, spent_s=time.perf_counter() - run.started)


def _prepare_data(run: _Run) -> None:
    """``data/``: the target's own answers, regenerated for ``--data-budget`` minutes or, unset, for what the split
    measured on a pilot (``size_data``) leaves the later stages, the pilot's rows joined with the later ones
    (``grow_data``)."""
    config, journal = run.config, run.journal
    if config.data_budget is not None:
        minutes = config.data_budget
        journal.run("prepare", lambda: run.regenerate(run.data, minutes, samples=config.samples))
        return
    parts = run.out / "data-split"
    split = journal.run(
        "size-data",
        lambda: size_data(
            config,
            run.target,
            parts,
            regenerate=run.regenerate,
            train_config=run.train_config,
            seconds_left=run.seconds_left,
            reserve_s=run.reserve_s,
        ),
    )
    journal.run(
        "prepare", lambda: prepared_earlier(run.data, run.target) or grow_data(config, split, parts, run.data, regenerate=run.regenerate)
    )


def _extract_states(run: _Run) -> None:
    """``hidden_states/``: the recipe's layers of the target for every prepared sample, which training reads instead of
    running the target."""
    from specdraft.hidden_states.config import ExtractConfig
    from specdraft.hidden_states.extract import extract_hidden_states

    config = run.config
    run.journal.run(
        "extract",
        lambda: extract_hidden_states(
            ExtractConfig(dataset=str(run.data), out=str(run.states), method=METHOD, threads=config.threads), target=run.target
        ).to_dict(),
    )


def _train_drafter(run: _Run) -> None:
    """``train/``: a step count a short timing probe fits into what the comparison's reserve leaves (capped at
    ``--epochs`` passes), so that the learning-rate schedule completes inside the budget; then training to it."""
    from specdraft.train.budget import steps_for_budget
    from specdraft.train.trainer import train
    from specdraft.tuning.budget_probes import median_record

    config, target = run.config, run.target

    def training_seconds_left() -> float:
        return run.seconds_left() - run.reserve_s

    def probe() -> dict:
        return steps_for_budget(run.train_config(), training_seconds_left(), target=target, cap_at_epochs=True)

    steps = run.journal.run("size-training", probe)["steps"]

    def train_in_budget() -> dict:
        # Steps are sized by a short probe, but step times drift (load, a slowing process): max_time keeps the
        # budget, stopping with a final checkpoint before the schedule ends if it must. Validation runs once, at
        # the end (both taus for the card): validating every 100 steps spent on decoding the budget the plan gave
        # to steps, and cut the plan short (docs/results/machine_tuning.md).
        result = train(
            run.train_config(
                max_steps=steps, max_time=max(60.0, training_seconds_left()), eval_interval=0, report_to=list(config.report_to)
            ),
            target=target,
        )
        return {
            **_train_facts(result),
            "dtype": result.compute_dtype,
            **(result.threads or {}),
            **(result.forward_path or {}),
            "anchors_per_s": median_record(run.train_dir / "metrics.jsonl", "anchors_per_s"),
        }

    run.journal.run("train", train_in_budget)


def _calibrate_drafter(run: _Run) -> None:
    """``train/final/``: the drafter's confidence head calibrated on the run's validation split, so that the scheduled
    decoders of the comparison gate on calibrated confidences."""
    from specdraft.train.calibrate import CalibrateConfig, calibrate

    run.journal.run("calibrate", lambda: calibrate(CalibrateConfig(drafter=str(run.final), data=str(run.states)), target=run.target))


def _compare_decoders(run: _Run) -> dict:
    """``eval/``: the decoders (``eval_drafters``) on the ``quick`` suite in what is left of the budget; always rerun, as
    it is cheap next to training. Returns its report."""
    from specdraft.decode.config import SamplingConfig
    from specdraft.eval.config import EvalConfig
    from specdraft.eval.runner import run_eval

    config = run.config
    eval_config = EvalConfig(
        out=str(run.out / "eval"),
        target=config.target,
        suite="quick",
        limit_per_domain=config.eval_prompts_per_domain,
        max_new_tokens=config.eval_max_new_tokens,
        drafters=eval_drafters(config, run.final),
        lookup_corpus=str(run.data),
        threads=config.threads,
        max_time=max(60.0, run.seconds_left() - EVAL_MARGIN_S),
        report_to=list(config.report_to),
    )
    report: dict = {}

    def evaluate() -> dict:
        report.update(run_eval(eval_config, SamplingConfig(), target=run.target))
        return {"report": str(run.out / "eval" / "report.json")}

    run.journal.forget("eval")
    run.journal.run("eval", evaluate)
    return report


def _close_run(run: _Run) -> None:
    """The run's wall time in the journal, its provenance and the table of what training used: the record its figures
    are checked against."""
    total = time.perf_counter() - run.started
    journal = run.journal
    journal.state["wall_s"] = round(total, 1)
    atomic_write_json(journal.path, journal.state)
    write_provenance(
        run.out,
        config=run.config,
        target=run.target.describe(),
        inputs=[run.recipe, run.data, run.states],
        measured=journal.state["stages"],
    )
    print(training_table(journal.state["stages"]))
    print(f"[quickstart] finished in {total / 60:.1f} min (budget {run.config.budget:g} min); report: {run.out / 'eval' / 'report.md'}")


def _train_facts(result: Any) -> dict:
    """Steps and final checkpoint; a run cut by the time budget counts as done (its final checkpoint exists)."""
    if not result.completed and result.stopped_by != "max_time":
        raise SpecdraftError(f"training stopped early ({result.stopped_by}) at step {result.step}; rerun quickstart to resume")
    return {"steps": result.step, "final": str(result.final), "stopped_by_time_budget": not result.completed}
