"""What vLLM 0.32 serves of a DFlash2 checkpoint (read by ``integrations/vllm/serve.py`` through the method spec).

vLLM has no ``dflash2`` speculative method: its speculators translation maps a DFlash2 checkpoint onto the
``dflash`` runtime (``DFlash2DraftModel`` architecture, ``DFlash2Speculator``), so that is the method we ask
for. Its grouped convolutions count block slots as ``1 + num_speculative_tokens``, so the round must be the
trained block: any other size would convolve across the wrong slot boundaries.
"""

from __future__ import annotations

from specdraft.errors import SpecdraftError, setting


def vllm_options(fields: dict, trained: int, requested: int | None, adaptive: bool, name: str) -> dict:
    """Extra ``--speculative-config`` entries for checkpoint ``name`` (``trained``: block_size - 1 draft tokens)."""
    if requested not in (None, trained):
        raise SpecdraftError(
            f"{name}: {setting('num_speculative_tokens')} {requested} differs from the trained {trained} (block_size - 1); vLLM's DFlash2 "
            "convolves over blocks of 1 + num_speculative_tokens slots, which must be the trained block"
        )
    return {"method": "dflash", "num_speculative_tokens": trained}
