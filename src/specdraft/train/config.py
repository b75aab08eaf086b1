"""``TrainConfig``: the one place where training defaults and ``--help`` text live.

Resolution order (later wins): dataclass defaults < ``--config recipe.yaml`` < command-line flags.
``model`` is merged per key (a recipe can set ``block_size`` and the CLI ``num_layers``). The
resolved config, with ``model`` expanded to the method config's full field set, is written to
``OUT/config.resolved.yaml`` so a run records every value it used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdraft.errors import SpecdraftError, setting
from specdraft.hidden_states.config import STORAGE_DTYPE_NAMES, VERIFY_LEVELS
from specdraft.hidden_states.data_modes import DATA_MODES
from specdraft.models.common.distill_losses import DISTILL_LOSSES
from specdraft.tracking import check_report_to
from specdraft.train.split import DEFAULT_SPLIT_SEED, DEFAULT_VAL_FRACTION
from specdraft.train.warm_start import FC_INITS, MARKOV_INITS
from specdraft.tuning.paths import path_choices
from specdraft.utils.config import check_fields, check_forward_path, config_field, require_finite

DTYPE_CHOICES = ("auto", "bf16", "fp32")
PARALLEL_CHOICES = ("auto", "ddp", "fsdp")


@dataclass
class TrainConfig:
    method: str | None = config_field(None, help="drafter method, a key of the METHODS registry (dspark, dflash, dflash2, eagle3)")
    target: str | None = config_field(
        None, help="target model: an embedded name or a HF directory (default: the target recorded in the hidden-state store)"
    )
    data: str | None = config_field(
        None, help="hidden-state store directory written by `specdraft extract` (hybrid mode: the local cache of requested samples)"
    )
    data_mode: str = config_field(
        "offline",
        help="where hidden states come from: offline (the --data store), online (requested from --producers, streamed "
        "through --store and deleted after use) or hybrid (samples in --data are read locally, others requested and cached there)",
        metadata={"choices": DATA_MODES.names()},
    )
    verify: str = config_field(
        "quick",
        help="offline: how the --data store is checked before the first step: quick (every sample present and "
        "whole, by size) or full (also every sample read and checked against its recorded sha256)",
        metadata={"choices": list(VERIFY_LEVELS)},
    )
    dataset: str | None = config_field(
        None,
        help="the prepared dataset: online/hybrid, whose samples are requested; offline, default the one the store recorded "
        "(pass it when the run was moved)",
    )
    producers: list[str] = config_field(
        [],
        help="online/hybrid: producer URLs 'http://HOST:PORT,...' (`specdraft serve-hidden-states`), or @FILE: one URL per "
        "line, reread every 2 s, so producers can join and leave while training runs",
    )
    producer_token: str | None = config_field(None, help="online/hybrid: the bearer token the producers were started with")
    store: str | None = config_field(
        None,
        help="online/hybrid: where producers write, a shared directory or mooncake://HOST:PORT/NS?admin=HOST:PORT "
        "(trainers hold the memory)",
    )
    stream_dtype: str = config_field(
        "bfloat16", help="online/hybrid: storage dtype requested from the producers", metadata={"choices": list(STORAGE_DTYPE_NAMES)}
    )
    prefetch: int = config_field(8, help="online/hybrid: sample requests kept in flight ahead of training")
    request_timeout: float = config_field(120.0, help="online/hybrid: seconds before an unanswered request goes to another producer")
    out: str | None = config_field(None, help="run directory: checkpoints, metrics.jsonl, final/ (rerun to resume)")
    model: dict = config_field(
        {}, help="method config overrides, 'key=value,key=value' (values parsed as YAML) or a YAML mapping in the recipe"
    )
    distill_loss: str = config_field(
        "",
        help=f"the drafter-to-target distillation term (models/common/distill_losses.py): {', '.join(DISTILL_LOSSES.names())} "
        "('' = the method's own: dspark l1, dflash2 kl, eagle3 soft_ce; dflash trains on hard labels and refuses it); "
        "sets model.distill_loss",
    )
    optimizer: str = config_field(
        "adamw",
        help="adamw, or muon (Muon on hidden weight matrices, AdamW on the rest; train/optimizers.py)",
        metadata={"choices": ["adamw", "muon"]},
    )
    lr: float = config_field(6e-4, help="peak learning rate (AdamW; Muon's steps are scaled to AdamW's update size)")
    weight_decay: float = config_field(0.0, help="decoupled weight decay (matrices only; norms and biases never decay)")
    betas: list[float] = config_field([0.9, 0.95], help="AdamW betas, 'b1,b2'")
    warmup_ratio: float = config_field(0.04, help="fraction of total steps with linear warm-up, then cosine decay")
    min_lr_ratio: float = config_field(0.0, help="cosine floor as a fraction of the peak learning rate")
    grad_clip: float = config_field(1.0, help="clip the global gradient norm to this value (0 = off)")
    pack_tokens: int = config_field(
        2048,
        help="tokens per packed row; samples are packed whole, longer ones are truncated "
        "(unless --max-sample-tokens gives them rows of their own)",
    )
    max_sample_tokens: int = config_field(
        0,
        help="long samples, not long packs: a sample longer than --pack-tokens gets a row of its own of up to this many "
        "tokens (longer ones are truncated to it), so short samples still pack as before; memory grows with it and with "
        "the anchors per sample, and each log record carries the process's peak RSS (0 = --pack-tokens: truncate)",
    )
    batch_rows: int = config_field(1, help="packed rows per optimizer step on each process")
    epochs: int = config_field(1, help="passes over the training split (ignored when --max-steps is set)")
    max_steps: int = config_field(0, help="optimizer steps to train (0 = as many as --epochs take)")
    max_time: float = config_field(0.0, help="stop (checkpoint + final) after this many seconds of training (0 = no limit)")
    seed: int = config_field(0, help="seed for initialisation, data order and every per-step random draw")
    val_fraction: float = config_field(
        DEFAULT_VAL_FRACTION,
        help="share of conversations held out for validation (whole conversations; a prompt shared with a training "
        "conversation stays in training; train/split.py); the split is recorded in OUT/split.json and reused on resume",
    )
    split_seed: int = config_field(
        DEFAULT_SPLIT_SEED,
        help="seed of the validation split (independent of --seed, so reruns with other seeds validate on the same samples)",
    )
    decode_prompts: int = config_field(
        3,
        help="at each validation also decode this many validation prompts greedily with the built-in runtime and log "
        "their tau (decoded) beside the teacher-forced estimate (0 = off)",
    )
    decode_tokens: int = config_field(32, help="tokens generated per prompt for the decoded tau")
    val_max_batches: int = config_field(8, help="validation batches per evaluation (0 = the whole split)")
    eval_interval: int = config_field(100, help="validate every N steps and at the end (0 = only at the end)")
    checkpoint_interval: int = config_field(200, help="checkpoint every N steps and at the end (0 = only at the end)")
    keep_checkpoints: int = config_field(2, help="keep only the newest N step checkpoints (0 = keep all)")
    log_interval: int = config_field(1, help="append a metrics.jsonl record every N steps")
    report_to: list[str] = config_field(
        [],
        help="trackers mirroring metrics.jsonl and the config, a comma list: tensorboard (OUT/tensorboard), mlflow "
        "(OUT/mlflow.db unless MLFLOW_TRACKING_URI), wandb (offline under OUT/wandb unless WANDB_MODE), trackio (its local "
        "store), or none; each is an extra: pip install 'specdraft[NAME]'",
    )
    dtype: str = config_field(
        "auto",
        help="compute dtype: bf16 autocast, fp32, or auto (times this run's step in both once per machine, "
        "cached under the specdraft cache, and picks the faster)",
        metadata={"choices": DTYPE_CHOICES},
    )
    forward_path: str = config_field(
        "auto",
        help="how the step's modules execute: eager, prepacked (frozen linears through oneDNN-prepacked weights; CPU, fp32; "
        "gqa applies to targets only, so prepacked+gqa trains as prepacked), or auto (times this run's fp32 step on each once "
        "per machine, cached, and picks the faster)",
        metadata={"choices": path_choices()},
    )
    device: str = config_field("auto", help="torch device: auto (the local CUDA device if any, else cpu), cpu, cuda")
    parallel: str = config_field(
        "auto",
        help="multi-process strategy under torchrun: ddp, fsdp (FSDP2 fully_shard; meant for GPUs) or auto (= ddp)",
        metadata={"choices": PARALLEL_CHOICES},
    )
    sequence_parallel: int = config_field(
        1,
        help="split each sample across this many consecutive processes of a torchrun launch (a sequence group: each holds "
        "1/N of its hidden states; processes = data x N); for samples one process cannot hold, see docs/guides/long-context.md",
    )
    num_threads: int = config_field(
        0,
        help="torch CPU threads per process (0 = auto: the count that ran this run's step fastest here, measured once per "
        "machine and cached)",
    )
    dry_run: bool = config_field(False, help="build the drafter, write an initialised checkpoint and exit")
    init_from_target: bool = config_field(
        False,
        help="fresh runs: start draft layer i from target layer L-N+i (the last N) where tensor shapes match (models/common/warm_start.py)",
    )
    fc_init: str = config_field(
        "random",
        help="fresh runs: the fc fusing the captured slots starts random or as the identity on the slot nearest the "
        "first copied target layer's input",
        metadata={"choices": list(FC_INITS)},
    )
    markov_init: str = config_field(
        "random",
        help="dspark, fresh runs: Markov head W1/W2 start random or from a rank-r SVD of the training split's bigram log-odds",
        metadata={"choices": list(MARKOV_INITS)},
    )

    def __post_init__(self) -> None:
        if isinstance(self.model, str):
            self.model = parse_overrides(self.model)
        if self.distill_loss:  # a train flag for every method, applied where the loss lives: the method config
            given = self.model.get("distill_loss") or self.distill_loss
            if given != self.distill_loss:
                raise SpecdraftError(f"{setting('distill_loss')} {self.distill_loss!r} contradicts model.distill_loss {given!r}")
            self.model = {**self.model, "distill_loss": self.distill_loss}
        require_finite(self)
        check_forward_path(self.forward_path, setting("forward_path"))
        self.betas = [float(b) for b in self.betas]
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise SpecdraftError(f"betas must be two numbers in [0, 1), got {self.betas}")
        DATA_MODES.get(self.data_mode)  # an unknown name raises with the list of modes
        if self.verify not in VERIFY_LEVELS:
            raise SpecdraftError(f"verify must be one of {', '.join(VERIFY_LEVELS)}, got {self.verify!r}")
        self.producers = [p.strip() for p in self.producers if p.strip()]
        self.report_to = check_report_to(self.report_to)
        if self.request_timeout <= 0:
            raise SpecdraftError(f"request_timeout must be > 0, got {self.request_timeout}")
        for name in ("pack_tokens", "batch_rows", "epochs", "log_interval", "prefetch", "decode_tokens"):
            if getattr(self, name) < 1:
                raise SpecdraftError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "max_steps",
            "max_sample_tokens",
            "val_max_batches",
            "decode_prompts",
            "eval_interval",
            "checkpoint_interval",
            "keep_checkpoints",
            "num_threads",
        ):
            if getattr(self, name) < 0:
                raise SpecdraftError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise SpecdraftError(f"lr must be a positive number, got {self.lr}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise SpecdraftError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise SpecdraftError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise SpecdraftError(f"val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.dtype not in DTYPE_CHOICES:
            raise SpecdraftError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        if self.fc_init not in FC_INITS or self.markov_init not in MARKOV_INITS:
            raise SpecdraftError(
                f"fc_init must be one of {', '.join(FC_INITS)} and markov_init one of {', '.join(MARKOV_INITS)}, "
                f"got {self.fc_init!r} and {self.markov_init!r}"
            )
        if self.parallel not in PARALLEL_CHOICES:
            raise SpecdraftError(f"parallel must be one of {', '.join(PARALLEL_CHOICES)}, got {self.parallel!r}")
        if self.max_time < 0 or self.weight_decay < 0 or self.grad_clip < 0:
            raise SpecdraftError("max_time, weight_decay and grad_clip must be >= 0")
        self._check_sequence_parallel()

    def _check_sequence_parallel(self) -> None:
        """Refuse a group size below 1. DDP and FSDP both run over the data x sequence mesh (``train/strategies.py``);
        streamed data is shared by a group: one request per sample (``hidden_states.streaming.GroupShare``)."""
        n = self.sequence_parallel
        if n < 1:
            raise SpecdraftError(f"{setting('sequence_parallel')} must be >= 1 (1 = off), got {n}")

    def require(self, *names: str) -> None:
        """Fail with a message naming both ways to set each missing field."""
        for name in names:
            if getattr(self, name) in (None, ""):
                raise SpecdraftError(f"{setting(name)} is required (or set `{name}:` in the {setting('config')} recipe)")

    def required(self, name: str) -> str:
        """The string field ``name``, refused as :meth:`require` refuses it when unset (typed ``str``, not optional)."""
        self.require(name)
        return str(getattr(self, name))

    @property
    def round_row_widths(self) -> bool:
        """Pad rows to a few widths (``train/batches.py: padded_width``): with long samples, rows of 500 to 8k tokens
        fragmented the heap (peak RSS 4.3 vs 2.5 GB, docs/results/long_train)."""
        return self.max_sample_tokens > self.pack_tokens

    @property
    def sample_tokens(self) -> int:
        """The most tokens of one sample a step reads (longer samples are truncated to it)."""
        return max(self.pack_tokens, self.max_sample_tokens)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def parse_overrides(text: str) -> dict:
    """``"block_size=8,num_layers=2"`` or a YAML mapping ``"{block_size: 8}"`` -> dict (values via YAML)."""
    import yaml

    text = text.strip()
    if not text:
        return {}
    if text.startswith("{"):
        value = _yaml_load(text, setting("model"))
        if not isinstance(value, dict):
            raise SpecdraftError(f"{setting('model')} {text!r} is not a YAML mapping")
        return value
    out: dict[str, Any] = {}
    for part in text.split(","):
        key, sep, raw = part.partition("=")
        if not sep or not key.strip():
            raise SpecdraftError(
                f"cannot parse model override {part!r}: expected key=value (e.g. {setting('model')} num_layers=2,block_size=8)"
            )
        out[key.strip()] = yaml.safe_load(raw.strip()) if raw.strip() else None
    return out


def _yaml_load(text: str, where: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SpecdraftError(f"{where} is not valid YAML: {exc}") from None


def load_recipe(path: str | Path) -> dict:
    """Read a YAML recipe and check it against ``TrainConfig``: every key a field, every value of its field's type
    (``utils/config.check_fields``), so a wrong one is named with the file rather than failing deep in the run."""
    path = Path(path)
    if not path.is_file():
        raise SpecdraftError(f"config file {path} does not exist")
    values = _yaml_load(path.read_text(), f"config file {path}") or {}
    if not isinstance(values, dict):
        raise SpecdraftError(f"config file {path} must hold a YAML mapping of TrainConfig fields, got {type(values).__name__}")
    if "model" in values and values["model"] is None:  # a `model:` section whose every line is commented out
        values["model"] = {}
    values = _yaml_numbers(TrainConfig, values)
    check_fields(TrainConfig, values, f"config file {path}")
    return values


def _yaml_numbers(cls: type, values: dict) -> dict:
    """YAML 1.1 reads "6e-4" as a string: a string or an integer is fine for a float field of ``cls`` when it reads as
    a number (anything else is left for the type check to name)."""
    hints = typing.get_type_hints(cls)
    out = dict(values)
    for key, value in values.items():
        if hints.get(key) in (float, float | None) and isinstance(value, (int, str)) and not isinstance(value, bool):
            with contextlib.suppress(ValueError):  # left as given: the dataclass check names the field
                out[key] = float(value)
    return out


def check_model_overrides(method: str | None, model: Any, where: str) -> dict:
    """``model`` (the recipe's or ``--model``'s) checked against ``method``'s config class with its key path
    (``model.block_size``), its float strings read as numbers; unchecked when the method is unknown here (an
    error of its own later) or its config is no dataclass."""
    import specdraft.models  # noqa: F401  (registers the built-in methods)
    from specdraft.models.base import METHODS

    if not isinstance(model, dict):
        raise SpecdraftError(f"{where}: model must be a mapping of method config overrides, got {model!r} ({type(model).__name__})")
    config_cls = METHODS.get(method).config_cls if method and method in METHODS else None
    if config_cls is None or not dataclasses.is_dataclass(config_cls):
        return model
    model = _yaml_numbers(config_cls, model)
    check_fields(config_cls, model, where, "model.")
    return model


def recipe_path(name_or_path: str | Path) -> Path:
    """A packaged recipe by name (``dspark``, ``dflash``, ``eagle3``: ``specdraft/recipes/NAME.yaml``) or a YAML path."""
    packaged = Path(__file__).resolve().parent.parent / "recipes" / f"{name_or_path}.yaml"
    if packaged.is_file():
        return packaged
    path = Path(name_or_path)
    if not path.is_file():
        names = sorted(p.stem for p in packaged.parent.glob("*.yaml"))
        raise SpecdraftError(f"recipe {str(name_or_path)!r} is neither a packaged recipe ({', '.join(names)}) nor a YAML file")
    return path


def resolve_config(recipe: str | Path | None = None, overrides: dict | None = None) -> TrainConfig:
    """Defaults < recipe (packaged name or file) < ``overrides`` (e.g. the flags given on the command line)."""
    path = recipe_path(recipe) if recipe else None
    values: dict[str, Any] = load_recipe(path) if path else {}
    overrides = dict(overrides or {})
    cli_model = overrides.pop("model", None)
    cli_model = parse_overrides(cli_model) if isinstance(cli_model, str) else cli_model
    method = overrides.get("method", values.get("method"))
    model = dict(check_model_overrides(method, values.get("model") or {}, f"config file {path}"))
    model.update(check_model_overrides(method, cli_model or {}, setting("model")))
    values.update(_yaml_numbers(TrainConfig, overrides))
    values["model"] = model
    try:
        return TrainConfig(**values)
    except TypeError as exc:
        raise SpecdraftError(f"invalid training config: {exc}") from None
