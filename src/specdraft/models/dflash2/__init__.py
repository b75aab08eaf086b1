"""DFlash2: the DFlash block plus grouped convolutions in its layers and a bilinear candidate selector."""

from specdraft.hidden_states.layers import LAYER_PRESETS, spread_output_slots
from specdraft.models.base import METHODS, MethodSpec, VllmServing
from specdraft.models.common.warm_start import init_block_layers, init_fc_identity
from specdraft.models.dflash2.config import DFlash2Config
from specdraft.models.dflash2.model import DFlash2Drafter, build_dflash2
from specdraft.models.dflash2.serving import vllm_options

# No confidence head: the built-in scheduler runs it on the draft gate alone (no confidences offered).
# vLLM 0.32 runs DFlash2 only in its GPU model runner (Triton selector walk), as its dflash method.
METHODS.register("dflash2")(
    MethodSpec(
        name="dflash2",
        config_cls=DFlash2Config,
        model_cls=DFlash2Drafter,
        layer_slots=spread_output_slots,
        build=build_dflash2,
        proposer="block",
        warm_starts={"init_from_target": init_block_layers, "fc_init=identity": init_fc_identity},
        serving=VllmServing(cpu=False, options=vllm_options),
    )
)
LAYER_PRESETS.register("dflash2")(spread_output_slots)

__all__ = ["DFlash2Config", "DFlash2Drafter", "build_dflash2"]
