"""What vLLM 0.32 serves of a DSpark checkpoint (read by ``integrations/vllm/serve.py`` through the method spec).

Its DSpark proposer exists only in the GPU model runner; it runs one query block of ``num_speculative_tokens``
slots, anchor first, so that must equal the trained block size; only the vanilla Markov head exists there
(``qwen3_dspark.py``); adaptive verification sizes each round from the raw confidence head.
"""

from __future__ import annotations

from specdraft.errors import SpecdraftError, setting


def vllm_options(fields: dict, trained: int, requested: int | None, adaptive: bool, name: str) -> dict:
    """Extra ``--speculative-config`` entries for checkpoint ``name`` (``fields``: its config.json; ``trained``:
    its draft tokens = block size, every slot, the anchor's included, drafts a token)."""
    head = fields.get("markov_head_type", "vanilla")
    if head != "vanilla":
        raise SpecdraftError(
            f"{name}: markov_head_type is {head!r}; vLLM 0.32 serves only the 'vanilla' Markov head (its DSpark "
            "loader has no weights for the others); train with markov_head vanilla, or decode with specdraft's built-in runtime"
        )
    if requested not in (None, trained):
        raise SpecdraftError(
            f"{name}: {setting('num_speculative_tokens')} {requested} differs from the trained block of "
            f"{trained} drafts; vLLM's DSpark runs a block of num_speculative_tokens slots, which must be {trained}"
        )
    options = {"num_speculative_tokens": trained}
    if adaptive:
        if not fields.get("enable_confidence_head", True):
            raise SpecdraftError(f"{name}: {setting('adaptive_verification')} needs a confidence head; this drafter has none")
        options["enable_adaptive_verification"] = True
    return options
