"""EAGLE-3: autoregressive drafter on fused target features."""

from specdraft.hidden_states.layers import LAYER_PRESETS
from specdraft.models.base import METHODS, MethodSpec
from specdraft.models.eagle3.config import Eagle3Config
from specdraft.models.eagle3.model import Eagle3Cache, Eagle3Drafter, build_eagle3

METHODS.register("eagle3")(
    MethodSpec(name="eagle3", config_cls=Eagle3Config, model_cls=Eagle3Drafter, layer_slots=LAYER_PRESETS.get("eagle3"), build=build_eagle3)
)

__all__ = ["Eagle3Cache", "Eagle3Config", "Eagle3Drafter", "build_eagle3"]
