"""``specdraft generate``: speculative decoding with a target and a drafter, with speed metrics."""

from __future__ import annotations

import argparse
import functools
import json
from dataclasses import dataclass
from pathlib import Path

from specdraft.cli import summary
from specdraft.decode.config import DecodeConfig, SamplingConfig, SchedulerConfig
from specdraft.utils.config import add_dataclass_arguments, config_field, dataclass_from_args
from specdraft.utils.io import FileKind


@dataclass(frozen=True)
class GenerateConfig:
    """Where the prompts come from and which target runs them."""

    target: str = config_field("smollm2-135m", help="embedded target name or a local Hugging Face model directory")
    dtype: str = config_field("float32", help="target weights dtype: float32 | bfloat16 | float16")
    device: str = config_field("cpu", help="torch device of target and drafter, e.g. cpu or cuda")
    prompt: str = config_field("", help="one user message (rendered with the target's chat template)")
    prompts_file: str = config_field("", help="text file with one user message per line (blank lines skipped)")
    batch_size: int = config_field(1, help="requests decoded together in one batch")
    threads: int = config_field(
        0,
        help="torch CPU threads (0 = auto: the count at which plain decoding of the target ran fastest here, measured once "
        "per machine and target and cached)",
    )
    metrics_out: str = config_field("", help="write the metrics (and the generated texts) to this JSON file")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate", help="generate with speculative decoding and report tau / tokens per second", description=summary(__doc__)
    )
    for cls in (GenerateConfig, DecodeConfig, SamplingConfig, SchedulerConfig):
        add_dataclass_arguments(parser, cls)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Generate; ``--metrics-out`` is claimed first, as every command's output (``utils/lock.claim_output``: only a
    metrics file is replaced, it must be writable, and no other writer may hold it or a directory above it), so a
    wrong path costs nothing and no decoding is wasted."""
    from specdraft.utils.lock import claim_output

    metrics_out = dataclass_from_args(GenerateConfig, args).metrics_out
    if not metrics_out:
        return _generate(args)
    with claim_output(metrics_out, METRICS_FILE, what="--metrics-out", command="specdraft generate"):
        return _generate(args)


def _generate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specdraft.decode.runtime import decoder_for_target, decoding_settings, resolve_decode_threads, resolve_target_path
    from specdraft.errors import SpecdraftError
    from specdraft.targets import load_target
    from specdraft.utils.io import atomic_write_json

    job = dataclass_from_args(GenerateConfig, args)
    config = dataclass_from_args(DecodeConfig, args)
    sampling = dataclass_from_args(SamplingConfig, args)
    scheduler = dataclass_from_args(SchedulerConfig, args)
    if job.batch_size < 1:
        raise SpecdraftError(f"--batch-size must be >= 1, got {job.batch_size}")
    messages = [job.prompt] if job.prompt else []
    if job.prompts_file:
        try:
            messages += [line.strip() for line in Path(job.prompts_file).read_text().splitlines() if line.strip()]
        except OSError as exc:
            raise SpecdraftError(f"cannot read --prompts-file {job.prompts_file}: {exc}") from None
    if not messages:
        raise SpecdraftError("nothing to generate: pass --prompt TEXT or --prompts-file FILE")
    target = load_target(job.target, dtype=job.dtype, device=job.device)
    threads = resolve_decode_threads(target, job.threads, rows=job.batch_size)  # first: the later probes run at the count used
    path = resolve_target_path(target, config.forward_path)
    decoder = decoder_for_target(target, config=config, sampling=sampling, scheduler=scheduler, forward_path=path)
    decoding_settings("generate", decoder, threads).log()
    tok = target.tokenizer
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True, tokenize=True, return_dict=False)
        for m in messages
    ]
    texts, batches = [], []
    for start in range(0, len(prompts), job.batch_size):
        result = decoder.generate(prompts[start : start + job.batch_size])
        batches.append(result.metrics)
        for message, out in zip(messages[start:], result.outputs):
            text = tok.decode(out.tokens, skip_special_tokens=True)
            texts.append({"prompt": message, "output": text, "tokens": len(out.tokens), "finish_reason": out.finish_reason})
            print(f"### {message}\n{text}\n")
    metrics = functools.reduce(lambda merged, batch: merged.merge(batch), batches)  # at least one batch: messages is not empty
    summary = metrics.to_json()
    print(
        f"drafter={config.drafter} requests={metrics.requests} tokens={metrics.output_tokens} tau={metrics.tau:.3f} "
        f"acceptance={metrics.acceptance_rate:.3f} tok/s={metrics.tokens_per_s:.2f} ttft={metrics.mean_ttft_s * 1000:.0f}ms "
        f"tpot={metrics.time_per_output_token_s * 1000:.1f}ms"
    )
    if job.metrics_out:
        atomic_write_json(
            job.metrics_out,
            {
                "target": target.describe(),
                "decode": vars(config),
                "sampling": vars(sampling),
                "scheduler": vars(scheduler),
                "metrics": summary,
                "outputs": texts,
            },
        )
        print(f"wrote {job.metrics_out}")
    return 0


def _is_metrics_file(path: Path) -> bool:
    """Whether ``path`` holds what ``--metrics-out`` writes: only such a file is replaced (a user's file never is)."""
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(obj, dict) and {"metrics", "outputs", "decode"} <= obj.keys()


METRICS_FILE = FileKind("metrics file `specdraft generate` wrote", _is_metrics_file, "metrics.json")
