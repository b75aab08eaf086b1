"""EAGLE-3: autoregressive drafter on fused target features."""

from specdraft.hidden_states.layers import LAYER_PRESETS, LayerSlot, need_layers
from specdraft.models.base import METHODS, MethodSpec
from specdraft.models.common.warm_start import init_fc_identity
from specdraft.models.eagle3.config import Eagle3Config
from specdraft.models.eagle3.model import Eagle3Cache, Eagle3Drafter, build_eagle3
from specdraft.models.eagle3.warm_start import init_eagle3_layer


def eagle3_slots(num_layers: int) -> list[LayerSlot]:
    """EAGLE-3 reference: inputs of layers 2, L//2 and L-3."""
    need_layers(num_layers, 4, "eagle3")
    return [LayerSlot(2, "input"), LayerSlot(num_layers // 2, "input"), LayerSlot(num_layers - 3, "input")]


METHODS.register("eagle3")(
    MethodSpec(
        name="eagle3",
        config_cls=Eagle3Config,
        model_cls=Eagle3Drafter,
        layer_slots=eagle3_slots,
        build=build_eagle3,
        proposer="chain",
        warm_starts={"init_from_target": init_eagle3_layer, "fc_init=identity": init_fc_identity},
    )
)
LAYER_PRESETS.register("eagle3")(eagle3_slots)

__all__ = ["Eagle3Cache", "Eagle3Config", "Eagle3Drafter", "build_eagle3", "eagle3_slots"]
