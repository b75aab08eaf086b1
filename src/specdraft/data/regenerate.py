"""Replace assistant replies by the target's own answers (self-distillation data for drafters).

Why: a drafter is scored on how often the *target* agrees with it, so it should learn the target's
distribution, not the human/ChatGPT replies in the source data.

Batched (prompts sorted by length, so a batch wastes little on padding), left-padded
``generate``; each finished batch is written atomically as
``<work>/batch-NNNNNN.json`` and reused on a rerun, so a killed job resumes where it stopped. The
work directory is keyed by everything that determines the output (target, prompts, decoding
settings), so a changed setting never reuses stale batches. Sampling (temperature > 0) seeds each
batch with ``seed + batch_index``, so a resumed run produces the same tokens as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdraft.utils.io import atomic_write_json


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int
    temperature: float  # 0 = greedy
    batch_size: int
    seed: int


@dataclass
class GenerationStats:
    generated_tokens: int = 0  # produced in this run (reused batches excluded)
    seconds: float = 0.0
    reused_batches: int = 0
    generated_batches: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0


def work_key(target_fingerprint: str, prompts: list[tuple[str, list[int]]], settings: GenerationSettings) -> str:
    h = hashlib.sha256(json.dumps([target_fingerprint, settings.__dict__], sort_keys=True).encode())
    for sample_id, ids in prompts:
        h.update(sample_id.encode() + b"\0" + json.dumps(ids).encode() + b"\n")
    return h.hexdigest()[:16]


def generate_batch(model: Any, prompts: list[list[int]], *, pad_id: int, eos_ids: set[int], settings: GenerationSettings, seed: int) -> list[list[int]]:
    """Completions (each cut after its first end-of-turn token) for left-padded prompts."""
    import torch
    from transformers import GenerationConfig

    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    sampling = settings.temperature > 0
    config = GenerationConfig(
        max_new_tokens=settings.max_new_tokens,
        do_sample=sampling,
        temperature=settings.temperature if sampling else None,
        top_k=0 if sampling else None,
        top_p=1.0 if sampling else None,
        pad_token_id=pad_id,
        eos_token_id=sorted(eos_ids),
    )
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        out = model.generate(input_ids=input_ids.to(model.device), attention_mask=attention_mask.to(model.device), generation_config=config)
    completions = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        completions.append(row[:cut])
    return completions


def regenerate(
    model: Any,
    prompts: list[tuple[str, list[int]]],
    *,
    work_dir: Path,
    pad_id: int,
    eos_ids: set[int],
    settings: GenerationSettings,
    progress: bool = True,
) -> tuple[dict[str, list[int]], GenerationStats]:
    """``{sample_id: completion ids}`` for ``(sample_id, prompt ids)`` pairs, resuming from ``work_dir``."""
    from tqdm.auto import tqdm

    work_dir.mkdir(parents=True, exist_ok=True)
    prompts = sorted(prompts, key=lambda p: len(p[1]))  # similar lengths share a batch: less padding
    stats = GenerationStats()
    results: dict[str, list[int]] = {}
    bar = tqdm(total=len(prompts), unit="sample", desc="regenerate", disable=not progress)
    for index, start in enumerate(range(0, len(prompts), settings.batch_size)):
        batch = prompts[start : start + settings.batch_size]
        ids = [sample_id for sample_id, _ in batch]
        path = work_dir / f"batch-{index:06d}.json"
        completions = _load_batch(path, ids)
        if completions is None:
            t0 = time.perf_counter()
            completions = generate_batch(model, [p for _, p in batch], pad_id=pad_id, eos_ids=eos_ids, settings=settings, seed=settings.seed + index)
            stats.seconds += time.perf_counter() - t0
            stats.generated_tokens += sum(len(c) for c in completions)
            stats.generated_batches += 1
            atomic_write_json(path, {"sample_ids": ids, "completions": completions})
        else:
            stats.reused_batches += 1
        results.update(zip(ids, completions))
        bar.update(len(batch))
        bar.set_postfix(tok_s=f"{stats.tokens_per_second:.1f}", reused=stats.reused_batches)
    bar.close()
    return results, stats


def _load_batch(path: Path, sample_ids: list[str]) -> list[list[int]] | None:
    """A finished batch, or None when absent or not for these samples (it is then regenerated)."""
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if saved.get("sample_ids") != sample_ids or len(saved.get("completions", [])) != len(sample_ids):
        return None
    return saved["completions"]
