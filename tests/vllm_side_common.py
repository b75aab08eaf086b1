"""What the model-level vLLM harnesses (``vllm_dspark_side.py``, ``vllm_dflash2_side.py``) share; imported
inside ``.venv-vllm`` (``run_vllm`` puts ``tests/`` on the path)."""

import contextlib
import json

import torch

#: vLLM's fused projections: a checkpoint's q/k/v and gate/up tensors load into these.
FUSED = {
    ".q_proj.": ".qkv_proj.",
    ".k_proj.": ".qkv_proj.",
    ".v_proj.": ".qkv_proj.",
    ".gate_proj.": ".gate_up_proj.",
    ".up_proj.": ".gate_up_proj.",
}


def drafter_engine_config(target_dir: str, drafter_dir: str, **speculative):
    """vLLM's own engine config for a specdraft drafter checkpoint, built as on a GPU server: the V1-runner
    check that refuses the method on this platform is bypassed (the model code is platform-neutral), and the
    torch accelerator is a no-op as vLLM's CPU runner makes it. Returns (config, checkpoint tensors, block size)."""
    from safetensors.torch import load_file
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

    _set_torch_accelerator_to_noop()
    torch.set_num_threads(2)
    checkpoint = load_file(f"{drafter_dir}/model.safetensors")
    with open(f"{drafter_dir}/config.json") as f:
        num_tokens = json.load(f)["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    VllmConfig._validate_v1_model_runner = lambda self: None
    config = EngineArgs(
        model=target_dir,
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        speculative_config={**speculative, "model": drafter_dir, "num_speculative_tokens": num_tokens},
    ).create_engine_config()
    return config, checkpoint, num_tokens


def record_loaded_parameters() -> set[str]:
    """Patch vLLM's ``AutoWeightsLoader`` so the returned set collects the fully qualified parameter names its
    outermost call fills (nested loaders report relative names)."""
    from vllm.model_executor.models import utils as model_utils

    loaded: set[str] = set()
    depth = [0]
    original = model_utils.AutoWeightsLoader.load_weights

    def recording(self, weights, *args, **kwargs):
        depth[0] += 1
        try:
            names = original(self, weights, *args, **kwargs)
        finally:
            depth[0] -= 1
        if depth[0] == 0:
            loaded.update(names)
        return names

    model_utils.AutoWeightsLoader.load_weights = recording
    return loaded


@contextlib.contextmanager
def drafter_model(config):
    """The drafter vLLM's own model loader builds from ``config`` (one process, gloo), in eval mode, used inside
    vLLM's config context as its runtime does."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader import get_model

    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, distributed_init_method="tcp://127.0.0.1:0", backend="gloo")
        initialize_model_parallel(1, 1)
        model = get_model(vllm_config=config, model_config=config.speculative_config.draft_model_config)
        model.eval()
        yield model
