"""Target families: what specdraft must know about an HF model family, registered by ``model_type``.

One ``Family`` per family, each concern one field, so supporting a new family is one entry here
(and a tiny-model case in ``tests/test_families.py``), never an ``if model_type == ...`` elsewhere:

- decoder parts: the layer list, final norm, input embedding and LM head (``decoder_parts``); hidden
  states are captured at layer inputs/outputs of that list (``hidden_states/capture.py``), so a
  family whose embedding is scaled (Gemma: x sqrt(hidden)) has the scaled embedding as ``input:0``,
  which is also what HF ``output_hidden_states[0]`` and vLLM's aux layer 0 hold;
- attention layout: sliding-window layers and their window (``targets/attention.py``);
- chat-template quirks: ``system_role=False`` folds a system message into the first user turn
  (Gemma's templates have no system role);
- the MASK token block drafters (DFlash/DSpark) use, where the family reserves one;
- vLLM: whether vLLM 0.32's model class exposes aux hidden states (``SupportsEagle3``) with the
  layer-id convention of ``models/common/checkpoint.py`` (id i = the input of layer i = HF
  ``hidden_states[i]``); ``tests/test_families.py`` checks each claim against vLLM's own classes;
- the vLLM-CPU build: a reason it cannot run the family's target (``vllm_cpu_refusal``), given before any
  vLLM server starts (``integrations/vllm/engine.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from specdraft.errors import SpecdraftError, setting
from specdraft.registry import Registry

if TYPE_CHECKING:
    import torch

    from specdraft.targets.attention import AttentionLayout


@dataclass(frozen=True)
class DecoderParts:
    decoder: torch.nn.Module  # the text decoder stack (``get_decoder()``)
    layers: torch.nn.ModuleList
    norm: torch.nn.Module  # final norm: its input is the last layer's output (``last_hidden``)
    embed: torch.nn.Module
    lm_head: torch.nn.Module


@dataclass(frozen=True)
class Family:
    name: str
    system_role: bool = True
    vllm_aux_hidden_states: bool = True
    mask_token: str | None = None
    vllm_cpu_refusal: str | None = None  # why the vllm-cpu build cannot run this family's target (a CUDA vLLM can)
    vllm_cpu_draft_refusal: str | None = None  # why the vllm-cpu build runs the target but cannot speculate on it

    def decoder_parts(self, model: Any) -> DecoderParts:
        """Layers, final norm, embedding and LM head of a ``*ForCausalLM`` (multimodal wrappers unwrapped)."""
        import torch

        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
        parts: dict[str, Any] = {
            "get_decoder().layers": getattr(decoder, "layers", None),
            "get_decoder().norm": getattr(decoder, "norm", None),
            "get_input_embeddings()": model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None,
            "get_output_embeddings()": model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None,
        }
        missing = [name for name, part in parts.items() if not isinstance(part, torch.nn.Module)]
        if missing or not isinstance(parts["get_decoder().layers"], torch.nn.ModuleList):
            raise SpecdraftError(
                f"{type(model).__name__} ({self.name} family) lacks {', '.join(missing) or 'a ModuleList of layers'}; "
                "specdraft captures hidden states at the decoder's `.layers` and `.norm` and reads its embedding and LM head"
            )
        return DecoderParts(decoder, *parts.values())

    def attention(self, model_or_config: Any) -> AttentionLayout:
        from specdraft.targets.attention import AttentionLayout

        return AttentionLayout.from_config(text_config(model_or_config))

    def require_vllm_aux(self, purpose: str) -> None:
        """Refuse, before starting vLLM, what vLLM cannot do for this family (it needs the target's aux hidden states)."""
        if not self.vllm_aux_hidden_states:
            raise SpecdraftError(
                f"vLLM 0.32 cannot {purpose} for {self.name} targets: its model class returns no aux hidden states "
                f"(no SupportsEagle3); use specdraft's own engine instead ({setting('engine')} hf, `specdraft generate`/`eval`)"
            )

    def require_vllm_build(self, *, cpu: bool, drafting: bool = False) -> None:
        """Refuse, before a vLLM server starts, a target that this vLLM build cannot run, or (``drafting``) cannot
        speculate on (``cpu``: the vllm-cpu build)."""
        reason = (self.vllm_cpu_refusal or (self.vllm_cpu_draft_refusal if drafting else None)) if cpu else None
        if reason:
            what = "serve drafters for" if drafting and not self.vllm_cpu_refusal else "run"
            raise SpecdraftError(
                f"the vLLM-CPU build cannot {what} {self.name} targets: {reason}; use specdraft's own engine "
                f"here ({setting('engine')} hf, `specdraft generate`/`eval`), or a CUDA vLLM"
            )

    def system_folded(self, messages: list[dict]) -> list[dict]:
        """``messages`` as this family's template accepts them: without a system role, the system text
        is prepended to the first user turn (as Gemma's own templates do when they accept one at all)."""
        if self.system_role or not messages or messages[0]["role"] != "system":
            return messages
        system, rest = messages[0], list(messages[1:])
        if rest and rest[0]["role"] == "user":
            rest[0] = {**rest[0], "content": f"{system['content']}\n\n{rest[0]['content']}"}
            return rest
        return [{"role": "user", "content": system["content"]}, *rest]


FAMILIES: Registry[Family] = Registry("target family (HF model_type)")
_QWEN3_5_VLLM_CPU = (
    "vLLM 0.32's qwen3_5 module imports the Qwen2-VL image processor, which needs torchvision, and the CPU install has "
    "none (PyPI's torchvision is broken there)"
)
for _family in (
    Family("llama"),
    Family("mistral"),
    Family("qwen2"),
    Family("qwen3"),
    Family("qwen3_moe"),
    # vLLM 0.32's Gemma2/Gemma3ForCausalLM return no aux hidden states: no EAGLE-3/DFlash serving there
    Family("gemma2", system_role=False, vllm_aux_hidden_states=False, mask_token="<mask>"),
    Family("gemma3_text", system_role=False, vllm_aux_hidden_states=False, mask_token="<mask>"),
    # MLA + MoE: HF caches the decompressed K/V per layer, so rejected drafts are ordinary masked columns
    Family("deepseek_v3"),
    # vLLM 0.32's Glm4MoeForCausalLM has no SupportsEagle3
    Family("glm4_moe", vllm_aux_hidden_states=False),
    # attention sinks add a per-head logit to the softmax; sliding/full layers come from layer_types
    Family("gpt_oss"),
    # per-layer input embeddings are computed from the ids inside the decoder, so they follow every layer hook
    Family("gemma4_text"),
    # GLM-5 sparse attention: its indexer masks its scores with the runtime's mask, so holes are never among the top-k
    # columns it picks; the indexer's keys are cached and cropped beside the K/V (decode/kv_cache.py)
    Family(
        "glm_moe_dsa",
        vllm_cpu_refusal="vLLM 0.32's sparse-attention (DSA) layers have no CPU implementation "
        '("Sparse Attention is not supported on CPU")',
    ),
    # linear-attention hybrids: the recurrent state rolls back per row (decode/kv_cache.py), attention layers keep holes
    Family(
        "qwen3_next",
        vllm_cpu_draft_refusal=(
            "vLLM 0.32 copies a hybrid's recurrent states between draft positions with a Triton kernel "
            "(mamba_utils.precopy_mamba_align_fused_kernel), which the CPU build lacks"
        ),
    ),
    Family("qwen3_5_text", vllm_cpu_refusal=_QWEN3_5_VLLM_CPU),
    Family("qwen3_5_moe_text", vllm_cpu_refusal=_QWEN3_5_VLLM_CPU),
    Family(
        "kimi_linear",
        vllm_cpu_refusal=(
            "vLLM 0.32 has KimiLinearForCausalLM only in its GPU packages (vllm.models.kimi_k3.nvidia / .amd), and on CPU its "
            'engine config is rejected ("--mamba-block-size can only be set with --enable-prefix-caching", with prefix caching too)'
        ),
    ),
):
    FAMILIES.register(_family.name)(_family)


def text_config(model_or_config: Any) -> Any:
    config = getattr(model_or_config, "config", model_or_config)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def family_of(model_or_config: Any) -> Family:
    """The registered family of a model or config (its decoder config's ``model_type``)."""
    model_type = getattr(text_config(model_or_config), "model_type", None)
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise SpecdraftError(
            f"target {type(model_or_config).__name__} (model_type {model_type!r}) is not a supported family "
            f"(supported: {', '.join(FAMILIES.names())}); "
            "specdraft needs to know its decoder layers, final norm and LM head, its sliding-window layout, its chat-template "
            "quirks and whether vLLM serves drafters for it: add a Family entry in specdraft/targets/families.py"
        )
    return FAMILIES.get(model_type)
