"""The drafter training loop: method-agnostic, resumable bit for bit, single- or multi-process.

The trainer knows drafters only through ``METHODS`` (``MethodSpec``) and ``DrafterModel.training_forward``.
Steps of ``train``:

1. Resolve the method, open the hidden-state store, load the target; check the store was made for
   this target (fingerprint) and holds the layers the method reads.
2. Check ``OUT``: a fresh directory, or a run whose latest checkpoint has the same identity
   (method, model config, target, layers) -- otherwise stop before anything is written.
3. Build the drafter (seeded); a fresh run warm-starts it (``warm_start``), a resumed one restores
   the checkpoint; wrap it for DDP/FSDP2, build the optimizer (AdamW or Muon) and the warm-up + cosine schedule, restore their state.
4. Step: batch = f(seed, step, rank) (``data.DataPlan``); reseed every RNG from (seed, rank, step);
   forward in the compute dtype (``--dtype auto``: the faster of fp32 and bf16 autocast for this
   step on this machine, measured once and cached, ``compute_dtype.py``; ``--num-threads 0``: the
   CPU thread count that ran the step fastest, ``utils/threads.py``), backward, clip, AdamW,
   schedule. Log, validate and checkpoint on their intervals; a SIGINT/SIGTERM or ``max_time`` ends
   the run with a checkpoint after the current step.
5. At the end: validation, a last checkpoint and ``OUT/final`` (the drafter and its ``MODEL_CARD.md``).

Validation (``train/split.py``: whole conversations, no prompt on both sides, recorded in
``OUT/split.json``) logs the teacher-forced tau estimate and, with ``decode_prompts``, the tau the
runtime gets decoding a few validation prompts (``train/acceptance.py``).

Multi-process: run under ``torchrun``; the process group uses gloo on CPU and NCCL on GPU. DDP
averages gradients. FSDP2 (``parallel: fsdp``) shards the whole drafter as one unit via
``fully_shard`` -- meant for GPUs, and it also runs on CPU with gloo, which is how the tests cover
it (2 processes, resume included); it has not been run on a GPU here. Optimizer/model state go
through ``torch.distributed.checkpoint.state_dict`` so checkpoints have the same layout whatever
the strategy (a DDP run can be resumed as FSDP and vice versa).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import os
import random
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from specdraft.errors import SpecdraftError
from specdraft.models.base import METHODS, DrafterBatch, DrafterModel, MethodSpec, TrainOutput
from specdraft.models.common.checkpoint import DRAFTER_DIR
from specdraft.registry import Registry
from specdraft.train import checkpoint as ckpt
from specdraft.train.compute_dtype import measure_train_dtype, synthetic_batch, train_step
from specdraft.train.config import TrainConfig
from specdraft.train.data import (
    DELIVERY_LOG,
    DataPlan,
    PrefetchingSource,
    SampleSource,
    collate,
    open_sample_source,
    select_slots,
    step_seed,
    token_rows,
    training_order,
)
from specdraft.train.acceptance import TEACHER_FORCED_ANCHORS, DecodeProbe, last_validation, model_card, unavailable_reason
from specdraft.train.metrics import MetricSums, MetricsLog, lr_factor
from specdraft.train.split import SPLIT_FILE, resolve_split, write_split
from specdraft.train.warm_start import WarmStartInputs, apply_warm_start, check_warm_start
from specdraft.utils.compute import COMPUTE_DTYPES, autocast, parse_device
from specdraft.utils.io import check_replaceable

log = logging.getLogger(__name__)

EVAL_SEED_KIND = 1
MODEL_CARD = "MODEL_CARD.md"  # in OUT/final: data, validation split and both acceptance figures (train/acceptance.py)


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


class _StepModule(nn.Module):
    """Routes ``forward`` to ``training_forward`` so DDP/FSDP hooks see the call."""

    def __init__(self, drafter: DrafterModel):
        super().__init__()
        self.drafter = drafter

    def forward(self, batch: DrafterBatch) -> TrainOutput:
        return self.drafter.training_forward(batch)


# ---------------------------------------------------------------------------------------------
# Parallel strategies: how the step module is wrapped, and how the drafter is saved from it.


@dataclass(frozen=True)
class Strategy:
    wrap: Callable[[nn.Module, torch.device], nn.Module]
    # Sharded parameters cannot go through ``save_pretrained``: rank 0 then keeps an unsharded CPU
    # replica of the drafter and loads the gathered full state into it before each save.
    save_via_replica: bool = False


def _ddp_wrap(module: nn.Module, device: torch.device) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None)


def _fsdp_wrap(module: nn.Module, device: torch.device) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    fully_shard(module)  # one unit: drafters are small; per-layer units would need method knowledge
    return module


STRATEGIES: Registry[Strategy] = Registry("parallel strategy")
STRATEGIES.register("single")(Strategy(wrap=lambda m, d: m))
STRATEGIES.register("ddp")(Strategy(wrap=_ddp_wrap))
STRATEGIES.register("fsdp")(Strategy(wrap=_fsdp_wrap, save_via_replica=True))


@dataclass
class _Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    def any(self, flag: bool, device: torch.device) -> bool:
        """True on every rank if ``flag`` is true on any rank (so all ranks stop at the same step)."""
        if self.world == 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return bool(t.item())


def _init_distributed(cfg: TrainConfig) -> tuple[_Dist, torch.device]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cfg.device == "auto":
        device = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    else:
        device = parse_device(cfg.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device(f"cuda:{local_rank}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not torch.distributed.is_initialized():
        if device.type != "cuda":
            _gloo_interface()
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return _Dist(rank, world, local_rank), device


def _gloo_interface() -> None:
    """Point gloo at the interface that reaches ``MASTER_ADDR``, unless ``GLOO_SOCKET_IFNAME`` is set.

    Gloo otherwise binds and advertises the address the host name resolves to, often 127.0.0.1
    (``/etc/hosts``), and ranks on other hosts then fail with "Connection refused" connecting to it.
    """
    from specdraft.utils.net import interface_of, local_address_towards

    master = os.environ.get("MASTER_ADDR")
    if os.environ.get("GLOO_SOCKET_IFNAME") or not master:
        return
    name = interface_of(local_address_towards(master, int(os.environ.get("MASTER_PORT", "29500"))))
    if name:
        os.environ["GLOO_SOCKET_IFNAME"] = name
        log.info("gloo uses interface %s (the route to MASTER_ADDR %s); set GLOO_SOCKET_IFNAME to choose another", name, master)


@contextlib.contextmanager
def _process_group_scope() -> Any:
    """Destroy a process group that ``train`` itself created (one the caller made is left alone)."""
    existed = torch.distributed.is_available() and torch.distributed.is_initialized()
    try:
        yield
    finally:
        if not existed and torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _measured_settings(cfg: TrainConfig, module: nn.Module, target: Any, identity: dict, dist_: "_Dist",
                       device: torch.device) -> tuple[str, dict | None, dict]:
    """The compute dtype and CPU thread count of the steps: ``cfg.dtype`` / ``cfg.num_threads``, or for
    ``auto`` / 0 what ran this step fastest here -- first the dtype, then the thread count in it --,
    timed on rank 0 (before the module is wrapped) and sent to every rank so they all compute alike.
    Returns (dtype, its probe, the thread facts). A dry run computes nothing."""
    from specdraft.utils.threads import resolve_threads, threads_facts

    if cfg.dry_run:
        return ("fp32" if cfg.dtype == "auto" else cfg.dtype), None, threads_facts(cfg.num_threads, None)
    names = list(COMPUTE_DTYPES)
    dtype, probe, threads = ("fp32" if cfg.dtype == "auto" else cfg.dtype), None, None
    if dist_.main:
        batch = synthetic_batch(rows=cfg.batch_rows, tokens=cfg.pack_tokens, slots=len(identity["slots"]),
                                hidden=int(target.hidden_size), vocab=int(target.vocab_size)).to(device)
        context = {k: identity[k] for k in ("method", "model_config", "slots")} | {"pack_tokens": cfg.pack_tokens, "batch_rows": cfg.batch_rows}
        was_training = module.training
        module.train()
        try:
            if cfg.dtype == "auto":
                probe = measure_train_dtype(module, batch, device=device, context=context)  # logs its figures
                dtype = probe.choice
            threads = resolve_threads(cfg.num_threads, "train-threads", {**context, "dtype": dtype},
                                      lambda: train_step(module, batch, dtype, device), device=device)
        finally:
            module.train(was_training)
    chosen = torch.tensor([names.index(dtype), torch.get_num_threads()], device=device)
    if dist_.world > 1:
        torch.distributed.broadcast(chosen, src=0)
        if not cfg.num_threads and device.type == "cpu":
            torch.set_num_threads(int(chosen[1].item()))
    return names[int(chosen[0].item())], probe.to_json() if probe else None, threads_facts(cfg.num_threads, threads)


def _reseed(value: int) -> None:
    torch.manual_seed(value)
    random.seed(value)
    np.random.seed(value % (2**32))


class _StopFlag:
    """SIGINT/SIGTERM set a flag checked after each step; a second SIGINT interrupts at once."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> "_StopFlag":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal = signum
        log.warning("received %s: saving a checkpoint after this step", signal.Signals(signum).name)

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


# ---------------------------------------------------------------------------------------------


def sample_lengths(dataset: SampleSource) -> list[int]:
    """Tokens per sample without reading hidden states (packing needs every length up front)."""
    lengths = getattr(dataset, "lengths", None)
    if callable(lengths):
        return [int(n) for n in lengths()]
    prepared = getattr(dataset, "prepared", None)
    if prepared is not None:
        all_lengths = prepared.lengths()
        return [int(all_lengths[prepared.index_of(sid)]) for sid in dataset.sample_ids]
    return [len(dataset[i]["token_ids"]) for i in range(len(dataset))]


def token_counts(dataset: SampleSource) -> torch.Tensor | None:
    """Response-token frequencies of the store's prepared dataset (EAGLE-3 picks its draft vocabulary from them)."""
    prepared = getattr(dataset, "prepared", None)
    return prepared.token_counts() if prepared is not None else getattr(dataset, "token_counts", lambda: None)()


def drafter_slots(drafter: DrafterModel, spec: MethodSpec, num_layers: int) -> list:
    """The layer slots the built drafter reads: its resolved config's (a ``layers`` override) or the method preset."""
    config = getattr(drafter, "config", None)
    return list(config.slots()) if callable(getattr(config, "slots", None)) else spec.layer_slots(num_layers)


def build_method_config(spec: MethodSpec, overrides: dict) -> Any:
    try:
        return spec.config_cls(**overrides)
    except TypeError as exc:
        fields = ", ".join(f.name for f in dataclasses.fields(spec.config_cls)) if dataclasses.is_dataclass(spec.config_cls) else "?"
        raise SpecdraftError(f"invalid --model override for method {spec.name!r} ({exc}); valid keys: {fields}") from None


def _config_dict(model_cfg: Any) -> dict:
    return dataclasses.asdict(model_cfg) if dataclasses.is_dataclass(model_cfg) else dict(vars(model_cfg))


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


def train(cfg: TrainConfig, *, target: Any = None, dataset: SampleSource | None = None) -> TrainResult:
    """Train (or resume training) a drafter as configured; see the module docstring.

    ``target`` (a ``Target``) and ``dataset`` (a ``SampleSource``) default to loading
    ``cfg.target`` and opening the source ``cfg.data_mode`` names (``data.open_sample_source``);
    tests pass small in-memory ones.
    """
    with _process_group_scope(), contextlib.ExitStack() as cleanup:
        if dataset is None:
            cfg.require("method", "out")
            dataset = open_sample_source(cfg)
            if isinstance(dataset, PrefetchingSource):
                cleanup.callback(dataset.close)  # streaming sources delete what they still hold in the store
        return _train(cfg, target, dataset)


def _train(cfg: TrainConfig, target: Any, dataset: SampleSource) -> TrainResult:
    import specdraft.models  # noqa: F401  (registers the built-in methods)

    cfg.require("method", "out")
    spec = METHODS.get(cfg.method)
    model_cfg = build_method_config(spec, cfg.model)
    check_warm_start(cfg, spec.name)
    out = Path(cfg.out)
    _check_out_dir(out)
    if cfg.num_threads:
        from specdraft.utils.threads import set_threads

        set_threads(cfg.num_threads)

    # 1. data and target, checked against each other and the method
    where = str(cfg.data or "(in-memory dataset)")
    store_target = dataset.target_info
    if target is None:
        from specdraft.targets import load_target

        target = load_target(cfg.target or store_target.get("name") or "")
    if store_target.get("fingerprint") != target.fingerprint:
        raise SpecdraftError(
            f"hidden-state store {where} was extracted from target {store_target.get('name')!r} (fingerprint "
            f"{store_target.get('fingerprint')}), not {target.name!r} (fingerprint {target.fingerprint}); "
            f"train with the store's target or re-run `specdraft extract --target {target.name}`"
        )
    _reseed(cfg.seed)
    drafter = spec.build(model_cfg, target, counts=token_counts(dataset))
    if not isinstance(drafter, DrafterModel):
        raise TypeError(f"METHODS[{spec.name!r}].build returned {type(drafter).__name__}, not a DrafterModel")
    resolved_model = _config_dict(getattr(drafter, "config", model_cfg))
    wanted = drafter_slots(drafter, spec, target.num_layers)
    slot_index = select_slots(dataset.slots, wanted, where=where)
    slot_index = None if slot_index == list(range(len(dataset.slots))) else slot_index

    dist_, device = _init_distributed(cfg)
    strategy_name = "fsdp" if cfg.parallel == "fsdp" else ("ddp" if dist_.world > 1 else "single")
    strategy = STRATEGIES.get(strategy_name)
    split = resolve_split(dataset, val_fraction=cfg.val_fraction, seed=cfg.split_seed, recorded=out / SPLIT_FILE)
    plan = DataPlan.build(
        list(dataset.sample_ids), sample_lengths(dataset), split=split, pack_tokens=cfg.pack_tokens,
        batch_rows=cfg.batch_rows, seed=cfg.seed, world_size=dist_.world, rank=dist_.rank,
    )
    probe, probe_skipped = None, None
    if cfg.decode_prompts and plan.val_indices:
        probe_skipped = unavailable_reason(spec.name, target)
        if probe_skipped is None:
            probe = DecodeProbe.from_split(token_rows(dataset, plan.val_indices), [dataset.sample_ids[i] for i in plan.val_indices],
                                           count=cfg.decode_prompts, tokens=cfg.decode_tokens)
        else:
            log.warning("decoded tau is not measured: %s", probe_skipped)
    total_steps = cfg.max_steps or plan.total_steps(cfg.epochs)
    warmup_steps = max(1, round(cfg.warmup_ratio * total_steps)) if cfg.warmup_ratio > 0 else 0

    # 2. the run directory: refuse an incompatible resume before writing anything
    identity = {
        "method": spec.name,
        "model_config": ckpt._jsonable(resolved_model),
        "target_fingerprint": target.fingerprint,
        "slots": [str(s) for s in wanted],
    }
    resume_dir = ckpt.latest_checkpoint(out)
    saved: dict | None = None
    if resume_dir is not None:
        saved = ckpt.read_state(resume_dir)
        ckpt.check_identity(saved["identity"], identity, where=resume_dir)
        if saved.get("data_fingerprint") != plan.fingerprint():
            log.warning("the training split differs from the one %s was trained on; resuming anyway", resume_dir)
        changed = sorted(k for k, v in ckpt._jsonable(cfg.to_dict()).items()
                         if k not in ("out", "dry_run", "target", "model") and saved["config"].get(k) != v)
        if changed:
            log.warning("resuming with changed settings: %s", ", ".join(f"{k} {saved['config'].get(k)!r} -> {getattr(cfg, k)!r}" for k in changed))
        if saved.get("world_size") != dist_.world:
            log.warning("resuming a %s-process run with %d process(es): the data order after step %d differs", saved.get("world_size"), dist_.world, saved["step"])
    resolved = {**cfg.to_dict(), "model": identity["model_config"], "target": cfg.target or target.name, "data": cfg.data}
    metrics_log = MetricsLog(out / ckpt.METRICS)
    if dist_.main:
        out.mkdir(parents=True, exist_ok=True)
        ckpt.remove_debris(out)
        _dump_yaml(out / ckpt.RESOLVED_CONFIG, resolved)
        write_split(out / SPLIT_FILE, split, decode_prompts=list(probe.sample_ids) if probe else [])
        metrics_log.truncate_after(saved["step"] if saved else 0)
        _truncate_delivery_log(out / DELIVERY_LOG, saved)

    # 3. model (built above; warm-started when the run is fresh), optimizer, schedule (+ state)
    if saved is None:
        apply_warm_start(drafter, spec.name, WarmStartInputs(target=target, cfg=cfg, token_rows=lambda: token_rows(dataset, plan.train_indices)))
    step_module = _StepModule(drafter)
    # state-dict names of the frozen target pieces: never stored in a checkpoint, never restored from one
    frozen = {n for n, p in step_module.named_parameters(remove_duplicate=False) if not p.requires_grad}
    if saved is not None:
        model_state, optim_state = ckpt.load_tensors(resume_dir, saved)
        missing = set(step_module.state_dict()) - frozen - set(model_state)
        if missing:
            raise SpecdraftError(f"{resume_dir / ckpt.STATE_TENSORS} lacks {len(missing)} tensor(s), e.g. {sorted(missing)[0]}; delete that checkpoint")
        step_module.load_state_dict({k: v for k, v in model_state.items() if k not in frozen}, strict=False)
    replica = copy.deepcopy(drafter).cpu() if strategy.save_via_replica and dist_.main else None
    step_module.to(device)
    compute_dtype, dtype_probe, threads = _measured_settings(cfg, step_module, target, identity, dist_, device)
    wrapped = strategy.wrap(step_module, device)
    optimizer = _build_optimizer(wrapped, cfg, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, total_steps=total_steps, warmup_steps=warmup_steps, min_ratio=cfg.min_lr_ratio)
    )
    if saved is not None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        if optim_state["state"]:
            set_optimizer_state_dict(wrapped, optimizer, optim_state, options=StateDictOptions(full_state_dict=True))
        scheduler.load_state_dict(saved["scheduler"])
        step = int(saved["step"])
        log.info("resuming from %s (step %d of %d)", resume_dir, step, total_steps)
    else:
        step = 0
    n_train = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    log.info("%s drafter: %.2fM trainable parameters, %d steps, %s on %s x%d, %s, %d CPU threads (%s)", spec.name, n_train / 1e6,
             total_steps, strategy_name, device, dist_.world, compute_dtype, threads["threads"], threads["threads_source"])

    def savable(model_state: dict[str, torch.Tensor]) -> DrafterModel:
        """The module to call ``save_pretrained`` on (rank 0 only)."""
        if replica is None:
            return drafter
        prefix = "drafter."
        replica.load_state_dict({k[len(prefix):]: v for k, v in model_state.items() if k.startswith(prefix)}, strict=False)
        return replica

    last_saved = int(saved["step"]) if saved is not None else -1  # the newest checkpoint's step

    def check_weights(at_step: int) -> None:
        """Never write a checkpoint or final drafter with NaN/inf weights (a step can blow them up with a finite loss)."""
        bad = _non_finite_parameter(wrapped)
        if dist_.any(bad is not None, device):
            raise _non_finite_error(f"parameter {bad or '(on another rank)'} is not finite", at_step, last_saved, out)

    def save(at_step: int) -> Path:
        nonlocal last_saved
        check_weights(at_step)
        last_saved = at_step
        path = out / ckpt.CHECKPOINTS / f"step-{at_step}"
        model_state, optim_state = _full_states(wrapped, optimizer, frozen)  # a collective: every rank calls it
        epoch, in_epoch = plan.locate(at_step)
        meta = {
            "step": at_step, "epoch": epoch, "step_in_epoch": in_epoch, "total_steps": total_steps,
            "world_size": dist_.world, "identity": identity, "data_fingerprint": plan.fingerprint(), "config": resolved,
            "delivered_bytes": _file_size(out / DELIVERY_LOG),  # every rank has flushed its deliveries (a collective above)
        }
        if dist_.main:
            ckpt.save_checkpoint(path, drafter=savable(model_state), model_state=model_state, optim_state=optim_state,
                                 scheduler_state=scheduler.state_dict(), meta=meta)
            ckpt.prune_checkpoints(out, cfg.keep_checkpoints)
        dist_.barrier()
        return path

    if cfg.dry_run:
        if saved is None:
            log.info("dry run: wrote %s", save(0))
        return TrainResult(out, step, total_steps, False, None, None, drafter, compute_dtype=compute_dtype, dtype_probe=dtype_probe,
                           threads=threads)

    # 4. the loop
    def evaluate(at_step: int) -> dict | None:
        wrapped.eval()
        sums = teacher_forced(wrapped, dataset, plan.val_batches(cfg.val_max_batches), pack_tokens=cfg.pack_tokens,
                              slot_index=slot_index, device=device, compute_dtype=compute_dtype,
                              seed=step_seed(cfg.seed, dist_.rank, at_step, EVAL_SEED_KIND))
        sums.all_reduce()
        if not sums.batches:
            wrapped.train()
            return None
        record = {"split": "val", "step": at_step, **sums.summary()}
        record.update(tau_teacher_forced=record.get("accept_len"), teacher_forced_anchors=TEACHER_FORCED_ANCHORS)
        if probe is not None:
            module = savable(_full_states(wrapped, optimizer, frozen)[0]) if strategy.save_via_replica else drafter  # a collective
            if dist_.main:
                record["decoded"] = probe.run(module, spec.name, target)
                record["tau_decoded"] = record["decoded"]["tau"]
            dist_.barrier()
        elif probe_skipped:
            record["decoded_skipped"] = probe_skipped
        wrapped.train()
        if dist_.main:
            metrics_log.write(record)
        return record

    from tqdm.auto import tqdm

    already_done = saved is not None and step >= total_steps
    stopped_by = None
    sums, window_seconds = MetricSums(), 0.0  # seconds spent in steps since the last record (eval/checkpoints excluded)
    fetch_seconds = 0.0  # of which reading samples (waiting for them, when they are streamed)
    if isinstance(dataset, PrefetchingSource):
        dataset.start(training_order(plan, step, total_steps))
    started = time.monotonic()
    wrapped.train()
    bar = tqdm(total=total_steps, initial=step, desc=f"train {spec.name}", unit="step", disable=not dist_.main, dynamic_ncols=True)
    with _StopFlag() as stop, bar:
        while step < total_steps:
            step_started = time.perf_counter()
            items = [[dataset[i] for i in row] for row in plan.train_rows(step)]
            fetch_seconds += time.perf_counter() - step_started
            batch = collate(items, pack_tokens=cfg.pack_tokens, slot_index=slot_index).to(device)
            _reseed(step_seed(cfg.seed, dist_.rank, step))
            lr = scheduler.get_last_lr()[0]
            with autocast(compute_dtype, device):
                output = wrapped(batch)
            optimizer.zero_grad(set_to_none=True)
            output.loss.backward()
            grad_norm = _clip(wrapped, cfg.grad_clip)
            loss_value = float(output.loss.detach())
            if dist_.any(not all(map(math.isfinite, (loss_value, grad_norm or 0.0))), device):
                raise _non_finite_error(f"the loss is {loss_value} (gradient norm {grad_norm})", step + 1, last_saved, out)
            optimizer.step()
            scheduler.step()
            step += 1
            tokens = int((batch.segment_ids >= 0).sum())
            sums.add(output, tokens)
            window_seconds += time.perf_counter() - step_started
            bar.update(1)

            if step % cfg.log_interval == 0 or step == total_steps:
                sums.all_reduce()
                epoch, _ = plan.locate(step - 1)
                record = {"split": "train", "step": step, "epoch": epoch, "dtype": compute_dtype, "threads": threads["threads"], "lr": lr, "grad_norm": grad_norm, **sums.summary(),
                          "tokens": sums.tokens, "tokens_per_s": sums.tokens / max(window_seconds, 1e-9), "seconds": window_seconds,
                          "fetch_fraction": fetch_seconds / max(window_seconds, 1e-9)}
                if "anchors" in record:
                    record["anchors_per_s"] = record["anchors"] / max(window_seconds, 1e-9)
                if dist_.main:
                    metrics_log.write(record)
                bar.set_postfix(loss=f"{record['loss']:.4f}", tau=f"{record.get('accept_len', 0):.2f}", tok_s=f"{record['tokens_per_s']:.0f}")
                sums, window_seconds, fetch_seconds = MetricSums(), 0.0, 0.0

            if cfg.eval_interval and step % cfg.eval_interval == 0 and step < total_steps:
                evaluate(step)
            timed_out = bool(cfg.max_time) and time.monotonic() - started >= cfg.max_time
            stop_now = dist_.any(stop.signal is not None or timed_out, device)
            if stop_now and step < total_steps:
                stopped_by = "signal" if stop.signal is not None else "max_time"
                save(step)
                break
            if cfg.checkpoint_interval and step % cfg.checkpoint_interval == 0 and step < total_steps:
                save(step)

    # 5. the end
    final = None
    if stopped_by is None and not already_done:
        evaluate(step)
        if last_saved != step:  # decided from this process's own record: every rank must agree, and
            save(step)  # rank 0 may already be writing while a slower rank would look at the disk
    if stopped_by != "signal":
        final = out / ckpt.FINAL
        check_weights(step)
        module = drafter
        if strategy.save_via_replica:
            module = savable(_full_states(wrapped, optimizer, frozen)[0])  # a collective: every rank calls it
        if dist_.main:
            with ckpt.atomic_dir(final, DRAFTER_DIR) as tmp:
                module.save_pretrained(tmp)
                (tmp / MODEL_CARD).write_text(model_card(method=spec.name, step=step, data=where, split=split.record,
                                                         validation=last_validation(out / ckpt.METRICS)))
        dist_.barrier()
    if stopped_by:
        log.warning("stopped by %s at step %d of %d; rerun the same command to resume", stopped_by, step, total_steps)
    return TrainResult(out, step, total_steps, step >= total_steps, stopped_by, final, drafter, stop_signal=stop.signal,
                       compute_dtype=compute_dtype, dtype_probe=dtype_probe, threads=threads)


def teacher_forced(forward: Callable[[DrafterBatch], TrainOutput], dataset: SampleSource, batches: list[list[list[int]]], *,
                   pack_tokens: int, slot_index: list[int] | None, device: torch.device | str, compute_dtype: str,
                   seed: int) -> MetricSums:
    """The validation pass's teacher-forced sums (``accept_len`` = ``tau_teacher_forced``) over ``batches``
    (``DataPlan.val_batches``), every RNG seeded with ``seed`` first. ``forward`` is the step module or a
    drafter's ``training_forward``, already in eval mode (uniform anchors); the benchmarks score other
    held-out sets through this same pass. The caller all-reduces across processes."""
    sums = MetricSums()
    _reseed(seed)
    with torch.no_grad():
        for rows in batches:
            batch = collate([[dataset[i] for i in row] for row in rows], pack_tokens=pack_tokens, slot_index=slot_index).to(device)
            with autocast(compute_dtype, device):
                sums.add(forward(batch), int((batch.segment_ids >= 0).sum()))
    return sums


def _build_optimizer(module: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    """The configured optimizer (``train/optimizers.py``)."""
    from specdraft.train.optimizers import OPTIMIZERS

    return OPTIMIZERS.get(cfg.optimizer)(module, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay,
                                         fused_loops=device.type == "cuda")


def _clip(module: nn.Module, max_norm: float) -> float | None:
    if not max_norm:
        return None
    params = [p for p in module.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
        norm = norm.full_tensor()
    return float(norm)


def _file_size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0


def _truncate_delivery_log(path: Path, saved: dict | None) -> None:
    """Cut the streaming sources' delivery log back to what the resumed checkpoint had seen, so samples
    delivered after it (read again on resume) are not listed twice; a fresh run starts it empty."""
    size = saved.get("delivered_bytes") if saved else 0
    if size is not None and _file_size(path) > size:
        with open(path, "r+b") as f:
            f.truncate(size)


def _non_finite_parameter(module: nn.Module) -> str | None:
    """The name of the first trainable parameter holding NaN/inf on this rank (its local shard under FSDP), or None."""
    for name, p in module.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if p.requires_grad and not bool(torch.isfinite(local.detach()).all()):
            return name
    return None


def _non_finite_error(what: str, at_step: int, last_saved: int, out: Path) -> SpecdraftError:
    kept = (f"the last good checkpoint, {out / ckpt.CHECKPOINTS / f'step-{last_saved}'}, is kept (a rerun resumes from it)"
            if last_saved >= 0 else "no checkpoint had been written yet")
    return SpecdraftError(
        f"training stopped at step {at_step}: {what}; nothing from this step on was saved and {kept}. "
        "Lower --lr, check --grad-clip and --weight-decay, or look for broken samples in the data"
    )


def _full_states(wrapped: nn.Module, optimizer: torch.optim.Optimizer, frozen: set[str]) -> tuple[dict, dict]:
    """Unsharded, CPU copies of the trainable model state and the optimizer state (a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = {k: v for k, v in get_model_state_dict(wrapped, options=options).items() if k not in frozen}
    if not optimizer.state:
        # Before the first step: get_optimizer_state_dict would materialise the state with a dummy
        # step (step=1), which a resume would then wrongly count as a real update.
        return model_state, {"state": {}, "param_groups": []}
    return model_state, get_optimizer_state_dict(wrapped, optimizer, options=options)
