"""The reference DSpark drafter shipped for the embedded target: small, calibrated, documented, exact."""

from __future__ import annotations

import json

import pytest

from specdraft.errors import SpecdraftError
from specdraft.reference import reference_drafter


def test_reference_drafter_ships_small_calibrated_and_documented():
    path = reference_drafter("smollm2-135m")
    assert (path / "model.safetensors").stat().st_size < 40 * 2**20
    config = json.loads((path / "config.json").read_text())
    assert config["speculators_model_type"] == "dspark"
    assert config["specdraft"]["config"]["confidence_temperatures"], "calibrated for the scheduled verify policy"
    card = (path / "MODEL_CARD.md").read_text()
    assert "tau per domain" in card and "speed-up" in card and "scripts/build_reference_drafter.py" in card
    assert "## Serving with vLLM" in card and "ignores the calibrated" in card  # what vLLM does with the calibration
    with pytest.raises(SpecdraftError, match="no reference drafter ships for target 'other'"):
        reference_drafter("other")


@pytest.mark.slow
def test_reference_drafter_decodes_exactly_and_accepts_drafts(smollm2_dir):
    from specdraft.decode.config import DecodeConfig, SamplingConfig, SchedulerConfig
    from specdraft.decode.runtime import decoder_for_target
    from specdraft.eval.suites import SUITES
    from specdraft.targets import load_target

    target = load_target("smollm2-135m")
    prompt = next(p for p in SUITES.get("math")() if p.domain == "math").token_ids(target.tokenizer)
    plain = decoder_for_target(target, config=DecodeConfig(drafter="none", max_new_tokens=48), sampling=SamplingConfig())
    spec = decoder_for_target(
        target,
        config=DecodeConfig(drafter="dspark", drafter_path=str(reference_drafter("smollm2-135m")), max_new_tokens=48),
        sampling=SamplingConfig(),
        scheduler=SchedulerConfig(),
    )
    expected = plain.generate([prompt]).outputs[0].tokens
    result = spec.generate([prompt])
    assert result.outputs[0].tokens == expected
    assert result.metrics.accepted > 0 and result.metrics.tau > 1.05, "the trained drafter gets drafts accepted"


@pytest.mark.slow
def test_reference_drafter_config_is_what_specdraft_writes_now(smollm2_dir):
    """The shipped config.json (e.g. ``sliding_window_non_causal``, the flag vLLM turns into DFlash causality) is
    exactly what ``save_pretrained`` writes for these weights today, and the strict reader verifies its checksum. One
    kind of field follows the machine, not us: the layer config's ``transformers_version`` stamp. The target is named
    portably, by name, hub id and fingerprint: the local directory it was converted into (under ``$SPECDRAFT_CACHE`` or
    the user's home) is not recorded."""
    from specdraft.models.common import checkpoint as ckpt
    from specdraft.models.common.drafter import load_drafter
    from specdraft.targets import load_target

    path = reference_drafter("smollm2-135m")
    drafter = load_drafter(path, target=load_target("smollm2-135m"))  # strict: fields, tensors and sha256
    shipped = json.loads((path / "config.json").read_text())
    written = json.loads(json.dumps(drafter.config_json()))  # as on disk (JSON object keys are strings)
    written["specdraft"]["checksums"] = {ckpt.WEIGHTS_FILE: ckpt.sha256_file(path / ckpt.WEIGHTS_FILE)}
    for config in (shipped, written):
        assert config["transformer_layer_config"].pop("transformers_version")
        assert "path" not in config["specdraft"]["target"]
        assert (
            config["speculators_config"]["verifier"]["name_or_path"]
            == config["specdraft"]["target"]["hub_id"]
            == "HuggingFaceTB/SmolLM2-135M-Instruct"
        )
    assert shipped == written
    assert shipped["sliding_window_non_causal"] is True
