"""DFlash: parallel block drafter with KV injection."""

from specdraft.hidden_states.layers import LAYER_PRESETS
from specdraft.models.base import METHODS, MethodSpec
from specdraft.models.dflash.config import DFlashConfig
from specdraft.models.dflash.model import ContextCache, DFlashDrafter, build_dflash

METHODS.register("dflash")(
    MethodSpec(name="dflash", config_cls=DFlashConfig, model_cls=DFlashDrafter, layer_slots=LAYER_PRESETS.get("dflash"), build=build_dflash)
)

__all__ = ["ContextCache", "DFlashConfig", "DFlashDrafter", "build_dflash"]
