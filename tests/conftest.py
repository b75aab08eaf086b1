"""Shared fixtures: the converted embedded target and tiny random targets that reuse its tokenizer.

``smollm2_dir`` converts the embedded GGUF once into the specdraft cache (``$SPECDRAFT_CACHE`` or
``~/.cache/specdraft``), so CI pays the ~20 s conversion once per machine, not per test run.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from specdraft.cli.main import load_plugins

load_plugins()  # the integrations and the decoding runtime register from above, as under the CLI


def tie_free_sparse_indexer() -> None:
    """GLM-5's indexer scores columns with a ReLU, which in a random model leaves many exactly 0; top-k then breaks the
    ties by a column's place in its row, which differs with a row's length (a longer forward, a padded batch) with or
    without speculation. Its tests use a softplus there (> 0, tie-free), so the top-k choice is unique and exactness
    is a property of the runtime, not of tie-breaking. Only the indexer's module sees the change."""
    import types

    import torch
    import transformers.models.glm_moe_dsa.modeling_glm_moe_dsa as dsa

    class _Functional(types.ModuleType):
        def __getattr__(self, name):
            return getattr(torch.nn.functional, name)

    functional = _Functional("torch.nn.functional")
    functional.relu = torch.nn.functional.softplus
    dsa.F = functional


tie_free_sparse_indexer()

TINY_FAMILIES = (
    "llama",
    "qwen3",
    "qwen3_moe",
    "gemma3",
    "mistral",
    "deepseek_v3",
    "glm4_moe",
    "gpt_oss",
    "gemma4_text",
    "qwen3_next",
    "qwen3_5_text",
    "qwen3_5_moe_text",
    "kimi_linear",
    "glm_moe_dsa",
)
#: few small experts, one dense layer first (DeepSeek/GLM), MLA with 32-wide rope and nope parts
MOE = dict(
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    moe_intermediate_size=32,
    first_k_dense_replace=1,
    n_shared_experts=1,
)
MLA = dict(q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32)
#: the linear-attention layers of the hybrids: 2 gated-delta-net heads of 32 (Qwen3-Next / Qwen3.5), 2 KDA heads of 32 (Kimi)
GATED_DELTA = dict(linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=32, linear_value_head_dim=32)
QWEN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
KIMI = dict(
    linear_num_heads=2,
    linear_head_dim=32,
    num_local_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_group=1,
    topk_group=1,
    **MLA,
)


def build_tiny_target_dir(
    out_dir: Path, tokenizer_dir: Path, *, family: str = "llama", num_layers: int = 6, seed: int = 0, **extra
) -> Path:
    """Save a random causal LM (hidden 64, 2 heads of 32) of ``family`` with the tokenizer from ``tokenizer_dir``
    (``extra``: further config fields, e.g. a shorter ``sliding_window`` or a hybrid's linear-attention heads)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdraft.targets.identity import TOKENIZER_FILES

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    configs = {
        "llama": lambda: transformers.LlamaConfig(**common),
        "qwen3": lambda: transformers.Qwen3Config(**common),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
        "gemma3": lambda: transformers.Gemma3TextConfig(**{"query_pre_attn_scalar": 32, "sliding_window": 64, **common}),
        "mistral": lambda: transformers.MistralConfig(**{"sliding_window": 64, **common}),
        # topk_method as DeepSeek-V3's own config sets it (vLLM's gate has the e_score_correction_bias HF always saves only then)
        "deepseek_v3": lambda: transformers.DeepseekV3Config(**common, **MOE, **MLA, topk_method="noaux_tc"),
        "glm4_moe": lambda: transformers.Glm4MoeConfig(**common, **MOE),
        "gpt_oss": lambda: transformers.GptOssConfig(**{"sliding_window": 64, **common}, num_local_experts=4, num_experts_per_tok=2),
        "gemma4_text": lambda: transformers.Gemma4TextConfig(
            **{"sliding_window": 64, **common},
            hidden_size_per_layer_input=16,
            vocab_size_per_layer_input=common["vocab_size"],
            per_layer_config={},
        ),
        # hybrids: the configs' own layer_types (3 of 4 layers linear attention, the 4th or 5th full attention)
        "qwen3_next": lambda: transformers.Qwen3NextConfig(**{**GATED_DELTA, **QWEN_MOE, **common}),
        "qwen3_5_text": lambda: transformers.Qwen3_5TextConfig(**{**GATED_DELTA, **common}),
        "qwen3_5_moe_text": lambda: transformers.Qwen3_5MoeTextConfig(**{**GATED_DELTA, **QWEN_MOE, **common}),
        "kimi_linear": lambda: transformers.KimiLinearConfig(**common, **KIMI),
        # GLM-5 sparse attention, its indexer keeping as many columns as a pipeline prompt has: a selection of fewer would
        # flip between near-equal scores with a batch's shape, which the stages here compare bit for bit; the decoding
        # tests (``test_families.SAMPLED_EXTRA``) keep 3 columns per query
        "glm_moe_dsa": lambda: transformers.GlmMoeDsaConfig(**common, **MOE, **MLA, index_topk=2048, index_n_heads=2, index_head_dim=32),
    }
    common.update(extra)
    config = configs[family]()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if "linear_attention" in (getattr(config, "layer_types", None) or ()):
        # HF zero-initialises the pad token's embedding row; a chat template uses that token, and until a full-attention
        # layer mixes in other tokens, linear-attention and MoE layers map a zero row to a zero row, which extraction
        # rightly refuses as a degenerate capture. A trained model's rows are never zero: give the row random values.
        with torch.no_grad():
            embed = model.get_input_embeddings().weight
            zero = embed.abs().amax(-1) == 0
            embed[zero] = torch.randn(int(zero.sum()), embed.shape[1]) * float(embed[~zero].std())
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted embedded SmolLM2-135M-Instruct directory (converted once per cache)."""
    from specdraft.targets import resolve_target_dir

    return resolve_target_dir("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_target_factory(smollm2_dir, tmp_path_factory):
    """``make(family="llama", num_layers=6, seed=0) -> Path``: tiny random targets, built once per argument set."""
    built: dict[tuple, Path] = {}

    def make(family: str = "llama", num_layers: int = 6, seed: int = 0) -> Path:
        key = (family, num_layers, seed)
        if key not in built:
            out = tmp_path_factory.mktemp(f"tiny-{family}-{num_layers}-{seed}")
            built[key] = build_tiny_target_dir(out, smollm2_dir, family=family, num_layers=num_layers, seed=seed)
        return built[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_target_factory) -> Path:
    """A tiny random Llama (6 layers, hidden 64, 2 heads) with the SmolLM2 tokenizer and chat template."""
    return tiny_target_factory("llama")


@pytest.fixture(scope="session")
def tiny_target(tiny_llama_dir):
    """A ``Target`` loaded from ``tiny_llama_dir``."""
    from specdraft.targets import load_target

    return load_target(str(tiny_llama_dir))


@pytest.fixture(scope="module")
def one_thread():
    """Module-wide single-threaded torch: tiny models run fastest so on a shared, oversubscribed CPU
    (a module opts in with an autouse fixture requesting this one)."""
    from test_models_support import single_thread

    with single_thread():
        yield


@pytest.fixture(scope="module")
def target():
    """One tiny in-memory target per module (``test_models_support.make_target``); modules with other
    needs define their own ``target`` fixture, which takes precedence."""
    from test_models_support import make_target

    return make_target()


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    """A Mooncake master on loopback (free ports, short read lease) for one test module."""
    from specdraft.integrations.mooncake.master import MooncakeMaster

    with MooncakeMaster(dir=str(tmp_path_factory.mktemp("mooncake")), port=0, lease_ttl_ms=300) as m:
        yield m
