"""DFlash: parallel block drafter with KV injection."""

from specdraft.hidden_states.layers import LAYER_PRESETS, spread_output_slots
from specdraft.models.base import METHODS, MethodSpec
from specdraft.models.common.warm_start import init_block_layers, init_fc_identity
from specdraft.models.dflash.config import DFlashConfig
from specdraft.models.dflash.model import ContextCache, DFlashDrafter, build_dflash

METHODS.register("dflash")(
    MethodSpec(
        name="dflash",
        config_cls=DFlashConfig,
        model_cls=DFlashDrafter,
        layer_slots=spread_output_slots,
        build=build_dflash,
        proposer="block",
        warm_starts={"init_from_target": init_block_layers, "fc_init=identity": init_fc_identity},
    )
)
LAYER_PRESETS.register("dflash")(spread_output_slots)

__all__ = ["ContextCache", "DFlashConfig", "DFlashDrafter", "build_dflash"]
