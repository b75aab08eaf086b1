"""DSpark: DFlash backbone + Markov sequential correction + confidence head."""

from specdraft.hidden_states.layers import LAYER_PRESETS, spread_output_slots
from specdraft.models.base import METHODS, MethodSpec, VllmServing
from specdraft.models.common.warm_start import init_block_layers, init_fc_identity
from specdraft.models.dspark.config import DSparkConfig
from specdraft.models.dspark.heads import MARKOV_HEADS, ConfidenceHead, MarkovHead
from specdraft.models.dspark.model import DSparkDrafter, build_dspark
from specdraft.models.dspark.serving import vllm_options
from specdraft.models.dspark.warm_start import init_markov_bigram


def _proposer_options(drafter: DSparkDrafter) -> dict:
    """Its confidences drive the verify-length scheduler, which needs them calibrated."""
    return {
        "provides_confidences": drafter.confidence_head is not None,
        "confidences_calibrated": bool(drafter.config.confidence_temperatures),
    }


METHODS.register("dspark")(
    MethodSpec(
        name="dspark",
        config_cls=DSparkConfig,
        model_cls=DSparkDrafter,
        layer_slots=spread_output_slots,
        build=build_dspark,
        proposer="block",
        proposer_options=_proposer_options,
        warm_starts={"init_from_target": init_block_layers, "fc_init=identity": init_fc_identity, "markov_init=bigram": init_markov_bigram},
        serving=VllmServing(cpu=False, adaptive_verification=True, options=vllm_options),
    )
)
LAYER_PRESETS.register("dspark")(spread_output_slots)

__all__ = ["MARKOV_HEADS", "ConfidenceHead", "DSparkConfig", "DSparkDrafter", "MarkovHead", "build_dspark"]
