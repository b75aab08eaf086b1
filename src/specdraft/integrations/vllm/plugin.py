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

vLLM-CPU 0.32.0, MLA targets (DeepSeek-V3 and kin) outside bf16/fp16: on a CPU with AMX tiles vLLM picks its
AMX MLA backend, whose weight packing accepts only bf16/fp16/int8/fp8 weights, so an fp32 target (the dtype
exactness checks serve in) fails to load with "expect weight to be bfloat16, ...". The same build's
reference MLA backend (``CPU_MLA``) runs any dtype; it is chosen for such targets unless the user named a
backend. Machines without AMX pick it already, which is why this appears on one machine and not another.
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


#: Model dtypes vLLM-CPU's AMX MLA backend can pack (``amx_mla.py`` process_weights_after_loading).
AMX_MLA_DTYPES = ("bfloat16", "float16")


def _reference_mla_outside_amx_dtypes(update):
    """``CpuPlatform.check_and_update_config`` that first selects ``CPU_MLA`` for an MLA model whose dtype AMX MLA
    cannot pack, where no attention backend was asked for (both the backend choice and the block size follow it)."""

    def check_and_update_config(cls, vllm_config):
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        model = vllm_config.model_config
        attention = vllm_config.attention_config
        if (
            model is not None
            and getattr(model, "use_mla", False)
            and attention.backend is None
            and str(model.dtype).removeprefix("torch.") not in AMX_MLA_DTYPES
        ):
            attention.backend = AttentionBackendEnum.CPU_MLA
        return update.__func__(cls, vllm_config)

    return classmethod(check_and_update_config)


def install() -> list[str]:
    """Apply the corrections this platform needs; returns what was patched (idempotent)."""
    from vllm.platforms import current_platform

    patched = []
    if current_platform.is_cpu():
        from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

        DFlashQwen3Model._normalize_context_k = _normalize_context_k_per_layer
        patched.append("DFlashQwen3Model._normalize_context_k")
        platform = type(current_platform)
        if not getattr(platform.check_and_update_config, "_specdraft", False):
            platform.check_and_update_config = _reference_mla_outside_amx_dtypes(platform.check_and_update_config)
            platform.check_and_update_config.__func__._specdraft = True
        patched.append(f"{platform.__name__}.check_and_update_config (reference MLA outside bf16/fp16)")
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
