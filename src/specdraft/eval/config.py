"""Typed config of ``specdraft eval`` (torch-free so ``--help`` stays fast)."""

from __future__ import annotations

from dataclasses import dataclass

from specdraft.decode.config import DRAFT_DTYPES
from specdraft.errors import SpecdraftError, setting
from specdraft.tracking import check_report_to
from specdraft.tuning.paths import path_choices
from specdraft.utils.config import check_forward_path, config_field, require_finite
from specdraft.utils.vllm_options import VLLM_PYTHON_LOOKUP


@dataclass(frozen=True)
class EvalConfig:
    """What to compare, on which prompts, at which concurrency levels."""

    out: str = config_field(help="run directory: report.json, report.md and PNG plots are written here")
    target: str = config_field("smollm2-135m", help="embedded target name or a local Hugging Face model directory")
    drafters: list[str] = config_field(
        ["ngram"],
        help="comma-separated drafters compared against plain autoregressive decoding: 'ngram' "
        "(prompt lookup, no training), 'suffix' (prompt lookup, else the target's own answers in --lookup-corpus), "
        "'reference' (the drafter shipped for the embedded target) and/or checkpoint directories (method read from "
        "their config.json); append '+ngram' or '+suffix' to a checkpoint or 'reference' for its hybrid with that lookup "
        "(per request and round, whichever is expected to commit more tokens per second); "
        "append '@POLICY' to set one drafter's verify policy, e.g. DIR@scheduled or reference+suffix@scheduled; "
        "prefix 'LABEL=' to name one in the report (e.g. a=runs/a/final,b=runs/b/final; checkpoints left unlabelled whose "
        "directories share a name are told apart by their parents: dspark:a/final, dspark:b/final)",
    )
    lookup_corpus: str = config_field(
        "",
        help="for 'suffix' drafters: a `specdraft prepare` output for this target whose answers (the target's own, when "
        "prepare regenerated them) propose continuations where prompt lookup finds none",
    )
    suite: str = config_field(
        "quick",
        help="prompt suite: mtbench | humaneval | translation | math | sharegpt | domains | quick | long-context (1k-8k-token "
        "documents and chats, sized for the embedded target; ignored with --prompts)",
    )
    prompts: str = config_field("", help="JSONL prompt file ('prompt' or 'messages' per line, optional 'id'/'domain')")
    limit_per_domain: int = config_field(0, help="use at most this many prompts per domain (0 = all)")
    max_new_tokens: int = config_field(64, help="tokens generated per prompt")
    num_draft_tokens: int = config_field(4, help="k: drafted tokens per round for chain drafters (block drafters use their block size)")
    concurrency: list[int] = config_field([1], help="comma-separated numbers of requests decoded together, e.g. 1,2,4")
    dtype: str = config_field("float32", help="target weights dtype: float32 | bfloat16")
    draft_dtype: str = config_field(
        "auto",
        help="compute dtype of the trained drafters' rounds: fp32, bf16 autocast, or auto (the faster here, measured "
        "once per machine and drafter configuration); the report records the dtype used and why",
        metadata={"choices": list(DRAFT_DTYPES)},
    )
    forward_path: str = config_field(
        "auto",
        help="how the target's and the drafters' forwards execute: eager, prepacked (oneDNN-prepacked linear weights; "
        "CPU, fp32), gqa (SDPA groups query heads over shared K/V heads; targets with grouped attention), prepacked+gqa or "
        "auto (the fastest here, measured once per machine and model); the report records the path and why",
        metadata={"choices": path_choices()},
    )
    device: str = config_field("cpu", help="torch device, e.g. cpu or cuda")
    threads: int = config_field(
        0,
        help="torch CPU threads (0 = auto: the count at which plain decoding of the target ran fastest here, measured once "
        "per machine and target and cached)",
    )
    max_time: float = config_field(
        0.0,
        help="seconds the comparison may take, its set-up (thread probe, warm-ups) included: no prompt batch is started "
        "that the mean batch time so far says would "
        "end past it, and the report covers the batches finished, each run by every drafter (0 = no limit)",
    )
    seed: int = config_field(0, help="sampling seed (temperature > 0)")
    plots: bool = config_field(True, help="write PNG plots (needs matplotlib)")
    report_to: list[str] = config_field(
        [],
        help="trackers the summary (tau, tokens/s, speed-up per drafter and concurrency) is mirrored to, once, a comma list: "
        "tensorboard, mlflow, wandb (offline unless WANDB_MODE), trackio, or none; their files go into --out",
    )
    endpoint: str = config_field(
        "",
        help="benchmark a running OpenAI-compatible vLLM server at this URL (e.g. from `specdraft serve`) instead of "
        "the built-in runtime; acceptance is read from its /metrics and --drafters is ignored",
    )

    parity: bool = config_field(
        False,
        help="acceptance parity: run each checkpoint drafter in --drafters through the built-in runtime and through vLLM "
        "(the server at --endpoint, which must serve that one drafter, else a server started per drafter as `specdraft serve` "
        "does) on the same prompts, and report tau side by side, flagging gaps above 3%%",
    )
    vllm_args: str = config_field("", help="--parity without --endpoint: extra vLLM api_server flags of the servers it starts")
    vllm_python: str | None = config_field(
        None, help=f"--parity without --endpoint: python of the vLLM environment (default: {VLLM_PYTHON_LOOKUP})"
    )

    def __post_init__(self) -> None:
        require_finite(self)
        check_report_to(self.report_to)
        if not self.drafters:
            raise SpecdraftError(f"{setting('drafters')} needs at least one drafter (e.g. ngram or a checkpoint directory)")
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise SpecdraftError(f"{setting('concurrency')} values must be >= 1, got {self.concurrency}")
        if self.max_new_tokens < 1:
            raise SpecdraftError(f"{setting('max_new_tokens', of='eval')} must be >= 1, got {self.max_new_tokens}")
        if self.limit_per_domain < 0:
            raise SpecdraftError(f"{setting('limit_per_domain')} must be >= 0, got {self.limit_per_domain}")
        if self.draft_dtype not in DRAFT_DTYPES:
            raise SpecdraftError(f"{setting('draft_dtype')} must be one of {', '.join(DRAFT_DTYPES)}, got {self.draft_dtype!r}")
        check_forward_path(self.forward_path, setting("forward_path"))
        if self.max_time < 0:
            raise SpecdraftError(f"{setting('max_time')} must be >= 0 seconds, got {self.max_time}")
