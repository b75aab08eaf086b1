"""The drafter training run, as a staircase: ``train`` -> ``_train`` (setup) -> ``fit`` -> finish.

The trainer knows drafters only through ``METHODS`` (``MethodSpec``) and ``DrafterModel.training_forward``.
Its parts, each in its own module:

- ``plan.py``: what the run will do, worked out once and side-effect free: the layer slots, the
  validation split (``split.py``: whole conversations, no prompt on both sides, ``OUT/split.json``),
  the data plan (batch = f(seed, step, rank), ``batches.DataPlan``), the run identity and the resume
  check (a resumed run must have the checkpoint's method, model config, target and layers).
- ``step.py``: the public ``train_step`` (forward in the compute dtype, backward, clip, update); every
  RNG is reseeded from (seed, rank, step) first. ``--dtype auto`` / ``--num-threads 0`` time this step
  once per machine (``tuning/dtype.py``, ``tuning/threads.py``).
- ``strategies.py``: the resumable ``TrainState``, and per parallel strategy its wrapping and checkpointer
  (which writes ``checkpoint_files.py``'s format).
- ``fit.py``: the loop, with logging, validation, stopping (SIGINT/SIGTERM, ``max_time``: a
  checkpoint after the current step) and checkpointing as hooks.
- ``validation.py``: the validation hook (the teacher-forced pass, the decoded tau) the loop calls.

A fresh run warm-starts the drafter (``warm_start``), a resumed one restores the checkpoint. At the
end: validation, a last checkpoint and ``OUT/final`` (the drafter and its ``MODEL_CARD.md``).
Validation logs the teacher-forced tau estimate and, with ``decode_prompts``, the tau the runtime
gets decoding a few validation prompts (``decoded_tau.py``).

Multi-process: run under ``torchrun``; the process group uses gloo on CPU and NCCL on GPU
(``distributed.py``). DDP averages gradients. ``--sequence-parallel N`` splits each sample across N consecutive
ranks (``sequence_parallel.py``: a data x sequence mesh under DDP or FSDP; the data plan and step seeds are the group's).
FSDP2 (``parallel: fsdp``) shards the whole drafter as one unit via ``fully_shard`` -- meant for GPUs, and it also
runs on CPU with gloo, which is how the tests cover it (2 processes, resume included); it has not been run on a GPU
here. Optimizer/model state go through ``torch.distributed.checkpoint.state_dict`` so checkpoints have the same layout
whatever the strategy (a DDP run can be resumed as FSDP and vice versa).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specdraft.errors import SpecdraftError, setting
from specdraft.models.base import METHODS, DrafterModel
from specdraft.models.common.checkpoint import DRAFTER_DIR
from specdraft.targets.base import Target
from specdraft.tracking import TrackedRun, open_trackers
from specdraft.train import checkpoint_files as ckpt
from specdraft.train.batches import (
    DELIVERY_LOG,
    PrefetchingSource,
    SampleSource,
    collate,
    group_share,
    open_sample_source,
    row_lengths,
    step_seed,
    token_rows,
    training_order,
)
from specdraft.train.config import TrainConfig
from specdraft.train.distributed import Dist, init_distributed, process_group_scope
from specdraft.train.fit import FitHooks, StepDone, TrainLog, fit
from specdraft.train.metrics import MetricsLog, lr_factor, trained_labels
from specdraft.train.model_card import last_validation, model_card
from specdraft.train.plan import RunPlan, build_method_config, plan_run
from specdraft.train.predicted_tau import log_predicted_tau
from specdraft.train.sequence_parallel import (
    SequenceGroups,
    require_same_sequence_parallel,
    require_sequence_parallel,
    sequence_groups,
)
from specdraft.train.split import SPLIT_FILE, write_split
from specdraft.train.step import StepModule, build_optimizer, reseed, synthetic_batch, train_step
from specdraft.train.strategies import STRATEGIES, Checkpointer, TrainState, strategy_name
from specdraft.train.validation import Validation
from specdraft.train.warm_start import WarmStartInputs, apply_warm_start, check_warm_start
from specdraft.tuning.measured import fastest_time
from specdraft.tuning.settings import Choice, MachineSettings
from specdraft.utils.compute import COMPUTE_DTYPES
from specdraft.utils.io import check_replaceable
from specdraft.utils.lock import claims_output
from specdraft.utils.provenance import write_provenance

log = logging.getLogger(__name__)

MODEL_CARD = "MODEL_CARD.md"  # in OUT/final: data, validation split and both acceptance figures (train/model_card.py)


@dataclass
class TrainResult:
    out: Path
    step: int  # optimizer steps done, in total over all invocations
    total_steps: int
    completed: bool  # reached total_steps (final/ written)
    stopped_by: str | None  # "signal", "max_time" or None
    final: Path | None
    drafter: DrafterModel | None = None  # the trained module (this process's replica)
    stop_signal: int | None = None  # the signal number when stopped_by == "signal" (the CLI exits 128 + it)
    compute_dtype: str | None = None  # what the steps ran in (``--dtype auto`` resolved)
    dtype_probe: dict | None = None  # the seconds per step that decided it (``--dtype auto`` only)
    threads: dict | None = None  # the CPU thread count of the steps and why (``threads_facts``: flag, measured, cached)
    forward_path: dict | None = None  # the path the step's modules ran on and why (``PathChoice.to_json``)


@dataclass(frozen=True)
class Compute:
    """Where and how the steps run: device, compute dtype (``--dtype auto`` resolved) and CPU threads."""

    device: torch.device
    dtype: str
    dtype_probe: dict | None  # the seconds per step that decided ``auto``
    threads: dict  # ``threads_facts``: the count and where it came from
    forward_path: dict  # ``PathChoice.to_json()``: the path the step's modules run on and why

    def settings(self, dtype_source: str) -> MachineSettings:
        """The train stage's machine settings (``tuning/settings.py``), for its one log block."""
        probe = self.dtype_probe or {}
        dtype = Choice(
            self.dtype, ("cached" if probe.get("cached") else "measured") if probe else dtype_source, dict(probe.get("seconds") or {})
        )
        return MachineSettings(
            "train",
            forward_path=Choice.from_facts(self.forward_path, "forward_path"),
            threads=Choice.from_facts(self.threads, "threads"),
            compute_dtype=dtype,
        )


@claims_output(None)  # one writer per run (rank 0 holds the job's lock); _check_out_dir checks ownership
def train(cfg: TrainConfig, *, target: Target | None = None, dataset: SampleSource | None = None) -> TrainResult:
    """Train (or resume training) a drafter as configured; see the module docstring.

    ``target`` and ``dataset`` default to loading ``cfg.target`` and opening the source ``cfg.data_mode``
    names (``batches.open_sample_source``); tests pass small in-memory ones.
    """
    cfg.require("method", "out")
    dist_ = Dist.from_env(cfg.sequence_parallel)
    with process_group_scope(), contextlib.ExitStack() as cleanup:
        if dataset is None:
            dataset = open_sample_source(cfg, rank=dist_.rank, world=dist_.world)
            if isinstance(dataset, PrefetchingSource):
                cleanup.callback(dataset.close)  # streaming sources delete what they still hold in the store
        return _train(cfg, target, dataset, dist_, cleanup)


def _train(cfg: TrainConfig, target: Target | None, dataset: SampleSource, dist_: Dist, cleanup: contextlib.ExitStack) -> TrainResult:
    """The staircase: plan, then the parts (process group, run directory, warm start, state), ``fit``, finish."""
    run, drafter, target = _plan(cfg, target, dataset, dist_)
    device = init_distributed(cfg.device, dist_)
    sequence = sequence_groups(dist_, drafter)
    if dist_.sequence > 1 and dist_.main:
        log.info(
            "sequence parallel: each sample split across %d processes, %d data-parallel group(s) (a %d-row halo)",
            dist_.sequence,
            dist_.data_world,
            sequence.window.min_rows,
        )
    metrics_log = cleanup.enter_context(_prepare_out(run, dist_, report_to=[] if cfg.dry_run else cfg.report_to))
    if run.resume is None:
        apply_warm_start(
            drafter,
            run.warm_starts,
            WarmStartInputs(target=target, cfg=cfg, token_rows=lambda: token_rows(dataset, run.data.train_indices)),
        )
    state, checkpointer, compute = _build_state(cfg, run, drafter, target, dist_, device)
    if dist_.main:
        write_provenance(
            run.out,
            config=run.resolved,
            target=dataset.target_info,
            inputs=[cfg.data, cfg.dataset],
            measured=compute.settings("dry run" if cfg.dry_run else "flag"),
        )
    result = functools.partial(
        TrainResult,
        run.out,
        total_steps=run.total_steps,
        drafter=drafter,
        compute_dtype=compute.dtype,
        dtype_probe=compute.dtype_probe,
        threads=compute.threads,
        forward_path=compute.forward_path,
    )
    if cfg.dry_run:
        if run.resume is None:
            log.info("dry run: wrote %s", checkpointer.save(state))
        return result(step=state.step, completed=False, stopped_by=None, final=None)

    validate = Validation(
        run,
        dataset,
        target,
        checkpointer,
        metrics_log,
        compute.device,
        compute.dtype,
        sequence,
        max_batches=cfg.val_max_batches,
        sample_tokens=cfg.sample_tokens,
        round_width=cfg.round_row_widths,
        seed=cfg.seed,
    )
    already_done = run.resume is not None and state.step >= run.total_steps
    if isinstance(dataset, PrefetchingSource):
        dataset.start(training_order(run.data, state.step, run.total_steps), group_share(sequence.window, sequence.group))
    hooks = _hooks(cfg, run, dataset, checkpointer, compute, sequence, validate, metrics_log)
    stopped_by, stop_signal = fit(state, run.total_steps, hooks, desc=f"train {run.method}", show_progress=dist_.main)
    final = _finish(state, run, checkpointer, validate, stopped_by=stopped_by, already_done=already_done)
    return result(step=state.step, completed=state.step >= run.total_steps, stopped_by=stopped_by, final=final, stop_signal=stop_signal)


def _plan(cfg: TrainConfig, target: Target | None, dataset: SampleSource, dist_: Dist) -> tuple[RunPlan, DrafterModel, Target]:
    """Check the method, ``OUT`` and the target against the store, build the drafter (seeded) and plan the run."""
    import specdraft.models  # noqa: F401  (registers the built-in methods)

    spec = METHODS.get(cfg.required("method"))
    model_cfg = build_method_config(spec, cfg.model)
    warm_starts = check_warm_start(cfg, spec.name)
    _check_out_dir(Path(cfg.required("out")))
    if cfg.num_threads:
        from specdraft.tuning.threads import set_threads

        set_threads(cfg.num_threads)
    target = _store_target(target, dataset, requested=cfg.target, where=str(cfg.data or "(in-memory dataset)"))
    reseed(cfg.seed)
    drafter = spec.build(model_cfg, target, counts=dataset.token_counts())
    if not isinstance(drafter, DrafterModel):
        raise TypeError(f"METHODS[{spec.name!r}].build returned {type(drafter).__name__}, not a DrafterModel")
    if dist_.sequence > 1:
        require_sequence_parallel(drafter)  # before any process group: every rank refuses alike
    run = plan_run(
        cfg,
        spec=spec,
        model_cfg=model_cfg,
        drafter=drafter,
        target=target,
        dataset=dataset,
        rank=dist_.data_rank,
        world=dist_.data_world,
        warm_starts=warm_starts,
    )
    if run.resume is not None:
        require_same_sequence_parallel(run.resume.state, run.resume.directory, dist_.sequence)
    return run, drafter, target


def _hooks(
    cfg: TrainConfig,
    run: RunPlan,
    dataset: SampleSource,
    checkpointer: Checkpointer,
    compute: Compute,
    sequence: SequenceGroups,
    validate: Validation,
    metrics_log: MetricsLog,
) -> FitHooks:
    """The fit loop's parts: read, step, and the logging, validation, stop and checkpoint hooks on their intervals."""

    def due(interval: int, state: TrainState) -> bool:
        return bool(interval) and state.step % interval == 0 and state.step < run.total_steps

    return FitHooks(
        read=lambda step: [[dataset[i] for i in row] for row in run.data.train_rows(step)],
        step=functools.partial(
            _step,
            sample_tokens=cfg.sample_tokens,
            round_width=cfg.round_row_widths,
            seed=cfg.seed,
            grad_clip=cfg.grad_clip,
            run=run,
            compute=compute,
            checkpointer=checkpointer,
            sequence=sequence,
        ),
        log=TrainLog(
            metrics_log,
            interval=cfg.log_interval,
            total_steps=run.total_steps,
            locate=run.data.locate,
            context={"dtype": compute.dtype, "threads": compute.threads["threads"]},
            main=checkpointer.dist.main,
            group=sequence.data_group,
        ),
        validate=lambda state: validate(state) if due(cfg.eval_interval, state) else None,
        stop=_stopping(cfg.max_time, run.total_steps, checkpointer),
        checkpoint=lambda state: checkpointer.save(state) if due(cfg.checkpoint_interval, state) else None,
    )


def _finish(
    state: TrainState, run: RunPlan, checkpointer: Checkpointer, validate: Validation, *, stopped_by: str | None, already_done: bool
) -> Path | None:
    """After the loop: a last validation and checkpoint when the schedule ran out here, and ``OUT/final``
    unless a signal stopped the run (``max_time`` still writes it)."""
    if stopped_by is None and not already_done:
        validate(state)
        if checkpointer.last_saved != state.step:  # decided from this process's own record: every rank must agree, and
            checkpointer.save(state)  # rank 0 may already be writing while a slower rank would look at the disk
    final = None
    if stopped_by != "signal":
        _require_learning(state, run, checkpointer)
        final = checkpointer.save_final(
            state,
            lambda directory: (directory / MODEL_CARD).write_text(
                model_card(
                    method=run.method,
                    step=state.step,
                    data=run.where,
                    split=run.split.record,
                    validation=last_validation(run.out / ckpt.METRICS),
                )
            ),
        )
    if stopped_by:
        log.warning("stopped by %s at step %d of %d; rerun the same command to resume", stopped_by, state.step, run.total_steps)
    return final


def _require_learning(state: TrainState, run: RunPlan, checkpointer: Checkpointer) -> None:
    """Refuse to write ``OUT/final`` for a run whose steps supervised no label: it learned nothing, and a final
    drafter would read as a completed run (the plan refuses the known causes first, ``plan.check_block_fits`` and
    ``plan.require_labels``; this catches what they cannot see, e.g. steps that read only the samples without one).
    Decided on rank 0, which writes the log, and agreed by every rank."""
    labels = trained_labels(run.out / ckpt.METRICS) if checkpointer.dist.main else None
    if checkpointer.dist.any(labels == 0, checkpointer.device):
        raise SpecdraftError(
            f"{run.out}: the {state.step} training step(s) supervised 0 labels ({ckpt.METRICS}), so the drafter learned nothing and "
            f"{ckpt.FINAL}/ is not written; give it samples with replies within {setting('pack_tokens')} tokens, or more steps"
        )


def _store_target(target: Target | None, dataset: SampleSource, *, requested: str | None, where: str) -> Target:
    """The target (loaded, unless given: ``requested``, else the store's), refused unless the store ``where`` was extracted from it."""
    store_target = dataset.target_info
    if target is None:
        from specdraft.targets import load_target

        target = load_target(requested or store_target.get("name") or "")
    if store_target.get("fingerprint") != target.fingerprint:
        raise SpecdraftError(
            f"hidden-state store {where} was extracted from target {store_target.get('name')!r} (fingerprint "
            f"{store_target.get('fingerprint')}), not {target.name!r} (fingerprint {target.fingerprint}); "
            f"train with the store's target or re-run `specdraft extract --target {target.name}`"
        )
    return target


def _prepare_out(run: RunPlan, dist_: Dist, *, report_to: list[str]) -> MetricsLog:
    """Write what the run directory records before the first step (rank 0), cut back to the resumed step, and open
    the ``--report-to`` trackers that mirror its log (rank 0)."""
    metrics_log = MetricsLog(run.out / ckpt.METRICS)
    if dist_.main:
        run.out.mkdir(parents=True, exist_ok=True)
        ckpt.remove_debris(run.out)
        _dump_yaml(run.out / ckpt.RESOLVED_CONFIG, run.resolved)
        write_split(run.out / SPLIT_FILE, run.split, decode_prompts=list(run.probe.sample_ids) if run.probe else [])
        metrics_log.truncate_after(run.resume.step if run.resume else 0)
        _truncate_delivery_log(run.out / DELIVERY_LOG, run.resume.state if run.resume else None)
        if report_to:
            tracked = TrackedRun(run.out, job="train", config=run.resolved, start_step=run.resume.step if run.resume else 0)
            metrics_log.mirror = open_trackers(report_to, tracked)
    return metrics_log


def _build_state(
    cfg: TrainConfig, run: RunPlan, drafter: DrafterModel, target: Target, dist_: Dist, device: torch.device
) -> tuple[TrainState, Checkpointer, Compute]:
    """The resumable state (the checkpoint's, when resuming), its strategy's checkpointer, and the measured compute settings."""
    step_module = StepModule(drafter)
    frozen = frozenset(n for n, p in step_module.named_parameters(remove_duplicate=False) if not p.requires_grad)
    optim_state: dict[str, Any] = {}  # the checkpoint's, read only when resuming
    if run.resume is not None:
        model_state, optim_state = ckpt.load_tensors(run.resume.directory, run.resume.state)
        missing = set(step_module.state_dict()) - frozen - set(model_state)
        if missing:
            raise SpecdraftError(
                f"{run.resume.directory / ckpt.STATE_TENSORS} lacks {len(missing)} tensor(s), e.g. {sorted(missing)[0]}; "
                "delete that checkpoint"
            )
        step_module.load_state_dict({k: v for k, v in model_state.items() if k not in frozen}, strict=False)
    strategy = STRATEGIES.get(strategy_name(cfg.parallel, dist_.world))
    checkpointer = strategy.checkpointer(
        drafter,
        out=run.out,
        keep=cfg.keep_checkpoints,
        dist=dist_,
        device=device,
        last_saved=run.resume.step if run.resume else -1,
        meta=functools.partial(_checkpoint_meta, run, dist_),
    )
    step_module.to(device)
    compute = _measured_settings(
        step_module,
        target,
        run.identity,
        dist_,
        device,
        dtype=cfg.dtype,
        num_threads=cfg.num_threads,
        batch_rows=cfg.batch_rows,
        pack_tokens=cfg.pack_tokens,
        dry_run=cfg.dry_run,
        forward_path=cfg.forward_path,
    )
    if dist_.main:
        compute.settings("dry run" if cfg.dry_run else "flag").log()
    wrapped = strategy.wrap(step_module, device)
    optimizer = build_optimizer(wrapped, name=cfg.optimizer, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, device=device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, total_steps=run.total_steps, warmup_steps=run.warmup_steps, min_ratio=cfg.min_lr_ratio)
    )
    state = TrainState(wrapped, optimizer, scheduler, frozen)
    if run.resume is not None:
        state.restore(run.resume.state, optim_state)
        log.info("resuming from %s (step %d of %d)", run.resume.directory, state.step, run.total_steps)
    n_train = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    log.info(
        "%s drafter: %.2fM trainable parameters, %d steps, %s on %s x%d, %s, %d CPU threads (%s)",
        run.method,
        n_train / 1e6,
        run.total_steps,
        strategy_name(cfg.parallel, dist_.world),
        device,
        dist_.world,
        compute.dtype,
        compute.threads["threads"],
        compute.threads["threads_source"],
    )
    if dist_.main:  # what a measured data-scaling fit predicts for this data, labelled so (train/predicted_tau.py)
        log_predicted_tau(run, target)
    return state, checkpointer, compute


def _checkpoint_meta(run: RunPlan, dist_: Dist, at_step: int) -> dict:
    """The run facts a checkpoint stores beside its tensors (read after every rank flushed its deliveries)."""
    epoch, in_epoch = run.data.locate(at_step)
    return {
        "step": at_step,
        "epoch": epoch,
        "step_in_epoch": in_epoch,
        "total_steps": run.total_steps,
        "world_size": dist_.world,
        "sequence_parallel": dist_.sequence,
        "identity": run.identity,
        "data_fingerprint": run.data.fingerprint(),
        "config": run.resolved,
        "delivered_bytes": _file_size(run.out / DELIVERY_LOG),
    }


def _step(
    state: TrainState,
    items: list,
    *,
    sample_tokens: int,
    round_width: bool,
    seed: int,
    grad_clip: float,
    run: RunPlan,
    compute: Compute,
    checkpointer: Checkpointer,
    sequence: SequenceGroups,
) -> StepDone:
    """The fit loop's step: collate (this rank's shard of each row under sequence parallelism), reseed from
    (seed, data rank, step), ``train_step`` (refusing a non-finite loss or gradient on any rank before the update),
    advance the schedule. The samples read are released once collated (``items`` is emptied: the loop holds the
    list through the step, and a long sample's stored states would otherwise stay beside its collated shard)."""
    lengths = row_lengths(items, sample_tokens)
    own = collate(
        items,
        sample_tokens=sample_tokens,
        round_width=round_width,
        slot_index=run.slot_index,
        where=run.where,
        agree=functools.partial(checkpointer.dist.any, device=compute.device),
        window=sequence.window,
    ).to(compute.device)
    items.clear()
    batch, shard = sequence.split(own)
    reseed(step_seed(seed, checkpointer.dist.data_rank, state.step))
    lr = float(state.scheduler.get_last_lr()[0])

    def check(loss: float, grad_norm: float | None) -> None:
        if checkpointer.dist.any(not all(map(math.isfinite, (loss, grad_norm or 0.0))), compute.device):
            raise checkpointer.failure(f"the loss is {loss} (gradient norm {grad_norm})", state.step + 1)

    result = train_step(
        state.module,
        batch,
        dtype=compute.dtype,
        device=compute.device,
        optimizer=state.optimizer,
        grad_clip=grad_clip,
        check=check,
        shard=shard,
    )
    state.scheduler.step()
    state.step += 1
    return StepDone(result, tokens=sum(lengths), lr=lr, row_tokens=max(lengths))


def _stopping(max_time: float, total_steps: int, checkpointer: Checkpointer) -> Callable[[TrainState, int | None], str | None]:
    """The stop hook: on a signal or past ``max_time`` on any rank, before the last step, save a checkpoint
    and say why ("signal" or "max_time"); every rank takes part every step, so all stop at the same one."""
    started = time.monotonic()

    def stop(state: TrainState, signum: int | None) -> str | None:
        timed_out = bool(max_time) and time.monotonic() - started >= max_time
        if checkpointer.dist.any(signum is not None or timed_out, checkpointer.device) and state.step < total_steps:
            checkpointer.save(state)
            return "signal" if signum is not None else "max_time"
        return None

    return stop


def _measured_settings(
    module: nn.Module,
    target: Target,
    identity: dict,
    dist_: Dist,
    device: torch.device,
    *,
    dtype: str,
    num_threads: int,
    batch_rows: int,
    pack_tokens: int,
    dry_run: bool,
    forward_path: str,
) -> Compute:
    """The forward path, compute dtype and CPU thread count of the steps: ``forward_path`` / ``dtype`` /
    ``num_threads``, or for ``auto`` / 0 what tuning measured fastest for this step here (``tuning.resolve_choices``:
    first the path, in fp32, then the dtype on it, then the thread count), timed on rank 0 (before the module is
    wrapped) and sent to every rank so they all compute alike. A dry run computes nothing."""
    from specdraft.tuning.forward_path import EAGER, FORWARD_PATHS, PathChoice, use_path
    from specdraft.tuning.settings import TimedWork, resolve_choices
    from specdraft.tuning.threads import threads_facts

    if dry_run:
        return Compute(
            device, "fp32" if dtype == "auto" else dtype, None, threads_facts(num_threads, None), PathChoice(EAGER, "dry run", {}).to_json()
        )
    names, paths = list(COMPUTE_DTYPES), FORWARD_PATHS.names()
    chosen_dtype, probe, threads = ("fp32" if dtype == "auto" else dtype), None, None
    path = PathChoice(forward_path, "flag", {})
    if dist_.main:
        batch = synthetic_batch(
            rows=batch_rows, tokens=pack_tokens, slots=len(identity["slots"]), hidden=int(target.hidden_size), vocab=int(target.vocab_size)
        ).to(device)
        context = {k: identity[k] for k in ("method", "model_config", "slots")} | {"pack_tokens": pack_tokens, "batch_rows": batch_rows}
        work = TimedWork(
            "train",
            context,
            seconds_in=lambda d: fastest_time(lambda: train_step(module, batch, dtype=d, device=device)),
            run=lambda d: train_step(module, batch, dtype=d, device=device),
            model=module,
            device=device,
        )
        was_training = module.training
        module.train()
        try:
            choices = resolve_choices("train", work, forward_path=forward_path, dtype=dtype, threads=num_threads)
        finally:
            module.train(was_training)
        path_choice, dtype_choice = choices.chosen("forward_path"), choices.chosen("compute_dtype")
        path = PathChoice(path_choice.value, path_choice.source, dict(path_choice.seconds))
        chosen_dtype, threads = dtype_choice.value, choices.chosen("threads").facts("threads")
        if dtype == "auto":  # the figures that decided it, as reports record them
            probe = {"choice": chosen_dtype, "seconds": dict(dtype_choice.seconds), "cached": dtype_choice.source == "cached"}
    chosen = torch.tensor([names.index(chosen_dtype), torch.get_num_threads(), paths.index(path.name) if dist_.main else 0], device=device)
    if dist_.world > 1:
        torch.distributed.broadcast(chosen, src=0)
        if not num_threads and device.type == "cpu":
            torch.set_num_threads(int(chosen[1].item()))
        if not dist_.main:
            path = PathChoice(paths[int(chosen[2].item())], "rank 0", {})
            use_path(module, path.name)
    return Compute(device, names[int(chosen[0].item())], probe, threads or threads_facts(num_threads, None), path.to_json())


def _check_out_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise SpecdraftError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / ckpt.RESOLVED_CONFIG).is_file() and not (out / ckpt.CHECKPOINTS).is_dir():
        raise SpecdraftError(f"--out {out} is not empty and is not a specdraft training run; choose a new or empty directory")
    check_replaceable(out / ckpt.FINAL, DRAFTER_DIR)  # refused now rather than after training


def _dump_yaml(path: Path, obj: dict) -> None:
    import yaml

    from specdraft.utils.io import atomic_write_bytes

    atomic_write_bytes(path, yaml.safe_dump(ckpt._jsonable(obj), sort_keys=False).encode())


def _file_size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0


def _truncate_delivery_log(path: Path, saved: dict | None) -> None:
    """Cut the streaming sources' delivery log back to what the resumed checkpoint had seen, so samples
    delivered after it (read again on resume) are not listed twice; a fresh run starts it empty."""
    size = saved.get("delivered_bytes") if saved else 0
    if size is not None and _file_size(path) > size:
        with open(path, "r+b") as f:
            f.truncate(size)
