"""Render a conversation with the target's chat template and mark exactly the assistant tokens.

The mask comes from render boundaries, not from regexes over template markup:

1. For each assistant message k, render ``messages[:k]`` with the generation prompt and
   ``messages[:k+1]``; the reply occupies the characters between the two (the template must be
   prefix-stable, i.e. each render is a prefix of the next, which holds for ordinary chat templates).
2. Tokenize the full render once with character offsets (``add_special_tokens=False``: the
   template already emits BOS if it wants one).
3. A token is masked when it starts inside a reply span. Inside each span, tokens after the first
   end-of-turn token (e.g. the newline the template adds after ``<|im_end|>``) are unmasked: the
   drafter should learn the reply and the stop token, not template glue.
"""

from __future__ import annotations

from typing import Any

from specdraft.data.sources import ASSISTANT
from specdraft.errors import SpecdraftError
from specdraft.targets.chat import render_chat


def render_with_mask(tokenizer: Any, messages: list[dict], eot_ids: set[int]) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)`` for a conversation; loss_mask is 1 on assistant reply tokens + end of turn."""
    full = render_chat(tokenizer, messages, generation_prompt=False)
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != ASSISTANT:
            continue
        if k == 0:
            raise SpecdraftError("a conversation cannot start with an assistant turn (it has no prompt); drop such turns first")
        before = render_chat(tokenizer, messages[:k], generation_prompt=True)
        through = render_chat(tokenizer, messages[: k + 1], generation_prompt=False)
        if not (through.startswith(before) and full.startswith(through)):
            raise SpecdraftError(
                "the target's chat template is not prefix-stable (rendering a conversation prefix does not give a prefix "
                "of the full render), so assistant spans cannot be located; use a template without history rewriting"
            )
        spans.append((len(before), len(through)))
    encoding = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoding["input_ids"])
    offsets = encoding["offset_mapping"]
    mask = [0] * len(ids)
    span_iter = iter(spans)
    span = next(span_iter, None)
    in_span_after_eot = False
    for i, (start, _end) in enumerate(offsets):
        while span is not None and start >= span[1]:
            span, in_span_after_eot = next(span_iter, None), False
        if span is None:
            break
        if span[0] <= start and not in_span_after_eot:
            mask[i] = 1
            in_span_after_eot = ids[i] in eot_ids
    return ids, mask
