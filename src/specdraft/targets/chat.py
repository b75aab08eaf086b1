"""What the target's chat template implies beyond rendering: where a turn ends.

The end-of-turn token comes from the template itself (``<end_of_turn>``, ``<|im_end|>``,
``<|eot_id|>``): instruction-tuned targets often declare another EOS (``<eos>``,
``<|end_of_text|>``), and without the template's token regeneration and decoding would run past
the end of a reply and the loss mask would train on the template glue after it.
"""

from __future__ import annotations

from typing import Any

_PROBE = "specdraft probe reply"


def render_chat(tokenizer: Any, messages: list[dict], *, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def end_of_turn_ids(tokenizer: Any, generation_config: Any = None) -> set[int]:
    """Token ids that end an assistant turn: the chat template's end-of-turn token (``<end_of_turn>``,
    ``<|im_end|>``, ``<|eot_id|>``, often not the tokenizer's EOS), the tokenizer's EOS and the
    generation config's EOS ids."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    eos = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    if eos is not None:
        ids.update(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    turn_end = template_end_of_turn(tokenizer)
    if turn_end is not None:
        ids.add(turn_end)
    return ids


def template_end_of_turn(tokenizer: Any) -> int | None:
    """The special token the chat template writes right after an assistant reply, if any."""
    import jinja2

    try:
        text = render_chat(
            tokenizer, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}], generation_prompt=False
        )
    except jinja2.TemplateError:
        return None
    if _PROBE not in text:
        return None
    after = tokenizer(text[text.rindex(_PROBE) + len(_PROBE) :].lstrip(" "), add_special_tokens=False)["input_ids"]
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if getattr(t, "special", False)}
    return int(after[0]) if after and after[0] in special else None
