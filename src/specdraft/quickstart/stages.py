"""``run_quickstart``: one phase per stage, each taking the run's shared state (``_Run``) and recording its facts in
the journal, so that a rerun skips what an earlier one finished."""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdraft.errors import SpecdraftError
from specdraft.quickstart.comparison import eval_drafters, size_eval
from specdraft.quickstart.config import EVAL_MARGIN_S, METHOD, MIN_TRAIN_S, QuickstartConfig, check_budget
from specdraft.quickstart.data import grow_data, prepared_earlier, size_data
from specdraft.quickstart.journal import Journal
from specdraft.quickstart.report import served_table, training_table
from specdraft.quickstart.served import (
    SERVED_DRAFTERS,
    SERVED_RECIPE,
    find_served_python,
    served_bench_config,
    served_rows,
    served_training_budget,
    size_served,
)
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
    #: The vLLM environment the served rows run in; None where they are off, not possible or not affordable
    #: (``served.py``), and why in the journal's ``served_skipped``.
    served_python: Path | None = None
    #: Seconds kept for the comparison: set by ``_size_comparison``, the first phase after ``_open_run``.
    reserve_s: float = 0.0
    #: Seconds kept for the served bench (measured by ``size_served``), with the served rows on.
    served_s: float = 0.0
    #: Seconds the served drafter's training was planned (``_plan_served_training``) and has not run yet.
    served_train_s: float = 0.0

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

    @property
    def served_train_dir(self) -> Path:
        return self.out / "train-served"

    @property
    def served_dir(self) -> Path:
        return self.out / "served"

    def kept_s(self) -> float:
        """Seconds the stages after training keep: the comparison's reserve and, with the served rows on, the bench's."""
        return self.reserve_s + self.served_s

    def skip_served(self, why: str) -> None:
        """The served rows dropped, with a one-line log and the reason in the journal (``served_skipped``)."""
        self.served_python = None
        self.served_s = self.served_train_s = 0.0
        self.journal.state["served_skipped"] = why
        print(f"[quickstart] served rows skipped: {why}", flush=True)

    def seconds_left(self) -> float:
        return self.deadline - time.perf_counter()

    def train_config(self, **overrides: Any) -> TrainConfig:
        """The recipe with quickstart's training flags over it, and ``overrides`` over those."""
        return _training_flags(self.config, self.recipe, self.anchored, {"data": str(self.states), "out": str(self.train_dir), **overrides})

    def served_config(self, **overrides: Any) -> TrainConfig:
        """The served drafter's recipe (``SERVED_RECIPE``) with quickstart's training flags, on the run's hidden states."""
        from specdraft.train.config import recipe_path

        recipe = recipe_path(SERVED_RECIPE)
        values = {"data": str(self.states), "out": str(self.served_train_dir), **overrides}
        return _training_flags(self.config, recipe, _anchored(recipe), values)

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
    _train_served(run)
    _bench_served(run)
    report = _compare_decoders(run)
    _close_run(run)
    return report


def _open_run(config: QuickstartConfig) -> _Run:
    """The run directory, its journal (what earlier invocations finished), the target and the recipe, which every later
    phase reads; the budget's clock starts before the target loads, since loading it is part of the run."""
    from specdraft.targets import load_target
    from specdraft.train.config import recipe_path
    from specdraft.tuning.threads import set_threads

    started = time.perf_counter()
    served_python, served_why = find_served_python(config.served)  # --served on without vLLM: refused before any work
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    journal = Journal(out / "quickstart.json", config)
    journal.state.pop("served_skipped", None)
    if config.threads:
        set_threads(config.threads)
    target = load_target(config.target)
    recipe = recipe_path(config.recipe)
    run = _Run(config, journal, target, out, recipe, _anchored(recipe), started=started, deadline=started + config.budget * 60)
    run.served_python = served_python
    if served_python is None:
        run.skip_served(served_why)
    return run


def _size_comparison(run: _Run) -> None:
    """The comparison's reserve (``--eval-reserve``, or measured by ``size_eval``), first: a budget it leaves no training
    in is refused before the data stages spend their minutes. Then the served rows' (``size_served``, measured), which
    drops them (``--served auto``) or refuses the run (``on``) where the budget cannot hold it too."""
    config = run.config
    run.reserve_s = (
        config.eval_reserve * 60
        or run.journal.run("size-eval", lambda: size_eval(config, run.target, run.train_config(), final=run.final))["reserve_s"]
    )
    check_budget(config, run.reserve_s, spent_s=time.perf_counter() - run.started)
    python = run.served_python
    if python is not None:
        sized = run.journal.run(
            "size-served",
            lambda: size_served(config, run.target, python, eval_reserve_s=run.reserve_s, spent_s=time.perf_counter() - run.started),
        )
        if sized["served"]:
            run.served_s = sized["bench_s"]
        else:
            run.skip_served(sized["why"])


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
            reserve_s=run.kept_s(),
            drafters=SERVED_DRAFTERS if run.served_python else 1,
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
    """``train/``: a step count a short timing probe fits into what the comparison's reserve (and the served rows', with
    the served drafter's share: ``_plan_served_training``) leaves, capped at ``--epochs`` passes, so that the
    learning-rate schedule completes inside the budget; then training to it."""
    from specdraft.train.budget import steps_for_budget
    from specdraft.train.trainer import train
    from specdraft.tuning.budget_probes import median_record

    config, target = run.config, run.target
    _plan_served_training(run)

    def training_seconds_left() -> float:
        return run.seconds_left() - run.kept_s() - run.served_train_s

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


def _plan_served_training(run: _Run) -> None:
    """``size-served-training``: the served drafter's steps, from a timing probe of its recipe, in its share of what
    training gets (``served_training_budget``) and capped at ``--epochs``; what they take is kept from the other
    drafter's training until the served one has run."""
    from specdraft.train.budget import HEADROOM, steps_for_budget

    if run.served_python is None:
        return
    share = served_training_budget(run.seconds_left() - run.kept_s())
    if "size-served-training" not in run.journal.state["stages"] and share < MIN_TRAIN_S:  # the stages before ran long
        run.skip_served(f"its drafter's share of training is {share:.0f} s, less than {MIN_TRAIN_S:.0f} s")
        return
    plan = run.journal.run(
        "size-served-training", lambda: steps_for_budget(run.served_config(), share, target=run.target, cap_at_epochs=True)
    )
    if "train-served" not in run.journal.state["stages"]:
        run.served_train_s = plan["steps"] * plan["seconds_per_step"] / HEADROOM


def _train_served(run: _Run) -> None:
    """``train-served/``: the served drafter (``SERVED_RECIPE``) trained to its planned steps on the run's hidden states;
    like the other, stopped with a final checkpoint where the budget runs out first."""
    from specdraft.train.trainer import train

    if run.served_python is None:
        return
    steps = run.journal.state["stages"]["size-served-training"]["steps"]

    def train_in_budget() -> dict:
        result = train(
            run.served_config(max_steps=steps, max_time=max(MIN_TRAIN_S, run.seconds_left() - run.kept_s()), eval_interval=0),
            target=run.target,
        )
        return {**_train_facts(result), "dtype": result.compute_dtype}

    run.journal.run("train-served", train_in_budget)
    run.served_train_s = 0.0


def _bench_served(run: _Run) -> None:
    """``served/``: plain vLLM serving, vLLM's ngram and the served drafter on the comparison's prompts
    (``integrations/vllm/served_bench.py``), where the time left still holds the bench's measured reserve next to the
    comparison's; otherwise the rows are skipped, and said why (the budget is kept), as they are where a server fails
    under ``--served auto``."""
    from specdraft.integrations.vllm.served_bench import run_served_bench

    if run.served_python is None:
        return
    left = run.seconds_left() - run.reserve_s
    if "served" not in run.journal.state["stages"] and left < run.served_s:
        run.skip_served(f"{left / 60:.1f} min left before the comparison, less than the bench's {run.served_s / 60:.1f} min (measured)")
        return
    final = Path(run.journal.state["stages"]["train-served"]["final"])
    bench = served_bench_config(run.config, final, run.served_dir)
    try:
        run.journal.run("served", lambda: {"report": str(run.served_dir / "served.md"), "rows": served_rows(run_served_bench(bench))})
    except SpecdraftError as exc:  # a server that fails: --served auto keeps the comparison, which needs no vLLM
        if run.config.served == "on":
            raise
        run.skip_served(f"the served bench failed: {str(exc).splitlines()[0]}")


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
    stages = journal.state["stages"]
    print(training_table(stages, served_skipped=journal.state.get("served_skipped", "")))
    if run.served_python is not None and "served" in stages:
        print(served_table(stages["served"]["rows"]))
        print(f"[quickstart] served rows (vLLM): {stages['served']['report']}")
    print(f"[quickstart] finished in {total / 60:.1f} min (budget {run.config.budget:g} min); report: {run.out / 'eval' / 'report.md'}")


def _anchored(recipe: Path) -> bool:
    """Whether the recipe's method drafts blocks, so that --max-anchors sizes its steps (EAGLE-3 drafts every position)."""
    from specdraft.models.base import METHODS
    from specdraft.train.config import load_recipe

    return "max_anchors" in {f.name for f in fields(METHODS.get(load_recipe(recipe)["method"]).config_cls)}


def _training_flags(config: QuickstartConfig, recipe: Path, anchored: bool, overrides: dict[str, Any]) -> TrainConfig:
    """``recipe`` with quickstart's training flags over it, and ``overrides`` over those."""
    from specdraft.train.config import resolve_config

    values = {
        "num_threads": config.threads,
        "pack_tokens": config.pack_tokens,
        "epochs": config.epochs,
        "model": {"max_anchors": config.max_anchors} if anchored else {},
        **overrides,
    }
    return resolve_config(recipe, values)


def _train_facts(result: Any) -> dict:
    """Steps and final checkpoint; a run cut by the time budget counts as done (its final checkpoint exists)."""
    if not result.completed and result.stopped_by != "max_time":
        raise SpecdraftError(f"training stopped early ({result.stopped_by}) at step {result.step}; rerun quickstart to resume")
    return {"steps": result.step, "final": str(result.final), "stopped_by_time_budget": not result.completed}
