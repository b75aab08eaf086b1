"""DSpark: DFlash backbone + Markov sequential correction + confidence head."""

from specdraft.hidden_states.layers import LAYER_PRESETS
from specdraft.models.base import METHODS, MethodSpec
from specdraft.models.dspark.config import DSparkConfig
from specdraft.models.dspark.heads import MARKOV_HEADS, ConfidenceHead, MarkovHead
from specdraft.models.dspark.model import DSparkDrafter, build_dspark

METHODS.register("dspark")(
    MethodSpec(name="dspark", config_cls=DSparkConfig, model_cls=DSparkDrafter, layer_slots=LAYER_PRESETS.get("dspark"), build=build_dspark)
)

__all__ = ["ConfidenceHead", "DSparkConfig", "DSparkDrafter", "MARKOV_HEADS", "MarkovHead", "build_dspark"]
